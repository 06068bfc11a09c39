"""Builds the CPU kernels (`kernels/cpu/*.c`) into a shared library, once per machine.

The library lives in a cache folder (`$PDSERVE_CACHE/cpu_kernels`, or
~/.cache/pdserve/cpu_kernels) under a name keyed by a hash of the sources, the
compiler (path and modification time), the flags and the CPU model and feature
flags, so a change to any of them builds afresh and a machine never loads a library
built for another CPU. Concurrent processes serialise on a file lock; the library is
compiled to a temporary file and renamed into place, so nobody ever loads a partial
file. Loading an existing build costs a hash of a few small files and a dlopen.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
SOURCES = (
    "common.h",
    "attention.h",
    "attend.h",
    "info.c",
    "kv_write.c",
    "decode.c",
    "prefill.c",
    "linear.h",
    "linear.c",
    "rotary.c",
    "norm.c",
    "activation.c",
    "program.c",
    "linear_bf16.c",
    "linear_lanes.c",
    "linear_int8.c",
    "linear_gguf.c",
    "linear_kquant.c",
)
# Tried in order: the first that compiles wins. -march=native auto-vectorises for
# this CPU (AVX2/FMA/F16C where present); a compiler that refuses it still builds.
# PDSERVE_CPU_ISA=avx2 builds for AVX2+FMA on any machine that has it (an AVX-512
# machine then runs the kernels an AVX2 machine runs), and `apply_isa` points torch's
# own kernels there too (ATEN_CPU_CAPABILITY).
ISA_VARIABLE = "PDSERVE_CPU_ISA"
ISA_FLAG_SETS = {
    "native": (("-O3", "-march=native", "-fopenmp"), ("-O3", "-fopenmp")),
    "avx2": (("-O3", "-march=haswell", "-mtune=generic", "-fopenmp"),),
}
ISA_CPU_FLAGS = {"native": (), "avx2": ("avx2", "fma", "f16c")}


def chosen_isa() -> str:
    """PDSERVE_CPU_ISA's value (default native); ValueError naming the choices."""
    isa = os.environ.get(ISA_VARIABLE, "native").strip().lower() or "native"
    if isa not in ISA_FLAG_SETS:
        raise ValueError(f"{ISA_VARIABLE} must be one of {', '.join(ISA_FLAG_SETS)}; got {isa!r}")
    return isa


def apply_isa() -> str:
    """Checks PDSERVE_CPU_ISA and, for avx2, makes torch's CPU kernels use AVX2 too
    (read on torch's first vectorised op, so this runs when `pdserve.kernels` loads)."""
    isa = chosen_isa()
    if isa == "avx2":
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    return isa


# -ffp-contract=off: the kernels fuse multiply-adds only where they say so (v8_fma), so
# a value's rounding never depends on how the compiler treated the code around it.
COMMON_FLAGS = (
    "-shared",
    "-fPIC",
    "-std=gnu11",
    "-fno-math-errno",
    "-Wno-psabi",
    "-ffp-contract=off",
)
# A cold build on a busy two-core machine (a test run beside other work) took about 5
# minutes; the limit only catches a compiler that hangs.
COMPILE_TIMEOUT_S = 900


class BuildError(RuntimeError):
    """The kernels cannot be built here; the message is one line."""


@dataclass(frozen=True)
class BuiltLibrary:
    path: Path
    fresh: bool  # compiled by this call (False: found in the cache)


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "pdserve"
    return base / "cpu_kernels"


def find_compiler() -> str:
    cc = os.environ.get("CC") or "gcc"
    path = shutil.which(cc)
    if path is None:
        raise BuildError(f"no C compiler found ({cc!r} is not on PATH)")
    return os.path.realpath(path)


def cpu_signature() -> str:
    """The CPU model and feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 16)
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags", "Features", "CPU part") and key not in wanted:
            wanted[key] = value.strip()
    return f"{platform.machine()} " + " | ".join(f"{k}={v}" for k, v in sorted(wanted.items()))


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where it does not)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 16)
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_bf16() -> bool:
    """Whether bf16 weights meet bf16 dot-product instructions here (AVX512-BF16 in a
    native build), so bf16 runs at well over float32's speed."""
    return chosen_isa() == "native" and "avx512_bf16" in cpu_flags()


def build_key(compiler: str) -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    stat = os.stat(compiler)
    digest.update(f"{compiler}\0{stat.st_mtime_ns}\0{stat.st_size}\0".encode())
    digest.update(repr((ISA_FLAG_SETS[chosen_isa()], COMMON_FLAGS)).encode())
    digest.update(cpu_signature().encode())
    return digest.hexdigest()[:20]


def library_path(compiler: str) -> Path:
    return cache_dir() / f"pdserve_cpu_kernels-{build_key(compiler)}.so"


def ensure_built() -> BuiltLibrary:
    """The path of a library for these sources on this CPU, compiling it if needed."""
    compiler = find_compiler()
    path = library_path(compiler)
    if path.exists():
        return BuiltLibrary(path, fresh=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():  # another process built it while we waited
            return BuiltLibrary(path, fresh=False)
        _remove_abandoned_builds(path.parent)
        _compile(compiler, path)
    return BuiltLibrary(path, fresh=True)


def _remove_abandoned_builds(folder: Path, max_age_s: float = 3600.0) -> None:
    """Temporary build folders of processes killed mid-compile (a live build is younger
    than COMPILE_TIMEOUT_S)."""
    now = time.time()
    for entry in folder.glob(".build-*"):
        try:
            if now - entry.stat().st_mtime > max_age_s:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        except OSError:
            pass  # another process removed it first


def _compile(compiler: str, target: Path) -> None:
    isa = chosen_isa()
    missing = [f for f in ISA_CPU_FLAGS[isa] if f not in cpu_signature().split()]
    if missing:
        raise BuildError(f"{ISA_VARIABLE}={isa} needs a CPU with {', '.join(missing)}")
    errors = []
    for flags in ISA_FLAG_SETS[isa]:
        with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as work:
            error = _compile_with(compiler, flags, Path(work))
            if error is None:
                os.replace(Path(work) / "kernels.so", target)
                return
        errors.append(f"{' '.join(flags)}: {error}")
    raise BuildError("compiling the CPU kernels failed: " + errors[-1])


def _compile_with(compiler: str, flags: tuple[str, ...], work: Path) -> str | None:
    """Compile every source at once (one process each: the cores build in parallel),
    then link. None on success, else the compiler's first error line."""
    define = f'-DPD_BUILD_FLAGS="{" ".join(flags)}"'
    sources = [name for name in SOURCES if name.endswith(".c")]
    jobs = []
    try:
        for name in sources:
            obj = work / name.replace(".c", ".o")
            cmd = [compiler, *flags, *COMMON_FLAGS, define, "-c", str(SOURCE_DIR / name)]
            jobs.append(_start([*cmd, "-o", str(obj)]))
        for job in jobs:
            error = _finish(job)
            if error is not None:
                return error
        objects = [str(work / name.replace(".c", ".o")) for name in sources]
        link = [compiler, *flags, *COMMON_FLAGS, *objects, "-o", str(work / "kernels.so"), "-lm"]
        return _finish(_start(link))
    except OSError as exc:
        return str(exc)
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait()


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(job: subprocess.Popen) -> str | None:
    try:
        _, stderr = job.communicate(timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        job.communicate()
        return f"the compiler ran past {COMPILE_TIMEOUT_S} s"
    return None if job.returncode == 0 else first_error_line(stderr)


def first_error_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower():
            return line
    return lines[0] if lines else "the compiler gave no message"
