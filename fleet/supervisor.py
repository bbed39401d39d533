"""Runs the fleet's processes in the foreground: prefixed logs, restarts, ordered shutdown.

Each child gets its own process group (so Ctrl-C reaches only us and we stop children in
order) and is told by the kernel to die if we die (PR_SET_PDEATHSIG), so no process is
left behind even if the supervisor itself is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

_PR_SET_PDEATHSIG = 1
RESTART_BACKOFF_S = (1, 2, 5, 10, 30)


def die_with_parent() -> None:
    with contextlib.suppress(OSError):  # not Linux: ordered shutdown still applies
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Service:
    name: str
    argv: list[str]
    stop_timeout_s: float = 15.0
    env: dict[str, str] = field(default_factory=dict)  # on top of the supervisor's
    restart: bool = True
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0
    _log_thread: threading.Thread | None = field(default=None, repr=False)


class Supervisor:
    def __init__(self, env: dict[str, str], cwd: str, pass_fds: tuple[int, ...] = ()) -> None:
        self.env = env
        self.cwd = cwd
        self.pass_fds = pass_fds  # inherited by every child (the DATA_DIR lock)
        self.services: list[Service] = []
        self.stopping = threading.Event()
        self._print_lock = threading.Lock()
        self._retiring: list[threading.Thread] = []

    def say(self, line: str, name: str = "fleet") -> None:
        with self._print_lock:
            sys.stdout.write(f"{name:>8} | {line}\n")
            sys.stdout.flush()

    def start(self, service: Service) -> Service:
        if service not in self.services:
            self.services.append(service)
        service.proc = subprocess.Popen(
            service.argv,
            cwd=self.cwd,
            env=self.env | service.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
            pass_fds=self.pass_fds,
            text=True,
            errors="replace",
            bufsize=1,
        )
        service.started_at = time.monotonic()
        service._log_thread = threading.Thread(target=self._pump, args=(service,), daemon=True)
        service._log_thread.start()
        return service

    def _pump(self, service: Service) -> None:
        proc = service.proc
        assert proc is not None and proc.stdout is not None
        for line in proc.stdout:
            self.say(line.rstrip("\n"), service.name)

    def watch(self, poll_s: float = 0.5, tick=None) -> None:
        """Until stopped: restart any service that exits, with a growing back-off, and call
        ``tick()`` (the autoscaler) every round."""
        while not self.stopping.wait(poll_s):
            if tick is not None:
                tick()
            for service in self.services:
                if service.proc is None or service.proc.poll() is None:
                    continue
                if not service.restart:
                    continue
                now = time.monotonic()
                if service.next_start == 0.0:
                    if now - service.started_at > 60:
                        service.restarts = 0  # it ran a while: start again from a short delay
                    delay = RESTART_BACKOFF_S[min(service.restarts, len(RESTART_BACKOFF_S) - 1)]
                    self.say(
                        f"{service.name} exited ({service.proc.returncode}); restart in {delay}s"
                    )
                    service.next_start = now + delay
                elif now >= service.next_start:
                    service.restarts += 1
                    service.next_start = 0.0
                    self.start(service)

    def retire(self, service: Service) -> threading.Thread:
        """Stop one service for good (warm: SIGTERM first) without blocking the caller."""
        self.services.remove(service)
        thread = threading.Thread(target=self._stop, args=(service,), daemon=True)
        thread.start()
        self._retiring.append(thread)
        return thread

    def stop_all(self) -> None:
        """Stop services in reverse start order; each gets SIGTERM, then SIGKILL."""
        self.stopping.set()
        for service in reversed(self.services):
            self._stop(service)
        for thread in self._retiring:
            thread.join()

    def _stop(self, service: Service) -> None:
        proc = service.proc
        if proc is None:
            return
        if proc.poll() is None:
            self.say(f"stopping {service.name}")
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(service.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.say(f"{service.name} did not stop in {service.stop_timeout_s}s; killing it")
        _signal_group(proc, signal.SIGKILL)  # whatever of its group is left
        proc.wait()
        if service._log_thread is not None:
            service._log_thread.join(2)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
