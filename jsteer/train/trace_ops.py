"""A profiled call's device time per model op: the kernels of a ``jax.profiler`` trace mapped to
the JAX ops they came from, through the program XLA optimised (``XLA_FLAGS=--xla_dump_to=DIR``, its
``*after_optimizations.txt``). A kernel is named after its HLO instruction (dots as underscores; a
deduplicated fusion after the instruction it repeats), and the instruction's ``metadata op_name``
says which JAX op it lowers, e.g. ``while/body/Decoder/layers_3/layers_3._layer/attn/o/dot_general``.
Layer indices are folded (``layers_*``), so a row sums an op over the layers. On a GPU the device
streams are read; on CPU the host threads' op events. CLI: ``experiments/gpu_trace_ops.py``.

:func:`summarise` (trace dict, HLO text, steps) -> {"busy_us_per_step", "ops": [{"op",
"us_per_step", "share", "events_per_step", "kernels"}, ...]} longest first; :func:`record` writes
such a trace of a call.
"""

from __future__ import annotations

import collections
import pathlib
import re
import tarfile
from typing import Optional

INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
OP_NAME = re.compile(r'op_name="([^"]*)"')
DEDUP = re.compile(r'deduplicated_name="([^"]*)"')
OPERAND = re.compile(r"%([\w.\-]+)")
CALLS = re.compile(r"calls=%?([\w.\-]+)")
COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
CONTROL = re.compile(r"\s(while|conditional|call)\(")
LAYER = re.compile(r"layers_\d+/layers_\d+\._layer|layers?_\d+")


def hlo_texts(path: pathlib.Path) -> list[str]:
    """Every optimised program at ``path``: that text file, or each ``*after_optimizations.txt`` in a
    folder (an ``--xla_dump_to`` folder) or in a .tgz of them, in name order."""
    if path.is_dir():
        files = sorted(path.glob("*after_optimizations.txt"))
        if not files:
            raise FileNotFoundError(f"{path}: no *after_optimizations.txt in the folder")
        return [f.read_text() for f in files]
    if path.name.endswith((".tgz", ".tar.gz")):
        with tarfile.open(path) as tar:
            members = sorted(
                (m for m in tar.getmembers() if m.name.endswith("after_optimizations.txt")), key=lambda m: m.name
            )
            if not members:
                raise FileNotFoundError(f"{path}: no *after_optimizations.txt in the archive")
            return [tar.extractfile(m).read().decode() for m in members]
    return [path.read_text()]


def hlo_text(path: pathlib.Path, trace: Optional[dict] = None) -> str:
    """The optimised HLO at ``path`` (see :func:`hlo_texts`): with several programs there, the one
    that names the most of ``trace``'s kernel time (several jitted steps dumped by one process,
    e.g. fine-tuning's and KALA's), else the last."""
    texts = hlo_texts(path)
    if trace is None or len(texts) == 1:
        return texts[-1]
    events, _ = device_events(trace)
    return max(texts, key=lambda text: _named_us(events, op_names(text)))


def _named_us(events: list[dict], names: dict[str, str]) -> float:
    """The summed duration of the events that ``names`` (kernel -> op) maps."""
    return sum(e.get("dur", 0) for e in events if _lookup(names, e["name"]) is not None)


def _lookup(names: dict[str, str], kernel: str) -> Optional[str]:
    key = kernel.replace(".", "_")
    return names.get(key) or names.get(re.sub(r"_\d+$", "", key))  # a clone's suffix the dump lacks


def record(call, out: pathlib.Path, calls: int = 1) -> float:
    """Run ``call()`` (its result blocked on) ``calls`` times under ``jax.profiler``; the Perfetto
    trace is copied to ``out/trace.json.gz``. Returns the traced calls' seconds."""
    import glob
    import shutil
    import tempfile
    import time

    import jax

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(call())
            seconds = time.perf_counter() - t0
        found = glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)
        if not found:
            raise RuntimeError(f"the profiler wrote no Perfetto trace under {tmp}")
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(found[0], out / "trace.json.gz")
    return seconds


