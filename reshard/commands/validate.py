"""``reshard validate``: prove that a checkpoint survives every conversion path.

A conversion tool is only trusted when a run resumed from its output continues exactly as if
it had never stopped. So, on the project's FSDP2 training loop (``reshard.train``):

1. One world on mesh A trains ``2N`` steps uninterrupted, saving a DCP checkpoint at step
   ``N`` and a digest of its full training state (parameters + AdamW state) there.
2. For each path, ``reshard.convert`` turns that checkpoint into a DCP checkpoint again:
   ``dcp`` re-lays it out for mesh B; ``safetensors``, ``torch`` and ``zarr`` go out to that
   format and back. ``reshard.verify`` checks each output bit for bit against the original.
3. One world on mesh B resumes from each path's output through ``reshard.load_model``, checks
   the loaded state's digest against step 1's, and trains to step ``2N``.
4. Each path's losses are compared with the uninterrupted run's: different meshes reduce in
   a different order, so fp32 noise is expected (a few 1e-7 relative on the tiny model),
   within ``rtol`` (1e-4 relative by default); a real conversion bug is a larger jump, and
   the bit-exact checks catch even one flipped element before any training.

A path matches only when all three hold: converted bit-exact, loaded bit-exact, losses within
tolerance. A path whose format this install lacks is "unavailable", which is not a match.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from reshard.core.errors import ReshardError, UsageError
from reshard.core.sizes import plural
from reshard.formats.registry import default_suffix, get_format
from reshard.pipeline.options import former_keyword
from reshard.train.launch import spawn, train_json
from reshard.train.loop import TrainConfig, TrainResult, check_config, train

__all__ = ["PATHS", "PathResult", "ValidateResult", "validate", "convert_path", "format_table"]

PATHS = ("dcp", "safetensors", "torch", "zarr")


@dataclass
class PathResult:
    name: str
    route: str
    status: str = "pending"  # match, mismatch, unavailable, error
    converted_exact: bool | None = None  # every intermediate and the final output vs the original
    loaded_exact: bool | None = None  # digest of the state loaded on mesh B vs the saved state
    max_loss_diff: float | None = None
    max_rel_loss_diff: float | None = None
    losses: dict[int, float] = field(default_factory=dict)
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "match"


@dataclass
class ValidateResult:
    from_mesh: str
    to_mesh: str
    steps: int
    model: str
    rtol: float
    reference_losses: dict[int, float]
    paths: list[PathResult]
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.paths) and all(p.ok for p in self.paths)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def _route(name: str, from_mesh: str, to_mesh: str) -> str:
    if name == "dcp":
        return f"DCP({from_mesh}) -> DCP laid out for {to_mesh}"
    return f"DCP({from_mesh}) -> {name} -> DCP"


def convert_path(name: str, ckpt: Path, workdir: Path, to_mesh: str) -> list[Path]:
    """Run path ``name``'s conversions of ``ckpt`` into ``workdir``; the outputs in order, the
    last one being the DCP checkpoint to resume from. (Tests replace this to break a path.)"""
    from reshard.commands.convert import convert

    if name == "dcp":
        out = workdir / f"dcp_{to_mesh}"
        convert(ckpt, out, to="dcp", to_mesh=to_mesh, quiet=True)
        return [out]
    mid = workdir / f"{name}{default_suffix(name)}"
    convert(ckpt, mid, to=name, quiet=True)
    back = workdir / f"{name}_back"
    convert(mid, back, to="dcp", quiet=True)
    return [mid, back]


def _available(name: str) -> str | None:
    """Why path ``name`` cannot run in this install, or None."""
    if name == "dcp":
        return None

    try:
        get_format(name)
    except (ReshardError, ImportError) as e:
        return f"the {name} format is not available here: {e}"
    return None


def _convert_and_verify(row: PathResult, ckpt: Path, workdir: Path, to_mesh: str) -> Path | None:
    from reshard.commands.verify import verify

    if (why := _available(row.name)) is not None:
        row.status, row.detail = "unavailable", why
        return None
    try:
        outputs = convert_path(row.name, ckpt, workdir, to_mesh)
        for out in outputs:
            check = verify(ckpt, out)
            if not check.equal:
                row.converted_exact = False
                d = check.differences[0]
                row.status = "mismatch"
                row.detail = (f"{out.name}: {plural(len(check.differences), 'difference')} from the checkpoint, "
                              f"first {d.name}: {d.kind}: {d.detail}")
                return outputs[-1]
    except Exception as e:  # noqa: BLE001 - a failing path is reported in its row, the others still run
        row.status, row.detail = "error", f"conversion failed: {type(e).__name__}: {e}"
        return None
    row.converted_exact = True
    return outputs[-1]


def _resume_all(sources: list[tuple[str, str]], cfg: Any) -> dict[str, Any]:
    """On every rank of mesh B: resume from each source in turn; per-path results or errors."""
    out: dict[str, Any] = {}
    for name, source in sources:
        try:
            out[name] = train(replace(cfg, resume=source)).to_json()
        except ReshardError as e:  # raised alike on every rank by the runtime: the world goes on
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _compare(row: PathResult, resumed: dict[str, Any], reference: dict[int, float], digest: str | None,
             steps: int, rtol: float) -> None:
    if "error" in resumed:
        row.status, row.detail = "error", f"resume failed: {resumed['error']}"
        return
    row.losses = {int(k): v for k, v in resumed["losses"].items()}
    row.loaded_exact = resumed["digests"].get(str(steps), resumed["digests"].get(steps)) == digest
    expected = [s for s in reference if s > steps]
    if sorted(row.losses) != expected:
        row.status, row.detail = "error", f"resumed run logged steps {sorted(row.losses)}, expected {expected}"
        return
    diffs = [abs(row.losses[s] - reference[s]) for s in expected]
    row.max_loss_diff = max(diffs)
    row.max_rel_loss_diff = max(d / max(abs(reference[s]), 1e-12) for d, s in zip(diffs, expected))
    if row.status != "pending":  # already a mismatch from verify: keep that explanation
        return
    if not row.loaded_exact:
        row.status, row.detail = "mismatch", "the state loaded on the target mesh differs from the saved state"
    elif row.max_rel_loss_diff > rtol:
        row.status, row.detail = "mismatch", f"losses after resume differ by up to {row.max_rel_loss_diff:.2e} relative"
    else:
        row.status = "match"


def validate(
    from_mesh: str,
    to_mesh: str | None = None,
    *,
    steps: int = 3,
    via: tuple[str, ...] | list[str] = PATHS,
    model: str = "tiny",
    global_batch: int = 12,
    rtol: float = 1e-4,
    workdir: str | os.PathLike | None = None,
    device: str = "cpu",
    timeout: float = 1800.0,
    mesh: str | None = None,
) -> ValidateResult:
    """Train ``steps`` on ``from_mesh``, convert through each path in ``via``, resume each on
    ``to_mesh`` (``--to-mesh``, as in ``convert`` and ``train``; ``mesh=`` is its former name)
    for ``steps`` more, and compare with an uninterrupted ``2 * steps`` run.

    >>> result = reshard.commands.validate.validate("2", "3", steps=3)
    >>> result.ok, [(p.name, p.status) for p in result.paths]

    ``workdir`` keeps the checkpoints and conversions (default: a temp dir, removed after).
    """
    to_mesh = former_keyword("validate", "mesh", "to_mesh", mesh, to_mesh)
    if to_mesh is None:
        raise UsageError("validate needs to_mesh=: the mesh every converted checkpoint is resumed on")
    started = time.perf_counter()
    unknown = [v for v in via if v not in PATHS]
    if unknown or not via:
        raise UsageError(f"--via {','.join(unknown) or '(empty)'}: choose among {', '.join(PATHS)}")
    if steps < 1:
        raise UsageError("--steps must be at least 1")
    base = TrainConfig(to_mesh=from_mesh, model=model, steps=2 * steps, global_batch=global_batch,
                       digest_at=(steps,), log=False)
    n_from, n_to = check_config(base).world_size, check_config(replace(base, to_mesh=to_mesh)).world_size
    with tempfile.TemporaryDirectory(prefix="reshard-validate-") as tmp:
        work = Path(workdir) if workdir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ref = TrainResult.from_json(spawn(train_json, n_from, replace(
            base, ckpt_dir=str(work / "run_a"), save_every=steps), device=device, timeout=timeout))
        ckpt = Path(ref.checkpoints[0])
        rows = [PathResult(name, _route(name, from_mesh, to_mesh)) for name in dict.fromkeys(via)]
        sources = []
        for row in rows:
            final = _convert_and_verify(row, ckpt, work, to_mesh)
            if final is not None:
                sources.append((row.name, str(final)))
        if sources:
            try:
                resumed = spawn(_resume_all, n_to, sources, replace(base, to_mesh=to_mesh), device=device, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - the world died: every path it carried failed
                resumed = {name: {"error": f"the world on mesh {to_mesh} failed: {e}"} for name, _ in sources}
            for row in rows:
                if row.name in resumed:
                    _compare(row, resumed[row.name], ref.losses, ref.digests.get(steps), steps, rtol)
    return ValidateResult(from_mesh, to_mesh, steps, model, rtol, ref.losses, rows, time.perf_counter() - started)


def _yes_no(v: bool | None) -> str:
    return "-" if v is None else ("bit-exact" if v else "DIFFERS")


def format_table(result: ValidateResult) -> str:
    """The report ``reshard validate`` prints: one row per path, then the verdict."""
    head = (f"validate: {result.steps} steps on mesh {result.from_mesh}, save, convert, resume on mesh "
            f"{result.to_mesh} for {result.steps} more; {result.model} model; loss tolerance {result.rtol:g} relative")
    cols = ("path", "route", "converted", "loaded", "max |dloss|", "max rel", "result")
    rows = [cols]
    for p in result.paths:
        rows.append((p.name, p.route, _yes_no(p.converted_exact), _yes_no(p.loaded_exact),
                     "-" if p.max_loss_diff is None else f"{p.max_loss_diff:.2e}",
                     "-" if p.max_rel_loss_diff is None else f"{p.max_rel_loss_diff:.2e}", p.status.upper()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = [head, ""] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    notes = [f"{p.name}: {p.detail}" for p in result.paths if p.detail]
    if notes:
        lines += [""] + notes
    bad = sum(not p.ok for p in result.paths)
    verdict = (f"all {len(result.paths)} paths match" if result.ok
               else f"{bad} of {len(result.paths)} paths do not match")
    lines += ["", f"{verdict} ({result.seconds:.0f}s)"]
    return "\n".join(lines)
