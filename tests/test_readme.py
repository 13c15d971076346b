"""The README a newcomer reads first: its links work in any clone and fork, offline; its speed
figures say where they hold and how to measure them again. (Its commands run as written, after
its first set-up command: tests/test_docs_commands.py.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _home() -> str:
    """The repository's own address, as pyproject.toml gives it (``Source``)."""
    return re.search(r'^Source\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1].rstrip("/")


def test_links_into_the_repository_are_relative() -> None:
    home = _home()
    for doc in DOCS:
        links = re.findall(r"\]\(([^)\s]+)\)", doc.read_text())
        assert [link for link in links if link.startswith(home)] == [], doc.name
    assert re.findall(r"\]\((docs/[^)\s]+|CONTRIBUTING\.md)\)", README.read_text()), "the README links its docs"


def test_speed_figures_say_on_what_machine_and_how_to_measure_them() -> None:
    """A ratio (``1.3x``) or a time (``a quarter second``) in the README holds on an idle
    machine, and the paragraph says so and names the script that measures it."""
    paragraphs = re.split(r"\n\s*\n|\n(?=- )", README.read_text())
    claims = [p for p in paragraphs if re.search(r"\b\d+\.\d+x\b|\bsecond\b", p)]
    assert len(claims) >= 2, claims
    for paragraph in claims:
        assert "idle machine" in paragraph and "scripts/bench.py" in paragraph, paragraph
