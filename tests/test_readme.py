"""The README's two commands stay true: CI runs the test one verbatim; the demo one works."""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bash_blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Two commands on a fresh machine", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_readme_gives_exactly_two_commands_and_ci_runs_the_test_one() -> None:
    blocks = _bash_blocks()
    assert len(blocks) == 2 and all("\n" not in b for b in blocks)
    demo, tests = blocks
    assert "pairclean demo" in demo and "pytest" in tests
    ci_lines = [ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert ci_lines[-1] == tests  # the last thing CI does is the README's test command


def test_bundled_sample_matches_its_generator(tmp_path: Path) -> None:
    pytest.importorskip("skimage")
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    import make_demo_sample

    fresh = make_demo_sample.build(tmp_path / "fresh.tar")

    def members(path: Path) -> dict[str, bytes]:
        with tarfile.open(path) as tar:
            return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]

    shipped, rebuilt = members(make_demo_sample.SAMPLE), members(fresh)
    assert sorted(shipped) == sorted(rebuilt)
    # captions and licences exactly; JPEG bytes may differ across libjpeg builds
    for name in shipped:
        if not name.endswith(".jpg"):
            assert shipped[name] == rebuilt[name], name
