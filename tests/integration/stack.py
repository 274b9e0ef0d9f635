"""A real Switchboard for tests: nats-server plus `switchboard serve` as a child process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import msgspec
import nats

from shared import subjects
from shared.messages import EngineInfo, MetricsSnapshot, Ping, encode
from switchboard.natsd import EmbeddedNats, die_with_parent
from tests.conftest import write_config

READY_PREFIX = "Switchboard ready on "


class Stack:
    def __init__(self, config_path: Path, nats_url: str):
        self.config_path = config_path
        self.nats_url = nats_url
        cfg = json.loads(config_path.read_text())["ServerConfig"]
        scheme = "https" if cfg.get("httpsEnabled") else "http"
        self.url = f"{scheme}://127.0.0.1:{cfg['port']}"
        self.mgmt_url = f"{scheme}://127.0.0.1:{cfg.get('managementPort', cfg['port'])}"
        self.metrics_url = f"{scheme}://127.0.0.1:{cfg.get('metricsPort', 1027)}"
        self.model = json.loads(config_path.read_text())["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelName"]
        self.proc: subprocess.Popen | None = None
        self.output: list[str] = []
        self.new_line = threading.Condition()

    def start(self, timeout: float = 180.0) -> "Stack":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "switchboard.cli", "serve", "--config", str(self.config_path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=die_with_parent,  # a killed test run leaves no server behind
        )
        # Always read the server's output: a full pipe would block every service that logs.
        self.reader = threading.Thread(target=self._read_output, daemon=True)
        self.reader.start()
        self.wait_for_line(READY_PREFIX, timeout)
        return self

    def _read_output(self) -> None:
        for line in self.proc.stdout:
            with self.new_line:
                self.output.append(line.rstrip())
                self.new_line.notify_all()
        with self.new_line:
            self.new_line.notify_all()

    def wait_for_line(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        seen = 0
        with self.new_line:
            while time.monotonic() < deadline:
                for line in self.output[seen:]:
                    if line.startswith(prefix):
                        return line
                seen = len(self.output)
                if not self.reader.is_alive():
                    break
                self.new_line.wait(0.5)
        raise RuntimeError(f"no line {prefix!r} (exit {self.proc.poll()}):\n" + "\n".join(self.output[-40:]))

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def drain_output(self) -> list[str]:
        """Everything the exited launcher printed (waits for the reader to reach the end)."""
        self.reader.join(10)
        return list(self.output)

    async def engine_info(self) -> EngineInfo:
        return await self._request(subjects.engine_health(self.model), EngineInfo)

    async def metrics(self) -> MetricsSnapshot:
        return await self._request(subjects.METRICS_SNAPSHOT, MetricsSnapshot)

    async def _request(self, subject: str, kind):
        nc = await nats.connect(self.nats_url)
        try:
            reply = await nc.request(subject, encode(Ping()), timeout=5)
            return msgspec.msgpack.decode(reply.data, type=kind)
        finally:
            await nc.close()

    async def wait_engine_idle(self, timeout: float = 10.0) -> EngineInfo:
        """Poll until no request runs or waits and every KV block is back in the pool."""
        deadline = time.monotonic() + timeout
        while True:
            info = await self.engine_info()
            if (info.running == 0 and info.waiting == 0 and info.free_blocks == info.total_blocks) \
                    or time.monotonic() > deadline:
                return info
            await asyncio.sleep(0.1)


@contextmanager
def running_stack(folder: Path, model_dir: Path, **sections) -> Iterator[Stack]:
    """A stack on a nats-server of its own, its config.json written into ``folder``; stopped on exit."""
    nats_server = EmbeddedNats()
    url = nats_server.start()
    sections["Switchboard"] = {"natsUrl": url, **sections.get("Switchboard", {})}
    stack = Stack(write_config(folder, model_dir, **sections), url)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()
        nats_server.stop()


def sse_events(body: str) -> list[dict]:
    """The JSON payloads of ``data: `` events, checking MindIE/TGI framing (a space after the colon)."""
    events = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), f"bad SSE framing: {block!r}"
        events.append(json.loads(block[len("data: "):]))
    return events


def post(stack: Stack, path: str, body, timeout: float = 60, **kw):
    """POST a JSON body (or raw bytes/str) to the business listener."""
    import httpx

    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(stack.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=timeout, **kw)
