"""jsteer.actsteer on a tiny random LLaMA: the methods against NumPy re-derivations, the hooks
(identity at strength 0, no recompiles, generated tokens steered), GGUF / safetensors files read
back by gguf / safetensors themselves, the errors, and the CLI."""

import dataclasses
import json

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

import jsteer
from jsteer import actsteer, decode
from jsteer.actsteer import ControlVector, WrongModelError
from jsteer.cli import main
from jsteer.hooks import Hooks, Steer, compose
from jsteer.steer import toy

POS = ["good great movie", "happy", "the film was nice and wonderful", "love it", "a good day"]
NEG = ["bad awful movie and the plot", "sad", "the film was ugly", "hate it", "a terrible day with some people"]
LAYERS = (0, 2)


@pytest.fixture(scope="module")
def lm():
    return toy.lm(seed=0, layers=3, norm_scale_noise=0.3)


def acts(lm, texts, layer):
    """Reference activations, one unpadded forward per text -> (last token [N, D], token mean
    without the leading bos [N, D]) in float64."""
    last, mean = [], []
    for t in texts:
        ids = lm.tokenizer.encode(t)
        assert ids[0] == lm.tokenizer.bos_id
        h = np.asarray(
            lm.forward(np.asarray([ids]), capture=(f"resid_post.{layer}",)).captured[f"resid_post.{layer}"][0],
            np.float64,
        )
        last.append(h[-1])
        mean.append(h[1:].mean(0))
    return np.stack(last), np.stack(mean)


