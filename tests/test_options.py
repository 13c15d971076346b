"""ConvertOptions is checked when it is built: the API and the CLI refuse the same options with
the same message (each naming the option as its caller writes it), before any source is read."""

from __future__ import annotations

from pathlib import Path

import pytest

import reshard
from reshard.errors import UsageError
from reshard.options import ConvertOptions
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as run_cli

CASES = [
    # (API keyword arguments, CLI flags, what both messages say)
    ({"mesh": "3x"}, ["--to-mesh", "3x"], "give the mesh as 8, 4x8 or dp_replicate=4,dp_shard=8"),
    ({"dtype": "float33"}, ["--dtype", "float33"], "float33"),
    ({"placements": "fsdp"}, ["--placements", "fsdp"], "needs"),
    ({"keep_per_rank": True}, ["--keep-per-rank"], "applies with"),
    ({"keep_dtype": ["norm"]}, ["--keep-dtype", "norm"], "(nothing is cast otherwise)"),
    ({"max_shard_size": "lots"}, ["--max-shard-size", "lots"], "cannot read size 'lots'"),
    ({"max_memory": "0"}, ["--max-memory", "0"], "must be positive"),
]


@pytest.mark.parametrize("given, flags, said", CASES)
def test_the_api_and_the_cli_refuse_the_same_options_before_reading(given: dict, flags: list[str], said: str,
                                                                     tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"  # never opened: the options are refused first
    with pytest.raises(UsageError, match=None) as api:
        ConvertOptions(**given)
    with pytest.raises(UsageError):
        reshard.convert(missing, tmp_path / "out", **given)
    assert said in str(api.value)
    proc = run_cli("convert", missing, tmp_path / "out", *flags)
    assert_one_line_error(proc, said)
    assert "no such file" not in proc.stderr


def test_options_are_named_as_their_caller_writes_them() -> None:
    with pytest.raises(UsageError, match=r"placements= needs mesh="):
        ConvertOptions(placements="fsdp")
    proc = run_cli("convert", "nowhere", "--placements", "fsdp")
    assert_one_line_error(proc, "--placements needs --to-mesh")
    # The command line's budget floor (a slip like 512 for 512MiB); the API moves data in any budget.
    assert ConvertOptions(max_memory="4KiB").budget == 4096
    assert_one_line_error(run_cli("convert", "nowhere", "--max-memory", "4KiB"), "--max-memory 4KiB: 4.0 KiB is too small")
