"""Layout conventions: every tool's names detected as that tool's, and each name's role."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reshard.core.catalog import Catalog, TensorEntry
from reshard.core.conventions import OPTIM_GROUP, OPTIM_STATE, OTHER, PARAM, PER_RANK, detect_layout, layout_notices, rename_path
from reshard.core.errors import UsageError
from reshard.core.facts import Facts


def _catalog(tensors: list[str], objects: list[str] = (), nested: bool = False, **facts) -> Catalog:
    cat = Catalog("dcp", Path("ckpt"), facts=Facts(**facts))
    cat.tensors = {n: TensorEntry(n, (2,), torch.float32) for n in tensors}
    cat.objects = {n: 0 for n in objects}
    if nested:  # sections as the first step of the nested path, as dcp.save records them
        cat.paths = {n: tuple(n.split(".", 1)) for n in [*tensors, *objects]}
    return cat


CASES = {
    "torchtitan": (
        ["model.layers.0.w", "optimizer.state.layers.0.w.exp_avg", "optimizer.state.layers.0.w.step"],
        ["optimizer.param_groups.layers.0.w.lr", "lr_scheduler.last_epoch", "train_state.step",
         "dataloader.dp_rank_0"], False),
    "torchtitan-flat": (
        ["layers.0.w", "tok.weight", "optimizer.state.layers.0.w.exp_avg"],
        ["optimizer.param_groups.layers.0.w.lr", "lr_scheduler.last_epoch", "train_state.step"], False),
    "torch-optim": (
        ["model.layers.0.w", "optim.state.layers.0.w.exp_avg", "extra.scale"],
        ["optim.param_groups.0.lr", "optim.param_groups.0.params", "train.step"], True),
    "torch-optimizer": (  # get_state_dict saved as {"model", "optimizer"}; accelerate's FSDP folders
        ["model.layers.0.w", "optimizer.state.layers.0.w.exp_avg"],
        ["optimizer.param_groups.0.lr", "optimizer.param_groups.0.params"], True),
    "torch-optimizer-only": (["state.layers.0.w.exp_avg"], ["param_groups.layers.0.w.lr"], False),
    "state-dict": (["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"], [], False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_tool_is_detected(name: str) -> None:
    tensors, objects, nested = CASES[name]
    layout = detect_layout(_catalog(tensors, objects, nested))
    assert layout.name == name
    roles = {n: layout.role(n) for n in [*tensors, *objects]}
    if name == "state-dict":  # HF names start with model. too: the whole name is the FQN
        assert all(r == PARAM for r in roles.values())
        assert layout.place("model.embed_tokens.weight").fqn == "model.embed_tokens.weight"
        return
    state = next(n for n in tensors if ".state." in f".{n}")
    assert roles[state] == OPTIM_STATE and layout.place(state).fqn == "layers.0.w"
    assert layout.param_fqn(state) == "layers.0.w"
    group = next(n for n in objects if "param_groups" in n)
    assert roles[group] == OPTIM_GROUP and layout.place(group).key == "lr"


def test_roles_and_overrides() -> None:
    titan = detect_layout(_catalog(*CASES["torchtitan"]))
    assert titan.groups == "fqn" and titan.place("optimizer.param_groups.layers.0.w.lr").fqn == "layers.0.w"
    assert titan.role("dataloader.dp_rank_0") == PER_RANK and titan.role("train_state.step") == OTHER
    assert titan.role("lr_scheduler.last_epoch") == OTHER
    ours = detect_layout(_catalog(*CASES["torch-optim"]))
    assert ours.groups == "index" and ours.place("optim.param_groups.0.lr").group == 0
    assert ours.role("extra.scale") == OTHER and ours.param_fqn("extra.scale") is None
    assert ours.in_section("optim.state.layers.0.w.exp_avg", "optim") and not ours.in_section("model.layers.0.w", "optim")
    # A plain optimizer's state keyed by int ids is optimizer state too (no FQN to link it by).
    plain = detect_layout(_catalog(["model.a.w", "optimizer.state.0.exp_avg"], ["optimizer.param_groups.0.params"], True))
    assert plain.name == "torch-optimizer" and plain.role("optimizer.state.0.exp_avg") == OPTIM_STATE
    # The reader's record, then the user's override, win over detection.
    verl = _catalog(*CASES["torch-optim"], layout="verl")
    assert detect_layout(verl).name == "verl"
    assert detect_layout(verl, "state-dict").name == "state-dict"
    with pytest.raises(UsageError, match="layout='nope' is not one of"):
        detect_layout(verl, "nope")


def test_casting_rule() -> None:
    layout = detect_layout(_catalog(*CASES["torch-optim"]))
    shapes = {"layers.0.w": (2,)}
    assert layout.casts("model.layers.0.w", (2,), shapes)
    assert layout.casts("optim.state.layers.0.w.exp_avg", (2,), shapes)
    assert not layout.casts("optim.state.layers.0.w.step", (), shapes)
    assert not layout.casts("extra.scale", (2,), shapes)
    assert not layout.casts("optim.state.layers.9.w.exp_avg", (2,), shapes)  # no parameter, no shape: kept


def test_rename_path_keeps_the_text_around_the_fqn() -> None:
    titan = detect_layout(_catalog(*CASES["torchtitan"]))
    name = "optimizer.state.layers.0.w.exp_avg"
    place = titan.place(name)
    assert rename_path(("optimizer", "state.layers.0.w.exp_avg"), name, place, "model.q") == (
        "optimizer", "state.model.q.exp_avg")
    assert rename_path(("optimizer", "state", "layers.0.w", "exp_avg"), name, place, "model.q") == (
        "optimizer", "state", "model.q", "exp_avg")
    assert rename_path(("model", "layers", "0", "w"), "model.layers.0.w", titan.place("model.layers.0.w"), "a.b") == (
        "model", "a.b")


def _shaped(tensors: dict[str, tuple[int, ...]], objects: list[str] = (), nested: bool = True) -> Catalog:
    cat = _catalog([], objects, False)
    cat.tensors = {n: TensorEntry(n, shape, torch.float32) for n, shape in tensors.items()}
    if nested:
        cat.paths = {n: tuple(n.split(".", 1)) for n in [*tensors, *objects]}
    return cat


PARAMS = {"embed.weight": (11, 8), "proj.weight": (8, 8), "head.weight": (11, 8)}


def _optim(prefix: str, keyed: str) -> dict[str, tuple[int, ...]]:
    out = {}
    for i, (fqn, shape) in enumerate(PARAMS.items()):
        key = fqn if keyed == "fqn" else str(i)
        out.update({f"{prefix}.state.{key}.exp_avg": shape, f"{prefix}.state.{key}.exp_avg_sq": shape,
                    f"{prefix}.state.{key}.step": ()})
    return out


def test_evidence_beats_a_marker_section() -> None:
    """torch's DCP tutorial {model, optim, train_state}: optimizer state that finds its
    parameters under optim. wins over torchtitan's train_state marker (which explains none of it)."""
    model = {f"model.{n}": s for n, s in PARAMS.items()}
    for extra in ([], ["train_state.step", "train_state.epoch"], ["extra.seed"]):
        cat = _shaped({**model, **_optim("optim", "fqn")}, ["optim.param_groups.0.lr", "optim.param_groups.0.params",
                                                            *extra])
        layout = detect_layout(cat)
        assert layout.name == "torch-optim", extra
        assert layout.place("optim.state.proj.weight.exp_avg").fqn == "proj.weight"
        assert "9 optimizer tensors under optim.state. matching their parameters by FQN" in layout.reason
        assert layout_notices(layout)[0].startswith("layout torch-optim (")
    # {model, optimizer} keyed by index (opt.state_dict()): the plain optimizer's ids, never torchtitan's
    cat = _shaped({**model, **_optim("optimizer", "index")}, ["optimizer.param_groups.0.lr",
                                                                "optimizer.param_groups.0.params", "train_state.step",
                                                                "lr_scheduler.last_epoch"])
    layout = detect_layout(cat)
    assert layout.name == "torch-optimizer" and "keyed by parameter index" in layout.reason
    assert layout.place("optimizer.state.1.exp_avg").role == OPTIM_STATE
    # torchtitan's own: FQN-keyed, its markers present; both readings agree, its marker decides
    cat = _shaped({**model, **_optim("optimizer", "fqn")}, ["optimizer.param_groups.proj.weight.lr",
                                                             "train_state.step", "lr_scheduler.last_epoch"])
    assert detect_layout(cat).name == "torchtitan"


