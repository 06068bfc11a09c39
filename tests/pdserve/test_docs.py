"""The user docs stay short and whole: README.md fits in 200 lines and keeps the two
commands that work on a fresh machine, every relative link in README.md and docs/
names a file that exists, and nothing in the tree cites a tracker's numbers or files
the repository does not hold."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = ["serving", "parallelism", "failures", "security", "operations", "benchmarks"]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # [text](target), target without #anchor
# The commit id is spelt in two parts so that this file does not match itself.
FORBIDDEN = r"issue [0-9]+|" + "ef96" + r"da5|DESIGN\.md"


def broken_links(page: Path) -> list[str]:
    """Relative link targets of a markdown page that do not exist."""
    targets = [t for t in LINK.findall(page.read_text()) if "://" not in t]
    return [t for t in targets if not (page.parent / t).exists()]


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert "    make serve " in text and "    make test " in text


def test_the_readme_points_at_every_docs_page_and_each_exists() -> None:
    text = README.read_text()
    for name in PAGES:
        assert f"(docs/{name}.md)" in text, name
        assert (REPO / "docs" / f"{name}.md").is_file(), name


def test_relative_links_resolve() -> None:
    pages = [README, REPO / "ARCHITECTURE.md", *sorted((REPO / "docs").glob("*.md"))]
    for page in pages:
        assert broken_links(page) == [], page.name


def test_the_link_checker_notices_a_missing_target(tmp_path: Path) -> None:
    (tmp_path / "here.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[a](here.md) [b](gone.md#part) [c](https://example.com/x.md)")
    assert broken_links(page) == ["gone.md"]


def test_no_tracker_numbers_or_missing_design_files_in_the_tree() -> None:
    found = subprocess.run(
        ["git", "grep", "-niE", FORBIDDEN],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if found.returncode == 128:  # not a git checkout (an unpacked sdist): nothing to say
        return
    assert found.returncode == 1, found.stdout  # 1: no match
