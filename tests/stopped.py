"""Stopping a test's peer process for real: ``SIGSTOP`` only signals, and a thread running on another core may
still answer a request or two before it stops."""

from __future__ import annotations

import os
import signal
import time


def stop_process(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP, and wait until every thread of the process is stopped (state T), not only signalled."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that just ended
                pass
        if all(state in "tT" for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: thread states {states}"
        time.sleep(0.001)
