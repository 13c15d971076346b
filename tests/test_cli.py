"""The command line through its real entry point (a typer upgrade that breaks it shows here)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist import HANG_GUARD


def reshard(*args: str | Path) -> subprocess.CompletedProcess:
    """Run the CLI in this process (``main`` is what the console script calls): torch is
    already imported, so each call costs milliseconds instead of seconds."""
    import contextlib
    import io

    from reshard.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def reshard_process(*args: str | Path) -> subprocess.CompletedProcess:
    exe = shutil.which("reshard")
    cmd = [exe] if exe else [sys.executable, "-m", "reshard"]
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=HANG_GUARD)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_inspect_json_lists_every_tensor_with_global_shape(fsdp2_dcp, fsdp2_reference) -> None:
    proc = reshard("inspect", fsdp2_dcp[0], "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["format"] == "dcp"
    shapes = {t["name"]: t["shape"] for t in doc["tensors"]}
    assert shapes == {n: list(t.shape) for n, t in fsdp2_reference.items()}
    assert {t["dtype"] for t in doc["tensors"]} == {"float32"}
    assert doc["total_bytes"] == sum(t.numel() * 4 for t in fsdp2_reference.values())
    table = reshard("inspect", fsdp2_dcp[0])
    assert table.returncode == 0 and "model.embed.weight" in table.stdout and "11x6" in table.stdout


def test_convert_then_verify_exit_codes(fsdp2_dcp, tmp_path: Path) -> None:
    out = tmp_path / "copy"
    proc = reshard("convert", fsdp2_dcp[0], out, "--quiet")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert reshard("verify", fsdp2_dcp[0], out).returncode == 0
    again = reshard("convert", fsdp2_dcp[0], out)
    assert_one_line_error(again, str(out), "--overwrite")
    # Flip one element of the copy: verify must say which tensor differs and exit 1.
    from reshard.formats.dcp.format import DCPFormat

    from reshard.core.regions import as_region

    region = as_region(DCPFormat().read(out).tensors["model.proj.weight"].chunks[0].data)
    with open(region.path, "r+b") as f:
        f.seek(region.offset)
        f.write(torch.tensor([123.0]).numpy().tobytes())
    diff = reshard("verify", fsdp2_dcp[0], out, "--json")
    assert diff.returncode == 1
    report = json.loads(diff.stdout)
    assert [d["name"] for d in report["differences"]] == ["model.proj.weight"]
    assert reshard("verify", fsdp2_dcp[0], out, "--atol", "1000").returncode == 0


def test_bad_input_is_one_line_exit_2(fsdp2_dcp, tmp_path: Path) -> None:
    assert_one_line_error(reshard("inspect", tmp_path / "missing"), "missing", "no such file")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(fsdp2_dcp[0], corrupt)
    (corrupt / ".metadata").write_bytes(b"\x80\x04garbage")
    assert_one_line_error(reshard("inspect", corrupt), ".metadata")
    assert_one_line_error(reshard("convert", corrupt, tmp_path / "o.pt"), ".metadata")
    assert not (tmp_path / "o.pt").exists()
    assert_one_line_error(reshard("convert", fsdp2_dcp[0], tmp_path / "x", "--max-memory", "lots"), "lots")
    assert_one_line_error(reshard("convert", fsdp2_dcp[0], tmp_path / "x", "--dtype", "float7"), "float7")
    assert_one_line_error(reshard("convert", fsdp2_dcp[0], tmp_path / "x", "--bogus"), "--bogus")
    from safetensors.torch import save_file

    save_file({"w": torch.ones(64, 64)}, tmp_path / "t.safetensors")
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[: len(data) // 2])
    assert_one_line_error(reshard("inspect", tmp_path / "t.safetensors"), "t.safetensors")
    assert_one_line_error(reshard("convert", tmp_path / "t.safetensors", tmp_path / "t.pt"), "t.safetensors")
    (tmp_path / "t.safetensors").unlink()
    debug = reshard("inspect", corrupt, "--debug")
    assert debug.returncode == 2 and "Traceback" in debug.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt"]


@pytest.mark.parametrize("args", [["convert", "--help"], ["inspect", "--help"], ["verify", "--help"]])
def test_help_reads(args: list[str]) -> None:
    proc = reshard(*args)
    assert proc.returncode == 0 and "Usage" in proc.stdout


def test_piped_help_keeps_every_example_line_whole() -> None:
    """``reshard CMD --help | less`` renders at 80 columns: every line of every command's
    examples (a comment, a command) comes out whole, never wrapped in the middle; a command's
    description is reflowed, not broken where its docstring's source wraps; train's help names
    --to-mesh only (--mesh is a hidden alias)."""
    import os

    import typer

    from reshard.cli.app import app

    commands = typer.main.get_command(app).commands
    code = "import sys\nfrom reshard.cli.app import main\nfor c in sys.argv[1:]:\n    main([c, '--help'])\n    print('\\0')"
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TERMINAL_WIDTH")}
    proc = subprocess.run([sys.executable, "-c", code, *commands], capture_output=True, text=True, timeout=HANG_GUARD, env=env)
    assert proc.returncode == 0, proc.stderr
    for name, shown in zip(commands, proc.stdout.split("\0")):
        lines = {line.strip() for line in shown.splitlines()}
        assert all(len(line) <= 80 for line in shown.splitlines()), shown
        examples = [line.strip() for line in commands[name].epilog.splitlines()[1:] if line.strip()]
        assert examples and [e for e in examples if e not in lines] == [], (name, shown)
        described = [line.rstrip() for line in shown.split("╭", 1)[0].splitlines()[3:]]  # past the usage line
        cut = [(a, b) for a, b in zip(described, described[1:]) if a and b and len(a) + 1 + len(b.split()[0]) <= 79]
        assert cut == [], (name, cut)  # a paragraph's line ends only where the next word would not fit
    train = proc.stdout.split("\0")[list(commands).index("train")]
    assert "--to-mesh" in train and "--mesh " not in train and "--mesh," not in train, train
    docs = Path(__file__).resolve().parents[1] / "docs"  # and the docs call it by that one name
    for doc in (docs / "cli.md", docs / "recipes" / "validate.md"):
        said = [line for line in doc.read_text().splitlines() if re.search(r"(?<![\w-])--mesh\b", line)]
        assert said == [], (doc.name, said)


def _torchrun_world(args: list[str | Path], world: int = 2) -> list[subprocess.CompletedProcess]:
    """``reshard ARGS`` as each rank of a torchrun job runs it: one process per rank, with the
    environment torchrun gives them (RANK, WORLD_SIZE, MASTER_ADDR/PORT...)."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "reshard", *map(str, args)], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world)]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=HANG_GUARD)
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out


