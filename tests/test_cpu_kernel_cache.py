"""jsteer.backbones.cpu's build cache on a shared machine (CWE-379): a library is loaded only from a
folder this user owns that group and others cannot write, and only if its sha256 is the one recorded
when this user built it; the temp-directory fallback is created 0700 and refused when someone else
made it first.

Most tests build a tiny stand-in for decode_kernels.cc (fast, and no vector ISA needed) and plant a library
whose constructor writes a marker file, so "not loaded" means its code never ran. They need a C++
compiler (g++); without one they fail."""

import hashlib
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

from jsteer.backbones import cpu

OTHER_UID = 4321  # a user that is not this one, for the folders made "someone else's"


@pytest.fixture
def probe(tmp_path, monkeypatch) -> pathlib.Path:
    """JSTEER_CACHE in tmp_path and a stand-in source returning 42; returns the kernels folder. The
    source names tmp_path so each test builds its own file name: dlopen hands back a library already
    loaded under the same path, which would hide what this test loads."""
    src = tmp_path / "probe.cc"
    src.write_text(f'// {tmp_path}\nextern "C" int jsteer_cache_probe() {{ return 42; }}\n')
    monkeypatch.setattr(cpu, "_SOURCE", src)
    monkeypatch.setenv("JSTEER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


@pytest.fixture
def fresh_available(monkeypatch):
    """available() asked again in this test and after it (its result is cached per process)."""
    cpu.available.cache_clear()
    monkeypatch.setattr(cpu, "_reason", cpu._reason)  # restored after the test
    yield
    cpu.available.cache_clear()


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    assert cxx, "these tests need a C++ compiler (g++)"
    return cxx


def _plant(path: pathlib.Path, marker: pathlib.Path, record: bool) -> bytes:
    """Another user's library at path: loading it runs its constructor, which creates marker.
    record: write its own sha256 beside it, as a forged record would be."""
    src = path.parent / "planted.cc"
    src.write_text(
        "#include <fcntl.h>\n#include <unistd.h>\n"
        f'__attribute__((constructor)) static void planted() {{ close(open("{marker}", O_CREAT | O_WRONLY, '
        '0600)); }\nextern "C" int jsteer_cache_probe() { return -1; }\n'
    )
    subprocess.run([_compiler(), "-shared", "-fPIC", str(src), "-o", str(path)], check=True)
    src.unlink()
    data = path.read_bytes()
    if record:
        path.with_name(path.name + ".sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    return data


def _as_someone_elses(make_folder, monkeypatch) -> tuple[pathlib.Path, int]:
    """make_folder() owned by another user, and that user's uid: for real as root (chown), otherwise
    by having the module see this process under another uid (make_folder runs after that)."""
    if os.geteuid() == 0:
        folder = make_folder()
        os.chown(folder, OTHER_UID, OTHER_UID)
        return folder, OTHER_UID
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    return make_folder(), me


def _mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_builds_privately_records_the_hash_and_reuses_it(probe):
    built = cpu._build()
    assert built.parent == probe and _mode(probe) == 0o700
    record = built.with_name(built.name + ".sha256")
    assert record.read_text().strip() == hashlib.sha256(built.read_bytes()).hexdigest()
    assert _mode(built) == 0o600 and _mode(record) == 0o600
    stamp = built.stat().st_mtime_ns
    assert cpu._build() == built and built.stat().st_mtime_ns == stamp  # verified, reused
    assert sorted(p.name for p in probe.iterdir()) == [built.name, record.name]  # no temp files left
    assert cpu._load().jsteer_cache_probe() == 42


@pytest.mark.parametrize("case", ["no_record", "record_of_the_real_build", "garbage_bytes", "symlink"])
def test_a_planted_library_is_never_loaded_but_rebuilt(probe, tmp_path, case):
    name = cpu._recipe()[2]
    target = probe / name
    marker = tmp_path / "planted-ran"
    if case == "record_of_the_real_build":  # swapped in after this user's build: the record no longer fits
        real = cpu._build().read_bytes()
        target.unlink()
        _plant(target, marker, record=False)
    else:
        probe.mkdir(parents=True, mode=0o700)
        if case == "no_record":
            _plant(target, marker, record=False)
        elif case == "garbage_bytes":
            target.write_bytes(b"\x7fELF not a library")
            target.with_name(name + ".sha256").write_text("0" * 64 + "\n")
        else:  # a link (to a library with a fitting record) is never followed
            _plant(tmp_path / "elsewhere.so", marker, record=True)
            target.symlink_to(tmp_path / "elsewhere.so")
            (probe / (name + ".sha256")).write_text((tmp_path / "elsewhere.so.sha256").read_text())
    lib = cpu._load()
    assert not marker.exists(), "the planted library's code ran"
    assert lib.jsteer_cache_probe() == 42
    assert not target.is_symlink()  # replaced by this user's build, atomically
    data = target.read_bytes()
    assert (probe / (name + ".sha256")).read_text().strip() == hashlib.sha256(data).hexdigest()
    if case == "record_of_the_real_build":
        assert data == real
    assert sorted(p.name for p in probe.iterdir()) == [name, name + ".sha256"]


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o720, 0o702], ids=oct)
def test_a_folder_writable_by_group_or_others_is_refused(probe, tmp_path, monkeypatch, fresh_available, mode):
    probe.mkdir(parents=True)
    marker = tmp_path / "planted-ran"
    _plant(probe / cpu._recipe()[2], marker, record=True)  # even a library with a fitting record
    probe.chmod(mode)
    problem = f"{probe}: it is writable by group or others (mode {mode:#o})"
    with pytest.raises(cpu.UnsafeCacheError, match=re.escape(problem)):
        cpu.cache_dir()
    with pytest.raises(cpu.UnsafeCacheError):
        cpu._load()
    # through available(): False with the reason, no exception to the caller
    monkeypatch.setattr(cpu, "_cpu_has_vector_isa", lambda: True)
    assert cpu.available() is False
    assert f"refusing the kernel cache folder {probe}" in cpu.unavailable_reason()
    assert not marker.exists()
    assert _mode(probe) == mode  # left as it is: it may be the user's on purpose


