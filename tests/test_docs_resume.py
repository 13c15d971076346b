"""docs/recipes/resume.md's laptop example runs as written: its ``resume_demo.py`` block is saved
and launched by its own ``torchrun`` lines (2 ranks save, 3 resume, gloo on CPU); the resumed
run sees the saved weights (the same loss on the same batch, to the last printed digit) and
Adam's step."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.dist import HANG_GUARD
from tests.test_docs_commands import ROOT, _blocks

DOC = ROOT / "docs" / "recipes" / "resume.md"


def _demo() -> tuple[str, list[list[str]]]:
    blocks = _blocks(DOC)
    at = next(i for i, (lang, _, lines) in enumerate(blocks) if lang == "python" and lines[0] == "# resume_demo.py")
    commands = [shlex.split(line) for line in blocks[at + 1][2] if line.startswith("torchrun")]
    return "\n".join(blocks[at][2]) + "\n", commands


def test_resume_example_saves_on_two_ranks_and_resumes_on_three(tmp_path: Path) -> None:
    script, commands = _demo()
    (tmp_path / "resume_demo.py").write_text(script)
    assert [c[c.index("--nproc_per_node") + 1] for c in commands] == ["2", "3"]
    printed = []
    for command in commands:
        # torchrun from this interpreter; --standalone picks a free port
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *command[1:]], cwd=tmp_path,
                              capture_output=True, text=True, timeout=HANG_GUARD)
        assert proc.returncode == 0, proc.stderr[-3000:]
        printed.append(re.search(r"(save|resume) on (\d) ranks: loss (\S+), adam step (\d+)", proc.stdout).groups())
    (_, n_save, loss_save, step_save), (_, n_resume, loss_resume, step_resume) = printed
    assert (n_save, n_resume) == ("2", "3")
    assert loss_save == loss_resume and step_save == step_resume == "1"
    assert (tmp_path / "ckpt_demo" / ".metadata").is_file()
