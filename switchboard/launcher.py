"""``switchboard serve``: embedded NATS plus the four services as supervised child processes.

``modelInstanceNumber`` engines and ``tokenizerProcessNumber`` tokenizers (``replicas.py``: names, each
engine's threads or device); the ready line waits for every child, and stopping stops them all.

Once ready, a child that dies (a crash, the kernel's OOM killer, a ``kill -9``) is started again, as an
orchestrator restarts a container: meanwhile the others serve on (a dead engine's or tokenizer's requests
resume on its peers; a new engine loads the fleet's adapters from them). A child that dies more than
``MAX_RESTARTS`` times within ``RESTART_WINDOW_S`` is crashing for a reason a restart does not mend. While a
peer of its service serves (a second engine or tokenizer), the deployment serves on and the child is started
again after a back-off (10 s, doubling to 5 min, as Kubernetes' CrashLoopBackOff); with none, as before it was
ready, the deployment stops with its last words.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from shared.config import Config
from switchboard.natsd import EmbeddedNats, die_with_parent
from switchboard.replicas import Replica, replicas
from switchboard.runner import FLEET_STOP_LINE, READY_LINE

READY_TIMEOUT_S = 900.0
STOP_GRACE_S = 10.0
MAX_RESTARTS, RESTART_WINDOW_S = 3, 120.0
BACKOFF_S, BACKOFF_MAX_S = 10.0, 300.0  # a crash-looping child with a serving peer: the waits before its restarts
NATS_POLL_S = 0.5
PUMP_DRAIN_S = 2.0
START_ERROR = re.compile(r"^switchboard [\w-]+: ")  # the line a service prints as it exits 2 (runner.py)


@dataclass
class Child:
    name: str
    proc: asyncio.subprocess.Process
    replica: Replica | None = None
    last_lines: deque = field(default_factory=lambda: deque(maxlen=20))
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    fleet_stop: bool = False  # it said it stops for /stopService (else an exit, even 0, is restarted)
    pumps: list = field(default_factory=list)  # the tasks reading its stdout and stderr
    backing_off: bool = False  # dead, its restart under way (after a back-off, for a crash loop)

    def last_error(self) -> str:
        return "\n".join(self.last_lines) or "(no output)"


async def spawn(replica: Replica, config_path: Path, nats_url: str) -> Child:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "switchboard.cli", replica.service, "--config", str(config_path), "--nats", nats_url,
        "--name", replica.name, *replica.flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, preexec_fn=die_with_parent,
    )
    child = Child(replica.name, proc, replica)
    child.pumps = [asyncio.create_task(_pump(child, proc.stdout, sys.stdout)),
                   asyncio.create_task(_pump(child, proc.stderr, sys.stderr))]
    return child


async def _pump(child: Child, stream: asyncio.StreamReader, echo) -> None:
    async for raw in stream:
        line = raw.decode(errors="replace").rstrip()
        if line == READY_LINE:
            child.ready.set()
            continue
        if line == FLEET_STOP_LINE:
            child.fleet_stop = True
            continue
        child.last_lines.append(line)
        if not START_ERROR.match(line):  # (a start-up error's one line is the launcher's to print, once)
            print(line, file=echo, flush=True)


async def launch(config_path: Path, cfg: Config) -> int:
    """Run every child until a stop (SIGTERM, SIGINT, /stopService) or a death; the exit code."""
    plan = replicas(cfg)  # before anything starts: a ConfigError here is the caller's exit 2
    nats = None if cfg.switchboard.nats_url else EmbeddedNats(store_dir=Path(cfg.switchboard.jetstream_dir))
    url = cfg.switchboard.nats_url or nats.start()
    if nats is None and not reachable(url):
        print(f"switchboard: nothing answers at Switchboard.natsUrl {url} yet; the services keep trying to reach it "
              "(Ctrl-C stops them)", file=sys.stderr, flush=True)
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:  # the first drains the gateway's requests, a second stops at once
        (force if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    children: list[Child] = []
    keeper = asyncio.create_task(_keep_nats(nats, stop)) if nats else None
    try:
        for replica in plan:
            children.append(await spawn(replica, config_path, url))
        code = await _run(children, cfg, stop, lambda replica: spawn(replica, config_path, url))
        return 1 if keeper is not None and keeper.done() and keeper.result() is False else code
    finally:
        if keeper:
            keeper.cancel()
        await shutdown(children, cfg.switchboard.shutdown_grace_seconds, force)
        if nats:
            nats.stop()


async def _keep_nats(nats: EmbeddedNats, stop: asyncio.Event) -> bool:
    """The embedded nats-server, started again when it dies (the services reconnect to it on their own); False
    when it kept dying (the deployment then stops)."""
    restarts: deque = deque()
    while not stop.is_set():
        await asyncio.sleep(NATS_POLL_S)
        if nats.proc is None or nats.proc.poll() is None:
            continue
        if not _may_restart(restarts):
            print(f"switchboard: the embedded nats-server exited with code {nats.proc.returncode} "
                  f"({MAX_RESTARTS} restarts within {RESTART_WINDOW_S:.0f}s did not mend it)", file=sys.stderr, flush=True)
            stop.set()
            return False
        print(f"switchboard: the embedded nats-server exited with code {nats.proc.returncode}; starting it again",
              file=sys.stderr, flush=True)
        try:
            await asyncio.to_thread(nats.run)
        except (OSError, RuntimeError, TimeoutError) as exc:
            print(f"switchboard: the embedded nats-server did not start again: {exc}", file=sys.stderr, flush=True)


async def _run(children: list[Child], cfg: Config, stop: asyncio.Event, respawn) -> int:
    """``respawn(replica)``: a new child for a dead one (``children`` is kept current, for the shutdown)."""
    started = time.monotonic()
    died = await _until_ready(children, stop)
    if died:
        return _report_death(died)
    if stop.is_set():
        return 0
    print(f"Switchboard ready on {business_url(cfg)} (management {management_url(cfg)}, "
          f"model {cfg.model.model_name}, {time.monotonic() - started:.1f}s)", flush=True)
    supervision = Supervision(children, stop, respawn)
    try:
        return await supervision.run()
    finally:
        supervision.cancel()


class Supervision:
    """Once ready: each death restarted, a crash loop backed off while a peer serves, else the deployment's end."""

    def __init__(self, children: list[Child], stop: asyncio.Event, respawn):
        self.children, self.stop, self.respawn = children, stop, respawn
        self.restarts: dict[str, deque] = {}
        self.backoffs: dict[str, float] = {}  # name -> its last back-off (while its deaths stay in the window)
        self.changed = asyncio.Event()  # a backed-off child was started again
        self.later: set[asyncio.Task] = set()

    async def run(self) -> int:
        while True:
            watched = [c for c in self.children if not c.backing_off]
            died = await _first_of([asyncio.ensure_future(self.stop.wait()), asyncio.ensure_future(self.changed.wait())],
                                   watched, None)
            if not isinstance(died, Child):
                if self.stop.is_set():
                    return 0
                self.changed.clear()
                continue
            if died.proc.returncode == 0 and died.fleet_stop:
                print("switchboard: stopped by /stopService", flush=True)
                return 0
            code = self.died(died)
            if code is not None:
                return code

    def died(self, died: Child) -> int | None:
        """Restart it now, or after a back-off; or the deployment's exit code."""
        if died.proc.returncode == 2:
            return _report_death(died, gave_up=True)
        if _may_restart(self.restarts.setdefault(died.name, deque())):
            self.backoffs.pop(died.name, None)
            # (exit 0: it was stopped alone, e.g. an operator's SIGTERM: it drained, and a restart brings it back)
            how = "stopped (exit 0)" if died.proc.returncode == 0 else f"exited with code {died.proc.returncode}"
            print(f"switchboard: the {died.name} service {how}; starting it again (the others serve on)",
                  file=sys.stderr, flush=True)
            self.restart_after(died, 0.0)
            return None
        if not self.peer_serves(died):
            return _report_death(died, gave_up=True)
        delay = self.backoffs[died.name] = min(2 * self.backoffs.get(died.name, BACKOFF_S / 2), BACKOFF_MAX_S)
        print(f"switchboard: the {died.name} service exited with code {died.proc.returncode} "
              f"({MAX_RESTARTS} restarts within {RESTART_WINDOW_S:.0f}s did not mend it); its peers serve on, "
              f"starting it again in {delay:.0f}s; its last output:\n{died.last_error()}", file=sys.stderr, flush=True)
        self.restart_after(died, delay)
        return None

    def peer_serves(self, died: Child) -> bool:
        service = died.replica.service if died.replica else died.name
        return any(c is not died and c.replica is not None and c.replica.service == service and not c.backing_off
                   and c.proc.returncode is None and c.ready.is_set() for c in self.children)

    def restart_after(self, died: Child, delay: float) -> None:
        died.backing_off = True
        task = asyncio.ensure_future(self._restart(died, delay))
        self.later.add(task)
        task.add_done_callback(self.later.discard)

    async def _restart(self, died: Child, delay: float) -> None:
        await asyncio.sleep(delay)
        child = await self.respawn(died.replica)
        self.children[self.children.index(died)] = child  # (the shutdown stops what ``children`` holds)
        self.changed.set()
        await _announce_back(child)

    def cancel(self) -> None:
        for task in self.later:
            task.cancel()


