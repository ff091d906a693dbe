"""Streamed HF loading: a lazy safetensors state dict (headers only until a tensor is read, stored
dtype kept) feeding the family conversion, so jsteer.load(dir, dtype="bfloat16") never holds a
float32 copy of the model; damaged folders are errors naming the file / tensor."""

import dataclasses
import json
import pathlib
import re
import shutil
import tracemalloc
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

import jsteer
from jsteer.backbones import decoder_hf, families, get_family
from jsteer.convert import hf, layout


def _tiny(family: str, width: int = 32, layers: int = 2):
    torch.manual_seed(0)
    if family == "bert":
        cfg = transformers.BertConfig(
            vocab_size=64,
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=4 * width,
            max_position_embeddings=32,
        )
        return transformers.BertModel(cfg).eval()
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=64, n_positions=32, n_embd=width, n_layer=layers, n_head=4, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=1,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _save(model, folder: pathlib.Path, dtype=torch.float32, shard: str | None = None) -> pathlib.Path:
    model.to(dtype).save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder


def _torch_bits(t: torch.Tensor) -> np.ndarray:
    """A torch tensor's values as NumPy in the same dtype (bf16 via ml_dtypes)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@pytest.fixture(scope="module")
def llama_bf16_sharded(tmp_path_factory):
    model = _tiny("llama")
    return model, _save(model, tmp_path_factory.mktemp("llama_bf16"), torch.bfloat16, shard="20KB")


# ----------------------------------------------------------------------------- the lazy state dict


def test_keys_from_headers_and_one_read_per_access(llama_bf16_sharded, monkeypatch):
    model, folder = llama_bf16_sharded
    reads = []
    real = hf.read_tensor
    monkeypatch.setattr(hf, "read_tensor", lambda name, *a, **k: reads.append(name) or real(name, *a, **k))
    cfg, state = hf.open_hf_dir(folder)
    assert isinstance(state, hf.SafetensorsState) and len(state.files) >= 3
    ref = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not model.config.tie_word_embeddings}
    assert cfg["model_type"] == "llama" and set(state) == set(ref)
    name = "model.layers.1.mlp.down_proj.weight"
    assert name in state and state.info(name).shape == tuple(ref[name].shape) and state.info(name).dtype == "BF16"
    assert reads == []  # names, shapes, dtypes: headers only
    x = state[name]
    assert reads == [name]
    assert x.dtype == np.dtype(ml_dtypes.bfloat16) and x.flags.writeable
    np.testing.assert_array_equal(x.view(np.uint16), _torch_bits(ref[name]).view(np.uint16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_stored_dtype_kept_unless_widened(dtype, tmp_path):
    model = _tiny("bert")
    _save(model, tmp_path, dtype)
    _, lazy = hf.open_hf_dir(tmp_path)
    _, wide = hf.open_hf_dir(tmp_path, widen=True)
    _, eager = hf.read_hf_dir(tmp_path)
    for k, t in model.state_dict().items():
        want = _torch_bits(t)
        assert lazy[k].dtype == want.dtype, k
        np.testing.assert_array_equal(lazy[k].astype(np.float64), want.astype(np.float64), err_msg=k)
        if t.is_floating_point():
            assert wide[k].dtype == eager[k].dtype == np.float32
        np.testing.assert_array_equal(wide[k], t.float().numpy() if t.is_floating_point() else t.numpy())
        np.testing.assert_array_equal(eager[k], wide[k])


def test_torch_bin_keeps_bf16_when_not_widened(tmp_path):
    model = _tiny("bert").to(torch.bfloat16)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / hf.BIN_NAME)
    _, state = hf.open_hf_dir(tmp_path)
    assert isinstance(state, dict)
    w = state["embeddings.word_embeddings.weight"]
    assert w.dtype == np.dtype(ml_dtypes.bfloat16)
    want = _torch_bits(model.embeddings.word_embeddings.weight)
    np.testing.assert_array_equal(w.view(np.uint16), want.view(np.uint16))


# ----------------------------------------------------------------------------- damaged folders


def test_missing_shard_names_the_file(llama_bf16_sharded, tmp_path):
    _, folder = llama_bf16_sharded
    bad = shutil.copytree(folder, tmp_path / "bad")
    victim = sorted(bad.glob("model-*.safetensors"))[1]
    victim.unlink()
    for fn in (hf.open_hf_dir, jsteer.load):
        with pytest.raises(FileNotFoundError, match=victim.name):
            fn(bad)


@pytest.mark.parametrize("cut", [5, 200, -3])
def test_truncated_shard_names_the_file(llama_bf16_sharded, tmp_path, cut):
    _, folder = llama_bf16_sharded
    bad = shutil.copytree(folder, tmp_path / "bad")
    victim = sorted(bad.glob("model-*.safetensors"))[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[:cut])  # the length prefix / the header / the last tensor's data
    for fn in (hf.open_hf_dir, jsteer.load):
        with pytest.raises(ValueError, match=rf"{victim.name}.*(truncated|corrupt)"):
            fn(bad)


def test_tensor_absent_from_its_shard_names_tensor_and_file(llama_bf16_sharded, tmp_path):
    _, folder = llama_bf16_sharded
    bad = shutil.copytree(folder, tmp_path / "bad")
    idx = bad / hf.SAFETENSORS_INDEX_NAME
    index = json.loads(idx.read_text())
    shard = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.layers.7.mlp.up_proj.weight"] = shard
    idx.write_text(json.dumps(index))
    for fn in (hf.open_hf_dir, jsteer.load):
        with pytest.raises(ValueError, match=rf"{shard}.*model\.layers\.7\.mlp\.up_proj\.weight.*absent"):
            fn(bad)


def test_file_shrunk_after_opening_names_file_and_tensor(tmp_path):
    _save(_tiny("bert"), tmp_path)
    _, state = hf.open_hf_dir(tmp_path)
    f = tmp_path / hf.SAFETENSORS_NAME
    last = max(state, key=lambda k: state.info(k).start)
    f.write_bytes(f.read_bytes()[: state.info(last).start + 2])
    with pytest.raises(ValueError, match=rf"{f.name}: truncated.*{last}"):
        state[last]
    with pytest.raises(ValueError, match=rf"{f.name}: truncated.*{last}"):
        state.view(last)
    first = min(state, key=lambda k: state.info(k).start)
    assert state[first].shape == state.info(first).shape  # tensors before the cut still read


# ----------------------------------------------------------------------------- apply_layout's placement


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype == np.dtype(ml_dtypes.bfloat16) else x


def test_layout_leaves_are_the_transformed_tensors_bit_for_bit(llama_bf16_sharded):
    """Transforms are views that ``device_put`` copies (strided) onto the device: every leaf holds
    exactly the NumPy transform's values, in the param layout ([in, ...out] kernels)."""
    _, folder = llama_bf16_sharded
    cfg, state = hf.open_hf_dir(folder)
    config = families.config_from_hf(cfg)
    flat = layout.flatten_paths(decoder_hf.params_from_hf(state, config, dtype=jnp.bfloat16))
    checked = 0
    for name, e in decoder_hf.layout(config).items():
        for path, fn in e.outputs if name in state else ():
            want = np.ascontiguousarray(fn(state[name]) if fn is not None else state[name])
            assert flat[path].dtype == want.dtype and flat[path].shape == want.shape, path
            assert np.array_equal(_bits(flat[path]), _bits(want)), path
            checked += 1
    assert checked == len(flat) and flat[("layers_0", "attn", "q", "kernel")].shape == (32, 4, 8)


