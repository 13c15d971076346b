"""The documentation's commands run as written: every shell command in README.md and docs/ is
extracted and run, offline, in a folder holding small checkpoints under the names the docs use
(``ckpt/``, ``ds/``, ``mg/``...), each file's commands in order in one folder. A command passes
when it exits 0, or 1 for ``reshard verify`` (a comparison that found differences: the docs
show verify across checkpoints that differ); a usage error, bad input or a crash fails it.

``SKIPPED`` lists the commands that cannot run here and why (network, installs, multi-node
launchers, the benchmarks); ``test_a_broken_command_fails`` proves the runner catches one.
Every relative link in the docs resolves to a file of the repository.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from reshard.cli import main

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
COMMANDS = ("reshard", "python", "torchrun", "pip")

# (substring of the command, why it does not run here). Keep this short and honest.
SKIPPED = (
    ("pip install", "installs packages: CI runs this very command (.ci/run)"),
    ("python scripts/bench", "a benchmark: minutes and GBs of data (docs/benchmarks.md shows its output)"),
    ("python -m pytest", "the test suite itself"),
    ("torchrun", "a multi-process launcher (tests/test_mesh_convert.py and test_runtime.py run the same paths)"),
    ("reshard push ckpt/step-1000_bfloat16_hf me/my-llama --private", "uploads to the Hub"),
    ("reshard push out/ user/model", "uploads to the Hub"),
    ("reshard convert meta-llama/", "downloads from the Hub (the folder it would make is provided)"),
    ("reshard validate", "trains and resumes on spawned worlds for a minute (tests/test_validate.py runs it)"),
)

# Commands another test runs as written, with what they need that this runner lacks.
RUN_ELSEWHERE = (
    ("resume_demo.py", "tests/test_docs_resume.py launches it with torchrun, 2 ranks then 3"),
)


@dataclass(frozen=True)
class Command:
    doc: Path
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}: {self.text}"


def _blocks(doc: Path) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of every fenced block."""
    out, lang, start, lines = [], None, 0, []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, lines = line[3:].strip(), number + 1, []
            else:
                out.append((lang, start, lines))
                lang = None
        elif lang is not None:
            lines.append(line)
    return out


def _first_word(line: str) -> str:
    words = [w for w in line.split() if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w)]
    return words[0] if words else ""


