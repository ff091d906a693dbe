"""Test setup: fp32 everywhere, 8 forced host devices (for sharding tests), LLVM -O0, offline HF."""

import os

# 8 host devices for the mesh tests. LLVM -O0 for XLA:CPU's code generation: the suite's programs are
# tiny and its time is mostly their compilation, a third of it LLVM's optimisation passes
# (tests/test_decoder_families.py 147 -> 97 s, test_kala_variants.py 93 -> 71 s, one process). XLA's
# own HLO passes (fusion, layouts, copies: what the HLO-reading tests check) run as before and
# neither level uses fast-math: the same functions, with rounding that can move in the last bits
# (test_train_multiprocess.py's one Adam step on near-zero gradients matched the one-process run
# only with its worker processes, which set their own flags, left at the default level).
# Benchmarks and the demo compile at the default level.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tempfile  # noqa: E402

# One persistent XLA compilation cache per test session, shared by the xdist workers, the notebook
# kernels and CLI subprocesses (they inherit the environment). conftest.py runs in the xdist
# controller before it starts its workers, so they all see the same folder. Many programs recur
# across modules (the same tiny configs), and each module's compiled programs are dropped after it
# (below), so without it every module compiles them again. The key is the program, the flags and
# the jax version, so a hit is the same executable. JSTEER_TEST_JAX_CACHE names a folder to keep.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ.get("JSTEER_TEST_JAX_CACHE") or tempfile.mkdtemp(
        prefix="jsteer-test-jax-cache-"
    )
    os.environ["JSTEER_TEST_JAX_CACHE_OWNED"] = "" if "JSTEER_TEST_JAX_CACHE" in os.environ else "1"
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import gc  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

import jsteer  # noqa: E402,F401  (first: its XLA flags must precede any backend)

jax.config.update("jax_default_matmul_precision", "highest")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """../shared/data; a missing folder fails loudly (never skips)."""
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared data sets not found at {SHARED_DATA}: tests need ../shared/data beside the repo")
    return SHARED_DATA


@pytest.fixture(autouse=True, scope="session")
def _jsteer_data_dir(tmp_path_factory):
    """Raw files the pipelines prepare through the TFDS layer go to a session folder under
    pytest's own temp root, never to ~/.cache/jsteer/tfds (or a $JSTEER_DATA_DIR of the shell)."""
    before = os.environ.get("JSTEER_DATA_DIR")
    os.environ["JSTEER_DATA_DIR"] = str(tmp_path_factory.mktemp("jsteer_data"))
    yield
    if before is None:
        os.environ.pop("JSTEER_DATA_DIR", None)
    else:
        os.environ["JSTEER_DATA_DIR"] = before


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Free each test module's compiled programs after it. XLA:CPU maps every executable's code
    into the process; a whole-suite run that kept them all passed vm.max_map_count (65530 maps)
    around test_sharding.py and crashed inside compilation (SIGSEGV in CI, SIGABRT here)."""
    yield
    jax.clear_caches()
    gc.collect()


def pytest_unconfigure(config):
    """The controller (or a run without xdist) removes the session's cache folder it made."""
    if not hasattr(config, "workerinput") and os.environ.get("JSTEER_TEST_JAX_CACHE_OWNED") == "1":
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
