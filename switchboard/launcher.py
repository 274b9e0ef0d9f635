"""``switchboard serve``: embedded NATS plus the four services as supervised child processes.

``modelInstanceNumber`` engines and ``tokenizerProcessNumber`` tokenizers (``replicas.py``: names, each
engine's threads or device); the ready line waits for every child, and stopping stops them all.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import Config
from switchboard.natsd import EmbeddedNats, die_with_parent
from switchboard.replicas import Replica, replicas
from switchboard.runner import READY_LINE

READY_TIMEOUT_S = 900.0
STOP_GRACE_S = 10.0


@dataclass
class Child:
    name: str
    proc: asyncio.subprocess.Process
    last_lines: deque = field(default_factory=lambda: deque(maxlen=20))
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def last_error(self) -> str:
        return "\n".join(self.last_lines) or "(no output)"


async def spawn(replica: Replica, config_path: Path, nats_url: str) -> Child:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "switchboard.cli", replica.service, "--config", str(config_path), "--nats", nats_url,
        "--name", replica.name, *replica.flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, preexec_fn=die_with_parent,
    )
    child = Child(replica.name, proc)
    asyncio.create_task(_pump(child, proc.stdout, sys.stdout))
    asyncio.create_task(_pump(child, proc.stderr, sys.stderr))
    return child


async def _pump(child: Child, stream: asyncio.StreamReader, echo) -> None:
    async for raw in stream:
        line = raw.decode(errors="replace").rstrip()
        if line == READY_LINE:
            child.ready.set()
            continue
        child.last_lines.append(line)
        print(line, file=echo, flush=True)


async def launch(config_path: Path, cfg: Config) -> int:
    """Run every child until a stop (SIGTERM, SIGINT, /stopService) or a death; the exit code."""
    plan = replicas(cfg)  # before anything starts: a ConfigError here is the caller's exit 2
    nats = None if cfg.switchboard.nats_url else EmbeddedNats(store_dir=Path(cfg.switchboard.jetstream_dir))
    url = cfg.switchboard.nats_url or nats.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    children: list[Child] = []
    try:
        for replica in plan:
            children.append(await spawn(replica, config_path, url))
        return await _run(children, cfg, stop)
    finally:
        await shutdown(children)
        if nats:
            nats.stop()


async def _run(children: list[Child], cfg: Config, stop: asyncio.Event) -> int:
    started = time.monotonic()
    died = await _until_ready(children, stop)
    if died:
        return _report_death(died)
    if stop.is_set():
        return 0
    print(f"Switchboard ready on {business_url(cfg)} (management {management_url(cfg)}, "
          f"model {cfg.model.model_name}, {time.monotonic() - started:.1f}s)", flush=True)
    died = await _first_death_or_stop(children, stop)
    if died and died.proc.returncode == 0:  # services leave on their own only after GET /stopService
        print("switchboard: stopped by /stopService", flush=True)
        return 0
    return _report_death(died) if died else 0


async def _until_ready(children: list[Child], stop: asyncio.Event) -> Child | None:
    all_ready = asyncio.ensure_future(_all_ready(children))
    try:
        done = await _first_of([all_ready, asyncio.ensure_future(stop.wait())], children, READY_TIMEOUT_S)
    finally:
        all_ready.cancel()
    if isinstance(done, Child):
        return done
    if done is None:
        stop.set()
        print(f"switchboard: services not ready after {READY_TIMEOUT_S:.0f}s", file=sys.stderr)
    return None


async def _all_ready(children: list[Child]) -> None:
    for child in children:  # (a task, not a gather: a gather cancelled here logged "exception never retrieved")
        await child.ready.wait()


async def _first_death_or_stop(children: list[Child], stop: asyncio.Event) -> Child | None:
    done = await _first_of([asyncio.ensure_future(stop.wait())], children, None)
    return done if isinstance(done, Child) else None


async def _first_of(waiters: list[asyncio.Future], children: list[Child], timeout: float | None):
    """The child that exited first, True when a waiter finished first, None on timeout."""
    exits = {asyncio.ensure_future(c.proc.wait()): c for c in children}
    done, pending = await asyncio.wait([*waiters, *exits], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    for task in done:
        if task in exits:
            await asyncio.sleep(0.2)  # let the pumps read its last words
            return exits[task]
    return True if done else None


def _report_death(child: Child) -> int:
    if child.proc.returncode == 2 and child.last_lines:  # a start-up error: its one line names the key or file
        print(child.last_lines[-1], file=sys.stderr, flush=True)
        return 2
    print(f"switchboard: the {child.name} service exited with code {child.proc.returncode}; "
          f"its last output:\n{child.last_error()}", file=sys.stderr, flush=True)
    return 1


async def shutdown(children: list[Child]) -> None:
    """SIGTERM every child (gateway first), then SIGKILL what is still running after the grace."""
    for child in reversed(children):
        if child.proc.returncode is None:
            child.proc.terminate()
    waits = [asyncio.ensure_future(c.proc.wait()) for c in children]
    _, late = await asyncio.wait(waits, timeout=STOP_GRACE_S)
    if late:
        for child in children:
            if child.proc.returncode is None:
                child.proc.kill()
        await asyncio.gather(*late)


def business_url(cfg: Config) -> str:
    return f"{_scheme(cfg)}://{_host(cfg.server.ip_address)}:{cfg.server.port}"


def management_url(cfg: Config) -> str:
    return f"{_scheme(cfg)}://{_host(cfg.server.management_ip)}:{cfg.server.management_listen_port}"


def _scheme(cfg: Config) -> str:
    return "https" if cfg.server.https_enabled else "http"


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
