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


def test_every_readme_block_runs_as_written() -> None:
    """The README's Python block used a `model` and `opt` it never made, and loaded an `hf_out/`
    nothing made: it was skipped as a fragment. Now each of its blocks runs, in order, on what
    its first command leaves (tests/test_docs_commands.py runs them); only installs, the test
    suite, the Hub upload and the launchers are left to other tests."""
    from tests.test_docs_commands import doc_steps, skip_reason

    steps = doc_steps(README)
    python = [s for s in steps if s.language == "python"]
    assert python and all(skip_reason(s) is None for s in python), [skip_reason(s) for s in python]
    skipped = {skip_reason(s) for s in steps if s.language == "shell" and skip_reason(s)}
    assert all(("install" in why or "uploads" in why or "test suite" in why or "multi-process" in why or "benchmark" in why
                or "trains" in why) for why in skipped), skipped


def test_push_says_it_needs_a_token_and_shows_the_dry_run() -> None:
    """`reshard push out/ user/model` fails at once without a Hub token: the README says a write
    token is needed, and shows --dry-run, which checks and lists without one (and runs here)."""
    from tests.test_docs_commands import doc_commands, skip_reason

    text = README.read_text()
    pushes = [c for c in doc_commands(README) if c.text.startswith("reshard push")]
    dry = [c for c in pushes if "--dry-run" in c.text.split()]
    assert dry and all(skip_reason(c) is None for c in dry)
    upload = next(line for line in text.splitlines() if line.startswith("reshard push") and "--dry-run" not in line)
    assert "token" in upload


def test_the_login_hint_is_the_one_the_error_gives(tmp_path: Path, monkeypatch) -> None:
    """The README said `huggingface-cli login` (a command huggingface_hub has replaced) where
    `reshard push` without a token says `hf auth login`: both say the same now."""
    import huggingface_hub
    from huggingface_hub import constants

    from tests.hf_models import save_tiny_llama
    from tests.test_cli import reshard as run_cli

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # nothing leaves: refused before any request
    proc = run_cli("push", save_tiny_llama(tmp_path / "model", tie=False), "someone/model")
    assert proc.returncode == 2 and "no Hugging Face token" in proc.stderr, proc.stderr
    login = re.search(r"run `([^`]+)`", proc.stderr)[1]
    upload = next(line for line in README.read_text().splitlines()
                  if line.startswith("reshard push") and "--dry-run" not in line)
    assert login in upload, (login, upload)
    assert not [doc.name for doc in DOCS if "huggingface-cli login" in doc.read_text()]
