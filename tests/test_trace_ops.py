"""jsteer.train.trace_ops: a profiled call's kernels mapped to the JAX ops they lower, on a
hand-written optimised HLO and trace (the GPU's naming: deduplicated fusions, a split-K gemm without
metadata, a while loop) and on a real traced decode on this CPU."""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

from jsteer.train import trace_ops

ROOT = pathlib.Path(__file__).resolve().parents[1]

HLO = """
%gemm_fusion_dot.584_computation (parameter_0.3: bf16[16,512,1], parameter_1.3: bf16[16,512,2048]) -> f32[16,1,2048] {
  %dot.813 = f32[16,2048,1]{1,2,0} dot(%parameter_1.3, %parameter_0.3), metadata={scheduling_name="dot.813"}
}

%body (arg: (s32[])) -> (s32[]) {
  %input_reduce_fusion.78 = bf16[2048]{0} fusion(%fusion.1210), kind=kInput, calls=%fused_reduce.78, \
metadata={op_name="jit(_generate)/while/body/Decoder/layers_0/layers_0._layer/attn/o/dot_general" \
deduplicated_name="input_reduce_fusion.78"}
  %input_reduce_fusion.79 = bf16[2048]{0} fusion(%fusion.1190), kind=kInput, calls=%fused_reduce.79, \
metadata={op_name="jit(_generate)/while/body/Decoder/layers_1/layers_1._layer/attn/o/dot_general" \
deduplicated_name="input_reduce_fusion.78"}
  %gemm_fusion_dot.584 = f32[16,1,2048]{2,1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot.584_computation
  %loop_add_fusion.19 = bf16[1,1,2048]{2,1,0} fusion(%gemm_fusion_dot.584, %input_reduce_fusion.78), kind=kLoop, \
metadata={op_name="jit(_generate)/while/body/Decoder/layers_0/layers_0._layer/add"}
}

ENTRY %main (p: s32[]) -> s32[] {
  %while.13 = (s32[]) while(%tuple), condition=%cond, body=%body, metadata={op_name="jit(_generate)/while"}
}
""".replace("\\\n", "")


def _trace(events, device=True):
    procs = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0" if device else "/host:CPU"}}
    ]
    return {"traceEvents": procs + [{"ph": "X", "pid": 1, "tid": 1, "name": n, "dur": d} for n, d in events]}


def test_kernels_are_summed_per_op_over_the_layers():
    trace = _trace(
        [("input_reduce_fusion_78", 10.0)] * 4
        + [("gemm_fusion_dot_584", 7.0)] * 2
        + [("loop_add_fusion_19", 1.0)] * 2
        + [("MemcpyD2H", 0.5)]
    )
    res = trace_ops.summarise(trace, HLO, steps=2)
    rows = {r["op"]: r for r in res["ops"]}
    o = rows["while/body/Decoder/layers_*/attn/o/dot_general"]
    assert o["us_per_step"] == 20.0 and o["events_per_step"] == 2.0 and o["kernels"] == ["input_reduce_fusion_78"]
    # a split-K gemm has no op_name: it is named after the op it feeds
    assert rows["(no op_name; feeds while/body/Decoder/layers_*/add)"]["us_per_step"] == 7.0
    assert rows["(unmapped) MemcpyD2H"]["us_per_step"] == 0.25
    assert res["busy_us_per_step"] == pytest.approx((40 + 14 + 2 + 0.5) / 2)
    assert res["ops"][0]["op"].endswith("attn/o/dot_general")  # longest first


def test_on_the_host_only_kernels_count_not_the_loop_or_the_runtime():
    trace = _trace([("while.13", 100.0), ("input_reduce_fusion.78", 3.0), ("PjitFunction(_generate)", 50.0)], False)
    res = trace_ops.summarise(trace, HLO)
    assert [r["op"] for r in res["ops"]] == ["while/body/Decoder/layers_*/attn/o/dot_general"]
    assert res["busy_us_per_step"] == 3.0


def test_of_several_dumped_programs_the_one_naming_the_trace_is_read(tmp_path):
    """Two jitted steps dumped by one process (fine-tuning's and KALA's): the trace's kernels pick."""
    other = """
ENTRY %main (p: f32[8]) -> f32[8] {
  %loop_add_fusion.19 = f32[8]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(step_fn)/kala/add"}
  %loop_mul_fusion.3 = f32[8]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(step_fn)/kala/mul"}
}
"""
    (tmp_path / "module_0001.jit_step_fn.sm_90_gpu_after_optimizations.txt").write_text(HLO)
    (tmp_path / "module_0002.jit_step_fn.sm_90_gpu_after_optimizations.txt").write_text(other)
    tar = tmp_path / "dump.tgz"
    with tarfile.open(tar, "w:gz") as t:
        for f in sorted(tmp_path.glob("*.txt")):
            t.add(f, arcname=f.name)
    decode = _trace([("input_reduce_fusion_78", 10.0), ("loop_add_fusion_19", 1.0)])
    kala = _trace([("loop_mul_fusion_3", 5.0), ("loop_add_fusion_19", 1.0)])
    for where in (tmp_path, tar):
        assert len(trace_ops.hlo_texts(where)) == 2
        assert trace_ops.hlo_text(where) == other  # without a trace, the last
        assert trace_ops.hlo_text(where, decode) == HLO
        assert trace_ops.hlo_text(where, kala) == other
    ops = [r["op"] for r in trace_ops.summarise(kala, trace_ops.hlo_text(tmp_path, kala))["ops"]]
    assert ops == ["kala/mul", "kala/add"]


