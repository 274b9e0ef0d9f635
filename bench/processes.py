"""Child servers for the benchmarks: start, wait until ready, and always stop them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
SERVER_START_TIMEOUT_S = 900.0
STOP_GRACE_S = 20.0


class Blocked(Exception):
    """A system could not be benchmarked; the message says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:]) or "(no output)"


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL the whole process group after a grace period."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers in its group; the leader was started as one
    except ProcessLookupError:
        pass
    proc.wait()


@contextmanager
def server(name: str, cmd: list[str], log: Path, ready: Callable[[], bool], cwd: Path | None = None,
           env: dict[str, str] | None = None, start_timeout: float | None = None) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` (output to ``log``), wait until ``ready()`` (at most ``start_timeout`` seconds,
    SERVER_START_TIMEOUT_S by default), yield its process, and always stop it afterwards."""
    limit = start_timeout or SERVER_START_TIMEOUT_S
    print(f"[{name}] starting: {' '.join(cmd)}  (log: {log})", flush=True)
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **OFFLINE_ENV, **(env or {})}, cwd=cwd, start_new_session=True)
    try:
        while not ready():
            if proc.poll() is not None:
                raise Blocked(f"{name} exited with code {proc.returncode} before it was ready:\n{log_tail(log)}")
            if time.monotonic() - started > limit:
                raise Blocked(f"{name} not ready after {limit:.0f}s:\n{log_tail(log)}")
            time.sleep(0.5)
        print(f"[{name}] ready after {time.monotonic() - started:.1f}s", flush=True)
        yield proc
    finally:
        stop(proc)
        print(f"[{name}] stopped", flush=True)


def tree_cpu_seconds(root: int) -> dict[int, float]:
    """CPU seconds (user + system, all threads) of ``root`` and of every process below it, found by parent
    or by session (``server`` starts each command as a session leader); Linux /proc only."""
    stats: dict[int, tuple[int, int, int]] = {}  # pid: (parent, session, clock ticks)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # exited meanwhile
                continue
            stats[int(entry.name)] = (int(fields[1]), int(fields[3]), int(fields[11]) + int(fields[12]))
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    tree, todo = set(), [root, *(pid for pid, (_, session, _) in stats.items() if session == root)]
    while todo:
        pid = todo.pop()
        if pid in stats and pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    tick = os.sysconf("SC_CLK_TCK")
    return {pid: stats[pid][2] / tick for pid in tree}


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def run_main(main: Callable[[], int]) -> None:
    """A benchmark's entry point: its exit code; Ctrl-C exits 130 (servers are stopped by ``server()``)."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted; servers stopped", file=sys.stderr)
        sys.exit(130)
