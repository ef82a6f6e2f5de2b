"""The README's demo: the bundled sample, the default estimator, the swapped captions found."""

from __future__ import annotations

from pathlib import Path

import pytest

from pairclean_workers.cli import _demo_truth, main

pytestmark = pytest.mark.slow


def test_demo_flags_exactly_the_swapped_captions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--no-progress", "--executor", "local"]) == 0
    swapped, flagged = _demo_truth(str(out))
    assert len(swapped) == 4
    assert flagged == swapped
    assert "flagged noisy: 4/4 swapped pairs, 0 of the clean ones" in capsys.readouterr().out
    # a second run resumes: nothing is rescored
    assert main(["demo", "--out", str(out), "--no-progress", "--executor", "local"]) == 0
    assert "1 already done" in capsys.readouterr().out
