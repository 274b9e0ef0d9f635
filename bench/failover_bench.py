"""Failover benchmark: from an engine's death to the next token on the replica.

    .venv/bin/python bench/failover_bench.py [--kills 5] [--streams 8] [--tokens 200] [--lease 2.0] [--model tiny|smol]

Services run as separate processes on a real nats-server (as containers run them): metrics, two
tokenizers, two engines, a gateway. Each round starts ``--streams`` greedy TGI streams; once every
stream has 10 tokens, one engine is SIGKILLed by its pid. For each stream that was on it (its next
token came more than 0.3 s after the kill), the time from the kill to that next token is one sample;
the killed engine is then started again for the next round. Prints p50 and max over all samples,
and checks every stream against an uninterrupted run (exact tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from switchboard.natsd import EmbeddedNats, free_port, wait_for_port  # noqa: E402
from switchboard.runner import READY_LINE  # noqa: E402

INTERRUPTED_S = 0.3


def config(folder: Path, model: Path, nats_url: str, lease: float) -> tuple[Path, str, str]:
    cfg = json.loads((ROOT / "config" / "config.json").read_text())
    server = cfg["ServerConfig"]
    server["port"], server["managementPort"], server["metricsPort"] = free_port(), free_port(), free_port()
    cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = str(model)
    cfg["Switchboard"].update(natsUrl=nats_url, leaseSeconds=lease, kvCacheMemoryMb=256, torchThreads=1)
    path = folder / "config.json"
    path.write_text(json.dumps(cfg))
    return path, f"http://127.0.0.1:{server['port']}", f"http://127.0.0.1:{server['managementPort']}"


def spawn(name: str, cfg: Path, nats_url: str, folder: Path) -> subprocess.Popen:
    log = open(folder / f"{name}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "switchboard.cli", name.split("-")[0], "--config", str(cfg),
                             "--nats", nats_url], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_ready(mgmt: str, timeout: float = 180) -> None:
    """The gateway is ready (an engine and a tokenizer heard)."""
    deadline = time.monotonic() + timeout
    wait_for_port("127.0.0.1", int(mgmt.rsplit(":", 1)[1]), timeout)
    while True:
        try:
            if httpx.get(mgmt + "/v2/health/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the services never became ready")
        time.sleep(0.2)


def wait_started(log: Path, times: int, timeout: float = 180) -> None:
    """Until the service writing ``log`` has announced itself ready ``times`` times (once per start)."""
    deadline = time.monotonic() + timeout
    while log.read_text(errors="replace").count(READY_LINE) < times:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{log.name}: not ready after {timeout} s")
        time.sleep(0.2)


async def stream(base: str, i: int, tokens: int, times: list[float], ids: list[int]) -> None:
    body = {"inputs": f"Request number {i}: the history of", "parameters": {"max_new_tokens": tokens}}
    async with httpx.AsyncClient(timeout=300) as client:
        async with client.stream("POST", base + "/generate_stream", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"stream {i}: {event}")
                    ids.append(event["token"]["id"])
                    times.append(time.monotonic())


async def run_round(base: str, streams: int, tokens: int, kill=None) -> tuple[list[list[int]], list[float]]:
    times = [[] for _ in range(streams)]
    ids = [[] for _ in range(streams)]
    tasks = [asyncio.create_task(stream(base, i, tokens, times[i], ids[i])) for i in range(streams)]
    samples = []
    if kill is not None:
        while min(len(t) for t in times) < 10:
            await asyncio.sleep(0.005)
        killed_at = await asyncio.to_thread(kill)
        await asyncio.gather(*tasks)
        for t in times:
            after = [x for x in t if x > killed_at]
            if after and after[0] - killed_at > INTERRUPTED_S:
                samples.append(after[0] - killed_at)
    await asyncio.gather(*tasks)
    return ids, samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument("--model", default=str(ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sb-failover-") as tmp, EmbeddedNats() as nats_url:
        folder = Path(tmp)
        cfg, base, mgmt = config(folder, Path(args.model), nats_url, args.lease)
        names = ["metrics", "tokenizer-0", "tokenizer-1", "engine-0", "engine-1", "gateway"]
        procs = {name: spawn(name, cfg, nats_url, folder) for name in names}
        try:
            wait_ready(mgmt)
            time.sleep(2 * args.lease)  # every tokenizer has heard both engines
            expected, _ = asyncio.run(run_round(base, args.streams, args.tokens))
            samples, exact = [], 0
            starts = {"engine-0": 1, "engine-1": 1}
            for round_no in range(args.kills):
                victim = f"engine-{round_no % 2}"

                def kill() -> float:
                    os.kill(procs[victim].pid, signal.SIGKILL)
                    return time.monotonic()

                ids, got = asyncio.run(run_round(base, args.streams, args.tokens, kill))
                exact += ids == expected
                samples += got
                print(f"round {round_no + 1}: killed {victim}; {len(got)} streams resumed, time to next token "
                      f"{', '.join(f'{s:.2f}' for s in got)} s; exact: {ids == expected}", flush=True)
                procs[victim].wait()
                procs[victim] = spawn(victim, cfg, nats_url, folder)
                starts[victim] += 1
                wait_started(folder / f"{victim}.log", starts[victim])
                time.sleep(2 * args.lease)  # heard by every tokenizer and the gateway
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(20)
    if samples:
        print(f"\nlease {args.lease} s, {len(samples)} resumed streams over {args.kills} kills: time from the kill to "
              f"the next token p50 {statistics.median(samples):.2f} s, max {max(samples):.2f} s; "
              f"{exact}/{args.kills} rounds token-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
