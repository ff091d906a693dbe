"""Type-embedding LAMA probing on a RoBERTa MLM (byte-level BPE): the literal [MASK] becomes
the tokenizer's own <mask>, a mask after a space asks for the leading-space gold ("ĠFlorence",
as HF's fill-mask does with "in <mask>"), and the probe's ranks / P@k are those of the HF
torch model's logits at the mask. A tiny random RobertaForMaskedLM with a trained byte-level
BPE saved as an HF folder and loaded with jsteer.load."""

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from tokenizers import AddedToken, ByteLevelBPETokenizer

import jsteer
from jsteer.cli import main
from jsteer.tokenizer import Tokenizer
from jsteer.typevec import core, probe

# "Florence" starts lines and follows spaces, so the vocabulary has both 'Florence' and
# 'ĠFlorence' (as roberta-base has for many names): the no-space form would be a real, wrong token.
CORPUS = [
    "Dante was born in Florence .",
    "Florence is a city in Italy .",
    "Mozart was born in Salzburg .",
    "Salzburg is a city in Austria .",
    "Peter was born in London .",
    "London is a city in England .",
    "The capital of Italy is Rome .",
    "Anna was born in Rome .",
    "Paris is the capital of France .",
    "Marie was born in Paris .",
    "the city of Florence is old .",
] * 10
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
PROMPTS = [
    ("Dante was born in [MASK] .", "Florence"),
    ("Mozart was born in [MASK] .", "Salzburg"),
    ("Peter was born in [MASK] .", "London"),
    ("Anna was born in [MASK] .", "Rome"),
    ("Marie was born in [MASK] .", "Paris"),
    ("The capital of Italy is [MASK] .", "Rome"),
]


def _hf_tokenizer(bpe_dir: pathlib.Path, lstrip: bool):
    """RobertaTokenizerFast over the trained files; ``lstrip`` True as roberta-base's <mask>."""
    mask = AddedToken("<mask>", lstrip=lstrip, rstrip=False, special=True, normalized=False)
    return transformers.RobertaTokenizerFast(
        vocab=str(bpe_dir / "vocab.json"), merges=str(bpe_dir / "merges.txt"), mask_token=mask
    )


@pytest.fixture(scope="module")
def roberta(tmp_path_factory):
    """-> (HF torch model, HF tokenizer (roberta-base's lstrip <mask>), jsteer LM, folder,
    jsteer tokenizer of the same vocabulary whose <mask> does not strip spaces)."""
    root = tmp_path_factory.mktemp("roberta")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1, special_tokens=SPECIALS)
    bpe.save_model(str(root))
    hf_tok = _hf_tokenizer(root, lstrip=True)
    vocab = hf_tok.get_vocab()
    for t in ("Florence", "ĠFlorence", "ĠSalzburg", "ĠLondon", "ĠRome", "ĠParis", "Ġcity", "Ġin"):
        assert t in vocab, t
    torch.manual_seed(0)
    cfg = transformers.RobertaConfig(
        vocab_size=len(hf_tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        pad_token_id=hf_tok.pad_token_id,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        type_vocab_size=1,
    )
    cfg._attn_implementation = "eager"
    hf = transformers.RobertaForMaskedLM(cfg)
    with torch.no_grad():  # spread the logits (the default init leaves them nearly flat)
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.05) + (1.0 if "LayerNorm.weight" in name else 0.0))
    hf.eval()
    model_dir = root / "model"
    hf.save_pretrained(model_dir)
    hf_tok.save_pretrained(model_dir)
    plain_dir = root / "tok_no_lstrip"
    _hf_tokenizer(root, lstrip=False).save_pretrained(plain_dir)
    return hf, hf_tok, jsteer.load(str(model_dir)), model_dir, Tokenizer.from_dir(plain_dir)


def _hf_ids(hf_tok, text: str) -> list[int]:
    return hf_tok(text.replace(probe.MASK, hf_tok.mask_token))["input_ids"]


