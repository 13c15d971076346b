from __future__ import annotations

import pytest

from reshard.core.errors import UsageError
from reshard.core.sizes import format_size, parse_size


@pytest.mark.parametrize("text,value", [("512MiB", 512 << 20), ("2GB", 2 * 10**9), ("20KB", 20_000),
                                        ("1GiB", 1 << 30), ("1024", 1024), ("1.5GiB", 3 << 29), (" 5gb ", 5 * 10**9)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["lots", "5 parsecs", "-1GB", "0", ""])
def test_bad_sizes_say_how_to_write_them(text: str) -> None:
    with pytest.raises(UsageError):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(1536) == "1.5 KiB" and format_size(3 << 30) == "3.0 GiB" and format_size(12) == "12 B"
