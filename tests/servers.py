"""Start and stop server processes in tests: each in its own session, stopped as a whole group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence

import psutil


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _is_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _log_tail(proc: subprocess.Popen, chars: int = 4000) -> str:
    proc.log.seek(0)
    return proc.log.read().decode(errors="replace")[-chars:]


def start_server(
    cmd: Sequence[str],
    ready: str | Callable[[], bool],
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    wait: bool = True,
    **popen_options,
) -> subprocess.Popen:
    """Starts `cmd` and returns once it is ready: `ready` is a URL that answers 200, or a predicate (for a
    server that speaks no HTTP); the output goes to `proc.log`. `popen_options` go to Popen (e.g. `user`).
    With `wait=False` it returns at once, and `until_ready` waits (the `timeout` counting from the start).

    A new session makes the process a group leader, so `stop_server` can end it together with any workers it
    forks. SIGINT and SIGTERM start at their defaults, as from a shell: an ignored signal is inherited through
    exec, and in the full test run something in this process ignores SIGINT (dagster dev, its webserver,
    daemon and code servers then all outlived Ctrl-C).
    """
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        list(cmd),
        env={**os.environ, **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_default_signals,
        **popen_options,
    )
    proc.log = log
    proc.ready, proc.timeout, proc.deadline = ready, timeout, time.monotonic() + timeout
    if wait:
        until_ready(proc)
    return proc


def until_ready(proc: subprocess.Popen) -> None:
    """Returns once a server from `start_server` is ready; stops it if it is not by its deadline."""
    ready = proc.ready
    is_ready = ready if callable(ready) else lambda: _is_up(ready)
    while not is_ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{_log_tail(proc)}")
        if time.monotonic() > proc.deadline:
            stop_server(proc)
            raise TimeoutError(f"{ready if isinstance(ready, str) else proc.args[0]} was not ready within "
                               f"{proc.timeout} s:\n{_log_tail(proc)}")
        time.sleep(0.2)


def group_processes(pgid: int) -> list[psutil.Process]:
    """Live members of a process group (zombies, which no signal can end, are left out)."""
    members = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(process)
        except (ProcessLookupError, psutil.Error):
            pass
    return members


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def stop_server(proc: subprocess.Popen, timeout: float = 10.0,
                first: signal.Signals = signal.SIGTERM) -> signal.Signals:
    """`first` (SIGTERM; SIGINT is Ctrl-C) to the whole process group, then SIGKILL to whatever is left after
    `timeout`; returns the signal that ended the group."""
    pgid = proc.pid  # start_new_session: the group id is the leader's pid
    ended_by = first
    for sig in (first, signal.SIGKILL):
        ended_by = sig
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_processes(pgid):
                break
            time.sleep(0.05)
        else:
            if sig != signal.SIGKILL:  # shown with a failing test's output: which process outlived the signal
                print(f"after {sig.name} for {timeout:.0f} s still running:",
                      [" ".join(p.cmdline()[:4]) for p in group_processes(pgid) if p.is_running()], flush=True)
            continue  # still running: escalate
        break
    proc.wait(timeout=timeout)
    return ended_by
