"""pairclean's process-wide CPU settings (``pairclean.embed.cpu_settings``): malloc keeps large
blocks, and the CLI's torch runs with OpenMP's passive wait policy. Each case runs in a
fresh interpreter, since both settings are per process and read once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc and libgomp: Linux only")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "PAIRCLEAN_CPU_TUNING")}
    return subprocess.run([sys.executable, "-c", code], env={**full, **env}, capture_output=True, text=True, timeout=300, check=True)


# Allocates, touches and frees a 96 MiB tensor - what a CNN's stem does every batch - ten
# times to reach a steady state (torch's 64-byte-aligned blocks do not fit exactly into a
# freed one at first), then ten times more, and reports the minor page faults of those.
_FAULTS = """
import json, resource, torch
from pairclean.embed.cpu_settings import keep_heap_memory
tuned = keep_heap_memory() if TUNE else False
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(24 << 20).fill_(1.0)
start = faults()
for _ in range(10):
    torch.empty(24 << 20).fill_(1.0)
print(json.dumps({"tuned": tuned, "faults": faults() - start}))
"""


def test_large_blocks_are_reused_instead_of_faulted_in_each_time() -> None:
    pages = (96 << 20) // 4096
    plain = json.loads(_python(_FAULTS.replace("TUNE", "False")).stdout)
    tuned = json.loads(_python(_FAULTS.replace("TUNE", "True")).stdout)
    assert tuned["tuned"] is True and plain["tuned"] is False
    assert plain["faults"] > 8 * pages  # glibc maps and zero-fills a fresh block every time
    assert tuned["faults"] < pages // 4  # reused from the heap, not faulted in again


def test_tuning_can_be_turned_off() -> None:
    out = _python("from pairclean.embed.cpu_settings import keep_heap_memory, process_env; print(keep_heap_memory(), process_env())",
                  PAIRCLEAN_CPU_TUNING="0")
    assert out.stdout.split() == ["False", "{}"]


def _cli_then_torch(**env: str) -> str:
    """Run the CLI's entry (``score --help`` exits before any model work), then import torch
    in the same process; libgomp prints the wait policy it read (OMP_DISPLAY_ENV)."""
    code = (
        "from pairclean_workers.cli import main\n"
        "try:\n    main(['score', '--help'])\nexcept SystemExit:\n    pass\n"
        "import torch\ntorch.ones(4).sum()\n"
    )
    return _python(code, OMP_DISPLAY_ENV="TRUE", **env).stderr


def test_the_cli_sets_the_passive_openmp_wait_policy_before_torch_loads() -> None:
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in _cli_then_torch()
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in _cli_then_torch(OMP_WAIT_POLICY="ACTIVE")  # the user's value wins


def test_the_wait_policy_is_not_touched_once_torch_is_loaded() -> None:
    code = "import os, torch\nfrom pairclean.embed.cpu_settings import apply_process_env\nprint(apply_process_env(), os.environ.get('OMP_WAIT_POLICY'))"
    assert _python(code).stdout.split() == ["False", "None"]