def _aligned_safetensors(path: pathlib.Path, tensors: dict) -> pathlib.Path:
    """A safetensors file whose tensors start 64-byte aligned (header padded to it, each tensor's
    bytes a multiple of 64): the case in which ``device_put`` would adopt a mapped tensor as is."""
    header, off = {}, 0
    for k, a in tensors.items():
        assert a.nbytes % 64 == 0
        header[k] = {
            "dtype": {"float32": "F32"}[a.dtype.name],
            "shape": list(a.shape),
            "data_offsets": [off, off + a.nbytes],
        }
        off += a.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 64)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(a.tobytes() for a in tensors.values()))
    return path


def test_no_leaf_shares_memory_with_the_file(tmp_path):
    """Tensors whose leaves are all transforms are taken as read-only maps of the file; a leaf that
    is a contiguous view of one (a reshape) is copied, so rewriting the file in place (same inode)
    after the load changes no param."""
    a = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    f = _aligned_safetensors(tmp_path / "model.safetensors", {"a": a, "b": a + 1})
    state = hf.SafetensorsState(hf.read_safetensors_header(f))
    v = state.view("a")
    assert not v.flags.writeable and v.ctypes.data % 64 == 0
    assert jax.device_put(v).unsafe_buffer_pointer() == v.ctypes.data  # the hazard: adopted as is
    del v
    lay = {
        n: layout.Entry((64, 16), (((n, "t"), layout.transpose), ((n, "flat"), lambda w: w.reshape(-1))))
        for n in ("a", "b")
    }
    for threads in (1, 2):
        params = layout.apply_layout(state, lay, threads=threads)
        with open(f, "r+b") as fh:  # overwrite the data in place
            fh.seek(f.stat().st_size - 2 * a.nbytes)
            fh.write(bytes(2 * a.nbytes))
        for n, want in (("a", a), ("b", a + 1)):
            assert np.array_equal(params[n]["t"], want.T) and np.array_equal(params[n]["flat"], want.reshape(-1))
        _aligned_safetensors(f, {"a": a, "b": a + 1})