def fold(op_name: str) -> str:
    """An op_name without the jit prefix, its layer indices folded: ``.../layers_*/attn/o/dot_general``."""
    op = op_name.split("/", 1)[1] if op_name.startswith("jit(") and "/" in op_name else op_name
    return LAYER.sub(lambda m: "layer_*" if m[0].startswith("layer_") else "layers_*", op)


def op_names(hlo: str) -> dict[str, str]:
    """Kernel name (an instruction's, or its deduplicated name's, dots as underscores) -> folded op_name.
    An instruction without metadata (a split-K gemm, a wrapped transpose) takes the first op_name in the
    computation it calls."""
    first_in: dict[str, str] = {}  # computation -> the first op_name inside it
    comp = None
    for line in hlo.splitlines():
        head = COMPUTATION.match(line)
        if head:
            comp = head.group(1)
        op = OP_NAME.search(line)
        if comp and op and comp not in first_in:
            first_in[comp] = op.group(1)
    out: dict[str, str] = {}
    nameless: dict[str, list[str]] = {}  # instruction without any op_name -> its kernel names
    users: dict[str, str] = {}  # instruction -> the folded op_name of its first user that has one
    for line in hlo.splitlines():
        m, op, calls = INSTR.match(line), OP_NAME.search(line), CALLS.search(line)
        if not m or CONTROL.search(line):  # a loop or branch: its time is its body's kernels'
            continue
        name = op.group(1) if op else first_in.get(calls.group(1)) if calls else None
        dedup = DEDUP.search(line)
        keys = {m.group(1), dedup.group(1) if dedup else m.group(1)}
        if name is None:
            nameless[m.group(1)] = [k.replace(".", "_") for k in keys]
            continue
        for key in keys:
            out.setdefault(key.replace(".", "_"), fold(name))
        for operand in OPERAND.findall(line.split("=", 1)[1]):
            users.setdefault(operand, fold(name))
    for instr, keys in nameless.items():  # e.g. a split-K gemm: named after what it feeds
        if instr in users:
            for key in keys:
                out.setdefault(key, f"(no op_name; feeds {users[instr]})")
    return out


def process_names(trace: dict) -> dict:
    """A trace's pid -> process name ("/device:GPU:0", "/host:CPU", ...)."""
    return {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}


def device_events(trace: dict) -> tuple[list[dict], bool]:
    """(complete events on the device streams (GPU / TPU), True), or, with no device in the trace,
    (every complete event of the host, False): only those named after an instruction are then kept."""
    dev = {p for p, n in process_names(trace).items() if "/device:" in n}
    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    return ([e for e in xs if e["pid"] in dev], True) if dev else (xs, False)


def summarise(trace: dict, hlo: str, steps: int = 1, top: int = 30) -> dict:
    """The trace's kernel time per folded op_name, divided by ``steps``, the ``top`` longest."""
    names = op_names(hlo)
    per = collections.defaultdict(lambda: {"us": 0.0, "events": 0, "kernels": set()})
    events, on_device = device_events(trace)
    for e in events:
        op = _lookup(names, e["name"])
        if op is None and not on_device:
            continue  # the host's runtime, not a kernel
        op = op or f"(unmapped) {e['name']}"
        row = per[op]
        row["us"] += e.get("dur", 0)
        row["events"] += 1
        row["kernels"].add(e["name"])
    total = sum(r["us"] for r in per.values())
    rows = sorted(per.items(), key=lambda kv: -kv[1]["us"])
    return {
        "steps": steps,
        "busy_us_per_step": total / steps,
        "ops": [
            {
                "op": op,
                "us_per_step": r["us"] / steps,
                "share": r["us"] / total if total else 0.0,
                "events_per_step": r["events"] / steps,
                "kernels": sorted(r["kernels"])[:6],
            }
            for op, r in rows[:top]
        ],
    }
