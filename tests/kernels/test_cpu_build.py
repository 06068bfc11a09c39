"""Building, caching and selecting the CPU C kernels.

The build tests drive `pdserve.kernels.cpu_build` with stand-in compilers (shell scripts that
log their arguments and copy the real library into place), so the cache key, the
file lock, the atomic rename and the error reporting are checked in seconds, without
recompiling. The fallback tests run fresh interpreters, since dispatch decides once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from pdserve.kernels import cpu_build, cpu_ops, dispatch, reference

REPO = Path(__file__).resolve().parents[2]
ATTENTION_OPS = ("write_kv_cache", "decode_attention", "prefill_attention")

FAKE_COMPILER = """#!/bin/sh
# Logs each call; "compiles" by touching the object, "links" by copying a real build.
echo "$@" >> "{log}"
{extra}
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
case " $* " in
  *" -c "*) : > "$out" ;;
  *) cp "{library}" "$out" ;;
esac
"""


@pytest.fixture(scope="module")
def real_library() -> Path:
    try:
        return cpu_build.ensure_built().path
    except cpu_build.BuildError as exc:
        if "no C compiler" in str(exc):
            pytest.skip(f"CPU kernels need a C compiler: {exc}")
        raise


def _fake_compiler(tmp_path: Path, library: Path, extra: str = "") -> tuple[Path, Path]:
    log = tmp_path / "compiler.log"
    script = tmp_path / "fake-cc"
    script.write_text(FAKE_COMPILER.format(log=log, library=library, extra=extra))
    script.chmod(0o755)
    return script, log


def _use(monkeypatch, tmp_path: Path, compiler: Path) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CACHE", str(cache))
    monkeypatch.setenv("CC", str(compiler))
    return cache / "cpu_kernels"


def test_concurrent_builds_compile_once_and_publish_whole_files(
    tmp_path, monkeypatch, real_library
):
    compiler, log = _fake_compiler(tmp_path, real_library, extra="sleep 0.3")
    folder = _use(monkeypatch, tmp_path, compiler)
    results = []
    workers = [threading.Thread(target=lambda: results.append(cpu_build.ensure_built()))]
    workers += [threading.Thread(target=lambda: results.append(cpu_build.ensure_built()))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert len(results) == 2 and results[0].path == results[1].path
    assert sorted(r.fresh for r in results) == [False, True]
    calls = log.read_text().splitlines()
    sources = [name for name in cpu_build.SOURCES if name.endswith(".c")]
    assert sum(" -c " in f" {c} " for c in calls) == len(sources)
    assert sum(" -c " not in f" {c} " for c in calls) == 1, "linked more than once"
    assert "-march=native" in calls[0] and "-fopenmp" in calls[0]
    assert [p.name for p in folder.glob("*.so")] == [results[0].path.name]
    assert not list(folder.glob(".build-*")), "temporary build files left behind"
    # The published file is a working library; a later call finds it.
    assert "C kernels" in cpu_ops.CpuKernels(results[0]).describe()
    assert cpu_build.ensure_built() == cpu_build.BuiltLibrary(results[0].path, fresh=False)


def test_a_compiler_refusing_native_flags_builds_with_portable_ones(
    tmp_path, monkeypatch, real_library
):
    refuse = 'case " $* " in *" -march=native "*) echo "error: bad -march" >&2; exit 1;; esac'
    compiler, log = _fake_compiler(tmp_path, real_library, extra=refuse)
    _use(monkeypatch, tmp_path, compiler)
    assert cpu_build.ensure_built().fresh
    used = [c for c in log.read_text().splitlines() if "-march=native" not in c]
    assert used and all("-O3" in c and "-fopenmp" in c for c in used)


def test_a_failed_build_reports_the_first_error_line_and_leaves_nothing(tmp_path, monkeypatch):
    script = tmp_path / "broken-cc"
    script.write_text(
        '#!/bin/sh\necho "In file included from x.c:1:" >&2\n'
        'echo "decode.c:7:3: error: boom happened" >&2\necho "  7 | boom" >&2\nexit 1\n'
    )
    script.chmod(0o755)
    folder = _use(monkeypatch, tmp_path, script)
    with pytest.raises(cpu_build.BuildError, match="decode.c:7:3: error: boom happened$"):
        cpu_build.ensure_built()
    assert not [p for p in folder.iterdir() if p.suffix != ".lock"]


def test_a_missing_compiler_is_a_build_error(tmp_path, monkeypatch):
    _use(monkeypatch, tmp_path, tmp_path / "no-such-cc")
    with pytest.raises(cpu_build.BuildError, match="no C compiler found"):
        cpu_build.ensure_built()


def test_the_cache_key_follows_sources_compiler_and_cpu(tmp_path, monkeypatch, real_library):
    compiler, _ = _fake_compiler(tmp_path, real_library)
    sources = tmp_path / "src"
    sources.mkdir()
    for name in cpu_build.SOURCES:
        (sources / name).write_bytes((cpu_build.SOURCE_DIR / name).read_bytes())
    monkeypatch.setattr(cpu_build, "SOURCE_DIR", sources)
    key = cpu_build.build_key(str(compiler))
    assert cpu_build.build_key(str(compiler)) == key
    with open(sources / "decode.c", "a") as f:
        f.write("\n/* edited */\n")
    edited = cpu_build.build_key(str(compiler))
    assert edited != key
    os.utime(compiler, ns=(0, 1))
    touched = cpu_build.build_key(str(compiler))
    assert touched != edited
    monkeypatch.setattr(cpu_build, "cpu_signature", lambda: "another cpu")
    assert cpu_build.build_key(str(compiler)) != touched


def test_dispatch_routes_cpu_attention_to_the_c_kernels_and_back(real_library):
    assert dispatch.load_cpu_kernels()
    assert "C kernels" in dispatch.cpu_kernels_status()
    cpu = torch.zeros(1)
    for name in ATTENTION_OPS:
        fn = dispatch.lookup(name, cpu)
        assert isinstance(getattr(fn, "__self__", None), cpu_ops.CpuKernels), name
    try:
        dispatch.set_cpu_kernels_enabled(False)
        assert dispatch.lookup("decode_attention", cpu) is reference.decode_attention_ref
        assert "torch references" in dispatch.cpu_kernels_status()
    finally:
        dispatch.set_cpu_kernels_enabled(True)


PROBE = """
import logging, torch
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from pdserve.kernels import cpu_kernels_status, dispatch, reference
for name in ("decode_attention", "prefill_attention", "write_kv_cache"):
    assert dispatch.lookup(name, torch.zeros(1)) is dispatch._REFERENCE[name], name
print("STATUS", cpu_kernels_status())
"""


def _probe(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PDSERVE_CACHE": str(tmp_path / "cache"), **env}
    return subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, env=full, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


@pytest.mark.slow
def test_without_a_compiler_cpu_attention_runs_the_references_and_says_so_once(tmp_path):
    done = _probe(tmp_path, CC=str(tmp_path / "missing-gcc"))
    assert done.returncode == 0, done.stderr
    assert "STATUS torch references (no C compiler found" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "no C compiler found" in warnings[0]


@pytest.mark.slow
def test_the_environment_switch_forces_the_references_without_building(tmp_path):
    done = _probe(tmp_path, PDSERVE_CPU_KERNELS="0")
    assert done.returncode == 0, done.stderr
    assert "STATUS torch references (C kernels off" in done.stdout
    assert not (tmp_path / "cache").exists(), "built although switched off"
