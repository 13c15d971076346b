"""The documentation's commands run as written: every shell command and Python block in
README.md and docs/ is extracted and run, offline, in a folder holding small checkpoints under
the names the docs use (``ckpt/``, ``ds/``, ``mg/``...), each file's blocks in order in one
folder and one process (so a ``memory://`` store lives from one block to the next, as in the
reader's own Python session); the README's folder is made by the README's own first command
(less its installs), as a reader's is. A command passes when it exits 0, or 1 for ``reshard
verify`` (a comparison that found differences: the docs show verify across checkpoints that
differ); a usage error, bad input or a crash fails it; a Python block passes when it raises
nothing.

No block is left out silently: ``SKIPPED`` and ``BLOCKS_SKIPPED`` say why each command or
block that cannot run here does not (network, installs, multi-node launchers, GPUs, the
benchmarks, fragments), ``NOT_CODE`` what the blocks of no code are instead, and
``test_what_does_not_run_here_says_why`` reports each of them as a skip with its reason
(``-ra`` prints them), failing for any without one; ``TORCHRUN_HERE``'s single-node torchrun
lines do run, on 2 ranks. ``test_a_broken_command_fails`` proves the runner catches a broken
command. Every relative link in the docs resolves to a file of the repository.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from reshard.cli.app import main
from tests.dist import HANG_GUARD

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
COMMANDS = ("reshard", "python", "torchrun", "pip")

UPLOADS = "uploads to the Hub"
# (substring of the command, why it does not run here). Keep this short and honest.
SKIPPED = (
    ("pip install", "installs packages: CI runs this very command (.ci/run)"),
    ("python scripts/bench", "a benchmark: minutes and GBs of data (docs/benchmarks.md shows its output)"),
    ("python -m pytest", "the test suite itself"),
    ("torchrun", "a multi-process launcher (tests/test_mesh_convert.py and test_runtime.py run the same paths)"),
    ("reshard push ckpt/step-1000_bfloat16_hf me/my-llama --private", UPLOADS),
    ("reshard push out/ user/model", UPLOADS),  # but not with --dry-run, which checks and lists offline
    ("reshard convert meta-llama/", "downloads from the Hub (the folder it would make is provided)"),
    ("reshard validate", "trains and resumes on spawned worlds for a minute (tests/test_validate.py runs it)"),
)
# A block that loads into a `model` it does not make (one that makes it, as the README's, runs).
FRAGMENT = "reshard.load_model(model"


def _is_fragment(text: str) -> bool:
    return FRAGMENT in text and not re.search(r"^model\s*=", text, re.M)


# The same for blocks other than shell commands: Python, and text that is no command here.
BLOCKS_SKIPPED = (
    ('validate("2", "3"', "trains and resumes on spawned worlds for a minute (tests/test_validate.py runs it)"),
    ('init_process_group("nccl")', "GPUs under torchrun (tests/test_runtime.py, test_deepspeed_resume.py and "
                                   "test_torchtitan_resume.py load the same way on gloo)"),
    (FRAGMENT, "a fragment: `model` and its optimizer are the reader's own, under torchrun "
               "(tests/test_runtime.py loads the same way on gloo)"),
    ("reshard inspect s3://bucket", "S3 buckets and the Hub: network and credentials (the memory:// block after it "
                                    "runs the same steps)"),
    ("(CheckpointManager):", "torchtitan is not a test dependency (tests/test_storage_reader.py loads through "
                             "reshard.StorageReader on gloo ranks)"),
)
# Blocks that are no code, by language: what they are instead.
NOT_CODE = {
    "json": "a JSON document (sample output, or a file's contents), not a command",
    "": "not commands (a diagram, a synopsis or sample output)",
}

# torchrun lines that run here as written, on 2 ranks (CI has 2 cores) instead of their count.
TORCHRUN_HERE = ("torchrun --standalone --nproc_per_node 8 -m reshard convert",)

# Commands another test runs as written, with what they need that this runner lacks.
RUN_ELSEWHERE = (
    ("resume_demo.py", "tests/test_docs_resume.py launches it with torchrun, 2 ranks then 3"),
)


@dataclass(frozen=True)
class Command:
    """A shell command, a Python block (``language="python"``), or a block of no code."""

    doc: Path
    line: int
    text: str
    language: str = "shell"

    def __str__(self) -> str:
        first, *more = self.text.splitlines() or [""]
        return f"{self.doc.relative_to(ROOT)}:{self.line}: {first}{' ...' if more else ''}"


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


def _is_shell(lang: str, lines: list[str]) -> bool:
    """``bash``/``sh``/``console`` blocks, prompted ones, and unlabelled blocks whose lines are
    all commands."""
    if lang in SHELL or any(line.startswith("$ ") for line in lines):
        return True
    body = [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return not lang and bool(body) and all(_first_word(line) in COMMANDS for line in body)


def doc_steps(doc: Path) -> list[Command]:
    """Everything fenced in ``doc``, in order: its shell commands one by one, each other block
    whole (Python to run, or a block of no code)."""
    steps = []
    for lang, start, lines in _blocks(doc):
        if _is_shell(lang, lines):
            steps += _shell_commands(doc, start, lines)
        else:
            steps.append(Command(doc, start, "\n".join(lines), lang))
    return steps


def doc_commands(doc: Path) -> list[Command]:
    """Shell commands of ``doc``."""
    return [c for c in doc_steps(doc) if c.language == "shell"]


def _shell_commands(doc: Path, start: int, lines: list[str]) -> list[Command]:
    """In console blocks (or with ``$`` prompts) only the prompted lines. Continuations
    (``\\``) are joined; comments and output lines are left out."""
    found = []
    prompted = any(line.startswith("$ ") for line in lines)
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
    """Why ``command`` does not run here; None for a command or Python block that does (and for
    a block of no code with no reason given, which the test below fails)."""
    if command.text.startswith(TORCHRUN_HERE):
        return None
    table = SKIPPED if command.language == "shell" else BLOCKS_SKIPPED
    listed = next((why for part, why in (*RUN_ELSEWHERE, *table) if part in command.text
                   and (part != FRAGMENT or _is_fragment(command.text))
                   and not (why == UPLOADS and "--dry-run" in command.text.split())), None)
    return listed or (None if command.language in ("shell", "python") else NOT_CODE.get(command.language))


def runs_here(command: Command) -> bool:
    return command.language in ("shell", "python") and skip_reason(command) is None


def run_python(command: Command, where: Path, capsys) -> tuple[int, str]:
    """Run a Python block in ``where``, as a reader pastes it into a fresh interpreter (it shares
    this process, so a ``memory://`` store outlives it, as in that reader's session)."""
    cwd = os.getcwd()
    os.chdir(where)
    try:
        exec(compile(command.text, str(command), "exec"), {"__name__": "__main__"})
        code, failure = 0, ""
    except Exception:  # the block's own error, shown with the command
        code, failure = 1, traceback.format_exc()
    finally:
        os.chdir(cwd)
    out = capsys.readouterr()
    return code, out.out + out.err + failure


def run(command: Command, where: Path, capsys) -> tuple[int, str]:
    """Run one command in ``where`` (reshard in this process, through its real entry point)."""
    words = shlex.split(command.text)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[:3] == ["python", "-m", "reshard"]:
        words = ["reshard", *words[3:]]
    if words[0] == "torchrun":
        return _torchrun(words, where, env)
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


def _torchrun(words: list[str], where: Path, env: dict[str, str]) -> tuple[int, str]:
    """A documented torchrun line, launched for real in ``where`` on 2 ranks."""
    at = words.index("--nproc_per_node") + 1
    words = [sys.executable, "-m", "torch.distributed.run", *words[1:at], "2", *words[at + 1:]]
    proc = subprocess.run(words, cwd=where, env=_with_root(**env, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=HANG_GUARD)
    return proc.returncode, proc.stdout + proc.stderr


def _with_root(**env: str) -> dict[str, str]:
    """This environment plus ``env``, importing this checkout's reshard in a subprocess."""
    return dict(os.environ, **env, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def readme_set_up(where: Path) -> None:
    """The README's first command, less its installs (this environment has them), run in
    ``where``: it leaves there what the README's other commands use."""
    first = doc_commands(ROOT / "README.md")[0].text
    steps: list[list[str]] = [[]]
    for word in shlex.split(first):
        if word == "&&":
            steps.append([])
        else:
            steps[-1].append(word)
    steps = [step for step in steps if step[:2] != ["pip", "install"]]
    assert [w[:2] for w in steps] == [["python", "scripts/example.py"]], first
    proc = subprocess.run([sys.executable, str(ROOT / steps[0][1]), *steps[0][2:]], cwd=where, env=_with_root(),
                          capture_output=True, text=True, timeout=HANG_GUARD)
    assert proc.returncode == 0, f"{first}\nexit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"


def passed(command: Command, code: int) -> bool:
    return code == 0 or (code == 1 and shlex.split(command.text)[:2] == ["reshard", "verify"])


# ---------------------------------------------------------------------------------- folders


@pytest.fixture(scope="module")
def training_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the project's training model, as `reshard train` saves it on 2 ranks."""
    runs = tmp_path_factory.mktemp("runs")
    assert main(["train", "--to-mesh", "2", "--steps", "2", "--ckpt-dir", str(runs), "--quiet"]) == 0
    return runs / "step-2"


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
        from tests.hf_models import save_lora_adapter

        save_lora_adapter(where / "llama-1b", where / "my-lora", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        from tests.hf_models import save_hf_names_dcp

        save_hf_names_dcp(where / "llama-1b", where / "hf-run" / "step-500")  # a run of the user's own: no config
    if doc.name == "README.md":  # the README's own set-up makes what its commands use
        shutil.rmtree(where / "ckpt")
        readme_set_up(where)
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
    steps = [c for doc in DOCS for c in doc_steps(doc)]
    for part, _ in (*RUN_ELSEWHERE, *SKIPPED, *BLOCKS_SKIPPED):  # every entry still names a documented step
        assert any(part in c.text for c in steps), part
    # The object-stores recipe's memory:// steps run (in one process: each CLI process would
    # have a store of its own), as does the check that an HF export loads.
    run_blocks = {(c.doc.name, c.text.splitlines()[0]) for c in steps if c.language == "python" and runs_here(c)}
    assert ("object-stores.md", "import fsspec") in run_blocks, run_blocks
    assert ("hub-export.md", "from transformers import AutoModelForCausalLM") in run_blocks, run_blocks


_NOT_RUN = [c for doc in DOCS for c in doc_steps(doc) if not runs_here(c)]


@pytest.mark.parametrize("command", _NOT_RUN, ids=[f"{c.doc.relative_to(ROOT)}:{c.line}" for c in _NOT_RUN])
def test_what_does_not_run_here_says_why(command: Command) -> None:
    reason = skip_reason(command)
    assert reason, f"{command}: a {command.language or 'unlabelled'} block this test neither runs nor says why " \
                   "(add it to SKIPPED or NOT_CODE)"
    pytest.skip(f"{command}: {reason}")


@pytest.mark.parametrize("doc", [d for d in DOCS if any(runs_here(c) for c in doc_steps(d))],
                         ids=lambda d: str(d.relative_to(ROOT)))
def test_documented_commands_run_as_written(doc: Path, training_ckpt: Path, tmp_path: Path, capsys,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from fsspec.implementations.memory import MemoryFileSystem

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(MemoryFileSystem, "store", {})  # each doc's memory:// starts empty, and is dropped after
    monkeypatch.setattr(MemoryFileSystem, "pseudo_dirs", [""])
    where = workspace(doc, tmp_path, training_ckpt)
    capsys.readouterr()
    for command in doc_steps(doc):
        if not runs_here(command):
            continue
        code, output = (run_python if command.language == "python" else run)(command, where, capsys)
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