def _may_restart(times: deque) -> bool:
    """One more restart of a child whose earlier ones were at ``times`` (kept to the window)."""
    now = time.monotonic()
    while times and now - times[0] > RESTART_WINDOW_S:
        times.popleft()
    times.append(now)
    return len(times) <= MAX_RESTARTS


async def _announce_back(child: Child) -> None:
    await child.ready.wait()
    print(f"switchboard: {child.name} is serving again", file=sys.stderr, flush=True)


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


async def _first_of(waiters: list[asyncio.Future], children: list[Child], timeout: float | None):
    """The child that exited first, True when a waiter finished first, None on timeout."""
    exits = {asyncio.ensure_future(c.proc.wait()): c for c in children}
    done, pending = await asyncio.wait([*waiters, *exits], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    for task in done:
        if task in exits:
            child = exits[task]
            if child.pumps:  # let the pumps read its last words (to the end of its output, within a bound)
                await asyncio.wait(child.pumps, timeout=PUMP_DRAIN_S)
            return child
    return True if done else None


def _report_death(child: Child, gave_up: bool = False) -> int:
    if child.proc.returncode == 2 and child.last_lines:  # a start-up error: its one line names the key or file
        print(child.last_lines[-1], file=sys.stderr, flush=True)
        return 2
    again = f" ({MAX_RESTARTS} restarts within {RESTART_WINDOW_S:.0f}s did not mend it)" if gave_up else ""
    print(f"switchboard: the {child.name} service exited with code {child.proc.returncode}{again}; "
          f"its last output:\n{child.last_error()}", file=sys.stderr, flush=True)
    return 1


async def shutdown(children: list[Child], drain_s: float = 0.0, force: asyncio.Event | None = None) -> None:
    """Stop the gateway first, giving the requests it serves ``drain_s`` (the others serve them meanwhile;
    ``force`` cuts that short), then every other child: SIGTERM, then SIGKILL after the grace."""
    gateways = [c for c in children if c.replica is not None and c.replica.service == "gateway"]
    await _stop(gateways, drain_s + STOP_GRACE_S, force)
    await _stop([c for c in children if c not in gateways], STOP_GRACE_S, None)


async def _stop(children: list[Child], grace_s: float, force: asyncio.Event | None) -> None:
    for child in reversed(children):
        if child.proc.returncode is None:
            child.proc.terminate()
    waits = [asyncio.ensure_future(c.proc.wait()) for c in children]
    if not waits:
        return
    forced = asyncio.ensure_future(force.wait()) if force is not None else None
    all_done = asyncio.ensure_future(asyncio.wait(waits))
    await asyncio.wait([all_done, *([forced] if forced else [])], timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
    for task in (forced, all_done):
        if task is not None:
            task.cancel()
    late = [w for w in waits if not w.done()]
    if late:
        for child in children:
            if child.proc.returncode is None:
                child.proc.kill()
        await asyncio.gather(*late)


def reachable(url: str, timeout: float = 2.0) -> bool:
    """Whether a TCP connection to the NATS URL's host and port opens."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222), timeout=timeout):
            return True
    except OSError:
        return False


def business_url(cfg: Config) -> str:
    return f"{_scheme(cfg)}://{_host(cfg.server.ip_address)}:{cfg.server.port}"


def management_url(cfg: Config) -> str:
    return f"{_scheme(cfg)}://{_host(cfg.server.management_ip)}:{cfg.server.management_listen_port}"


def _scheme(cfg: Config) -> str:
    return "https" if cfg.server.https_enabled else "http"


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
