"""The job log wrapper (``pairclean_service.joblog``): a job's log is bounded, keeps its
end, and the wrapper exits as the job did."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pairclean_service.joblog import wrap

CHATTY = ("import sys\n"
          "for i in range(20000): print(f'warning {i}: a decoder had something to say', flush=i % 997 == 0)\n"
          "sys.stderr.write('error: the last words\\n'); sys.exit(3)\n")


def test_a_chatty_job_log_is_bounded_and_keeps_its_end(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_bytes(b"an earlier attempt's line\n")
    done = subprocess.run(wrap([sys.executable, "-c", CHATTY], str(log), 8192), timeout=120)
    assert done.returncode == 3  # the job's own exit code
    text = log.read_text()
    assert text.startswith("an earlier attempt's line\nwarning 0:")  # appended, never rewritten
    assert len(text.encode()) < 8192 + 256 * 1024 + 1024  # unbounded: about 900 kB
    assert "reached its limit of 8192 bytes" in text and "bytes of the job's output left out" in text
    assert text.rstrip().endswith("error: the last words")
    tail = text.split("bytes follow]\n", 1)[1]
    assert tail.startswith("warning ") and "warning 19999:" in tail  # from a whole line, to the end


def test_a_quiet_job_log_is_copied_whole(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    done = subprocess.run(wrap([sys.executable, "-c", "print('one'); print('two')"], str(log), 8192), timeout=60)
    assert done.returncode == 0 and log.read_text() == "one\ntwo\n"


def test_a_job_ended_by_a_signal_to_its_group_ends_the_same_way(tmp_path: Path) -> None:
    """The runner ends a job with SIGTERM to its process group: the job gets it, the wrapper
    copies its last words and dies of the same signal (the runner reads the exit status)."""
    log = tmp_path / "job.log"
    job = ("import signal, sys, time\n"
           "def bye(*_): print('stopping on SIGTERM', flush=True); sys.exit(143)\n"
           "signal.signal(signal.SIGTERM, bye); print('ready', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen(wrap([sys.executable, "-c", job], str(log), 8192), start_new_session=True)
    deadline = time.monotonic() + 30
    while "ready" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert log.read_text() == "ready\nstopping on SIGTERM\n"
    killed = subprocess.Popen(wrap([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                                   str(tmp_path / "k.log"), 8192), start_new_session=True)
    while "up" not in ((tmp_path / "k.log").read_text() if (tmp_path / "k.log").exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGTERM)  # the job has no handler: killed by the signal
    assert killed.wait(timeout=30) == -signal.SIGTERM


@pytest.mark.slow
def test_the_service_bounds_a_job_log_and_keeps_its_state(live_server_cls, make_shards, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A job run by the service goes through the wrapper: its log stops at the operator's
    ``max_log_bytes`` and the job's end (its state and closing line) is still there. The
    job is made chatty by a ``sitecustomize`` that prints 20,000 lines (540 kB) as it starts."""
    from pairclean_service.client import PaircleanClient

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "if 'pairclean_workers.cli' in sys.orig_argv and 'pairclean_service.joblog' not in sys.orig_argv:\n"
        "    for i in range(20000): print(f'chatty library line {i}')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    shards = make_shards(n_shards=3, per_shard=4, folder=tmp_path / "shards")
    with live_server_cls(tmp_path, max_log_bytes=4096) as server:
        client = PaircleanClient(server.url, server.key)
        job = client.submit([str(s) for s in shards], str(tmp_path / "out"), estimator="pairclean-tiny-test")
        assert client.wait(job, timeout=300, poll=0.3)["state"] == "SUCCEEDED"
        logs = client.get_job_logs(job)
    assert logs.startswith("chatty library line 0\n") and "reached its limit of 4096 bytes" in logs
    assert "chatty library line 1000\n" not in logs  # past the limit and before the tail: left out
    assert "SUCCEEDED: 3 shards scored" in logs.split("bytes follow]")[1]
    assert len(logs.encode()) < 4096 + 256 * 1024 + 1024
