from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def fsdp2_dcp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(DCP dir saved by FSDP2 + AdamW on 3 gloo ranks, reference .pt of its full tensors)."""
    from tests.fixtures import save_fsdp2_dcp

    out = tmp_path_factory.mktemp("fsdp2") / "ckpt"
    ref = save_fsdp2_dcp(out, world_size=3)
    return out, ref


@pytest.fixture(scope="session")
def fsdp2_reference(fsdp2_dcp: tuple[Path, Path]) -> dict:
    from tests.fixtures import full_reference

    return full_reference(fsdp2_dcp[1])
