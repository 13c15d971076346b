"""Placement plans, replica ownership and per-rank state, without a process group (the live
DTensor checks are in test_mesh_convert.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reshard.core.boxes import Box
from reshard.core.catalog import Catalog, Chunk, TensorEntry
from reshard.core.conventions import detect_layout
from reshard.core.errors import UsageError
from reshard.core.sharding import REPLICATE, distinct_boxes, local_boxes, parse_mesh, parse_placement, shard
from reshard.pipeline.mesh_target import mesh_target, per_rank_names, uneven_dims
from reshard.pipeline.placements import assign_placements, load_placement_plan


def _layout(shapes: dict[str, tuple[int, ...]]):
    cat = Catalog("dcp", Path("src"))
    cat.tensors = {n: TensorEntry(n, s, torch.float32) for n, s in shapes.items()}
    return detect_layout(cat)

_LLAMA = {
    "model.tok_embeddings.weight": (64, 32),
    "model.layers.0.attention.wq.weight": (32, 32),
    "model.layers.0.attention.wk.weight": (16, 32),
    "model.layers.0.attention.wv.weight": (16, 32),
    "model.layers.0.attention.wo.weight": (32, 32),
    "model.layers.0.feed_forward.w1.weight": (48, 32),
    "model.layers.0.feed_forward.w2.weight": (32, 48),
    "model.layers.0.feed_forward.w3.weight": (48, 32),
    "model.layers.0.attention_norm.weight": (32,),
    "model.layers.0.ffn_norm.weight": (32,),
    "model.norm.weight": (32,),
    "model.output.weight": (64, 32),
    "optim.state.layers.0.attention.wo.weight.exp_avg": (32, 32),
    "optim.state.layers.0.attention.wo.weight.step": (),
    "extra.scale": (2,),
}


def test_placement_parsing() -> None:
    assert parse_placement("Shard(1)") == shard(1) and parse_placement("S0") == shard(0)
    assert parse_placement("Replicate()") == REPLICATE and parse_placement("r") == REPLICATE
    with pytest.raises(UsageError):
        parse_placement("Partial()")


def test_presets_and_fsdp_tp_plan_for_the_training_model() -> None:
    mesh1, mesh2 = parse_mesh("8"), parse_mesh("2x4")
    assert load_placement_plan(None, mesh1).name == "fsdp" and load_placement_plan(None, mesh2).name == "hsdp"
    with pytest.raises(UsageError):
        load_placement_plan(None, parse_mesh("2x2x2"))
    tp = assign_placements(load_placement_plan("fsdp+tp", parse_mesh("dp_shard=2,tp=2")), parse_mesh("dp_shard=2,tp=2"),
                           _LLAMA, _layout(_LLAMA))
    assert tp["model.layers.0.attention.wq.weight"] == (shard(0), shard(0))  # column-wise
    assert tp["model.layers.0.attention.wo.weight"] == (shard(0), shard(1))  # row-wise
    assert tp["model.layers.0.feed_forward.w2.weight"] == (shard(0), shard(1))
    assert tp["model.layers.0.ffn_norm.weight"] == (shard(0), REPLICATE)
    # Optimizer state follows its parameter; scalars and non-parameters stay whole.
    assert tp["optim.state.layers.0.attention.wo.weight.exp_avg"] == (shard(0), shard(1))
    assert tp["optim.state.layers.0.attention.wo.weight.step"] == (REPLICATE, REPLICATE)
    assert tp["extra.scale"] == (REPLICATE, REPLICATE)
    with pytest.raises(UsageError, match="match no tensor"):  # the TP preset on a model it does not know
        assign_placements(load_placement_plan("fsdp+tp", parse_mesh("2x2")), parse_mesh("2x2"), {"model.a.weight": (4, 4)},
                          _layout({"model.a.weight": (4, 4)}))


def test_replicas_are_stored_once_and_spread_over_ranks() -> None:
    mesh = parse_mesh("4x2")  # (Replicate, Shard(0)): 2 distinct shards, 4 copies each
    load = [0] * 8
    local = local_boxes((10, 3), (REPLICATE, shard(0)), mesh)
    boxes, ranks = distinct_boxes(local, 4, load)
    assert boxes == [Box((0, 0), (5, 3)), Box((5, 0), (5, 3))] and ranks == [0, 1]
    boxes2, ranks2 = distinct_boxes(local, 4, load)  # the next tensor goes to ranks with less so far
    assert boxes2 == boxes and ranks2 == [2, 3]
    assert uneven_dims((2, 7), (shard(0),), parse_mesh("4")) == ["dim 0 (2) over dp_shard=4 leaves empty shards"]
    assert uneven_dims((8, 7), (shard(0),), parse_mesh("4")) == []


class _Zeros:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def read(self, box: Box) -> torch.Tensor:
        return torch.zeros(box.sizes)


def _catalog(world: int | None) -> Catalog:
    cat = Catalog("dcp", Path("src"))
    for name, shape in {"model.w": (8, 2), "rng.rank3.state": (4,), "dataloader.position": ()}.items():
        cat.tensors[name] = TensorEntry(name, shape, torch.float32, [Chunk(Box((0,) * len(shape), shape), _Zeros(shape))])
    cat.objects.update({"train.step": 3, "rng_states.rank_1": [1, 2], "scheduler.last_epoch": 3})
    if world is not None:
        cat.facts.source_world_size = world
    return cat


def test_per_rank_state_dropped_with_a_notice_unless_the_rank_count_is_unchanged() -> None:
    assert per_rank_names(["train.step", "rng.rank3.state", "dataloader.pos", "model.ranking.w", "x.dp_rank_2"]) == [
        "rng.rank3.state", "dataloader.pos", "x.dp_rank_2"]
    plan = load_placement_plan(None, parse_mesh("4"))
    moved = mesh_target(_catalog(3), parse_mesh("4"), plan)
    assert set(moved.tensors) == {"model.w"} and set(moved.objects) == {"train.step", "scheduler.last_epoch"}
    (notice,) = moved.notices
    for name in ("rng.rank3.state", "dataloader.position", "rng_states.rank_1", "keep_per_rank=True"):
        assert name in notice
    kept = mesh_target(_catalog(3), parse_mesh("4"), plan, keep_per_rank=True)
    assert "rng_states.rank_1" in kept.objects and "kept per-rank state" in kept.notices[0]
    same = mesh_target(_catalog(4), parse_mesh("4"), plan)
    assert "rng_states.rank_1" in same.objects and not same.notices


_HF = {
    "model.embed_tokens.weight": (64, 32),
    "model.layers.0.self_attn.q_proj.weight": (32, 32),
    "model.layers.0.self_attn.q_proj.bias": (32,),
    "model.layers.0.self_attn.o_proj.weight": (32, 32),
    "model.layers.0.mlp.up_proj.weight": (48, 32),
    "model.layers.0.mlp.down_proj.weight": (32, 48),
    "model.layers.0.input_layernorm.weight": (32,),
    "model.norm.weight": (32,),
    "lm_head.weight": (64, 32),
}


def test_mesh_names_choose_the_placements_or_refuse() -> None:
    """A mesh naming tp is laid out with tensor parallelism, never silently as HSDP; names
    reshard does not know are refused with the choices."""
    assert load_placement_plan(None, parse_mesh("dp_shard=4,tp=2")).name == "fsdp+tp"
    assert load_placement_plan(None, parse_mesh("dp_replicate=2,dp_shard=4")).name == "hsdp"
    with pytest.raises(UsageError, match=r"no default placements; give --placements fsdp .* fsdp\+tp"):
        load_placement_plan(None, parse_mesh("dp_shard=2,cp=2"))
    with pytest.raises(UsageError, match="unknown dimension 'foo'"):
        parse_mesh("foo=2")
    mesh = parse_mesh("dp_shard=2,tp=2")
    with pytest.raises(UsageError, match="match no tensor"):
        assign_placements(load_placement_plan(None, mesh), mesh, {"model.a.weight": (4, 4)},
                          _layout({"model.a.weight": (4, 4)}))


def test_tp_preset_knows_hf_names_and_three_dim_meshes() -> None:
    mesh = parse_mesh("dp_shard=4,tp=2")
    got = assign_placements(load_placement_plan("fsdp+tp", mesh), mesh, _HF, _layout(_HF))
    col, row, rep = (shard(0), shard(0)), (shard(0), shard(1)), (shard(0), REPLICATE)
    assert got["model.layers.0.self_attn.q_proj.weight"] == col and got["model.layers.0.self_attn.q_proj.bias"] == col
    assert got["model.layers.0.self_attn.o_proj.weight"] == row and got["model.layers.0.mlp.down_proj.weight"] == row
    assert got["model.layers.0.mlp.up_proj.weight"] == col and got["lm_head.weight"] == col
    assert got["model.norm.weight"] == rep and got["model.layers.0.input_layernorm.weight"] == rep
    mesh3 = parse_mesh("dp_replicate=2,dp_shard=2,tp=2")
    got3 = assign_placements(load_placement_plan(None, mesh3), mesh3, _HF, _layout(_HF))
    assert got3["model.layers.0.self_attn.o_proj.weight"] == (REPLICATE, shard(0), shard(1))
    assert got3["model.norm.weight"] == (REPLICATE, shard(0), REPLICATE)


def test_boxes_of_one_holder_are_owned_as_when_placed_one_by_one() -> None:
    """``mesh_shards`` takes the owners of boxes that no two ranks hold from a cache: the same
    boxes, owners and per-rank loads as placing every box (``distinct_boxes``), tensor after
    tensor, replicated ones (whose owners depend on the load so far) among them."""
    import random

    from reshard.core.sharding import mesh_shards

    rng = random.Random(0)
    for spec, options in (("4", [(shard(0),), (REPLICATE,)]), ("2x3", [(REPLICATE, shard(0)), (shard(0), shard(1)),
                                                                      (shard(1), shard(0)), (REPLICATE, REPLICATE)])):
        mesh = parse_mesh(spec)
        load, expected_load = [0] * mesh.world_size, [0] * mesh.world_size
        for _ in range(300):
            shape = tuple(rng.randint(0, 7) for _ in range(rng.choice([1, 2])))
            placements = rng.choice([p for p in options if all(k != "Shard" or d < len(shape) for k, d in p)])
            itemsize = rng.choice([1, 2, 4])
            local, boxes, ranks = mesh_shards(shape, placements, mesh, itemsize, load)
            assert local == local_boxes(shape, placements, mesh)
            assert (boxes, ranks) == distinct_boxes(local, itemsize, expected_load)
            assert load == expected_load
