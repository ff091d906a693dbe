"""Core ``jsteer`` verbs: ``convert``, ``info``, ``generate`` and ``doctor``.

    jsteer convert SRC DST [--dtype bfloat16] [--head mlm]
    jsteer info CKPT [--json]
    jsteer doctor [--json]          # JAX backend, devices, package versions, CPU kernel, caches
    jsteer generate SRC "prompt" ["prompt" ...] [--max-new-tokens 32] [--temperature 0]
                    [--top-p 1] [--top-k 0] [--seed 0] [--do-sample] [--num-return-sequences N]
                    [--repetition-penalty P] [--min-new-tokens N] [--stop STR] [--chat] [--stream] [--ids]

SRC is anything :func:`jsteer.load` accepts: ``minilm``, ``smollm2-135m``, an HF folder, a
``.gguf`` file or a jsteer checkpoint folder.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

_HEADS = ("auto", "none", "mlm", "token_classification", "qa")
_DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert a model (HF folder, GGUF, embedded name) to a jsteer checkpoint",
        description="Load SRC and write it as a jsteer (Orbax) checkpoint folder DST.",
    )
    p.add_argument("src", help="embedded name (minilm, smollm2-135m), HF folder, .gguf file or jsteer checkpoint")
    p.add_argument("dst", help="output folder (replaced atomically if it already holds a jsteer checkpoint)")
    p.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="parameter dtype to store (default: as stored for a jsteer checkpoint, else float32)",
    )
    p.add_argument("--head", choices=_HEADS, default="auto", help="BERT head to keep (default: from the weights)")
    p.set_defaults(func=_convert)

    p = subparsers.add_parser(
        "info",
        help="show a model's config, tokenizer and provenance",
        description="Describe a checkpoint without running it.",
    )
    p.add_argument("ckpt", help="jsteer checkpoint folder (or any source jsteer.load accepts)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_info)

    p = subparsers.add_parser(
        "generate",
        help="continue prompts with a decoder model",
        description="Generate continuations of one or more prompts.",
    )
    p.add_argument("src", help="embedded name, HF folder, .gguf file or jsteer checkpoint (a decoder)")
    p.add_argument("prompts", nargs="+", help="prompt text(s); several are decoded as one batch")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k cut")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--do-sample", action="store_true", help="sample (temperature 1 unless --temperature is given)")
    p.add_argument("--num-return-sequences", type=int, default=1, help="continuations per prompt")
    p.add_argument("--repetition-penalty", type=float, default=None, help="HF's repetition penalty (1 = off)")
    p.add_argument("--min-new-tokens", type=int, default=0, help="hold the end-of-text tokens back until then")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable); kept in the text")
    p.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is one user message, rendered with the tokenizer's chat template",
    )
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.add_argument("--ids", action="store_true", help="also print the generated token ids")
    p.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="activation / parameter dtype (default: as stored for a jsteer checkpoint, else float32)",
    )
    p.set_defaults(func=_generate)

    p = subparsers.add_parser(
        "doctor",
        help="what this installation runs on: backend, devices, versions, caches",
        description="Report the JAX backend and devices, the key packages' versions, whether "
        "the CPU decode kernel is available, the embedded models and where the "
        "caches live.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_doctor)


def doctor_report() -> dict:
    """The facts ``jsteer doctor`` prints (also used by tests)."""
    import os
    import platform

    import jax

    import jsteer
    from jsteer import hub, loading
    from jsteer.backbones import cpu
    from jsteer.perf import PACKAGES, installed

    embedded = {}
    for name in loading.EMBEDDED:
        try:
            embedded[name] = str(loading.embedded_path(name))
        except FileNotFoundError as e:
            embedded[name] = f"missing: {e}"
    try:
        kernel_dir = str(cpu.cache_dir())
    except Exception as e:  # noqa: BLE001 - a refused cache folder is a fact to report
        kernel_dir = f"refused: {e}"
    hub_dir, hub_from = hub.cache_dir()
    described = cpu.describe()
    return {
        "jsteer": jsteer.__version__,
        "jsteer_path": os.path.dirname(jsteer.__file__),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "jax_backend": jax.default_backend(),
        "devices": [f"{d.platform}:{d.id} {getattr(d, 'device_kind', '')}".strip() for d in jax.devices()],
        "packages": {n: installed(n) for n in PACKAGES},
        "cpu": {k: v for k, v in described.items() if k in ("model", "family", "simd")} | {"cores": os.cpu_count()},
        "cpu_kernel": {
            "available": bool(cpu.available()),
            "reason": cpu.unavailable_reason(),
            "rows": described["kernel_rows"],
            "rows_env": cpu.ROWS_ENV,
        },
        "cpu_dots": jsteer.cpu_precision.STATE,
        "cpu_malloc": jsteer.cpu_malloc.STATE,
        "cpu_hugepages": jsteer.cpu_malloc.HUGEPAGES,
        "gpu_atomics": jsteer.gpu_atomics.STATE,
        "embedded_models": embedded,
        "caches": {
            "cpu_kernels": kernel_dir,
            "hf_hub": f"{hub_dir} ({hub_from})",
            "tfds_data_dir": os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets")),
        },
    }


def _doctor(args) -> int:
    info = doctor_report()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"jsteer {info['jsteer']} ({info['jsteer_path']}), Python {info['python']}, {info['platform']}")
    print(f"JAX backend: {info['jax_backend']}; devices: {', '.join(info['devices'])}")
    print("packages:   " + ", ".join(f"{n} {v or 'NOT INSTALLED'}" for n, v in info["packages"].items()))
    c = info["cpu"]
    print(f"CPU: {c['model']} ({c['family']}), {c['cores']} cores; {' '.join(c['simd'])}")
    k = info["cpu_kernel"]
    rows = f"up to {k['rows']} rows" if k["rows"] else "any row count"
    state = f"available, products of {rows} (${k['rows_env']})"
    state = state if k["available"] else f"unavailable ({k['reason']})"
    print(f"CPU decode kernel: {state}")
    print(f"CPU fp32 dots: {info['cpu_dots']}  (jsteer/cpu_precision.py)")
    print(f"CPU buffers between calls: {info['cpu_malloc']}  (jsteer/cpu_malloc.py)")
    print(f"CPU huge pages for large buffers: {info['cpu_hugepages']}")
    print(f"GPU f32 scatter atomics: {info['gpu_atomics']}  (jsteer/gpu_atomics.py)")
    for name, where in info["embedded_models"].items():
        print(f"embedded model {name}: {where}")
    for name, where in info["caches"].items():
        print(f"cache {name}: {where}")
    return 0


def _head_arg(h: str):
    from jsteer.loading import _AUTO

    return _AUTO if h == "auto" else (None if h == "none" else h)


def _convert(args) -> int:
    import jsteer

    t0 = time.perf_counter()
    lm = jsteer.load(args.src, dtype=args.dtype, head=_head_arg(args.head))
    t1 = time.perf_counter()
    out = jsteer.save(lm, args.dst)
    t2 = time.perf_counter()
    print(f"loaded {lm} in {t1 - t0:.1f}s")
    dtype = lm.provenance.get("dtype") or str(lm.dtype)
    print(f"saved {out} in {t2 - t1:.1f}s ({_count(lm.params):,} params, {dtype}, identity {lm.identity})")
    return 0


def _count(tree) -> int:
    import jax
    import numpy as np

    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(tree)))


def _info(args) -> int:
    from jsteer.checkpoints import SIDECAR
    from jsteer.loading import load

    path = pathlib.Path(args.ckpt).expanduser()
    if path.is_dir() and (path / SIDECAR).is_file():
        info = _checkpoint_info(path)
    else:
        lm = load(args.ckpt)
        info = {
            "family": lm.family,
            "head": lm.head,
            "config": _config_dict(lm.config),
            "tokenizer": _tok_summary(lm.tokenizer),
            "provenance": lm.provenance,
            "params": _count(lm.params),
        }
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    print(f"family:     {info['family']}" + (f" (head: {info['head']})" if info["family"] == "bert" else ""))
    print(f"parameters: {info['params']:,}")
    print("config:")
    for k, v in info["config"].items():
        print(f"  {k}: {v}")
    print("tokenizer:")
    for k, v in info["tokenizer"].items():
        print(f"  {k}: {v}")
    print("provenance:")
    for k, v in info["provenance"].items():
        print(f"  {k}: {v}")
    return 0


def _config_dict(config) -> dict:
    import dataclasses

    return dataclasses.asdict(config)


def _tok_summary(tok) -> dict:
    if tok is None:
        return {"tokenizer": "none (no tokenizer files: token ids only)"}
    return {"vocab_size": tok.vocab_size, **{f"{r}_id": i for r, i in tok.special_ids.items() if i is not None}}


def _checkpoint_info(path: pathlib.Path) -> dict:
    """Sidecar + Orbax metadata only: no weights are read."""
    import jax
    import numpy as np

    from jsteer import checkpoints
    from jsteer.tokenizer import Tokenizer

    meta = checkpoints.read_sidecar(path, checkpoints.CHECKPOINT_FORMAT)
    tree = checkpoints.read_tree_metadata(path / checkpoints.PARAMS_DIR)

    n = int(sum(np.prod(m.shape, dtype=np.int64) for m in jax.tree.leaves(tree)))
    tok = None if meta["tokenizer"] is None else Tokenizer.from_json(meta["tokenizer"])
    return {
        "family": meta["family"],
        "head": meta.get("head"),
        "config": meta.get("config") or meta["hf_config"],
        "tokenizer": _tok_summary(tok),
        "provenance": meta["provenance"],
        "params": n,
    }


def _generate(args) -> int:
    import jsteer

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    lm = jsteer.load(args.src, dtype=args.dtype)
    prompts = [[{"role": "user", "content": p}] for p in args.prompts] if args.chat else args.prompts
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        do_sample=args.do_sample or None,
        num_return_sequences=args.num_return_sequences,
        repetition_penalty=args.repetition_penalty,
        min_new_tokens=args.min_new_tokens,
        stop=args.stop,
    )
    t0 = time.perf_counter()
    if args.stream:
        if len(args.prompts) != 1 or args.num_return_sequences != 1:
            raise ValueError("--stream prints one continuation: give one prompt and --num-return-sequences 1")
        print(args.prompts[0], end="", flush=True)
        for piece in lm.stream(prompts, **kw):
            print(piece[0], end="", flush=True)
        print()
        print(
            f"[streamed {args.max_new_tokens} tokens at most in {time.perf_counter() - t0:.1f}s incl. compile]",
            file=sys.stderr,
        )
        return 0
    texts, tokens, lengths = lm.generate(prompts, return_ids=True, **kw)
    dt = time.perf_counter() - t0
    n = args.num_return_sequences
    for i, text in enumerate(texts):
        print(f"{args.prompts[i // n]}{text}")
        if args.ids:
            print(f"ids: {tokens[i, : lengths[i]].tolist()}")
        if len(texts) > 1:
            print("---")
    print(f"[{len(texts)} x {args.max_new_tokens} tokens in {dt:.1f}s incl. compile]", file=sys.stderr)
    return 0
