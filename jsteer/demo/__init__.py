"""The jsteer demo (``make demo`` / ``python -m jsteer.demo``): every method, before / after, on the
two embedded models (SmolLM2-135M-Instruct from its 4-bit GGUF wheel, MiniLM), in a few minutes
on a CPU.

0. Load SmolLM2 and MiniLM; fit a small positivity scorer on MiniLM features (SST-5 texts no
   steer saw) that judges the steered continuations below.
1. LM-Steer: the shipped rank-32 sentiment steer (``jsteer/assets/``, trained by
   ``experiments/demo_steer.py``) at -v, 0, +v on three neutral prompts, its top / bottom tokens,
   and its committed evaluation (positivity against steer value).
2. Type Embeddings: a City type vector from the KG examples moves the next-token top-5 of two
   "... was born in" prompts towards cities.
3. KALA: plain fine-tuning vs KALA on the synthetic unseen-entity NER task (F1, seen / unseen).
4. Activation steering: a CAA control vector at -s, 0, +s.
5. Composition: one ``generate`` call carrying the steer and the type vector, each at its own
   per-row strength (traced: a second call with other strengths does not recompile).
6. ``summary.png`` / ``summary.html`` under ``--out``.

Every number is labelled "measured now" (computed by this run) or "committed" (read from the
named results file). Data: the KG examples and SST-5 under ``../shared/data``.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import time

from jsteer.demo import sections


class _Out:
    """Prints (unless quiet) and keeps every line for the HTML page."""

    def __init__(self, quiet: bool):
        self.quiet, self.lines, self.timings = quiet, [], {}

    def __call__(self, text: str = "", always: bool = False) -> None:
        self.lines.append(text)
        if always or not self.quiet:
            print(text, flush=True)

    @contextlib.contextmanager
    def section(self, title: str):
        self("")
        self(f"== {title}", always=True)
        t0 = time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        self.timings[title] = dt
        self(f"   [{title}: {dt:.1f}s]", always=True)


def _fmt_pos(x: float) -> str:
    return f"{x:.2f}"


def show_steer(say, r: dict) -> None:
    say(f"shipped steer {pathlib.Path(r['file']).name}: rank {r['rank']}, {r['bytes'] / 1e3:.0f} KB, base model")
    say(f"  {r['base_model']} (matches the loaded SmolLM2; other models are refused)")
    for p in dict.fromkeys(x["prompt"] for x in r["rows"]):
        say(f"  > {p!r}")
        for x in (x for x in r["rows"] if x["prompt"] == p):
            say(f"    {x['value']:+5.1f}: {x['text'].strip()[:90]!r}")
    say("  mean over the 3 continuations (measured now):")
    for v, m in r["mean"].items():
        say(
            f"    value {v:+5.1f}: MiniLM-probe positivity {_fmt_pos(m['positivity'])}, "
            f"steer projection {m['projection']:+.2f}"
        )
    say("  words whose logit the steer moves most at a typical context (E W c_bar, measured now):")
    say(f"    promoted by +v: {' '.join(r['top'])}")
    say(f"    demoted by +v:  {' '.join(r['bottom'])}")
    c = r["committed"]
    say(f"  committed evaluation ({c['source']}):")
    say(f"    {c['setup']['prompts']} x {c['setup']['samples_per_prompt']} samples, top-p {c['setup']['top_p']}")
    vs = sorted(float(v) for v in c["table"])
    say("    value      " + " ".join(f"{v:+6g}" for v in vs[:4]) + "       0 " + " ".join(f"{v:+6g}" for v in vs[4:]))
    row = [c["table"][f"{v:+g}"]["positivity"] for v in vs]
    rise = [c["table"][f"{v:+g}"]["ppl_rise"] for v in vs]
    say("    positivity " + " ".join(f"{x:6.2f}" for x in row[:4]) + f" {c['unsteered']['positivity']:6.2f} "
        + " ".join(f"{x:6.2f}" for x in row[4:]))  # fmt: skip
    say(
        "    ppl rise   "
        + " ".join(f"{x:+6.2f}" for x in rise[:4])
        + "   0.00 "
        + " ".join(f"{x:+6.2f}" for x in rise[4:])
    )


def show_typevec(say, r: dict) -> None:
    say(f"City type vector from {len(r['examples'])} KG examples: {', '.join(r['examples'])}")
    say(
        f"  added after layer {r['layer']} at the last prompt token, lambda {r['lambda']} x {r['unit']:.1f} "
        f"(setting from the committed {r['setting_from']})"
    )
    say(
        f"  next-token top-5 and P(city) over {r['n_city_tokens']} City tokens "
        f"({r['n_held_out']} not examples), measured now:"
    )
    for b, p in enumerate(r["prompts"]):
        say(f"  > {p!r}")
        for name in ("before", "after"):
            x = r[name][b]
            top = ", ".join(f"{t.strip() or repr(t)} {q:.2f}" for t, q in x["top"])
            say(
                f"    {name:>6}: {top}   | P(city) {x['city_mass']:.3f}, "
                f"non-example cities {x['held_out_city_mass']:.3f}"
            )


def show_kala(say, r: dict) -> None:
    say(
        f"synthetic NER: {r['train']} training sentences; {r['seen']} held-out sentences about seen entities, "
        f"{r['unseen']} about unseen ones (class visible only through KG links); tiny BERT, {r['epochs']} epochs"
    )
    say("  entity F1 (measured now)      seen   unseen")
    for m, name in (("finetune", "plain fine-tuning"), ("relational", "KALA (relational)")):
        f = r["f1"][m]
        say(f"    {name:<26} {f['seen']:6.1f}   {f['unseen']:6.1f}")


def show_actsteer(say, r: dict) -> None:
    c = r["committed"]
    same = "same texts as" if r["recipe"]["texts_sha256"] == c["texts_sha256"] else "texts differ from"
    say(
        f"CAA control vector, layer {r['layer']}, {r['recipe']['pairs']} SST-5 pairs ({same} the committed {c['file']})"
    )
    for p in dict.fromkeys(x["prompt"] for x in r["rows"]):
        say(f"  > {p!r}")
        for x in (x for x in r["rows"] if x["prompt"] == p):
            say(f"    {x['strength']:+4.1f}: {x['text'].strip()[:90]!r}")
    say(
        "  mean MiniLM-probe positivity (measured now): "
        + ", ".join(f"{s:+g}: {q:.2f}" for s, q in r["mean_positivity"].items())
    )
    h = c["held_out"]
    if h:
        say(
            f"  committed held-out ({c['file']}): positivity {h['negative']:.2f} at -s, {c['unsteered']:.2f} "
            f"unsteered, {h['positive']:.2f} at +s (max ppl rise {h['max_ppl_rise']:+.0%})"
        )


def show_compose(say, r: dict) -> None:
    v = max(x["steer"] for x in r["rows"])
    say(f"one generate call, 4 rows of {r['prompt']!r}, (steer value, type-vector lambda) per row, measured now")
    say(f"  (steer +-{v:g}: beyond the committed evaluation's +-5; proj: steer projection after the first token):")
    for x in r["rows"]:
        city = "city" if x["first_token_is_city"] else "    "
        say(
            f"    steer {x['steer']:+4.1f}, type {x['type']:.1f} [{city}] proj {x['projection']:+.2f}: "
            f"{x['text'].strip()[:80]!r}"
        )
    say(
        f"  first call (compiles) {r['first_call_s']:.1f}s; second call with other strengths "
        f"{r['second_call_s']:.1f}s, {r['second_call_new_programs']} programs compiled for it"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jsteer.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="out/demo", help="where summary.png / summary.html go (default out/demo)")
    ap.add_argument("--quiet", action="store_true", help="print only the section times and the summary's path")
    args = ap.parse_args(argv)
    from jsteer import progress

    with progress.quiet(args.quiet):
        return _run(args)


def _run(args) -> int:
    out = pathlib.Path(args.out)
    say = _Out(args.quiet)
    t_start = time.perf_counter()
    say("jsteer demo: LM-Steer, Type Embeddings, KALA, activation steering and their composition", always=True)

    import jsteer

    with say.section("0. load SmolLM2 + MiniLM, fit the positivity scorer"):
        smol = jsteer.load("smollm2-135m")
        minilm = jsteer.load("minilm")
        scorer, info = sections.sentiment_scorer(minilm)
        say(f"SmolLM2: {smol.family}, identity {smol.identity[:23]}...; MiniLM: {minilm.family}")
        say(
            f"positivity scorer: logistic probe on MiniLM mean-pooled features of {info['train_texts']} SST-5 "
            f"texts; accuracy {info['accuracy']:.2f} on {info['test_texts']} SST-5 test texts (measured now)"
        )
    with say.section("1. LM-Steer"):
        steer = sections.steer_section(smol, scorer, sections.english_words(minilm))
        show_steer(say, steer)
        try:
            sections.load_steer(minilm)
        except ValueError as e:
            say(f"  loading it onto MiniLM is refused: {type(e).__name__}")
    with say.section("2. Type Embeddings"):
        typevec = sections.typevec_section(smol)
        show_typevec(say, typevec)
    with say.section("3. KALA"):
        kala = sections.kala_section()
        show_kala(say, kala)
    with say.section("4. Activation steering"):
        act = sections.actsteer_section(smol, scorer)
        show_actsteer(say, act)
    with say.section("5. Composition"):
        comp = sections.compose_section(smol)
        show_compose(say, comp)
    with say.section("6. Summary page"):
        from jsteer.demo import summary

        png = summary.write_png(out / "summary.png", steer, typevec, kala)
        total = time.perf_counter() - t_start
        page = summary.write_html(out / "summary.html", png, say.lines, dict(say.timings, total=total))
        say(f"wrote {png} and {page}", always=True)
    total = time.perf_counter() - t_start
    say("")
    say("section times: " + ", ".join(f"{k.split('.')[0]}: {v:.0f}s" for k, v in say.timings.items()), always=True)
    say(f"demo done in {total:.0f}s; summary page: {page.resolve()}", always=True)
    return 0