def test_loaded_model_survives_its_files_being_rewritten_or_deleted(llama_bf16_sharded, tmp_path):
    _, folder = llama_bf16_sharded
    folder = shutil.copytree(folder, tmp_path / "copy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer files
        lm = jsteer.load(folder, dtype="bfloat16")
    want = [np.array(x) for x in jax.tree.leaves(lm.params)]
    for f in folder.glob("*.safetensors"):
        f.write_bytes(bytes(f.stat().st_size))  # truncated and rewritten in place
    assert all(np.array_equal(_bits(x), _bits(w)) for x, w in zip(jax.tree.leaves(lm.params), want))
    shutil.rmtree(folder)
    assert all(np.array_equal(_bits(x), _bits(w)) for x, w in zip(jax.tree.leaves(lm.params), want))


def _llama_layout(folder):
    cfg, state = hf.open_hf_dir(folder)
    return state, decoder_hf.layout(families.config_from_hf(cfg))


def test_worker_threads_give_the_one_at_a_time_tree(llama_bf16_sharded):
    """Tensors converted on worker threads: the same tree, in the same order, bit for bit."""
    _, folder = llama_bf16_sharded
    state, lay = _llama_layout(folder)
    one = layout.flatten_paths(layout.apply_layout(state, lay, dtype=jnp.bfloat16, threads=1))
    many = layout.flatten_paths(layout.apply_layout(state, lay, dtype=jnp.bfloat16, threads=4))
    assert list(one) == list(many)
    assert all(many[k].dtype == one[k].dtype and np.array_equal(_bits(many[k]), _bits(one[k])) for k in one)


@pytest.mark.parametrize("threads", [1, 4])
def test_first_bad_tensor_in_layout_order_is_reported(llama_bf16_sharded, threads):
    _, folder = llama_bf16_sharded
    state, lay = _llama_layout(folder)
    names = list(lay)
    first, last = names[2], names[-1]
    for n in (first, last):
        lay[n] = dataclasses.replace(lay[n], shape=(3, 5))
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(first)}' has shape .*expected \(3, 5\)"):
        layout.apply_layout(state, lay, threads=threads)


