from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reshard.core.boxes import Box
from reshard.core.catalog import Catalog, Chunk, TensorEntry
from reshard.core.errors import UsageError
from reshard.core.pieces import OutputFile, Piece
from reshard.pipeline.plan import full_target, make_plan


class _Zeros:
    def read(self, box: Box) -> torch.Tensor:
        return torch.zeros(box.sizes)


def _catalog() -> Catalog:
    cat = Catalog("test", Path("x"))
    w = TensorEntry("model.w", (5, 2), torch.float32,
                    [Chunk(Box((0, 0), (3, 2)), _Zeros()), Chunk(Box((3, 0), (2, 2)), _Zeros())])
    step = TensorEntry("optim.state.w.step", (), torch.int64, [Chunk(Box((), ()), _Zeros())])
    cat.tensors = {"model.w": w, "optim.state.w.step": step}
    cat.objects = {"optim.param_groups.0.lr": 0.1}
    return cat


def test_full_target_casts_floats_only_and_selects_sections() -> None:
    target = full_target(_catalog(), dtype=torch.bfloat16)
    assert target.tensors["model.w"].dtype.torch is torch.bfloat16
    assert target.tensors["optim.state.w.step"].dtype.torch is torch.int64
    only = full_target(_catalog(), only="optim")
    assert list(only.tensors) == ["optim.state.w.step"] and list(only.objects) == ["optim.param_groups.0.lr"]
    with pytest.raises(UsageError, match="matches nothing"):
        full_target(_catalog(), only="nope")


def test_plan_pairs_each_piece_with_overlapping_chunks() -> None:
    cat = _catalog()
    piece = Piece("model.w", Box((2, 0), (2, 2)), torch.float32)
    plan = make_plan(cat, [OutputFile("f", [b"h", piece])])
    assert [s.box for s in plan.sources[piece]] == [Box((2, 0), (1, 2)), Box((3, 0), (1, 2))]
    assert plan.total_bytes == 16
    cat.tensors["model.w"].chunks.pop()  # a hole: the plan refuses before any byte moves
    with pytest.raises(UsageError, match="covered"):
        make_plan(cat, [OutputFile("f", [piece])])
