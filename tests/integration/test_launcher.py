"""`switchboard serve`: readiness line, merged planes, clean stop, config errors, dead services."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx

from tests.conftest import free_port, write_config
from tests.integration.stack import READY_PREFIX, Stack


def processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(["ps", "-ewwo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if text in line and "ps -ewwo" not in line]


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def serve(config_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "switchboard.cli", "serve", "--config", str(config_path)],
                          capture_output=True, text=True, timeout=120)


def test_serve_merged_planes_then_sigterm_leaves_nothing_behind(tmp_path, tiny_model_dir):
    path = write_config(tmp_path, tiny_model_dir)
    data = json.loads(path.read_text())
    data["ServerConfig"]["managementPort"] = data["ServerConfig"]["port"]  # one listener for both planes
    path.write_text(json.dumps(data))
    stack = Stack(path, nats_url="")
    try:
        check_merged_stack_then_stop(stack, path)
    finally:
        stack.stop()


def check_merged_stack_then_stop(stack: Stack, path) -> None:
    stack.start()
    assert any(line.startswith(READY_PREFIX + stack.url) for line in stack.output)
    assert httpx.get(stack.url + "/v2/health/ready").status_code == 200
    r = httpx.post(stack.url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}}, timeout=60)
    assert r.status_code == 200
    assert len(processes_mentioning(str(path))) == 5  # launcher + 4 services
    children = child_pids(stack.proc.pid)
    assert len(children) == 5  # embedded nats-server + 4 services
    (nats_pid,) = [pid for pid in children if "nats-server" in open(f"/proc/{pid}/cmdline", "rb").read().decode()]
    os.kill(nats_pid, 9)  # the embedded nats-server dies: it is started again, and the services reconnect
    stack.wait_for_line("switchboard: the embedded nats-server exited with code -9; starting it again", 10)
    # A request sent at once may be lost with the dead connection: it is asked again once the bus is back,
    # well before the tokenizer's 30 s start timeout.
    deadline = time.monotonic() + 15
    while (r := httpx.post(stack.url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}},
                           timeout=60)).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)
    children = child_pids(stack.proc.pid)
    started = time.monotonic()
    assert stack.stop() == 0
    assert time.monotonic() - started < 10
    time.sleep(0.5)
    assert processes_mentioning(str(path)) == []
    assert [pid for pid in children if os.path.exists(f"/proc/{pid}")] == []


def test_bad_config_names_the_key_and_range(tmp_path, tiny_model_dir):
    path = write_config(tmp_path, tiny_model_dir, ServerConfig={"port": 80})
    result = serve(path)
    assert result.returncode == 2
    assert "ServerConfig.port" in result.stderr and "[1024, 65535]" in result.stderr


def test_a_port_in_use_is_named_before_anything_starts(tmp_path, tiny_model_dir):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = serve(write_config(tmp_path, tiny_model_dir, ServerConfig={"metricsPort": port}))
    assert result.returncode == 2 and time.monotonic() - started < 30, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.endswith(f": ServerConfig.metricsPort: cannot listen on 127.0.0.1:{port}: Address already in use"), line


def test_missing_model_folder_is_reported(tmp_path):
    path = write_config(tmp_path, tmp_path / "no-such-model")
    result = serve(path)
    assert result.returncode == 2
    assert "modelWeightPath" in result.stderr and "does not exist" in result.stderr


def test_a_dying_service_is_reported_with_its_last_error(tmp_path, tiny_model_dir):
    model = tmp_path / "gpt2-like"
    model.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.update({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    (model / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):  # a whole folder: it starts
        (model / name).write_bytes((tiny_model_dir / name).read_bytes())
    result = serve(write_config(tmp_path, model))
    assert result.returncode == 2  # a start-up error: one line naming it, no traceback
    assert "switchboard engine: ModelConfig.modelWeightPath: unsupported model architecture" in result.stderr
    assert "LlamaForCausalLM" in result.stderr and "Traceback" not in result.stderr


def test_sigterm_while_nats_is_down_stops_everything_at_once(tmp_path, tiny_model_dir):
    """``Switchboard.natsUrl`` names a NATS that is not there: the services keep trying to reach it, and a SIGTERM
    still stops them all at once (~2 s; not after the launcher's 10 s grace and SIGKILL), with no
    traceback or "exception was never retrieved" in the output, and the retries' errors are not logged each."""
    path = write_config(tmp_path, tiny_model_dir, Switchboard={"natsUrl": f"nats://127.0.0.1:{free_port()}"})
    proc = subprocess.Popen([sys.executable, "-m", "switchboard.cli", "serve", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(  # the services are past their imports, in their retries
                any(f'"service": "switchboard-{name}", "msg": "nats error"' in line for line in list(lines))
                for name in ("gateway", "tokenizer", "engine", "metrics")):
            time.sleep(0.2)
        assert len(processes_mentioning(str(path))) == 5  # launcher + 4 services
        started = time.monotonic()
        proc.terminate()
        proc.wait(30)
        reader.join(10)
        output = "".join(lines)
        assert proc.returncode == 0
        assert time.monotonic() - started < 8, output[-3000:]  # (2 s alone; a busy 2-core machine is slower)
    finally:
        proc.kill()
    assert "Traceback" not in output and "never retrieved" not in output, output[-3000:]
    assert processes_mentioning(str(path)) == []
    # each connection says once that NATS is not there (then every 30 s), not at each retry (every 0.5 s)
    assert 1 <= output.count('"msg": "nats error"') <= 8, output[-3000:]
    assert output.count("nothing answers at Switchboard.natsUrl") == 1, output[-3000:]  # the launcher's one line


def broken_copy(tmp_path, tiny_model_dir, name: str, content: bytes):
    """The tiny model's folder with file ``name`` replaced by ``content``."""
    model = tmp_path / "broken"
    model.mkdir()
    for file in tiny_model_dir.iterdir():
        (model / file.name).write_bytes(content if file.name == name else file.read_bytes())
    return model


def test_broken_model_files_are_named_before_anything_starts(tmp_path, tiny_model_dir):
    """A tokenizer.json that is not JSON, weights cut short, weights that are not safetensors: exit 2 with one
    line naming the file (they were tracebacks from the services, exit 1, naming no file)."""
    weights = (tiny_model_dir / "model.safetensors").read_bytes()
    for name, content, needle in (("tokenizer.json", b'{"version": "1.0", "model": {', "is not valid JSON"),
                                  ("model.safetensors", weights[: len(weights) // 2], "is cut short"),
                                  ("model.safetensors", bytes(range(256)) * 4, "is not a safetensors file")):
        case = tmp_path / f"{name}-{needle[:6]}"
        case.mkdir()
        result = serve(write_config(case, broken_copy(case, tiny_model_dir, name, content)))
        assert result.returncode == 2 and f"{name}: {needle}" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr


def test_settings_a_service_cannot_run_with_stop_the_start_in_one_line(tmp_path, tiny_model_dir):
    """Found by a service as it starts (fp8 on cpu; a chat template that does not compile): exit 2 with the
    service's one line, no traceback (they were 35-line tracebacks and exit 1)."""
    path = write_config(tmp_path, tiny_model_dir, Switchboard={"kvCacheDtype": "fp8_e4m3"})
    result = serve(path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert 'switchboard engine: Switchboard.kvCacheDtype "fp8_e4m3" runs on cuda only' in result.stderr
    assert "Traceback" not in result.stderr
    case = tmp_path / "template"
    case.mkdir()
    model = broken_copy(case, tiny_model_dir, "chat_template.jinja", b"{% for m in messages %}{{ m.content ")
    result = serve(write_config(case, model))
    assert result.returncode == 2 and "the chat template" in result.stderr and "does not compile" in result.stderr, \
        result.stderr[-2000:]
    # (a K/V cache smaller than one sequence is the same one-line exit: tests/unit/test_pool_check.py)


def test_requests_still_running_when_the_grace_ends_get_their_familys_503(tmp_path, tiny_model_dir):
    """SIGTERM with Switchboard.shutdownGraceSeconds 2 and answers far longer than that: the whole answer gets a
    503 in TGI's shape, the stream its error as the last event (uvicorn's cancellation answered a plain-text 500
    and cut streams bare)."""
    import asyncio
    import signal

    from tests.integration.stack import running_stack, sse_events

    long = {"inputs": "My name is", "parameters": {"max_new_tokens": 4000, "do_sample": False}}
    sections = {"Switchboard": {"shutdownGraceSeconds": 2},
                "BackendConfig.ModelDeployConfig": {"maxSeqLen": 8192, "maxInputTokenLen": 64},
                "BackendConfig.ScheduleConfig": {"maxIterTimes": 8000}}

    async def both(url: str, stop) -> tuple[httpx.Response, str]:
        async with httpx.AsyncClient(timeout=60) as client:
            whole = asyncio.create_task(client.post(url + "/generate", json=long))
            async with client.stream("POST", url + "/generate_stream", json=long) as streamed:
                assert streamed.status_code == 200
                chunks = streamed.aiter_text()
                text = await chunks.__anext__()  # the stream has begun
                stop()
                text += "".join([chunk async for chunk in chunks])
            return await whole, text

    with running_stack(tmp_path, tiny_model_dir, **sections) as stack:
        started = time.monotonic()
        whole, streamed = asyncio.run(both(stack.url, lambda: stack.proc.send_signal(signal.SIGTERM)))
        assert 1.0 < time.monotonic() - started < 15
        assert whole.status_code == 503, whole.text
        assert "shutdownGraceSeconds" in whole.json()["error"], whole.text
        last = sse_events(streamed)[-1]
        assert "shutdownGraceSeconds" in last["error"], last
        assert stack.proc.wait(30) == 0