def test_mask_token_and_leading_space_gold(roberta):
    _, hf_tok, lm, _, tok_plain = roberta
    tok = lm.tokenizer
    prompts = [probe.Prompt(t, g) for t, g in PROMPTS]
    exs, sk = probe.encode_prompts(prompts, tok, "mlm")
    assert sk.total == 0 and len(exs) == len(PROMPTS), sk.report()
    for e in exs:
        # one <mask>, right after 'Ġin' / 'Ġis': the ids HF's fill-mask feeds roberta-base for "... <mask> ."
        assert list(e.ids) == _hf_ids(hf_tok, e.prompt.text), [tok.id_to_token(i) for i in e.ids]
        assert [i for i, t in enumerate(e.ids) if t == tok.mask_id] == [e.pos]
        assert tok.id_to_token(e.ids[e.pos - 1]) in ("Ġin", "Ġis")
        assert e.gold == tok.token_to_id("Ġ" + e.prompt.gold)
    dante = exs[0]
    assert [tok.id_to_token(i) for i in dante.ids][-4:] == ["Ġin", "<mask>", "Ġ.", "</s>"]
    assert dante.gold == tok.token_to_id("ĠFlorence") != tok.token_to_id("Florence")
    # a <mask> that does not strip spaces on its left (this tokenizer.json's): the same ids, no
    # stray 'Ġ' token before the mask
    exs_plain, _ = probe.encode_prompts(prompts, tok_plain, "mlm")
    assert [e.ids for e in exs_plain] == [e.ids for e in exs]
    assert [e.gold for e in exs_plain] == [e.gold for e in exs]
    # a mask with no space before it (first, or after "(") takes the no-space form, as HF's fill-mask
    first, _ = probe.encode_prompts([probe.Prompt("[MASK] is a city in Italy .", "Florence")], tok, "mlm")
    assert first[0].gold == tok.token_to_id("Florence") and first[0].pos == 1
    assert list(first[0].ids) == _hf_ids(hf_tok, "[MASK] is a city in Italy .")
    # BTo and type-switching prompts go through the same rewrite
    bto, _ = probe.encode_prompts(prompts[:1], tok, "mlm", text_fn=lambda p: probe.bto_text(p.text, "City"))
    assert list(bto[0].ids) == _hf_ids(hf_tok, "Dante was born in the city [MASK] .")
    assert tok.id_to_token(bto[0].ids[bto[0].pos - 1]) == "Ġcity" and bto[0].gold == dante.gold
    sw = probe.switch_prompts(
        [probe.Prompt("Dante was born in [MASK] .", "Florence", "place_of_birth", "City", "Dante")]
    )
    sw_ex, _ = probe.encode_prompts(sw, tok, "mlm")
    assert sw[0].text == "Dante (born [MASK])." and sw_ex[0].gold == dante.gold
    assert list(sw_ex[0].ids) == _hf_ids(hf_tok, sw[0].text)
    # golds that are not one token are still a counted skip
    _, sk = probe.encode_prompts([probe.Prompt("Dante was born in [MASK] .", "Xqzvkwplm")], tok, "mlm")
    assert sk.counts == {"gold is not a single token": 1}
    assert probe.mask_token(tok) == "<mask>" and probe.mask_token(tok_plain) == "<mask>"


def _torch_ranks(hf, hf_tok, prompts, te=None, lam=0.0) -> np.ndarray:
    """Gold ranks by hand, independently of the probe's encoding: HF's fill-mask input (the
    text with <mask>, HF's tokenizer), the gold " <answer>" (the form fill-mask scores after a
    space), HF torch logits at the mask, special tokens left out; with a TE,
    inputs_embeds = word embeddings + lam * te at the mask."""
    out = []
    for p in prompts:
        ids = _hf_ids(hf_tok, p.text)
        pos = ids.index(hf_tok.mask_token_id)
        gold = hf_tok(" " + p.gold, add_special_tokens=False)["input_ids"]
        assert len(gold) == 1, p.gold
        ids = torch.tensor([ids])
        with torch.no_grad():
            if te is None:
                logits = hf(input_ids=ids).logits
            else:
                x = hf.get_input_embeddings().weight[ids].clone()
                x[0, pos] += lam * torch.tensor(np.asarray(te))
                logits = hf(inputs_embeds=x).logits
        row = logits[0, pos].double().numpy().copy()
        row[hf_tok.all_special_ids] = -np.inf
        out.append(int((row > row[gold[0]]).sum()))
    return np.array(out)


