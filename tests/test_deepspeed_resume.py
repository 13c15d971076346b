"""A DeepSpeed ZeRO-3 run moved to FSDP2 on another number of ranks, optimizer included.

``reshard.load_model(model, "global_step2/", optimizer=opt)`` on a 3-rank FSDP2 mesh (gloo;
vocab 61 and hidden 32 shard unevenly over 3) restores DeepSpeed's fp32 master weights, Adam
moments, step and lr bit for bit, from the ZeRO folder (rank 0 streams) and from its
universal conversion (every rank reads). Then the fp32 ZeRO-3 run saved on 3 DeepSpeed ranks
resumes under FSDP2: the next two steps' losses equal those DeepSpeed computed when the same
run went on uninterrupted (``reference.pt``, tests/data/deepspeed/README.md).
"""

from __future__ import annotations

from pathlib import Path

import torch

import reshard
from tests.dist import HANG_GUARD, run_world

DATA = Path(__file__).resolve().parent / "data" / "deepspeed"


def _fsdp_llama(folder: Path, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)  # weights unlike the checkpoint's, to be overwritten
    model = LlamaForCausalLM(LlamaConfig.from_json_file(folder / "config.json"))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Hyper-parameters unlike DeepSpeed's, so restoring them shows.
    return model, torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.5, 0.5), weight_decay=0.0)


def _check_restored(model: torch.nn.Module, opt: torch.optim.Optimizer, ref: dict, where: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    for name, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), ref["fp32"][name]), (where, name)
    _, osd = get_state_dict(model, opt)
    assert set(osd["state"]) == set(ref["fp32"]), where
    for fqn, state in osd["state"].items():
        assert torch.equal(state["step"], ref["step"]), (where, fqn)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key].full_tensor(), ref[key][fqn]), (where, fqn, key)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (ref["lr"], (0.9, 0.95), 0.01), where


def _resume(rank: int, world: int) -> None:
    ref = torch.load(DATA / "zero3_bf16" / "reference.pt", weights_only=True)
    for source, mode in ((DATA / "zero3_bf16" / "global_step2", "rank0"),
                         (DATA / "zero3_bf16_universal" / "global_step2_universal", "parallel")):
        model, opt = _fsdp_llama(DATA / "zero3_bf16", world)
        result = reshard.load_model(model, source, optimizer=opt, mode=mode, progress=False)
        assert result.missing == [] and result.unexpected == [], (result.missing, result.unexpected)
        _check_restored(model, opt, ref, f"{source.parent.name} {mode}")

    # The fp32 run: continue where DeepSpeed stopped, on the batches it trained on next. Each
    # of DeepSpeed's 3 ranks took one micro-batch of 2 and averaged; every FSDP rank takes all.
    folder = DATA / "zero3_fp32_3ranks"
    ref = torch.load(folder / "reference.pt", weights_only=True)
    model, opt = _fsdp_llama(folder, world)
    reshard.load_model(model, folder / "global_step2", optimizer=opt, progress=False)
    assert opt.param_groups[0]["lr"] == ref["lr_next"]  # the lr DeepSpeed's scheduler gave step 3
    losses = []
    for tokens in ref["tokens"]:
        micro = tokens.split(2)
        loss = sum(model(input_ids=m, labels=m).loss for m in micro) / len(micro)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    want = ref["loss"].tolist()
    # Same numbers in the same order: observed bit-equal; a reduction order change may move the
    # last bits of the gradient sum, hence the fp32-noise tolerance.
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, want)), (losses, want)


def test_load_model_moves_a_zero3_run_to_fsdp2_on_three_ranks() -> None:
    run_world(_resume, 3, timeout=HANG_GUARD)
