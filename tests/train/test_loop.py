"""The FSDP2 loop on real gloo worlds: a 2-rank run that checkpoints, a resume of it on 3
ranks through the CLI that continues the same loss curve, and a 1-rank mixed-precision run
that starts from the very same weights (initialization does not depend on the mesh)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import reshard
from reshard.train.launch import launch
from reshard.train.loop import TrainConfig, TrainResult, WarmupCosine
from reshard.train.model import ModelConfig, Transformer
from tests.dist import HANG_GUARD
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as run_cli

PROGRESS = re.compile(r"^step +(\d+)/(\d+)  loss (\d+\.\d+)  lr \S+  grad_norm \S+  [\d,]+ tok/s$", re.M)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainResult, Path]:
    ckpt_dir = tmp_path_factory.mktemp("loop") / "ckpt"
    result = launch(TrainConfig(to_mesh="2", steps=4, ckpt_dir=str(ckpt_dir), save_every=2, digest_at=(0,), log=False),
                    device="cpu", timeout=HANG_GUARD)
    return result, ckpt_dir


def test_checkpoints_hold_the_contract_layout(first_run: tuple[TrainResult, Path]) -> None:
    result, ckpt_dir = first_run
    assert result.checkpoints == [str(ckpt_dir / "step-2"), str(ckpt_dir / "step-4")]
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-2", "step-4"]  # no staging left behind
    assert sorted(result.losses) == [1, 2, 3, 4] and result.losses[4] < result.losses[1]
    cat = reshard.inspect(ckpt_dir / "step-2")
    fqns = list(Transformer(ModelConfig.preset("tiny")).state_dict())
    want = {f"model.{n}" for n in fqns} | {f"optim.state.{n}.{k}" for n in fqns for k in ("exp_avg", "exp_avg_sq", "step")}
    assert set(cat.tensors) == want
    obj = cat.objects
    assert (obj["train.step"], obj["train.data_position"]) == (2, 24)
    assert obj["train.model_config.dim"] == 32 and obj["train.model_config.tie_embeddings"] is False
    assert obj["train.scheduler.last_epoch"] == 2 and obj["train.scheduler.lr_lambdas.0.total"] == 4
    assert obj["optim.param_groups.0.lr"] == pytest.approx(3e-3 * WarmupCosine(2, 4, 0.1)(2))


def test_cli_resumes_on_another_rank_count_and_continues(first_run: tuple[TrainResult, Path], tmp_path: Path,
                                                         capfd: pytest.CaptureFixture) -> None:
    reference, ckpt_dir = first_run
    proc = run_cli("train", "--nproc", "3", "--to-mesh", "3", "--steps", "6", "--resume", ckpt_dir / "step-2",
                   "--ckpt-dir", tmp_path / "more", "--device", "cpu")
    out = capfd.readouterr().out  # the ranks print on the inherited stdout
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {ckpt_dir / 'step-2'} at step 2 (data position 24)" in out
    losses = {int(m[0]): float(m[2]) for m in PROGRESS.findall(out)}
    assert sorted(losses) == [3, 4, 5, 6] and all(m[1] == "6" for m in PROGRESS.findall(out))
    for step in (3, 4):  # the same steps as the uninterrupted 2-rank run, to fp32 reduction noise
        assert losses[step] == pytest.approx(reference.losses[step], rel=1e-5, abs=0)
    assert "trained steps 3..6" in proc.stderr
    assert reshard.inspect(tmp_path / "more" / "step-6").objects["train.step"] == 6


def test_mixed_precision_run_starts_from_the_same_weights(first_run: tuple[TrainResult, Path]) -> None:
    reference, _ = first_run
    result = launch(TrainConfig(to_mesh="1", steps=2, mixed_precision=True, digest_at=(0,), log=False),
                    device="cpu", timeout=HANG_GUARD)
    assert result.digests[0] == reference.digests[0]  # fp32 sharded parameters, identical on 1 and 2 ranks
    for step in (1, 2):  # bf16 compute: close to the fp32 run, not equal
        assert result.losses[step] == pytest.approx(reference.losses[step], rel=1e-2)
        assert result.losses[step] != reference.losses[step]


@pytest.mark.parametrize("args, needle", [
    (["--nproc", "2", "--to-mesh", "3"], "mesh '3' has 3 ranks but the job has 2"),
    (["--to-mesh", "5"], "--global-batch 12 does not split over 5 ranks"),
    (["--to-mesh", "2x2x1"], "shards data-parallel only"),
    (["--to-mesh", "2", "--model", "huge"], "unknown model config 'huge'"),
    (["--to-mesh", "2", "--resume", "/nonexistent/ckpt"], "no such checkpoint"),
])
def test_bad_runs_are_refused_before_any_rank_starts(args: list[str], needle: str) -> None:
    assert_one_line_error(run_cli("train", *args), needle)


def test_former_spellings_are_taken_with_a_notice() -> None:
    """``--mesh`` and ``--config`` (train's names before one flag meant one field in every
    command) still work, each saying its new name; disagreeing with it is refused."""
    proc = run_cli("train", "--mesh", "2", "--config", "huge")
    assert proc.returncode == 2 and "unknown model config 'huge'" in proc.stderr
    assert "notice: --mesh is now --to-mesh" in proc.stderr and "notice: --config is now --model" in proc.stderr
    assert_one_line_error(run_cli("train", "--to-mesh", "2", "--mesh", "3"),
                          "--to-mesh 2 and --mesh 3 disagree; --mesh is --to-mesh's former name")
