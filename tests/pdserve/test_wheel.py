"""The wheel holds one top-level name, pdserve, with every room under it and nothing else.

Built from a copy of the tracked files: the live tree may hold build/ and egg-info litter
(setuptools would package a stale build/lib), and other work in progress.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.pdserve import import_rules

REPO = Path(__file__).resolve().parents[2]
REQUIRED = (
    "pdserve/engine/llm.py",
    "pdserve/scheduler/step_scheduler.py",
    "pdserve/kernels/cpu/decode.c",
    "pdserve/cli.py",
    "pdserve/eval/data/smollm2_quality.jsonl",  # package data: the shipped eval dataset
)

pytestmark = pytest.mark.slow


def copy_tracked_files(destination: Path) -> Path:
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        source = REPO / rel
        if source.is_file():  # a tracked file may be deleted in the work tree
            (destination / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / rel)
    return destination


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the copy of the source, the wheel built from it)"""
    source = copy_tracked_files(tmp_path_factory.mktemp("source"))
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*command, "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = out.glob("pdserve-*.whl")
    return source, wheel


def version() -> str:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def members(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_wheel_holds_pdserve_only(built: tuple[Path, Path]) -> None:
    _, wheel = built
    names = members(wheel)
    dist_info = f"pdserve-{version()}.dist-info/"
    strays = sorted(n for n in names if not n.startswith(("pdserve/", dist_info)))
    assert strays == []
    assert [n for n in REQUIRED if n not in names] == []
    # experiments/ and tests/ neither beside pdserve/ nor mapped into it
    not_product = [n for n in names if set(n.split("/")[:2]) & set(import_rules.NOT_PRODUCT)]
    assert not_product == []


def test_wheel_holds_every_product_module(built: tuple[Path, Path]) -> None:
    # pyproject.toml lists packages by hand: a new subpackage would be left out silently.
    source, wheel = built
    names = members(wheel)
    expected = [
        str(m.path) if m.room == "pdserve" else f"pdserve/{m.path}"
        for m in import_rules.product_modules(source)
    ]
    c_sources = (source / "kernels" / "cpu").glob("*.[ch]")  # compiled on the target machine
    expected += [f"pdserve/{p.relative_to(source)}" for p in c_sources]
    assert [n for n in expected if n not in names] == []


def test_wheel_declares_the_cli(built: tuple[Path, Path]) -> None:
    _, wheel = built
    with zipfile.ZipFile(wheel) as archive:
        entry_points = archive.read(f"pdserve-{version()}.dist-info/entry_points.txt").decode()
    assert "pdserve = pdserve.cli:main" in entry_points
