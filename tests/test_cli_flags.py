"""The command line's flags come from one table (reshard/cli/flags.py), and the table says only
what is true: each row gives a field of its command's options or a parameter of the function
the command calls, once per command; convert exposes every ConvertOptions field it has a flag
for, with the options' own defaults; and no command defines an option outside the table."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import typer
from reshard.formats.options import ConvertOptions
from reshard.formats.registry import declared_options

from reshard.cli.app import app
from reshard.cli.flags import CLI_ONLY, FLAGS, TARGETS, Flag, flags_of, refresh_flags

NOT_ON_THE_COMMAND_LINE = {"workers"}  # ConvertOptions fields only the API sets


def _names(target: str) -> dict[str, Any]:
    """A target's fields or parameters, with their defaults (and ``ConvertOptions``'s output
    options, declared beside their formats)."""
    module, _, name = target.partition(":")
    obj = getattr(importlib.import_module(module), name)
    if obj is ConvertOptions:
        return _conversion_defaults()
    if dataclasses.is_dataclass(obj):
        return {f.name: f.default for f in dataclasses.fields(obj)}
    return {p.name: p.default for p in inspect.signature(obj).parameters.values()}


def problems(flags: tuple[Flag, ...]) -> list[str]:
    """What is wrong with a table of flags: rows that give nothing their command takes, and a
    field or flag given twice to one command."""
    out = []
    for command, targets in TARGETS.items():
        known = set(CLI_ONLY).union(*(_names(t) for t in targets))
        rows = [f for f in flags if command in f.commands]
        out += [f"{command} {f.flag}: {f.field} is not an option of {', '.join(targets)}" for f in rows if f.field not in known]
        for what, keys in (("field", [f.field for f in rows]), ("flag", [d for f in rows for d in f.decls])):
            out += [f"{command}: {what} {k} twice" for k in sorted({k for k in keys if keys.count(k) > 1})]
    out += [f"{f.flag}: no command {c}" for f in flags for c in f.commands if c not in TARGETS]
    return out


def test_every_flag_gives_an_option_its_command_takes_once() -> None:
    assert problems(FLAGS) == []
    # The rule can fail: a flag that maps to no field, or one given twice.
    stray = Flag("max_memroy", ("--max-memroy",), str, "typo", ("convert",))
    assert problems(FLAGS + (stray,)) == [
        "convert --max-memroy: max_memroy is not an option of reshard.formats.options:ConvertOptions"]
    twice = Flag("dtype", ("--cast",), str, "again", ("convert",))
    assert problems(FLAGS + (twice,)) == ["convert: field dtype twice"]


def _conversion_defaults() -> dict[str, Any]:
    fields = {f.name: f.default for f in dataclasses.fields(ConvertOptions) if f.name != "output"}
    return {**fields, **{name: o.default for name, o in declared_options().items()}}


def test_convert_exposes_each_conversion_option_once_with_its_default() -> None:
    rows = {f.field: f for f in flags_of("convert")}
    defaults = _conversion_defaults()
    assert set(defaults) - NOT_ON_THE_COMMAND_LINE == set(rows) - CLI_ONLY | {"quiet"}
    for name, row in rows.items():
        if name in defaults:  # the flag left out means the option's own default
            assert (row.value(row.default) if row.value else row.default) == defaults[name], row.flag


def test_no_command_defines_an_option_outside_the_table() -> None:
    """Each command's own parameters are its arguments; every option comes from the table, and
    --help shows them in the table's order."""
    refresh_flags()  # as main() does: the registry as it is now (a test may have registered a format and left)
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]  # a group
    assert set(commands) == set(TARGETS)
    for name, command in commands.items():
        options = [p for p in command.params if p.param_type_name == "option"]
        table = flags_of(name)
        assert [p.opts[0] for p in options] == [f.flag for f in table], name
        assert [p.name for p in options] == [f.field for f in table], name


def flags_with_two_meanings(flags: tuple[Flag, ...]) -> dict[str, set[str]]:
    """Each flag that gives different fields in different commands (a former spelling, hidden
    and taken with a notice, is not a meaning)."""
    meanings: dict[str, set[str]] = {}
    for f in flags:
        if f.renames is None:
            meanings.setdefault(f.flag, set()).add(f.field)
    return {flag: fields for flag, fields in meanings.items() if len(fields) > 1}


def test_one_flag_means_one_field_in_every_command() -> None:
    """``--to-mesh`` is the mesh and ``--config`` the model's HF config wherever they appear
    (train's ``--config`` preset is ``--model``, validate's ``to_mesh`` is ``mesh``)."""
    rows = tuple(f for command in TARGETS for f in flags_of(command))
    assert flags_with_two_meanings(rows) == {}
    planted = Flag("model", ("--config",), str, "the preset again", ("train",))
    assert flags_with_two_meanings(rows + (planted,)) == {"--config": {"config", "model"}}
    for former in (f for f in FLAGS if f.renames):
        assert former.hidden and former.field in CLI_ONLY, former.flag