def test_two_equal_explanations_are_refused_with_the_candidates() -> None:
    """{model, ema} with no optimizer: "model." is a section, or every tensor is a parameter;
    nothing decides, so detection refuses and names --layout; with it (or when the layout does
    not change the result) it goes on."""
    from reshard.core.conventions import AmbiguousLayoutError

    cat = _shaped({**{f"model.{n}": s for n, s in PARAMS.items()}, **{f"ema.{n}": s for n, s in PARAMS.items()}})
    with pytest.raises(AmbiguousLayoutError) as e:
        detect_layout(cat)
    message = str(e.value)
    assert "--layout state-dict" in message and "--layout torch-optim" in message and "ema.* (3 tensors)" in message
    assert "\n" not in message
    assert detect_layout(cat, "state-dict").role("ema.proj.weight") == PARAM
    assert detect_layout(cat, refuse_ambiguous=False).name in ("state-dict", "torch-optim")
    # one section named model: a nested section beats calling "model.x" a parameter name
    alone = _shaped({f"model.{n}": s for n, s in PARAMS.items()} | {"step": ()})
    layout = detect_layout(alone)
    assert layout.name == "torch-optim" and layout.place("model.proj.weight").fqn == "proj.weight"
    assert layout.unexplained == ()
    # an extra section beside model and optimizer state is said, not guessed at
    ema = _shaped({**{f"model.{n}": s for n, s in PARAMS.items()}, **_optim("optim", "fqn"),
                   **{f"ema.{n}": s for n, s in PARAMS.items()}}, ["optim.param_groups.0.params"])
    layout = detect_layout(ema)
    assert layout.name == "torch-optim" and len(layout.unexplained) == 3
    assert "ema.* (3 tensors) not model or optimizer state" in layout_notices(layout)[1]


