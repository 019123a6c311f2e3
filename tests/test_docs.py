"""README.md is a front door that stays true: at most 200 lines, every link into docs/
resolves (and every local link of a docs/ page), and its Python quick start runs from any
directory and prints what the README shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 200
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _local_links(page: Path) -> list[str]:
    """Relative link targets of a markdown page (no URLs, no in-page anchors), anchor cut."""
    links = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        links.append(target.split("#", 1)[0])
    return links


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.M | re.S)


def test_readme_is_at_most_200_lines():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


def test_every_docs_link_in_the_readme_resolves():
    links = _local_links(README)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if not (ROOT / link).exists()]
    assert missing == []


def test_every_docs_page_is_linked_from_the_readme_and_its_local_links_resolve():
    pages = sorted((ROOT / "docs").glob("*.md"))
    linked = {Path(link).name for link in _local_links(README) if link.startswith("docs/")}
    assert [p.name for p in pages if p.name not in linked] == []
    for page in pages:
        missing = [link for link in _local_links(page) if not (page.parent / link).exists()]
        assert missing == [], page.name


def test_the_readme_gives_the_test_command_ci_runs():
    blocks = [body for info, body in _fenced_blocks(README.read_text()) if info == "bash"]
    assert "python -m pytest tests -q\n" in blocks
    assert "\npython -m pytest tests -q\n" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_quick_start_runs_from_another_directory_and_prints_what_it_shows(tmp_path):
    text = README.read_text()
    section = text[text.index("## Quick start in Python"):]
    section = section[: section.index("\n## ", 1)]
    blocks = _fenced_blocks(section)
    code, shown = blocks[0][1], blocks[1][1]
    assert blocks[0][0] == "python"
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == shown
