from __future__ import annotations

import pytest

from engine.config import EngineConfig, parse_size
from engine.errors import Edge0Error


@pytest.mark.parametrize(
    "text, expected",
    [
        ("400K", 400 * 1024),
        ("512M", 512 * 1024**2),
        ("2G", 2 * 1024**3),
        ("1.5GiB", int(1.5 * 1024**3)),
        ("3GB", 3 * 1000**3),
        ("1000", 1000),
        (" 64 mib ", 64 * 1024**2),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "12X", "-3M", "1.2.3G"])
def test_bad_sizes_are_explained(text):
    with pytest.raises(Edge0Error, match="cannot read size"):
        parse_size(text)


def test_bad_mode_is_refused():
    with pytest.raises(Edge0Error, match="resident, on-demand"):
        EngineConfig(mode="fast")
