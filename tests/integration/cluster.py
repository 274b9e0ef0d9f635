"""Services as separate processes on one real nats-server, as containers run them, each killable by its pid."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import nats

from shared import subjects
from shared.messages import EngineInfo, decoder
from shared.metrics_messages import MetricsEvent, PrefixPulled, Routed
from switchboard.natsd import EmbeddedNats, die_with_parent, wait_for_port
from switchboard.runner import READY_LINE
from tests.conftest import write_config


class Cluster:
    def __init__(self, folder: Path, model_dir: Path, engines: int = 2, tokenizers: int = 2,
                 args: dict[str, list[str]] | None = None, nats_max_payload: int | None = None, **sections):
        self.nats = EmbeddedNats(max_payload=nats_max_payload) if nats_max_payload else EmbeddedNats()
        self.url = self.nats.start()
        sections["Switchboard"] = {"natsUrl": self.url, "kvCacheMemoryMb": 64, **sections.get("Switchboard", {})}
        self.config = write_config(folder, model_dir, **sections)
        server = json.loads(self.config.read_text())["ServerConfig"]
        self.base = f"http://127.0.0.1:{server['port']}"
        self.mgmt = f"http://127.0.0.1:{server['managementPort']}"
        self.logs = folder
        self.args = args or {}  # extra command-line arguments per process name ("engine-0": ["--role", "prefill"])
        self.procs: dict[str, subprocess.Popen] = {}
        for name in ["metrics", *[f"tokenizer-{i}" for i in range(tokenizers)],
                     *[f"engine-{i}" for i in range(engines)], "gateway"]:
            self.start(name)

    def start(self, name: str) -> subprocess.Popen:
        service = name.split("-")[0]
        log = open(self.logs / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "switchboard.cli", service, "--config", str(self.config), "--nats", self.url,
             *self.args.get(name, [])],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        return self.procs[name]

    def wait_ready(self, timeout: float = 120.0) -> "Cluster":
        wait_for_port("127.0.0.1", int(self.mgmt.rsplit(":", 1)[1]), timeout)
        deadline = time.monotonic() + timeout
        while httpx.get(self.mgmt + "/v2/health/ready", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, f"not ready after {timeout} s:\n{self.log_tails()}"
            time.sleep(0.2)
        return self

    def wait_started(self, name: str, times: int, timeout: float = 120.0) -> None:
        """Until ``name`` has announced itself ready ``times`` times (once per start), plus a lease so that
        every other instance has heard its heartbeat."""
        deadline = time.monotonic() + timeout
        while (self.logs / f"{name}.log").read_text(errors="replace").count(READY_LINE) < times:
            assert time.monotonic() < deadline, f"{name} not started after {timeout} s:\n{self.log_tails()}"
            time.sleep(0.1)
        time.sleep(2.5)

    def kill(self, name: str) -> None:
        """SIGKILL, by the process's own pid: no goodbye, no drain."""
        proc = self.procs[name]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def restart_nats(self, down_s: float = 0.5) -> None:
        """Stop the real nats-server and start a new one on the same port."""
        self.nats.stop()
        time.sleep(down_s)
        self.nats.start()

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for path in sorted(self.logs.glob("*.log")):
            out.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.nats.stop()


class FleetListener:
    """Routed and PrefixPulled events and the engines' heartbeats, heard on the cluster's nats-server."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.routed: list[Routed] = []
        self.pulled: list[PrefixPulled] = []
        self.engines: dict[str, EngineInfo] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> None:
        self.nc = await nats.connect(self.url, max_reconnect_attempts=-1)
        events, beats = decoder(MetricsEvent), decoder(EngineInfo)

        async def on_event(msg):
            event = events.decode(msg.data)
            if isinstance(event, Routed):
                self.routed.append(event)
            elif isinstance(event, PrefixPulled):
                self.pulled.append(event)

        async def on_beat(msg):
            info = beats.decode(msg.data)
            self.engines[info.instance] = info

        await self.nc.subscribe(subjects.METRICS_EVENTS, cb=on_event)
        await self.nc.subscribe(subjects.engine_heartbeat(self.model), cb=on_beat)

    def prefix_counters(self) -> tuple[int, int]:
        """Prompt tokens found in the engines' prefix caches and prompt tokens looked up, all engines heard."""
        engines = list(self.engines.values())
        return (sum(e.prefix_hit_tokens_total for e in engines), sum(e.prefix_queried_tokens_total for e in engines))

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.nc.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