def test_worker_threads_place_on_the_callers_default_device(llama_bf16_sharded):
    """``jax.default_device`` is thread-local: the workers place where the caller would."""
    _, folder = llama_bf16_sharded
    state, lay = _llama_layout(folder)
    dev = jax.devices()[-1]
    with jax.default_device(dev):
        params = layout.apply_layout(state, lay, threads=4)
    assert {d for x in jax.tree.leaves(params) for d in x.devices()} == {dev}


def test_callers_arrays_are_copied_not_shared():
    """On CPU ``device_put`` adopts an aligned NumPy buffer as the device array: arrays of a plain
    state dict (the caller's) are copied, so changing them afterwards changes no param."""
    a = hf._aligned_empty(4 * 8 * 4).view(np.float32).reshape(4, 8)  # page-aligned: adoptable
    a[:] = np.arange(32).reshape(4, 8)
    lay = {"a": layout.entry(("a",), (4, 8)), "b": layout.entry(("b",), (4, 8), layout.transpose)}
    params = layout.apply_layout({"a": a, "b": a}, lay)
    a[:] = -1
    assert np.array_equal(params["a"], np.arange(32).reshape(4, 8))
    assert np.array_equal(params["b"], np.arange(32).reshape(4, 8).T)


# ----------------------------------------------------------------------------- jsteer.load


def _transient_host_bytes(fn):
    """Peak NumPy / Python heap bytes while ``fn`` runs, less what its result still holds after
    (tracemalloc sees NumPy buffers, not XLA's; on CPU a param may alias the NumPy buffer it was
    made from, and that buffer is then the param, not a copy)."""
    tracemalloc.start()
    try:
        result = fn()
        current, peak = tracemalloc.get_traced_memory()
        del result
        return peak - current
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_bf16_load_streams_without_a_float32_copy(family, tmp_path):
    """Host memory a bf16 -> bf16 load holds only while loading stays well under the checkpoint's
    own size: tensors are read, cast and placed one at a time (reading the whole checkpoint first
    would take >= 1x, widening it to float32 >= 2x)."""
    folder = _save(_tiny(family, width=128, layers=6), tmp_path / family, torch.bfloat16)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer files in these folders
        jsteer.load(folder, dtype="bfloat16")  # warm: imports and jit caches are not the load's memory
        transient = _transient_host_bytes(lambda: jsteer.load(folder, dtype="bfloat16"))
        lm = jsteer.load(folder, dtype="bfloat16")
        ref = jsteer.load(folder, dtype="float32")
    assert transient < 0.5 * size, (transient, size)
    assert {x.dtype for x in jax.tree.leaves(lm.params)} == {jnp.dtype(jnp.bfloat16)}
    # bf16 weights read as bf16 equal the float32 load cast back: nothing was rounded twice
    assert all(
        np.array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))
        for a, b in zip(jax.tree.leaves(lm.params), jax.tree.leaves(ref.params))
    )


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_family_conversion_casts_to_dtype(family, tmp_path):
    model = _tiny(family)
    _, state = hf.open_hf_dir(_save(model, tmp_path))
    fam = get_family(family)
    config = fam.config_from_hf(model.config.to_dict())
    params = fam.params_from_hf(state, config, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    default = fam.params_from_hf(state, config)
    assert {x.dtype for x in jax.tree.leaves(default)} == {jnp.dtype(jnp.float32)}


def test_sharded_bf16_safetensors_and_bin_load_alike(llama_bf16_sharded, tmp_path):
    model, folder = llama_bf16_sharded
    binned = tmp_path / "bin"
    model.config.save_pretrained(binned)
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, binned / hf.BIN_NAME)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = jsteer.load(folder, dtype="bfloat16"), jsteer.load(binned, dtype="bfloat16")
    assert a.provenance["source_format"] == b.provenance["source_format"] == "hf"
    assert jax.tree.structure(a.params) == jax.tree.structure(b.params)
    assert all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params))
    )
