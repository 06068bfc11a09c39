"""ARCHITECTURE.md stays true to the code: the disaggregated journey is at most ten
anchors, each an existing `path:function`, and every file or function it names exists;
each room's cell is short, its detail in the room's package docstring."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "ARCHITECTURE.md"
MAIN_LINE = "### Disaggregated (1 prefill + 1 decode), main line"
ANCHOR = re.compile(r"`([\w/]+\.py):([\w.]+)`")
PATH = re.compile(r"`(\w+/[\w/]*\.py)[`:]")  # room/file.py


def main_line(text: str) -> list[str]:
    """The numbered items of the journey's main line, in order."""
    section = text.split(MAIN_LINE, 1)[1].split("\n#", 1)[0]
    return [line for line in section.splitlines() if re.match(r"\d+\. ", line)]


def room_cells(text: str) -> dict[str, str]:
    """Each room of the Rooms table and its "owns" cell (cells split on " | ", since a
    cell may hold `serve|sweep`)."""
    section = text.split("## Rooms", 1)[1].split("\n## ", 1)[0]
    cells = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            room, owns = line.split(" | ")[:2]
            cells[room.strip("| `/")] = owns
    return cells


def defines(path: Path, qualname: str) -> bool:
    """Whether the module defines `name` or `Class.method` (top level or in a class)."""
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in qualname.split("."):
        found = [
            node
            for node in scope
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and node.name == part
        ]
        if not found:
            return False
        scope = getattr(found[0], "body", [])
    return True


def test_the_main_line_is_at_most_ten_existing_anchors() -> None:
    items = main_line(PAGE.read_text())
    assert 1 <= len(items) <= 10, items
    for item in items:
        anchor = ANCHOR.match(item.split(" ", 1)[1])
        assert anchor, f"a main-line step must start with a `path:function` anchor: {item}"
        path, qualname = anchor.groups()
        assert defines(REPO / path, qualname), f"{path}:{qualname} does not exist"


def test_every_named_function_and_file_exists() -> None:
    text = PAGE.read_text()
    anchors = ANCHOR.findall(text)
    assert anchors
    for path, qualname in anchors:
        assert (REPO / path).is_file(), path
        assert defines(REPO / path, qualname), f"{path}:{qualname} does not exist"
    for path in PATH.findall(text):
        assert (REPO / path).is_file(), f"ARCHITECTURE.md names {path}, which does not exist"


def test_room_cells_are_short_and_the_detail_is_in_the_package_docstring() -> None:
    cells = room_cells(PAGE.read_text())
    assert {"common", "gateway", "engine", "experiments"} <= set(cells)
    for room, owns in cells.items():
        assert len(owns.split()) <= 30, f"{room}: {len(owns.split())} words"
        package = REPO / room / "__init__.py"
        docstring = ast.get_docstring(ast.parse(package.read_text())) or ""
        assert len(docstring.split()) > len(owns.split()), f"{room}/__init__.py says less"


def test_the_checker_notices_a_missing_function(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("class A:\n    def run(self):\n        pass\n\ndef f():\n    pass\n")
    assert defines(module, "A.run") and defines(module, "f")
    for missing in ("A.stop", "g", "f.inner"):
        assert not defines(module, missing)
    with pytest.raises(IndexError):
        main_line("no journey here")
    table = (
        "## Rooms\n\n| `a/` | `x serve|sweep` y | z |\n| b | c | d |\n\n## Next\n| `c/` | e | f |"
    )
    assert room_cells(table) == {"a": "`x serve|sweep` y"}