def test_hf_names_and_flat_state_dicts_are_models() -> None:
    flat = _shaped({"model.embed_tokens.weight": (4, 2), "lm_head.weight": (4, 2)}, nested=False)
    layout = detect_layout(flat)
    assert layout.name == "state-dict" and layout_notices(layout) == []  # the only reading: nothing to say


class _Buffered(torch.nn.Module):
    """Four parameters and a registered buffer: five model tensors, four with optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)
        self.register_buffer("scale", torch.full((3,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)) * self.scale


def _saved_by_torch(path: Path, **sections: dict) -> _Buffered:
    """``dcp.save({"model": ..., "optim": ..., **sections})`` of ``get_state_dict`` after a step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _Buffered()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, **sections}, checkpoint_id=path, no_dist=True)
    return model


def test_a_checkpoint_torch_saved_is_named_after_torch_and_counted_in_tensors(tmp_path: Path, capsys) -> None:
    """torch's own ``dcp.save`` of ``get_state_dict(model, opt)`` as ``{model, optim}``: shown as
    the layout torch writes (not reshard's), its model tensors counted as tensors (a buffer is
    not a parameter), and ``--dtype`` names that same layout when it casts the model section."""
    from safetensors.torch import load_file

    from reshard.cli.app import main

    model = _saved_by_torch(tmp_path / "ckpt")
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    layout_line = capsys.readouterr().out.splitlines()[1]
    assert layout_line.startswith("layout: torch-optim (torch's get_state_dict saved as {model, optim"), layout_line
    assert "5 tensors under model.; 12 optimizer tensors under optim.state." in layout_line, layout_line
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors"), "--only", "model",
                 "--dtype", "bfloat16"]) == 0
    err = capsys.readouterr().err
    assert "notice: cast to bfloat16 under layout torch-optim: 5 model tensors\n" in err, err
    saved = load_file(tmp_path / "m.safetensors")
    assert sorted(saved) == sorted(model.state_dict()) and {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert torch.equal(saved["scale"], model.scale.to(torch.bfloat16))
    # the names layouts had before they were named after their writers still work as --layout
    for former, now in (("reshard", "torch-optim"), ("model", "state-dict")):
        assert main(["inspect", str(tmp_path / "ckpt"), "--layout", former]) == 0
        line = capsys.readouterr().out.splitlines()[1]
        assert line.startswith(f"layout: {now} (") and line.endswith(": as given"), line


def test_one_of_a_thing_is_said_in_the_singular(tmp_path: Path, capsys) -> None:
    """``1 tensor``, never ``1 tensors``: in the HF export's notices and the summary line."""
    from safetensors.torch import load_file

    from reshard.cli.app import main
    from reshard.core.sizes import plural

    assert (plural(0, "tensor"), plural(1, "tensor"), plural(2, "file")) == ("0 tensors", "1 tensor", "2 files")
    _saved_by_torch(tmp_path / "ckpt", extra={"scale": torch.tensor([1.5, 2.5])})
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf", "--weights-only"]) == 0
    err = capsys.readouterr().err
    assert "notice: 1 tensor outside the model section left out (e.g. 'extra.scale')" in err, err
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "one.safetensors"), "--only", "extra"]) == 0
    assert f"\nwrote {tmp_path / 'one.safetensors'} (safetensors, 1 tensor, 8 B) in " in capsys.readouterr().err
    assert list(load_file(tmp_path / "one.safetensors")) == ["extra.scale"]


def test_a_conversion_detects_the_layout_once(monkeypatch) -> None:
    """``build_target`` asks for the layout before and after steps that leave the tables as
    they were (notices added by ``dataclasses.replace``): the answer is carried, not
    recomputed (at 100k tensors a detection costs seconds); a step that changes the tables
    (``exclude``) is detected anew."""
    from reshard.formats.options import ConvertOptions

    from reshard.commands.convert import build_target
    from reshard.core import conventions

    calls = []
    real = conventions._detect
    monkeypatch.setattr(conventions, "_detect", lambda *a: calls.append(a) or real(*a))
    names, objects, _ = CASES["torchtitan"]
    build_target(_catalog(names, objects, nested=True), "dcp", ConvertOptions(to_mesh="2"))
    assert len(calls) == 1
    build_target(_catalog(names, objects, nested=True), "dcp", ConvertOptions(to_mesh="2", exclude=["train_state.*"]))
    assert len(calls) == 3