def test_caa_equals_numpy_mean_difference(lm):
    cv = actsteer.train(lm, POS, NEG, layers=list(LAYERS), method="caa", batch_size=4)  # 2 batches, padded
    cv_mean = actsteer.train(lm, POS, NEG, layers=list(LAYERS), method="caa", reduce="mean")
    assert cv.layers == LAYERS and cv.recipe["reduce"] == "last" and cv.hidden_size == 32
    for k in LAYERS:
        (pl, pm), (nl, nm) = acts(lm, POS, k), acts(lm, NEG, k)
        np.testing.assert_allclose(cv.numpy()[k], (pl - nl).mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(cv_mean.numpy()[k], (pm - nm).mean(0), rtol=1e-5, atol=1e-6)


def test_pca_equals_numpy_svd_with_repeng_sign(lm):
    cv = actsteer.train(lm, POS, NEG, layers=list(LAYERS), method="pca")
    for k in LAYERS:
        (pos, _), (neg, _) = acts(lm, POS, k), acts(lm, NEG, k)
        d = pos - neg
        v = np.linalg.svd(d - d.mean(0), full_matrices=False)[2][0]
        got = cv.numpy()[k]
        np.testing.assert_allclose(np.abs(got @ v), 1.0, atol=1e-5)  # the first principal component, unit
        v = got if got @ v > 0 else -got
        above, below = ((pos - neg) @ v > 0).sum(), ((pos - neg) @ v < 0).sum()
        want = v if above >= below else -v  # repeng: flip when more positives project lower
        np.testing.assert_allclose(got, want, atol=1e-6)
        assert ((pos - neg) @ got > 0).sum() >= ((pos - neg) @ got < 0).sum()


def test_actadd_equals_the_pair_difference(lm):
    cv = actsteer.train(lm, "good great movie", "bad awful", layers=1, method="actadd")
    (_, pm), (_, nm) = acts(lm, ["good great movie"], 1), acts(lm, ["bad awful"], 1)
    assert cv.recipe["reduce"] == "mean" and cv.recipe["positive"] == "good great movie"
    np.testing.assert_allclose(cv.numpy()[1], pm[0] - nm[0], rtol=1e-5, atol=1e-6)


def test_zero_strength_is_identity_and_strength_never_recompiles(lm):
    cv = actsteer.train(lm, POS, NEG, layers=list(LAYERS))
    ids, mask = lm.encode_batch(["the movie was", "it is a very"])
    base = np.asarray(lm.forward(ids, mask).logits)
    np.testing.assert_array_equal(np.asarray(lm.forward(ids, mask, hooks=cv.hooks(0)).logits), base)
    assert np.abs(np.asarray(lm.forward(ids, mask, hooks=cv.hooks(3.0)).logits) - base).max() > 1e-2
    prompts = ["the movie was", "it is a very"]
    plain = lm.generate(prompts, max_new_tokens=5, return_ids=True)[1]
    for zero in (0.0, np.zeros(2)):  # strength 0: empty hooks, the unsteered computation
        assert cv.hooks(zero).interventions is None
        np.testing.assert_array_equal(
            lm.generate(prompts, max_new_tokens=5, hooks=cv.hooks(zero), return_ids=True)[1], plain
        )
    n = decode.compiled_count()
    lm.generate(prompts, max_new_tokens=5, hooks=cv.hooks(1.0))
    assert decode.compiled_count() == n + 1
    for s in (2.0, -1.5, 4, np.float32(0.5), jnp.asarray(3.0)):  # a scalar of any type
        lm.generate(prompts, max_new_tokens=5, hooks=cv.hooks(s))
    assert decode.compiled_count() == n + 1  # the strength is traced: one program for every nonzero value
    for s in ([1.0, -1.0], jnp.asarray([0.0, 3.0])):  # per row [B]: one more shape, one more program
        lm.generate(prompts, max_new_tokens=5, hooks=cv.hooks(s))
    assert decode.compiled_count() == n + 2


def test_generated_tokens_are_steered_like_a_teacher_forced_forward(lm):
    """Greedy generate with cv hooks = argmax of a forward with the same hooks over prompt +
    generated ids, at every generated position: the vector acts on generated tokens too."""
    cv = actsteer.train(lm, POS, NEG, layers=[1], method="caa")
    prompts, n = ["the movie was", "we saw some people and"], 10
    hooks = cv.hooks(jnp.asarray([6.0, -6.0]))
    toks = lm.generate(prompts, max_new_tokens=n, hooks=hooks, stop_ids=(), return_ids=True)[1]
    assert (toks != lm.generate(prompts, max_new_tokens=n, stop_ids=(), return_ids=True)[1]).any()
    ids, mask = lm.encode_batch(prompts, bucket=True)  # the ids generate ran on
    full, fmask = np.concatenate([ids, toks], 1), np.concatenate([mask, np.ones_like(toks)], 1)
    logits = np.asarray(lm.forward(full, fmask, hooks=hooks).logits)
    t = ids.shape[1]
    np.testing.assert_array_equal(logits[:, t - 1 : t - 1 + n].argmax(-1), toks)


def test_hooks_compose_with_an_lm_steer_steer_and_other_vectors(lm):
    cv = actsteer.train(lm, POS, NEG, layers=list(LAYERS))
    ids, mask = lm.encode_batch(["the movie was", "it is a very"])
    rs = np.random.RandomState(0)
    steer = Steer(eps=jnp.asarray([0.5]), vec=jnp.asarray(rs.randn(1, 32).astype(np.float32)))
    both = compose(cv.hooks(2.0), Hooks(steer=steer))
    ref = Hooks(steer=steer, interventions=cv.hooks(2.0).interventions)
    np.testing.assert_array_equal(
        np.asarray(lm.forward(ids, mask, hooks=both).logits), np.asarray(lm.forward(ids, mask, hooks=ref).logits)
    )
    twice = compose(cv.hooks(1.0), cv.hooks(2.0))  # two Adds at each site = one at the summed strength
    np.testing.assert_allclose(
        np.asarray(lm.forward(ids, mask, hooks=twice).logits),
        np.asarray(lm.forward(ids, mask, hooks=cv.hooks(3.0)).logits),
        rtol=1e-5,
        atol=1e-5,
    )
    assert len(lm.generate(["the movie was"], max_new_tokens=3, hooks=compose(cv.hooks(2.0), Hooks(steer=steer)))) == 1


def test_gguf_round_trip_and_structure(lm, tmp_path):
    cv = actsteer.train(lm, POS, NEG, layers=[1, 2], method="pca")
    path = cv.export_gguf(tmp_path / "cv.gguf")
    r = gguf.GGUFReader(str(path))
    assert r.get_field("general.architecture").contents() == "controlvector"
    assert r.get_field("controlvector.model_hint").contents() == "llama"
    assert r.get_field("controlvector.layer_count").contents() == 2
    assert [t.name for t in r.tensors] == ["direction.1", "direction.2"]
    for t in r.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32 and list(t.shape) == [32]
        np.testing.assert_array_equal(np.asarray(t.data), cv.numpy()[int(t.name.split(".")[1])])
    back = ControlVector.from_gguf(path, lm=lm)
    assert (back.base_model, back.method, back.recipe, back.layers) == (cv.base_model, "pca", cv.recipe, (1, 2))
    for k in cv.layers:
        np.testing.assert_array_equal(back.numpy()[k], cv.numpy()[k])

    with pytest.raises(ValueError, match="layer 0 cannot be exported: llama.cpp refuses"):
        actsteer.train(lm, POS, NEG, layers=[0, 1]).export_gguf(tmp_path / "zero.gguf")
    assert not (tmp_path / "zero.gguf").exists()

    # a repeng / llama.cpp file without jsteer's keys: no identity, only the hidden size is checked
    w = gguf.GGUFWriter(str(tmp_path / "repeng.gguf"), "controlvector")
    w.add_string("controlvector.model_hint", "llama")
    w.add_uint32("controlvector.layer_count", 1)
    w.add_tensor("direction.2", np.ones(32, np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    foreign = ControlVector.from_gguf(tmp_path / "repeng.gguf", lm=lm)
    assert foreign.base_model is None and foreign.method == "gguf" and foreign.layers == (2,)
    with pytest.raises(WrongModelError, match="hidden size 32, the model .* has 16"):
        ControlVector.from_gguf(tmp_path / "repeng.gguf", lm=toy.lm(hidden=16, layers=3))

    w = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(
        ValueError,
        match=r"model\.gguf: not a control vector: general.architecture is 'llama'.*"
        r"token_embd.weight",
    ):
        ControlVector.from_gguf(tmp_path / "model.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="junk.gguf: not a GGUF file"):
        ControlVector.from_gguf(tmp_path / "junk.gguf")


def test_safetensors_round_trip_plain_reader_and_model_checks(lm, tmp_path):
    cv = actsteer.train(lm, POS, NEG, layers=list(LAYERS))
    path = cv.save(tmp_path / "cv.safetensors")
    plain = load_file(str(path))
    assert sorted(plain) == ["direction.0", "direction.2"]
    assert all(v.dtype == np.float32 and v.shape == (32,) for v in plain.values())
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
    assert meta["format"] == "jsteer.controlvector/1" and meta["base_model"] == lm.identity
    assert (meta["method"], meta["model_type"], int(meta["hidden_size"])) == ("caa", "llama", 32)
    assert json.loads(meta["layers"]) == [0, 2] and json.loads(meta["recipe"])["pairs"] == len(POS)
    back = ControlVector.load(path, lm=lm)
    assert back.recipe == cv.recipe and back.layers == cv.layers
    for k in LAYERS:
        np.testing.assert_array_equal(back.numpy()[k], plain[f"direction.{k}"])

    other = toy.lm(seed=1, layers=3)
    with pytest.raises(WrongModelError, match=f"computed on base model {cv.base_model}.*model is {other.identity}"):
        ControlVector.load(path, lm=other)
    with pytest.raises(WrongModelError, match=r"layer 2 is out of range \(the model has 2 layers"):
        dataclasses.replace(back, base_model=None).check(toy.lm(seed=0, layers=2))
    with pytest.raises(FileNotFoundError, match="missing.safetensors: no such control-vector file"):
        ControlVector.load(tmp_path / "missing.safetensors")
    from safetensors.numpy import save_file

    save_file({"direction.1": np.ones(32, np.float32)}, str(tmp_path / "bare.safetensors"))
    with pytest.raises(ValueError, match="bare.safetensors: metadata field 'format' is missing"):
        ControlVector.load(tmp_path / "bare.safetensors")
    save_file({"weight": np.ones(32, np.float32)}, str(tmp_path / "w.safetensors"), metadata=cv.metadata())
    with pytest.raises(ValueError, match="tensor 'weight' is not a control-vector direction"):
        ControlVector.load(tmp_path / "w.safetensors")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(layers=[3]), r"layer 3 is out of range \(the model has 3 layers: 0..2\)"),
        (dict(layers=[-1]), "layer -1 is out of range"),
        (dict(layers=[1, 1]), "layer 1 is given twice"),
        (dict(layers=[]), "layers: none given"),
        (dict(layers=["1"]), "'1' is not an int layer index"),
        (dict(positive=[]), "positive: no texts"),
        (dict(negative=NEG[:3]), "5 positive but 3 negative texts"),
        (dict(negative=NEG[:4] + [" "]), r"negative\[4\] is empty"),
        (dict(method="actadd"), "actadd takes one prompt pair, got 5"),
        (dict(method="pca", positive=POS[:1], negative=NEG[:1]), "pca needs at least 2 pairs"),
        (dict(method="pca", positive=["good", "good"], negative=["bad", "bad"]), "every pair has the same difference"),
        (dict(method="mean"), "unknown method 'mean'"),
        (dict(reduce="first"), "reduce must be 'last' or 'mean'"),
    ],
)
def test_bad_input_is_refused_by_name(lm, kw, match):
    args = dict(positive=POS, negative=NEG, layers=[1], method="caa") | kw
    with pytest.raises(ValueError, match=match):
        actsteer.train(lm, **args)


def test_vector_of_another_hidden_size_or_depth_is_refused(lm):
    cv = actsteer.train(lm, POS, NEG, layers=[2])
    small = toy.lm(seed=0, hidden=16, layers=3)
    with pytest.raises(WrongModelError, match="hidden size 32, the model .* has 16"):
        cv.check(small)
    with pytest.raises(ValueError, match=r"'resid_post.2': layer 2 is out of range \(the model has 2 layers"):
        toy.lm(seed=0, layers=2).forward(*lm.encode_batch(["good"]), hooks=cv.hooks(1.0))
    with pytest.raises(ValueError, match="direction.2 has shape"):
        ControlVector({2: np.ones(16, np.float32)}, None, 32, "caa")
    with pytest.raises(ValueError, match="strength must be a scalar or"):
        cv.hooks(np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"select: layer 1 is not in this vector \(layers \[2\]\)"):
        cv.select([1])


def test_select_keeps_a_subset_of_layers(lm):
    cv = actsteer.train(lm, POS, NEG, layers=[0, 1, 2])
    one = cv.select(1)
    assert one.layers == (1,) and one.recipe["layers"] == [1] and one.base_model == cv.base_model
    np.testing.assert_array_equal(one.numpy()[1], cv.numpy()[1])
    assert list(one.hooks(2.0).interventions) == ["resid_post.1"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("actsteer_cli")
    jsteer.save(toy.lm(seed=0, layers=3), d / "toy0")
    jsteer.save(toy.lm(seed=1, layers=3), d / "toy1")
    (d / "pos.txt").write_text("\n".join(POS) + "\n\n")
    (d / "neg.txt").write_text("\n".join(NEG) + "\n")
    (d / "neg3.txt").write_text("\n".join(NEG[:3]) + "\n")
    return d


def test_cli_train_and_generate(saved, capsys):
    d = saved
    for out, method in (("cv.safetensors", "caa"), ("cv.gguf", "pca")):
        assert (
            main(
                [
                    "actsteer",
                    "train",
                    "--model",
                    str(d / "toy0"),
                    "--positive",
                    str(d / "pos.txt"),
                    "--negative",
                    str(d / "neg.txt"),
                    "--layers",
                    "1,2",
                    "--method",
                    method,
                    "--out",
                    str(d / out),
                ]
            )
            == 0
        )
        captured = capsys.readouterr()
        assert "5 pairs" in captured.out
        # the activations pass shows the project's bar: 10 texts (5 pairs), counted in texts
        assert "actsteer: activations" in captured.err and "/10 " in captured.err, captured.err
    cv = ControlVector.load(d / "cv.safetensors", lm=jsteer.load(str(d / "toy0")))
    assert cv.layers == (1, 2) and cv.recipe["positive_file"] == str(d / "pos.txt")
    assert (
        main(
            [
                "actsteer",
                "generate",
                "--model",
                str(d / "toy0"),
                "--vector",
                str(d / "cv.safetensors"),
                "--strength",
                "4",
                "--vector",
                str(d / "cv.gguf"),
                "--strength",
                "-1",
                "--max-new-tokens",
                "4",
                "--json",
                "the movie was",
                "it is",
            ]
        )
        == 0
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [x["prompt"] for x in lines] == ["the movie was", "it is"]

    def fails(argv, match):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and match in err, err

    fails(
        ["actsteer", "generate", "--model", str(d / "toy1"), "--vector", str(d / "cv.safetensors"), "x"],
        "computed on base model",
    )
    fails(
        [
            "actsteer",
            "train",
            "--model",
            str(d / "toy0"),
            "--positive",
            str(d / "pos.txt"),
            "--negative",
            str(d / "neg3.txt"),
            "--layers",
            "1",
            "--out",
            str(d / "x.safetensors"),
        ],
        "has 5 prompts but",
    )
    fails(
        [
            "actsteer",
            "train",
            "--model",
            str(d / "toy0"),
            "--positive",
            str(d / "pos.txt"),
            "--negative",
            str(d / "neg.txt"),
            "--layers",
            "1,7",
            "--out",
            str(d / "x.safetensors"),
        ],
        "layer 7 is out of range",
    )
    fails(
        [
            "actsteer",
            "train",
            "--model",
            str(d / "toy0"),
            "--positive",
            str(d / "nope.txt"),
            "--negative",
            str(d / "neg.txt"),
            "--layers",
            "1",
            "--out",
            str(d / "x.safetensors"),
        ],
        "nope.txt: no such file",
    )
    fails(
        [
            "actsteer",
            "generate",
            "--model",
            str(d / "toy0"),
            "--vector",
            str(d / "cv.gguf"),
            "--strength",
            "1",
            "--strength",
            "2",
            "x",
        ],
        "1 --vector files but 2 --strength values",
    )
    assert not (d / "x.safetensors").exists()
