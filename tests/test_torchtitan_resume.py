"""torchtitan's own checkpoints resumed on 3 ranks by reshard.load_model and by torchtitan's
CheckpointManager.load agree (model, moments, step, lr, two more training steps):
scripts/fixtures/check_torchtitan_resume.py, launched here where torchtitan is installed.

torchtitan does not install beside the test dependencies (its datasets pin downgrades
huggingface_hub and fsspec), so CI skips this; the script's docstring has the venv recipe, and
tests/test_load_fused.py covers the fused q/k/v path in CI with torchtitan's hooks reproduced.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import HANG_GUARD

pytest.importorskip("torchtitan")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fixtures" / "check_torchtitan_resume.py"


def test_load_model_equals_torchtitans_own_resume_on_three_ranks() -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           str(SCRIPT)], capture_output=True, text=True, timeout=HANG_GUARD)
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(reports) == 4, proc.stderr[-3000:]
    assert all(r["ok"] for r in reports), reports
