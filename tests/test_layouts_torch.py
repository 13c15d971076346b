"""The layouts torch's own writers give a training checkpoint, saved by FSDP2 on 2 gloo ranks
and used on 3, with nothing guessed wrong:

* ``tutorial``: torch's DCP tutorial, ``{"model", "optim"}`` from ``get_state_dict`` (FQN-keyed);
* ``tutorial_extra``: the same with ``train_state`` and ``extra`` sections beside them (the
  ``train_state`` section once made it torchtitan's, leaving the optimizer whole on ``--to-mesh``);
* ``fqn``: ``{"model", "optimizer"}`` from ``get_state_dict``;
* ``index``: ``{"model": model.state_dict(), "optimizer": opt.state_dict()}``, the plain way:
  optimizer state keyed by parameter index;
* ``titan``: torchtitan's ``{model, optimizer, lr_scheduler, train_state, dataloader}``.

For each: ``--to-mesh 3`` shards every optimizer tensor like its parameter and torch's
``dcp.load`` on a live 3-rank model reads it exactly; ``--dtype bfloat16`` casts parameters and
moments, never ``step``; ``--only model`` / ``--only optim`` select exactly those tensors;
``load_model(..., optimizer=opt)`` on 3 ranks restores model and optimizer exactly. And a
checkpoint two layouts explain equally (``{"model", "ema"}``) is refused naming ``--layout``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import reshard
from reshard.cli.app import main
from reshard.core.conventions import OPTIM_STATE, PARAM, detect_layout
from tests.dist import HANG_GUARD, run_world
from tests.test_titan_layout import _fsdp, _titan_state

VARIANTS = ("tutorial", "tutorial_extra", "fqn", "index", "titan")
LR = 0.03
_TORCH_READS = ("tutorial", "tutorial_extra", "fqn", "index")  # titan's: tests/test_titan_layout.py


def _train(world: int, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    model = _fsdp(world, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    for _ in range(2):
        tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(rank))
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt, sched


def _state(variant: str, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, rank: int) -> dict:
    """What each way of saving hands dcp.save."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if variant == "index":
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}
    if variant == "titan":
        return _titan_state(model, opt, sched, rank, "model")
    msd, osd = get_state_dict(model, opt)
    if variant == "fqn":
        return {"model": msd, "optimizer": osd}
    state = {"model": msd, "optim": osd}
    if variant == "tutorial_extra":
        state.update(train_state={"step": 2, "epoch": 1}, extra={"seed": 7, "scale": torch.ones(3)})
    return state