def test_a_folder_owned_by_another_user_is_refused(probe, tmp_path, monkeypatch, fresh_available):
    marker = tmp_path / "planted-ran"

    def make():
        probe.mkdir(parents=True, mode=0o700)
        _plant(probe / cpu._recipe()[2], marker, record=True)
        return probe

    folder, owner = _as_someone_elses(make, monkeypatch)
    problem = f"{folder}: it is owned by uid {owner}, not by this user"
    with pytest.raises(cpu.UnsafeCacheError, match=re.escape(problem)):
        cpu._load()
    monkeypatch.setattr(cpu, "_cpu_has_vector_isa", lambda: True)
    assert cpu.available() is False
    assert f"refusing the kernel cache folder {folder}: it is owned by uid {owner}" in cpu.unavailable_reason()
    assert not marker.exists()


@pytest.mark.parametrize("case", ["fresh", "made_by_another_user", "world_writable", "symlink"])
def test_temp_folder_fallback_is_private_and_checked(probe, tmp_path, monkeypatch, fresh_available, case):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("JSTEER_CACHE", str(blocker))  # $JSTEER_CACHE/kernels cannot be made: the temp folder is used
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)  # like /tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    marker = tmp_path / "planted-ran"

    def folder() -> pathlib.Path:
        return tmp / f"jsteer-kernels-{os.geteuid()}"

    def plant(path):
        path.mkdir(mode=0o700)
        _plant(path / cpu._recipe()[2], marker, record=True)
        return path

    if case == "fresh":
        assert cpu.cache_dir() == folder() and _mode(folder()) == 0o700
        assert folder().stat().st_uid == os.geteuid()
        assert cpu._load().jsteer_cache_probe() == 42
        assert sorted(p.suffix for p in folder().iterdir()) == [".sha256", ".so"]
        return
    if case == "made_by_another_user":
        path, owner = _as_someone_elses(lambda: plant(folder()), monkeypatch)
        problem = f"it is owned by uid {owner}, not by this user"
    elif case == "world_writable":
        path = plant(folder())
        path.chmod(0o777)
        problem = "it is writable by group or others (mode 0o777)"
    else:  # a link to a private folder of the attacker's (here: owned by us, so only the link gives it away)
        plant(tmp_path / "attacker")
        path = folder()
        path.symlink_to(tmp_path / "attacker")
        problem = "it is a symbolic link"
    with pytest.raises(cpu.UnsafeCacheError, match=re.escape(f"{path}: {problem}")):
        cpu._load()
    monkeypatch.setattr(cpu, "_cpu_has_vector_isa", lambda: True)
    assert cpu.available() is False
    assert f"refusing the kernel cache folder {path}: {problem}" in cpu.unavailable_reason()
    assert not marker.exists()


_REAL_KERNEL = """
import os, pathlib, sys
import jax, numpy as np
from jsteer.backbones import cpu
cache = pathlib.Path(sys.argv[1])
if not cpu._cpu_has_vector_isa():  # the documented fallback (tests/test_cpu_kernel.py skips here)
    assert cpu.available() is False and cpu.unavailable_reason() == cpu.NO_VECTOR_ISA
    print("no vector isa"); raise SystemExit(0)
assert cpu.available(), cpu.unavailable_reason()
assert cpu.unavailable_reason() is None
name = cpu._recipe()[2]
assert sorted(p.name for p in (cache / "kernels").iterdir()) == [name, name + ".sha256"]
rng = np.random.default_rng(0)
x, w = rng.standard_normal((5, 70)).astype(np.float32), rng.standard_normal((70, 130)).astype(np.float32)
got = np.asarray(jax.jit(lambda x, w: cpu.small_gemm(x, cpu.pack(w), 130))(x, w))
want = x.astype(np.float64) @ w.astype(np.float64)
np.testing.assert_allclose(got, want, rtol=0, atol=4e-7 * 70 * np.abs(want).max())
# another process's build of the same key lands over this one (same bytes, a new file): asked again,
# available() loads that file but keeps the handlers it registered (XLA refuses a second library's)
lib = cache / "kernels" / name
copy = lib.with_name("copy.so")
copy.write_bytes(lib.read_bytes())
copy.chmod(0o700)
copy.replace(lib)
held = os.open("/dev/null", os.O_RDONLY)  # the folder's next descriptor, so a path dlopen has not seen
cpu.available.cache_clear()
assert cpu.available(), cpu.unavailable_reason()
again = np.asarray(jax.jit(lambda x, w: cpu.small_gemm(x, cpu.pack(w), 130) + 0)(x, w))
np.testing.assert_array_equal(again, got)
print("built and computed")
"""


def test_the_real_kernel_builds_in_a_fresh_cache_and_computes_the_same(tmp_path):
    """In a fresh process (this one's handlers are registered already), including a rebuild by someone
    else landing over the loaded file, as when two pytest workers build a cold cache at once."""
    env = {**os.environ, "JSTEER_CACHE": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", _REAL_KERNEL, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] in ("built and computed", "no vector isa")