def test_probe_ranks_and_precision_match_torch(roberta):
    hf, hf_tok, lm, _, _ = roberta
    pm = probe.from_lm(lm)
    assert pm.kind == "mlm" and set(pm.excluded_ids) == set(hf_tok.all_special_ids)
    prompts = [probe.Prompt(t, g, "P19", "City") for t, g in PROMPTS]
    exs, sk = probe.encode_prompts(prompts, lm.tokenizer, "mlm")
    assert len(exs) == len(prompts), sk.report()
    te = core.make(
        pm.embedding(),
        jnp.asarray([lm.tokenizer.token_to_id("Ġ" + w) for w in ("Florence", "Salzburg", "London", "Paris")]),
    )
    n = len(exs)
    res = probe.score_rows(
        pm, exs, list(range(n)) * 2, [0.0] * n + [2.5] * n, [0] * (2 * n), te[None], batch_size=4, post_grid=(0.0,)
    )
    want_b = _torch_ranks(hf, hf_tok, prompts)
    np.testing.assert_array_equal(res.rank[:n], want_b)
    np.testing.assert_array_equal(res.rank[n:], _torch_ranks(hf, hf_tok, prompts, te, 2.5))
    assert len(set(want_b.tolist())) > 1  # ranks that tell prompts apart
    # evaluate's B (all prompts reported): P@k of the hand-computed ranks
    rep = probe.evaluate(pm, {"City/P19": prompts}, {}, methods=("B",), holdout=0.0, batch_size=4)
    assert rep["per_group"]["City/P19"]["n_test"] == n
    assert rep["per_group"]["City/P19"]["B"] == probe.precision_at(want_b)
    assert rep["per_group"]["City/P19"]["B"] == {f"P@{k}": float(np.mean(want_b < k)) for k in probe.KS}


def test_cli_probes_a_roberta_checkpoint(roberta, tmp_path, capsys):
    """`jsteer typevec probe --lama` on the RoBERTa folder: every prompt is usable (it used to
    skip them all: '[MASK] not kept as one token', 'gold is not a single token')."""
    hf, hf_tok, _, model_dir, _ = roberta
    lama = tmp_path / "lama"
    (lama / "TREx").mkdir(parents=True)
    (lama / "relations.jsonl").write_text('{"relation": "P19", "template": "[X] was born in [Y] ."}\n')
    facts = [
        ("Dante", "Florence"),
        ("Mozart", "Salzburg"),
        ("Peter", "London"),
        ("Anna", "Rome"),
        ("Marie", "Paris"),
        ("Zed", "Qqzzxxqv"),
    ]
    (lama / "TREx" / "P19.jsonl").write_text(
        "".join(json.dumps({"sub_label": s, "obj_label": o}) + "\n" for s, o in facts)
    )
    kg = tmp_path / "kg"
    kg.mkdir()
    (kg / "City.csv").write_text(
        "Label,Degree\n"
        + "".join(f"{w},{9 - i}\n" for i, w in enumerate(["Florence", "Salzburg", "London", "Rome", "Paris"]))
    )
    out = tmp_path / "rep.json"
    assert (
        main(
            [
                "typevec",
                "probe",
                "--model",
                str(model_dir),
                "--lama",
                str(lama),
                "--kg",
                str(kg),
                "--n",
                "4",
                "--holdout",
                "0",
                "--lambdas",
                "0,1",
                "--batch-size",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rep = json.loads(out.read_text())
    assert rep["kind"] == "mlm" and rep["per_group"]["City/P19"]["n_test"] == 5
    assert rep["skips"]["City/P19"]["by_reason"] == {"gold is not a single token": 1}
    assert rep["type_vectors"]["used"]["City"]["tokens"][0].startswith(" ")
    want = _torch_ranks(hf, hf_tok, [probe.Prompt(f"{s} was born in [MASK] .", o) for s, o in facts[:5]])
    assert rep["per_group"]["City/P19"]["B"] == probe.precision_at(want)
    assert "City/P19" in capsys.readouterr().out
