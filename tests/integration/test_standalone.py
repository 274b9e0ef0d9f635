"""Services started one by one, as containers run them; a missing engine is a fast 503."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from switchboard.natsd import EmbeddedNats, die_with_parent, wait_for_port
from tests.conftest import write_config


def start(name: str, config, url: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "switchboard.cli", name, "--config", str(config), "--nats", url],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=die_with_parent)


def test_gateway_without_an_engine_answers_503_fast(tmp_path, tiny_model_dir):
    config = write_config(tmp_path, tiny_model_dir)
    import json

    server = json.loads(config.read_text())["ServerConfig"]
    with EmbeddedNats() as url:
        procs = [start("tokenizer", config, url), start("gateway", config, url)]
        try:
            wait_for_port("127.0.0.1", server["port"], 60)
            wait_for_port("127.0.0.1", server["managementPort"], 60)
            base, mgmt = f"http://127.0.0.1:{server['port']}", f"http://127.0.0.1:{server['managementPort']}"
            assert httpx.get(mgmt + "/v2/health/live").status_code == 200
            assert httpx.get(mgmt + "/v2/health/ready", timeout=10).status_code == 503
            assert httpx.get(mgmt + "/health", timeout=10).status_code == 503
            started = time.monotonic()
            r = httpx.post(base + "/generate", json={"inputs": "hello"}, timeout=30)
            assert time.monotonic() - started < 3
            assert r.status_code == 503
            assert r.json()["error_type"] == "unavailable" and "engine" in r.json()["error"]
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                assert proc.wait(15) == 0, proc.stderr.read().decode()


def test_two_tokenizers_in_a_queue_group_serve_concurrent_requests(tmp_path, tiny_model_dir):
    import json
    from concurrent.futures import ThreadPoolExecutor

    config = write_config(tmp_path, tiny_model_dir)
    server = json.loads(config.read_text())["ServerConfig"]
    with EmbeddedNats() as url:
        procs = [start(name, config, url) for name in ("tokenizer", "tokenizer", "engine", "metrics", "gateway")]
        try:
            base, mgmt = f"http://127.0.0.1:{server['port']}", f"http://127.0.0.1:{server['managementPort']}"
            wait_for_port("127.0.0.1", server["managementPort"], 60)
            deadline = time.monotonic() + 60
            while httpx.get(mgmt + "/v2/health/ready", timeout=10).status_code != 200:
                assert time.monotonic() < deadline, "stack never became ready"
                time.sleep(0.2)

            def generate(i: int) -> httpx.Response:
                return httpx.post(base + "/generate", json={"inputs": f"request {i}", "parameters": {
                    "max_new_tokens": 8, "details": True}}, timeout=60)

            with ThreadPoolExecutor(8) as pool:
                responses = list(pool.map(generate, range(16)))
            assert [r.status_code for r in responses] == [200] * 16
            assert all(r.json()["details"]["generated_tokens"] >= 1 for r in responses)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                assert proc.wait(15) == 0, proc.stderr.read().decode()