def doc_commands(doc: Path) -> list[Command]:
    """Shell commands of ``doc``: ``bash``/``sh``/``console`` blocks, and unlabelled blocks
    whose lines are all commands; in console blocks (or with ``$`` prompts) only the prompted
    lines. Continuations (``\\``) are joined; comments and output lines are left out."""
    found = []
    for lang, start, lines in _blocks(doc):
        prompted = any(line.startswith("$ ") for line in lines)
        if lang not in SHELL and not prompted:
            body = [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
            if lang or not body or not all(_first_word(line) in COMMANDS for line in body):
                continue
        text, at = "", 0
        for offset, line in enumerate(lines):
            if prompted:
                if not line.startswith("$ ") and not text:
                    continue
                line = line[2:] if line.startswith("$ ") else line
            if not text:
                at = start + offset
            text += line.rstrip().removesuffix("\\") + " " if line.rstrip().endswith("\\") else line
            if not line.rstrip().endswith("\\"):
                words = shlex.split(text, comments=True)
                if words:
                    found.append(Command(doc, at, " ".join(shlex.quote(w) for w in words)))
                text = ""
    return found


def skip_reason(command: Command) -> str | None:
    return next((why for part, why in (*RUN_ELSEWHERE, *SKIPPED) if part in command.text), None)


def run(command: Command, where: Path, capsys) -> tuple[int, str]:
    """Run one command in ``where`` (reshard in this process, through its real entry point)."""
    words = shlex.split(command.text)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[:3] == ["python", "-m", "reshard"]:
        words = ["reshard", *words[3:]]
    assert words[0] == "reshard", f"{command}: no runner for {words[0]!r}; add it or a SKIPPED entry"
    saved = {k: os.environ.get(k) for k in env}
    cwd = os.getcwd()
    os.environ.update(env)
    os.chdir(where)
    try:
        code = main(words[1:])
    finally:
        os.chdir(cwd)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out = capsys.readouterr()
    return code, out.out + out.err


def passed(command: Command, code: int) -> bool:
    return code == 0 or (code == 1 and shlex.split(command.text)[:2] == ["reshard", "verify"])


# ---------------------------------------------------------------------------------- folders


@pytest.fixture(scope="module")
def training_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the project's training model, as `reshard train` saves it on 2 ranks."""
    runs = tmp_path_factory.mktemp("runs")
    assert main(["train", "--to-mesh", "2", "--steps", "2", "--ckpt-dir", str(runs), "--quiet"]) == 0
    return runs / "step-2"


def _hf_side_files(folder: Path, ckpt: Path) -> None:
    """cfg/ (the model's config.json, as --to hf builds it) and tok/ (tokenizer side files)."""
    export = folder / ".export"
    assert main(["convert", str(ckpt), str(export), "--to", "hf", "--quiet"]) == 0
    (folder / "cfg").mkdir()
    shutil.copy(export / "config.json", folder / "cfg" / "config.json")
    (folder / "tok").mkdir()
    (folder / "tok" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    shutil.rmtree(export)


def workspace(doc: Path, root: Path, ckpt: Path) -> Path:
    """The folder a doc's commands run in, with the checkpoints it names."""
    where = root / doc.stem
    where.mkdir()
    shutil.copytree(ckpt, where / "ckpt")
    if doc.name == "hub-export.md":
        shutil.rmtree(where / "ckpt")
        shutil.copytree(ckpt, where / "ckpt" / "step-1000")
        from tests.hf_models import save_tiny_llama

        save_tiny_llama(where / "llama-1b", tie=False)  # what the Hub download of the line before makes
    if doc.name == "README.md":
        _hf_side_files(where, ckpt)
        shutil.copytree(DATA / "torchtitan" / "llama3" / "checkpoint" / "step-2", where / "titan")
    if doc.name == "mesh.md":
        plan = next(lines for lang, _, lines in _blocks(doc) if lang == "json")
        (where / "plan.json").write_text("\n".join(plan))
    if doc.name == "migrate.md":
        shutil.copytree(DATA / "deepspeed" / "zero3_bf16", where / "ds")
        shutil.copytree(DATA / "megatron" / "gpt_tp2", where / "mg")
    if doc.name in ("validate.md", "migrate.md"):  # these make or name their own checkpoints
        shutil.rmtree(where / "ckpt")
    return where


# ---------------------------------------------------------------------------------- tests


def test_the_docs_have_commands_and_few_are_skipped() -> None:
    commands = [c for doc in DOCS for c in doc_commands(doc)]
    skipped = [c for c in commands if skip_reason(c) and not any(part in c.text for part, _ in RUN_ELSEWHERE)]
    assert len(commands) >= 40 and len(skipped) <= 16, [str(c) for c in skipped]
    for part, _ in (*RUN_ELSEWHERE, *SKIPPED):  # every entry still names a documented command
        assert any(part in c.text for c in commands), part


@pytest.mark.parametrize("doc", [d for d in DOCS if doc_commands(d)], ids=lambda d: str(d.relative_to(ROOT)))
def test_documented_commands_run_as_written(doc: Path, training_ckpt: Path, tmp_path: Path, capsys,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    where = workspace(doc, tmp_path, training_ckpt)
    capsys.readouterr()
    for command in doc_commands(doc):
        if skip_reason(command):
            continue
        code, output = run(command, where, capsys)
        assert passed(command, code), f"{command}\nexit {code}:\n{output[-2000:]}"


def test_a_broken_command_fails(training_ckpt: Path, tmp_path: Path, capsys) -> None:
    """The runner is not a rubber stamp: a documented command that no longer works fails."""
    where = tmp_path / "w"
    shutil.copytree(training_ckpt, where / "ckpt")
    good = Command(ROOT / "README.md", 1, "reshard convert ckpt/ --to-mesh 4x8")
    assert passed(good, run(good, where, capsys)[0])
    for broken in ("reshard convert ckpt/ --to-mesh 4x8",  # now exists: refused without --overwrite
                   "reshard convert ckpt/ out/ --to hf --no-such-flag",
                   "reshard verify --quick ckpt_8/",
                   "reshard inspect step-1000_hf/"):
        command = Command(ROOT / "README.md", 1, broken)
        assert not passed(command, run(command, where, capsys)[0]), broken


def test_relative_links_resolve_inside_the_repository() -> None:
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path = (doc.parent / target).resolve()
            assert path.exists() and ROOT in path.parents, f"{doc.relative_to(ROOT)}: link {target} leads nowhere"
        assert not re.search(r"(?<![/\w])shared/", text), f"{doc.relative_to(ROOT)} names shared/, outside the repository"
