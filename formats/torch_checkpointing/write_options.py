"""``--device-type``, the torch_checkpointing output's own option, declared apart from the
format so ``reshard --help`` does not import it.

torch_checkpointing records each tensor's device mesh with its device type, and loads a
checkpoint without resharding only where the live state dict's meshes equal the recorded
ones, device type included. A checkpoint does not say which device it will be loaded on:
this says it (``cuda`` by default, where training runs; ``cpu`` for gloo jobs). Any other
device type loads as well, through torch_checkpointing's resharding path.
"""

from __future__ import annotations

import re

from reshard.core.errors import UsageError, option
from reshard.pipeline.options import OutputOption, WriterOptions

__all__ = ["DEVICE_TYPE", "device_type"]

_DEVICE_TYPE = re.compile(r"[a-z][a-z0-9_]*")
_DEFAULT = "cuda"


def _device_type(value: object) -> str:
    if not isinstance(value, str) or not _DEVICE_TYPE.fullmatch(value):
        raise UsageError(f"{option('--device-type', 'device_type=')} {value!r} is not a torch device type such as cuda "
                         "or cpu")
    return value


# None when not given (as the command line gives every unset option): ``device_type`` reads it.
DEVICE_TYPE: OutputOption[str | None] = OutputOption(
    "device_type", "--device-type", f"Device type the {{takes:device_type}} output's meshes are recorded on (default "
    f"{_DEFAULT}; cpu for gloo): loads there take no resharding.", default=None, metavar="TYPE", check=_device_type,
    after="fsync")


def device_type(options: WriterOptions) -> str:
    """The device type an output's meshes are recorded on."""
    return options.value(DEVICE_TYPE) or _DEFAULT
