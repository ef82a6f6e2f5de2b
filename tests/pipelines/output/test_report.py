"""`pairclean inspect`'s text: what a terminal prints must not be driven by a shard's keys."""

from __future__ import annotations

from pairclean.output.report import _row


def test_control_characters_in_keys_are_printed_escaped() -> None:
    row = {"key": "esc\x1b[2J\x1b[31mRED\r", "status": "ok", "similarity": 0.25, "weight": 0.5, "noisy": False}
    line = _row(row)
    assert "\x1b" not in line and "\r" not in line and "esc\\x1b[2J\\x1b[31mRED\\r" in line
    assert "dir/ключ é" in _row(row | {"key": "dir/ключ é"})  # printable text is left alone
