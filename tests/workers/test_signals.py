"""Stopping a batch verb on a signal (workers/signals.py): the first raises, a second while
stopping leaves the clean-up (the lock's release) alone, a third quits at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest


def test_a_second_signal_while_stopping_does_not_cut_the_clean_up_short(capsys) -> None:
    from pairclean_workers import signals

    # as in a terminal (a shell's background job, CI's included, starts with SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    cleaned = []
    with pytest.raises(KeyboardInterrupt):
        with signals.stop_signals():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            finally:
                os.kill(os.getpid(), signal.SIGINT)  # pressed again during the clean-up
                time.sleep(0.1)
                cleaned.append(True)
    assert cleaned == [True]
    assert "signal again to quit at once" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    signal.signal(signal.SIGINT, before)


def test_a_signal_the_process_ignores_stays_ignored() -> None:
    from pairclean_workers import signals

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with signals.stop_signals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # nothing raised
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_third_signal_quits_at_once() -> None:
    script = (
        "import os, signal, time\n"
        "from pairclean_workers import signals\n"
        "with signals.stop_signals():\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGTERM); time.sleep(2)\n"
        "    except KeyboardInterrupt:\n"
        "        os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n"
        "        os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
        "        print('not reached')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143 and "not reached" not in done.stdout