def test_hlo_text_names_the_folder_without_a_dump(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        trace_ops.hlo_text(tmp_path)


def _traced_ops(tmp_path, module_re: str, args: list, trace: str, steps: int) -> tuple[list, dict]:
    """Run an experiments/ script (args) on this CPU under an XLA dump of the modules matching
    module_re; its trace (at tmp_path / trace) summed per op: (op names, the summary)."""
    # LLVM -O0 as in conftest.py (the scripts' compilation is most of these tests' time): the op names
    # come from XLA's HLO passes, which run as before
    dump = f"--xla_dump_to={tmp_path}/hlo --xla_dump_hlo_module_re={module_re}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{dump} --xla_backend_optimization_level=0")
    subprocess.run([sys.executable, *args], cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    trace = json.load(gzip.open(tmp_path / trace))
    res = trace_ops.summarise(trace, trace_ops.hlo_text(tmp_path / "hlo", trace), steps, 400)
    return [r["op"] for r in res["ops"]], res


def test_a_traced_decode_on_this_cpu_maps_to_the_decoders_ops(tmp_path):
    """The real naming: experiments/gpu_decode_trace.py --tiny under an XLA dump, read back."""
    args = ["experiments/gpu_decode_trace.py", "--tiny", "--new", "4", "--out", str(tmp_path / "t")]
    ops, res = _traced_ops(tmp_path, ".*generate.*", args, "t/trace.json.gz", steps=4)
    assert any("while/body/Decoder/layers_*/" in op for op in ops), ops
    assert not any(op == "while" or op.startswith("(unmapped)") for op in ops), ops
    assert res["busy_us_per_step"] > 0


def test_a_traced_bert_train_step_on_this_cpu_maps_to_its_forward_and_backward_ops(tmp_path):
    """bench_gpu.py --trace (device_check_bert.sh's step) under an XLA dump of the Trainer's step_fn."""
    args = ["experiments/bench_gpu.py", "--part", "bert", "--tiny", "--sizes", "4x32", "--framework", "jax"]
    args += ["--reps", "1", "--trace", str(tmp_path / "t"), "--out", str(tmp_path / "b.json")]
    ops, res = _traced_ops(tmp_path, ".*step_fn.*", args, "t/bert_4x32/trace.json.gz", steps=3)
    _records_the_machine(json.loads((tmp_path / "b.json").read_text())["machine"])
    assert any(op.startswith("jvp(BertForTokenClassification)/encoder/layer_*/") for op in ops), ops
    assert any(op.startswith("transpose(jvp(BertForTokenClassification))/encoder/layer_*/") for op in ops), ops
    assert res["busy_us_per_step"] > 0


def test_traced_kala_steps_on_this_cpu_each_map_to_their_own_program(tmp_path):
    """bench_kala.py --trace (device_check_kala.sh's step): fine-tuning's and relational KALA's steps,
    both jit(step_fn) in one dump, each summed through its own program."""
    args = ["experiments/bench_kala.py", "--methods", "finetune,relational", "--graph-rungs", "0", "--examples", "64"]
    args += ["--batch-size", "8", "--steps", "1", "--rounds", "1", "--no-torch", "--trace", str(tmp_path / "t")]
    ops, res = _traced_ops(
        tmp_path, ".*step_fn.*", args + ["--out", str(tmp_path / "b.json")], "t/relational/trace.json.gz", 3
    )
    assert any("/kala/graph_" in op and "layer_*" in op for op in ops), ops
    assert any(op.startswith("transpose(jvp(KalaModel))/encoder/layer_*/") for op in ops), ops
    trace = json.load(gzip.open(tmp_path / "t/finetune/trace.json.gz"))
    tuned = trace_ops.summarise(trace, trace_ops.hlo_text(tmp_path / "hlo", trace), 3, 400)
    assert tuned["ops"] and not any("/kala/" in r["op"] for r in tuned["ops"]), tuned["ops"]
    _records_the_machine(json.loads((tmp_path / "b.json").read_text())["machine"])
    assert res["busy_us_per_step"] > 0


def _records_the_machine(m: dict) -> None:
    """A benchmark JSON's ``machine`` (jsteer.perf.machine, issue #36: the CPU model and flags)."""
    from jsteer.backbones import cpu

    assert m["cpu"] == json.loads(json.dumps(cpu.describe())) and m["cpu"]["model"] and m["cpu"]["simd"]
    assert m["versions"]["jax"] and m["cpu_count"] == os.cpu_count() and "gpu_atomics" in m


def test_layer_indices_fold_for_decoders_and_encoders():
    assert trace_ops.fold("jit(_generate)/while/body/Decoder/layers_3/layers_3._layer/attn/o/dot_general") == (
        "while/body/Decoder/layers_*/attn/o/dot_general"
    )
    assert trace_ops.fold("jit(step)/transpose(jvp(Bert))/encoder/layer_11/add_any") == (
        "transpose(jvp(Bert))/encoder/layer_*/add_any"
    )