def test_a_usage_error_under_torchrun_is_said_once_and_every_rank_exits_2(fsdp2_dcp, tmp_path: Path) -> None:
    """A torchrun job meeting an output that exists (docs/recipes/mesh.md once did): rank 0 says
    it in one line, the other ranks say nothing, every rank exits 2, no traceback; an option
    error, met before any process group, likewise."""
    (tmp_path / "ckpt_2").mkdir()
    for args, line in (
            (["convert", fsdp2_dcp[0], tmp_path / "ckpt_2", "--to-mesh", "2"],
             f"reshard: error: {tmp_path / 'ckpt_2'} already exists; pass --overwrite to replace it"),
            (["convert", fsdp2_dcp[0], "--to-mesh", "2", "--no-such-flag"],
             "reshard: error: No such option: --no-such-flag (see `reshard convert --help`)")):
        ranks = _torchrun_world(args)
        assert [r.returncode for r in ranks] == [2, 2], [r.stderr for r in ranks]
        said = [line for r in ranks for line in (r.stdout + r.stderr).splitlines() if line.strip()]
        assert said == [line], said


def test_installed_entry_point(tmp_path: Path) -> None:
    """The console script itself: help works, and an error is one line with exit 2."""
    assert "convert" in reshard_process("--help").stdout
    assert_one_line_error(reshard_process("inspect", tmp_path / "nope"), "nope")


def test_allow_class_reads_a_trusted_class_as_data(tmp_path: Path) -> None:
    """A class outside the allow-list is refused with the option to pass; with --allow-class
    the file converts, the class never imported, and torch reads the output back as the class."""
    from tests.formats.test_torch_save import save_unimportable

    module = save_unimportable(tmp_path / "in.pt",
                               lambda m: {"model": {"w": torch.arange(4.0)}, "args": m.Config(3e-4, torch.ones(2))})
    present = {"no_such_pkg": type(sys)("no_such_pkg"), "no_such_pkg.conf": module}
    refused = reshard("convert", tmp_path / "in.pt", tmp_path / "out.pt")
    assert_one_line_error(refused, "in.pt", "--allow-class no_such_pkg.conf.Config")
    assert not (tmp_path / "out.pt").exists()
    ok = reshard("convert", tmp_path / "in.pt", tmp_path / "out.pt", "--allow-class", "no_such_pkg.conf.Config", "--quiet")
    assert ok.returncode == 0, ok.stderr
    listed = reshard("inspect", tmp_path / "in.pt", "--allow-class", "no_such_pkg.conf.Config", "--json")
    assert listed.returncode == 0 and ["args"] == [o["name"] for o in json.loads(listed.stdout)["objects"]], listed.stderr
    same = reshard("verify", tmp_path / "in.pt", tmp_path / "out.pt", "--allow-class", "no_such_pkg.conf.Config")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "no_such_pkg" not in sys.modules
    assert reshard("inspect", tmp_path / "in.pt").returncode == 2  # allowed for one command only
    assert_one_line_error(reshard("inspect", tmp_path / "in.pt", "--allow-class", "os.system"), "os.system")
    sys.modules.update(present)
    try:
        out = torch.load(tmp_path / "out.pt", weights_only=False)
    finally:
        for name in present:
            del sys.modules[name]
    assert type(out["args"]) is module.Config and out["args"].lr == 3e-4 and torch.equal(out["model"]["w"], torch.arange(4.0))


def test_a_mistyped_command_is_named_and_help_points_at_the_commands() -> None:
    proc = reshard("conver", "ckpt/")
    assert_one_line_error(proc, "Did you mean 'convert'?", "(see `reshard --help`)")
    assert "reshard conver --help" not in proc.stderr


def test_inspect_to_mesh_answers_for_the_mesh_first(fsdp2_dcp) -> None:
    """`reshard inspect ckpt/ --to-mesh 4x8` reprinted the whole tensor table and every object
    before the per-rank answer asked for; now the checkpoint's summary lines, then that answer,
    and how to see the rest."""
    src = fsdp2_dcp[0]
    plain = reshard("inspect", src).stdout
    proc = reshard("inspect", src, "--to-mesh", "4x8")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == plain.splitlines()[0] and lines[1].startswith("layout: ")
    first_table_row = next(line for line in plain.splitlines() if line.startswith("name "))
    assert first_table_row not in lines and not any(line.startswith("objects (") for line in lines)
    at = next(i for i, line in enumerate(lines) if line.startswith("on mesh "))
    assert at < 8 and lines[at + 1].split() == ["params", "optim", "other", "total", "ranks"]
    assert lines[-1] == f"every tensor and object: reshard inspect {src}"
