"""A local Ray started by ``pairclean score`` keeps Ray's token authentication without
printing Ray's "Token authentication is enabled" warning on every start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")


def test_local_ray_starts_with_token_auth_and_no_warning(tmp_path: Path) -> None:
    from pairclean_workers.cli import sample_shard

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    r = subprocess.run([sys.executable, "-m", "pairclean_service.cli", "score", sample_shard(), "--out", str(tmp_path / "out"),
                        "--model", "pairclean-tiny-test", "--executor", "ray", "--num-actors", "1", "--no-progress"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "Token authentication is" not in r.stderr, r.stderr
    assert (tmp_path / "out" / "demo-000000.parquet").exists()


def test_a_cluster_address_nothing_listens_on_is_one_line_not_a_hang(tmp_path: Path) -> None:
    """``ray.init("host:port")`` retried a wrong address without end (C++ warnings, no error)."""
    import socket

    from pairclean_workers.cli import sample_shard

    with socket.socket() as s:  # a port nothing listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, "-m", "pairclean_service.cli", "score", sample_shard(), "--out", str(tmp_path / "out"),
                        "--model", "pairclean-tiny-test", "--ray-address", f"127.0.0.1:{port}", "--no-progress"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1
    assert r.stderr == (f"error: cannot reach the Ray cluster at '127.0.0.1:{port}' (Connection refused); "
                        "check --ray-address or RAY_ADDRESS, or leave both unset for a local Ray\n")
