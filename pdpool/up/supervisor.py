"""Children of ``pdpool up``: each one's output prefixed with its name, its state, restarts with backoff.

States: ``starting`` (launched, not answering HTTP yet), ``loading`` (``/health/ready`` 503), ``ready``,
``restarting`` (exited or failed; relaunched after a backoff, as a Deployment's CrashLoopBackOff would:
1 s doubling to 30 s, back to 1 s once it stayed ready a minute), ``stopping``, ``stopped``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO

from pdpool.node_process import NodeProcess
from pdpool.up.pool import ProcessSpec

BACKOFF_START, BACKOFF_MAX, BACKOFF_RESET_AFTER = 1.0, 30.0, 60.0
NAME_WIDTH = 10


class Output:
    """Whole lines to stdout, each prefixed ``name | ``, from any thread."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stdout
        self.lock = threading.Lock()

    def line(self, name: str, text: str) -> None:
        with self.lock:
            self.stream.write(f"{name:<{NAME_WIDTH}}| {text}\n")
            self.stream.flush()

    def pump(self, name: str, pipe: IO[bytes]) -> threading.Thread:
        """Copy ``pipe`` line by line until EOF, on a daemon thread."""
        def run() -> None:
            with contextlib.suppress(ValueError, OSError):
                for raw in iter(pipe.readline, b""):
                    self.line(name, raw.decode(errors="replace").rstrip("\n"))
            with contextlib.suppress(OSError):
                pipe.close()

        thread = threading.Thread(target=run, name=f"pdpool-up-{name}", daemon=True)
        thread.start()
        return thread


class Child:
    def __init__(self, spec: ProcessSpec, env: dict[str, str], out: Output) -> None:
        self.spec = spec
        self.env = env
        self.out = out
        self.node = NodeProcess(spec.name, port=spec.port, host=spec.host)
        self._group_killed: int | None = None
        self.state = "pending"
        self.restarts = 0
        self.backoff = BACKOFF_START
        self.restart_at = 0.0
        self.ready_since: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.node.proc.pid if self.node.proc is not None else None

    def start(self) -> None:
        self.node.launch(self.spec.argv, self.env, stdout=subprocess.PIPE)
        self.out.pump(self.name, self.node.proc.stdout)
        self.state = "starting"

    def poll(self, now: float) -> bool:
        """Advance the state machine; True when the state changed."""
        before = self.state
        if self.state == "restarting":
            if now >= self.restart_at:
                self.start()
        elif self.state in ("starting", "loading", "ready"):
            if not self.node.alive:
                self._crashed(now, f"exited with code {self.node.proc.returncode}")
            else:
                readiness, error = self.node.readiness()
                if readiness == "failed":
                    self._kill_group()
                    self._crashed(now, f"failed to start: {error}")
                elif readiness == "ready":
                    self.state = "ready"
                    self.ready_since = self.ready_since or now
                    if now - self.ready_since >= BACKOFF_RESET_AFTER:
                        self.backoff = BACKOFF_START
                else:
                    self.state = "starting" if readiness == "down" else "loading"
                    self.ready_since = None
        return self.state != before

    def _crashed(self, now: float, why: str) -> None:
        self._kill_group()  # whatever it started goes with it
        self.restarts += 1
        self.state = "restarting"
        self.ready_since = None
        self.restart_at = now + self.backoff
        self.out.line("up", f"{self.name} {why}; restarting in {self.backoff:g}s (restart {self.restarts})")
        self.backoff = min(self.backoff * 2, BACKOFF_MAX)

    def terminate(self) -> None:
        """SIGTERM: a node drains and deregisters, a router finishes what is in flight."""
        self.state = "stopping"
        self.node.signal(signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> None:
        """Wait for the exit until ``deadline`` (monotonic), then SIGKILL its whole process group."""
        proc = self.node.proc
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.out.line("up", f"{self.name} did not stop in time; killing it")
        self._kill_group()
        self.state = "stopped"

    def kill_now(self) -> None:
        """SIGKILL its process group without waiting (safe in a signal handler)."""
        if self.node.proc is not None and self._group_killed != self.node.proc.pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.node.proc.pid, signal.SIGKILL)

    def _kill_group(self) -> None:
        proc = self.node.proc
        if proc is None or self._group_killed == proc.pid:  # once per launch: a reaped pid may be reused later
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session (start_new_session): the child and its helpers
        proc.wait()
        self._group_killed = proc.pid
