"""The parts of training checkpoints that need no process group: nesting flat objects again,
finding the latest step."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard.core.errors import CheckpointNotFoundError
from reshard.train.checkpoint import latest_checkpoint, train_objects, unflatten


def test_flat_objects_nest_back_into_the_scheduler_state() -> None:
    flat = {"train.step": 3, "train.data_position": 36, "train.scheduler.last_epoch": 3,
            "train.scheduler.base_lrs": [0.003], "train.scheduler.lr_lambdas.1.total": 6,
            "train.scheduler.lr_lambdas.0.total": 5, "train.scheduler.lr_lambdas.0.warmup": 2,
            "train.model_config.dim": 32, "optim.param_groups.0.lr": 0.1}
    got = train_objects(flat)
    assert got == {"step": 3, "data_position": 36, "model_config": {"dim": 32}, "scheduler": {
        "last_epoch": 3, "base_lrs": [0.003], "lr_lambdas": [{"total": 5, "warmup": 2}, {"total": 6}]}}
    assert unflatten(flat, "nothing.") == {}


def test_latest_checkpoint_picks_the_highest_step(tmp_path: Path) -> None:
    for step in (2, 10, 4):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"")
    (tmp_path / "step-99.tmp").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-10"
    assert latest_checkpoint(tmp_path / "step-4") == tmp_path / "step-4"
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint"):
        latest_checkpoint(tmp_path / "missing")