def _save(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, sched = _train(world, rank)
    for variant in VARIANTS:
        dcp.save(_state(variant, model, opt, sched, rank), checkpoint_id=Path(root) / variant)
    # Two top-level sections of parameter-shaped tensors and nothing saying which is the model.
    msd = model.state_dict()
    dcp.save({"model": msd, "ema": {k: v.detach().clone() for k, v in msd.items()}}, checkpoint_id=Path(root) / "ema")
    _, osd = get_state_dict(model, opt)
    ref = {"model": {k: v.full_tensor() for k, v in model.state_dict().items()},
           "optim": {f"{fqn}.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v
                     for fqn, s in osd["state"].items() for k, v in s.items()},
           "order": [n for n, _ in model.named_parameters()], "lr": opt.param_groups[0]["lr"]}
    if rank == 0:
        torch.save(ref, Path(root) / "ref.pt")
    dist.barrier()


def _check(model: torch.nn.Module, opt: torch.optim.Optimizer, ref: dict, where: str) -> None:
    """Every parameter, moment and step equal to the full reference, and the saved lr."""
    for k, v in model.state_dict().items():
        assert torch.equal(v.full_tensor(), ref["model"][k]), (where, k)
    names = dict(model.named_parameters())
    assert len(opt.state) == len(names), where
    for fqn, p in names.items():
        state = opt.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, (where, fqn)
        for key, v in state.items():
            got = v.full_tensor() if hasattr(v, "full_tensor") else v
            want = ref["optim"][f"{fqn}.{key}"]
            assert got.dtype == want.dtype and torch.equal(got, want), (where, fqn, key)
    assert opt.param_groups[0]["lr"] == ref["lr"] and opt.param_groups[0]["betas"] == (0.8, 0.95), where


def _fresh(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _fsdp(world, 1234)
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def _torch_reads(variant: str, path: Path, world: int, rank: int, ref: dict) -> None:
    """torch's dcp.load into the same structure the variant was saved from, on a live model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fresh(world)
    msd, osd = get_state_dict(model, opt)  # gives the optimizer its state (zeros) to load into
    if variant == "index":
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        dcp.load(state, checkpoint_id=path)
        opt.load_state_dict(state["optimizer"])
    else:
        section = "optimizer" if variant == "fqn" else "optim"
        state = {"model": msd, section: osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state[section])
    _check(model, opt, ref, f"dcp.load of {variant} --to-mesh 3")


def _resume(rank: int, world: int, root: str) -> None:
    ref = torch.load(Path(root) / "ref.pt", weights_only=True)
    for variant in VARIANTS:
        model, opt = _fresh(world)
        result = reshard.load_model(model, Path(root) / variant, optimizer=opt, progress=False)
        assert result.missing == [] and result.unexpected == [], (variant, result.missing, result.unexpected)
        assert result.notices and result.notices[0].startswith("layout "), (variant, result.notices)
        _check(model, opt, ref, f"load_model {variant}")
    for variant in _TORCH_READS:
        _torch_reads(variant, Path(root) / f"{variant}_3", world, rank, ref)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("layouts")
    run_world(_save, 2, str(root), timeout=HANG_GUARD)
    return root


EXPECTED = {"tutorial": "torch-optim", "tutorial_extra": "torch-optim", "fqn": "torch-optimizer",
            "index": "torch-optimizer", "titan": "torchtitan"}


def _param_of(variant: str, layout, name: str, order: list[str]) -> str:
    """The model tensor an optimizer tensor belongs to (by position for index-keyed state)."""
    fqn = layout.place(name).fqn
    return f"model.{order[int(fqn)] if variant == 'index' else fqn}"


def test_every_layout_converts_as_its_layout_says(saved: Path) -> None:
    ref = torch.load(saved / "ref.pt", weights_only=True)
    for variant in VARIANTS:
        src = saved / variant
        source = reshard.inspect(src)
        layout = detect_layout(source)
        assert layout.name == EXPECTED[variant], (variant, layout.name, layout.reason)
        moments = {n for n in source.tensors if layout.role(n) == OPTIM_STATE}
        params = {n for n in source.tensors if layout.role(n) == PARAM}
        assert len(moments) == 18 and len(params) == 6, variant

        # --to-mesh 3: every optimizer tensor laid out exactly like its parameter (steps whole).
        result = reshard.convert(src, saved / f"{variant}_3", to_mesh="3", quiet=True)
        assert any(n.startswith(f"layout {EXPECTED[variant]} (") for n in result.notices), result.notices
        out = reshard.inspect(saved / f"{variant}_3")
        for name in moments:
            entry = out.tensors[name]
            if not entry.shape:
                continue
            param = out.tensors[_param_of(variant, layout, name, ref["order"])]
            assert [c.box for c in entry.chunks] == [c.box for c in param.chunks], (variant, name)
            assert len(entry.chunks) == min(3, entry.shape[0]), (variant, name)

        # --dtype bfloat16: parameters and moments cast, step (and everything else) kept.
        reshard.convert(src, saved / f"{variant}_bf16", dtype="bfloat16", quiet=True)
        cast = reshard.inspect(saved / f"{variant}_bf16")
        for name, entry in cast.tensors.items():
            role, key = layout.role(name), layout.place(name).key
            cast = role == PARAM or (role == OPTIM_STATE and key != "step")
            want = torch.bfloat16 if cast else source.tensors[name].dtype.torch
            assert entry.dtype.torch == want, (variant, name, entry.dtype)

        # --only model / --only optim: exactly the model's and the optimizer's tensors.
        reshard.convert(src, saved / f"{variant}_model", only="model", quiet=True)
        reshard.convert(src, saved / f"{variant}_optim", only="optim", quiet=True)
        assert set(reshard.inspect(saved / f"{variant}_model").tensors) == params, variant
        assert set(reshard.inspect(saved / f"{variant}_optim").tensors) == moments, variant

    run_world(_resume, 3, str(saved), timeout=HANG_GUARD)


def test_an_ambiguous_checkpoint_is_refused_until_a_layout_is_given(saved: Path, capsys) -> None:
    src = saved / "ema"
    assert main(["convert", str(src), "--to-mesh", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the layout is ambiguous" in err[0] and "--layout state-dict" in err[0], err
    assert not (saved / "ema_3").exists()
    assert main(["convert", str(src), "--to-mesh", "3", "--layout", "state-dict"]) == 0
    assert "notice: layout state-dict (as given)" in capsys.readouterr().err
    out = reshard.inspect(saved / "ema_3")
    assert all(len(t.chunks) == min(3, t.shape[0]) for t in out.tensors.values())  # ema sharded as parameters too
    # A plain copy does not depend on the layout: no refusal.
    assert main(["convert", str(src), str(saved / "ema.safetensors")]) == 0
    # The CLI names the layout it chose on an unambiguous source.
    assert main(["convert", str(saved / "tutorial_extra"), str(saved / "cli_3"), "--to-mesh", "3"]) == 0
    assert "notice: layout torch-optim (6 tensors under model.; 18 optimizer tensors" in capsys.readouterr().err


def test_index_keyed_state_in_one_process_and_what_strict_false_reports(tmp_path: Path) -> None:
    """torch.save({"model", "optimizer": opt.state_dict()}) into a plain model: matched by the
    optimizer's order; groups that differ are refused as index-keyed; strict=False lists every
    checkpoint tensor it did not load in ``unexpected``, and a model-only file says it has no
    optimizer state."""
    from reshard.cli.example import TinyNet
    from reshard.runtime.load_plan import StateDictMismatchError

    torch.manual_seed(0)
    ref = TinyNet()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref(torch.randint(0, 11, (2, 5))).square().mean().backward()
    ref_opt.step()
    torch.save({"model": ref.state_dict(), "optimizer": ref_opt.state_dict(), "ema": {"w": torch.ones(2)}},
               tmp_path / "c.pt")
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    result = reshard.load_model(model, tmp_path / "c.pt", optimizer=opt, progress=False)
    assert "optimizer state keyed by parameter index matched" in result.notices[-1]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
        for key, v in ref_opt.state[q].items():
            assert torch.equal(opt.state[p][key], v), (name, key)
    assert opt.param_groups[0]["lr"] == LR

    split = torch.optim.AdamW([{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:]}])
    with pytest.raises(StateDictMismatchError, match=r"keyed by parameter index .* groups of \[6\] parameters, but the "
                                                     r"optimizer has groups of \[2, 4\]"):
        reshard.load_model(model, tmp_path / "c.pt", optimizer=split, progress=False)
    loose = reshard.load_model(model, tmp_path / "c.pt", optimizer=split, progress=False, strict=False)
    assert len(loose.missing) == 18 and len(loose.unexpected) == 18  # nothing of the optimizer dropped silently
    assert all(n.startswith("optimizer.state.") for n in loose.unexpected)

    torch.save(ref.state_dict(), tmp_path / "model.pt")
    with pytest.raises(StateDictMismatchError, match="holds no optimizer state .* load without optimizer="):
        reshard.load_model(model, tmp_path / "model.pt", optimizer=opt, progress=False)
    assert len(reshard.load_model(model, tmp_path / "model.pt", optimizer=opt, progress=False, strict=False).missing) == 18
