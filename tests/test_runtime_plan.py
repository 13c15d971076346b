"""The load plan as a value: name matching, mismatch errors, who gets which box (no worlds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Catalog, Chunk, TensorEntry
from reshard.core.errors import CorruptCheckpointError
from reshard.runtime.load_plan import StateDictMismatchError, make_load_plan
from reshard.runtime.targets import SlotMeta, make_slots, storage_aliases


def _catalog(shapes: dict[str, tuple[int, ...]], paths: dict | None = None, holes: str | None = None) -> Catalog:
    tensors = {}
    for name, shape in shapes.items():
        box = full_box(shape)
        if name == holes:  # only the first row stored
            box = Box(box.offsets, (1, *shape[1:]))
        tensors[name] = TensorEntry(name, shape, torch.float32, [Chunk(box, None)])
    return Catalog("test", Path("ck"), tensors, {"optim.param_groups.0.lr": 0.1}, paths or {})


def _rows(shape: tuple[int, ...], start: int, n: int) -> SlotMeta:
    return SlotMeta(shape, torch.bfloat16, (Box((start,) + (0,) * (len(shape) - 1), (n, *shape[1:])),) if n else ())


def _whole(shape: tuple[int, ...]) -> SlotMeta:
    return SlotMeta(shape, torch.float32, (full_box(shape),))


CKPT = {
    "model.w": (5, 2),
    "model.b": (5,),
    "optim.state.w.exp_avg": (5, 2),
    "optim.state.w.step": (),
    "extra.note": (1,),
}


def test_plan_matches_sections_and_groups_boxes_by_rank() -> None:
    # 3 ranks, w sharded 2/2/1 rows, b replicated by hand on two ranks, step whole everywhere.
    metas = [
        {"w": _rows((5, 2), 0, 2), "b": _rows((5,), 0, 3), "optim.state.w.step": _whole(())},
        {"w": _rows((5, 2), 2, 2), "b": _rows((5,), 0, 3), "optim.state.w.step": _whole(())},
        {"w": _rows((5, 2), 4, 1), "b": _rows((5,), 3, 2), "optim.state.w.step": _whole(())},
    ]
    plan = make_load_plan(_catalog(CKPT), metas, strict=False, slab_bytes=64)
    by_target = {i.target: i for i in plan.items}
    assert [i.source for i in plan.items] == ["model.w", "model.b", "optim.state.w.step"]
    assert by_target["w"].boxes == (
        (Box((0, 0), (2, 2)), (0,)), (Box((2, 0), (2, 2)), (1,)), (Box((4, 0), (1, 2)), (2,)))
    assert by_target["b"].boxes == ((Box((0,), (3,)), (0, 1)), (Box((3,), (2,)), (2,)))
    assert not by_target["w"].broadcast and not by_target["b"].broadcast
    assert by_target["optim.state.w.step"].broadcast
    # Bytes travel in the stored dtype, each distinct box read once.
    assert by_target["w"].dtype == torch.float32
    assert plan.total_bytes == (10 + 5 + 1) * 4
    # Only the section being loaded can hold unexpected names: extra.* never does.
    assert plan.unexpected == ["optim.state.w.exp_avg"]
    assert plan.missing == [] and plan.objects == {"optim.param_groups.0.lr": 0.1}


def test_exact_name_wins_over_section() -> None:
    cat = _catalog({"w": (5, 2), "model.w": (5, 2)})
    plan = make_load_plan(cat, [{"w": _whole((5, 2))}], strict=False, slab_bytes=64)
    assert [(i.target, i.source) for i in plan.items] == [("w", "w")]
    # A flat checkpoint whose names say nothing of sections: model.w is one more parameter.
    assert plan.unexpected == ["model.w"]


def test_mismatch_is_one_error_naming_missing_and_unexpected() -> None:
    metas = [{"w": _whole((5, 2)), "scale": _whole((3,)), **{f"extra{i}": _whole((1,)) for i in range(6)}}]
    with pytest.raises(StateDictMismatchError) as e:
        make_load_plan(_catalog(CKPT), metas, slab_bytes=64)
    assert str(e.value) == (
        "ck: checkpoint does not match the state dict being loaded: 7 missing (in the state dict, not in the "
        "checkpoint): 'scale', 'extra0', 'extra1', 'extra2', 'extra3' and 2 more; 1 unexpected (in the "
        "checkpoint, not in the state dict): 'model.b'. Nothing was loaded. Pass keymap=... to rename the "
        "checkpoint's names, or strict=False to load the names that match"
    )
    plan = make_load_plan(_catalog(CKPT), metas, strict=False, slab_bytes=64)
    assert plan.loaded == ["w"] and plan.missing[0] == "scale" and plan.unexpected == ["model.b"]


def test_shape_mismatch_fails_even_when_not_strict() -> None:
    with pytest.raises(StateDictMismatchError, match=r"'w' is \[5, 2\] in the checkpoint \('model.w'\) but \[6, 2\] here"):
        make_load_plan(_catalog(CKPT), [{"w": _whole((6, 2))}], strict=False, slab_bytes=64)


def test_names_nothing_matches_show_the_whole_checkpoint() -> None:
    with pytest.raises(StateDictMismatchError, match="5 unexpected"):
        make_load_plan(_catalog(CKPT), [{"zzz": _whole((1,))}], slab_bytes=64)


def test_incomplete_checkpoint_is_refused() -> None:
    with pytest.raises(CorruptCheckpointError, match="stores only 2 of the 10 elements"):
        make_load_plan(_catalog({"w": (5, 2)}, holes="w"), [{"w": _whole((5, 2))}], slab_bytes=64)


def test_tied_weights_load_once_from_whichever_name_is_stored() -> None:
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(5, 2)
    model.out = torch.nn.Linear(2, 5, bias=False)
    model.out.weight = model.emb.weight
    slots = make_slots(model.state_dict())
    aliases = storage_aliases(slots)
    assert aliases == [("emb.weight", "out.weight")]
    metas = [{n: s.meta for n, s in slots.items()}]
    for stored in ("emb.weight", "out.weight"):
        plan = make_load_plan(_catalog({stored: (5, 2)}), metas, aliases, slab_bytes=64)
        assert plan.loaded == [stored] and plan.missing == [] and plan.unexpected == []


def test_nested_state_dicts_flatten_like_dcp() -> None:
    t = torch.zeros(2)
    slots = make_slots({"model": {"a.b": t}, "optim": {"state": {"a.b": {"exp_avg": t, "step": 3}}}, "groups": [{"x": t}]})
    assert list(slots) == ["model.a.b", "optim.state.a.b.exp_avg", "groups.0.x"]
    with pytest.raises(Exception, match="meta device"):
        make_slots({"w": torch.empty(2, device="meta")})
