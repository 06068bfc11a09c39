"""mypy resolves every `pdserve.<room>` import and fails on a wrongly typed cross-room call.

The rooms are reached statically through the links `pdserve/<room> -> ../<room>`; the
check runs on a copy of the product tree, once as it is and once with a planted error.
The copy starts from the checkout's mypy cache where `make lint` or `make test` left one
(the cache is keyed by module and content, not by folder), so both runs are incremental.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pdserve import import_rules

REPO = Path(__file__).resolve().parents[2]
ROOMS = [room for room in import_rules.ROOMS if room != "pdserve"]
# A module of the gateway calling into common with a str where an int belongs.
PLANTED = """from pdserve.common.model_split import stage_layers


def planted_stage() -> tuple[int, int]:
    return stage_layers("four", 2, 0)
"""


def copy_product_tree(destination: Path) -> Path:
    skip = shutil.ignore_patterns("__pycache__", "*.so", "build")
    for room in ROOMS:
        shutil.copytree(REPO / room, destination / room, ignore=skip)
    # The links stay links, to the copy's own rooms.
    shutil.copytree(REPO / "pdserve", destination / "pdserve", symlinks=True, ignore=skip)
    shutil.copy2(REPO / "pyproject.toml", destination / "pyproject.toml")
    if (REPO / ".mypy_cache").is_dir():
        shutil.copytree(REPO / ".mypy_cache", destination / ".mypy_cache")
    return destination


def mypy(tree: Path) -> subprocess.CompletedProcess[str]:
    # mypy looks in its working folder first: the copy's pdserve/, not the checkout's.
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", sys.executable],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_room_is_linked_under_pdserve() -> None:
    links = {p.name: os.readlink(p) for p in (REPO / "pdserve").iterdir() if p.is_symlink()}
    assert links == {room: f"../{room}" for room in ROOMS}


def test_mypy_passes_the_tree_and_fails_a_wrongly_typed_cross_room_call(tmp_path: Path) -> None:
    tree = copy_product_tree(tmp_path)
    clean = mypy(tree)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "Success: no issues found" in clean.stdout

    (tree / "gateway" / "planted.py").write_text(PLANTED)
    planted = mypy(tree)
    assert planted.returncode == 1, planted.stdout + planted.stderr
    errors = [e for e in planted.stdout.splitlines() if ": error: " in e]
    assert errors == [
        "pdserve/gateway/planted.py:5: error: Argument 1 to "
        '"stage_layers" has incompatible type "str"; expected "int"  [arg-type]'
    ]
    shutil.rmtree(tree / ".mypy_cache", ignore_errors=True)  # large; the rest is small


@pytest.mark.parametrize("room", ["gateway", "engine"])
def test_a_room_imports_once_under_its_pdserve_name(room: str) -> None:
    # The links put each room's files on two paths: only the pdserve name may load them.
    code = (
        f"import json, sys, pdserve.{room} as m; print(json.dumps([m.__file__, "
        "sorted(n for n in sys.modules if n.split('.')[0] in sys.argv[1:])]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *ROOMS],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    file, bare = json.loads(out)
    assert Path(file).resolve() == REPO / room / "__init__.py"
    assert bare == []
