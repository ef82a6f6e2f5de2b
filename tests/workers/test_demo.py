"""The README's demo: the bundled sample, the default estimator, the swapped captions found."""

from __future__ import annotations

import re
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
    first = capsys.readouterr().out
    assert "flagged noisy: 4/4 swapped pairs, 0 of the clean ones" in first
    # The summary is filled in (its histogram and pairs once came out empty): the bins
    # count all 10 pairs and the pairs are listed by key.
    bins = re.findall(r"^  \[\d\.\d, \d\.\d\)\s+(\d+)", first.split("weight histogram:")[1], flags=re.M)
    assert len(bins) == 10 and sum(map(int, bins)) == 10
    assert all(key in first.split("first pairs:")[1] for key in swapped)
    # it ends by saying how to see the pairs with their images: the service's page of the demo job
    assert "pairclean serve --demo" in first.splitlines()[-1] and "/ui/demo" in first.splitlines()[-1]
    # a second run resumes: nothing is rescored
    assert main(["demo", "--out", str(out), "--no-progress", "--executor", "local"]) == 0
    assert "1 already done" in capsys.readouterr().out
