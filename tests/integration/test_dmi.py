"""MindIE's PD split as its coordinator drives it (reference §3.9–§3.12, §3.33), with real processes on a
real nats-server: a prefill server (gateway "P", inferMode "dmi") and a decode server (gateway "D", its own
config.json and ports) over one deployment of two engines on logical devices 0 and 1, which take the roles
of the servers whose role assignments name their devices: engine-0 prefills, engine-1 decodes.

The test acts as the coordinator: it assigns the roles, reads D's ``GET /dresult``, sends requests to P
with the ``req-id``/``d-target``/``req-type`` headers, and checks every frame kind (``data:``,
``lastData:``, ``retry:``, ``error:``, ``ka:heartbeat``, ``close:``) and each header and role error."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time

import httpx
import pytest

from tests.conftest import write_config
from tests.integration.cluster import Cluster
from tests.integration.test_pd import TOKENS, co_located, engine_infos, pd_body

DMI = {"inferMode": "dmi"}
MODEL = "SmolLM2-135M-Instruct"


def role(device: int, peer_device: int) -> dict:
    """A coordinator's role body: this server runs on logical device ``device``, its peer on ``peer_device``."""
    return {"local": {"server_ip": "127.0.0.1", "device": [{"device_ip": "10.0.0.1", "device_logical_id": str(device)}]},
            "peers": [{"server_ip": "127.0.0.1",
                       "device": [{"device_ip": "10.0.0.2", "device_logical_id": str(peer_device)}]}]}


ROLE_P, ROLE_D = role(0, 1), role(1, 0)  # engine-0 runs on device 0 (the prefill server's), engine-1 on 1


class Frames:
    """A coordinator's ``GET /dresult`` connection, read on a thread into (req_id, kind, body) items."""

    def __init__(self, base: str):
        self.items: queue.Queue = queue.Queue()
        self.status: int | None = None
        self.thread = threading.Thread(target=self._read, args=(base,), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while self.status is None:
            assert time.monotonic() < deadline, "no answer from /dresult"
            time.sleep(0.02)

    def _read(self, base: str) -> None:
        try:
            self._frames(base)
        except httpx.HTTPError:  # the server went away (a killed gateway, the cluster stopping)
            pass
        self.items.put((None, "ended", b""))

    def _frames(self, base: str) -> None:
        with httpx.stream("GET", base + "/dresult", timeout=httpx.Timeout(120, read=30)) as r:
            self.status = r.status_code
            buffer, req_id = b"", None
            for data in r.iter_bytes():
                buffer += data
                *parts, buffer = buffer.split(b"\0")
                for part in parts:
                    if part == b"ka:heartbeat":
                        self.items.put((None, "ka", b""))
                    elif part.startswith(b"reqId:"):
                        req_id = part[len(b"reqId:"):].decode()
                    elif part and req_id is not None:  # an empty part: a body's own trailing NUL (vLLM's framing)
                        kind, _, body = part.partition(b":")
                        self.items.put((req_id, kind.decode(), body))

    def next(self, timeout: float = 60) -> tuple[str | None, str, bytes]:
        return self.items.get(timeout=timeout)

    def until_last(self, req_id: str, timeout: float = 60) -> list[tuple[str, bytes]]:
        """This request's frames up to its last (lastData, error or retry); keep-alives skipped."""
        out, deadline = [], time.monotonic() + timeout
        while True:
            rid, kind, body = self.next(max(0.1, deadline - time.monotonic()))
            if rid == req_id:
                out.append((kind, body))
                if kind in ("lastData", "error", "retry"):
                    return out


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("dmi")
    c = Cluster(folder, tiny_model_dir, engines=2, tokenizers=1, ServerConfig=DMI,
                args={"engine-0": ["--device-index", "0"], "engine-1": ["--device-index", "1"]})
    try:
        (folder / "d").mkdir()
        d_config = write_config(folder / "d", tiny_model_dir, ServerConfig=DMI, Switchboard={"natsUrl": c.url})
        server = json.loads(d_config.read_text())["ServerConfig"]
        c.d_base = f"http://127.0.0.1:{server['port']}"
        c.d_mgmt = f"http://127.0.0.1:{server['managementPort']}"
        c.d_target = f"127.0.0.1;{server['port']}"
        c.args["gateway-d"] = ["--config", str(d_config)]
        c.start("gateway-d")
        c.wait_ready()
        c.wait_started("engine-0", 1)
        c.wait_started("engine-1", 1)
        c.wait_started("gateway-d", 1)
        yield c
    finally:
        c.stop()


def headers(pd, req_id: str, **extra) -> dict[str, str]:
    return {"req-id": req_id, "d-target": pd.d_target, "req-type": "prefill", **extra}


def status(mgmt: str, version: str = "v1") -> dict:
    return httpx.get(f"{mgmt}/{version}/status", timeout=10).json()


def wait_status(mgmt: str, want: str, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while (s := status(mgmt))["service"]["roleStatus"] != want:
        assert time.monotonic() < deadline, s
        time.sleep(0.2)
    return s


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data:"):]) for line in text.splitlines()
            if line.startswith("data:") and line[len("data:"):].strip() != "[DONE]"]


def test_roles_go_unknown_switching_ready_with_real_peers(pd):
    assert status(pd.mgmt)["service"] == {"roleStatus": "RoleUnknown", "currentRole": "none"}
    r = httpx.post(pd.base + "/generate", json=pd_body(0, False), headers=headers(pd, "a1"))
    assert r.status_code == 503 and r.json()["error_type"] == "Service Unavailable", r.text
    assert httpx.post(pd.mgmt + "/v1/role/prefill", json=ROLE_P).json() == {"result": "ok"}
    assert status(pd.mgmt)["service"] == {"roleStatus": "RoleSwitching", "currentRole": "none"}  # no D heard yet
    assert status(pd.mgmt, "v2")["linkStatus"] == {"peers": [{"target": "127.0.0.1", "link": "linking"}]}
    for path in ("/health", "/v2/health/ready"):
        r = httpx.get(pd.mgmt + path)
        assert r.status_code == 500 and r.json() == {"message": "DMI connection is unhealthy"}
    assert httpx.get(pd.mgmt + "/v2/health/live").status_code == 200  # liveness is the process's
    r = httpx.get(pd.d_base + "/dresult")
    assert r.status_code == 400 and r.json()["error"] == "Only the Decode node supports dresult but you send to none"
    assert httpx.post(pd.d_mgmt + "/v1/role/decode", json=ROLE_D).json() == {"result": "ok"}
    assert wait_status(pd.mgmt, "RoleReady")["service"]["currentRole"] == "prefill"
    assert httpx.get(pd.mgmt + "/v2/health/ready").status_code == 200
    d = wait_status(pd.d_mgmt, "RoleReady")
    assert d["service"]["currentRole"] == "decode" and d["peers"] == ["127.0.0.1"]
    assert "peers" not in status(pd.mgmt)  # only a decode server lists the prefill servers it is linked to
    assert status(pd.d_mgmt, "v2")["linkStatus"] == {"peers": [{"target": "127.0.0.1", "link": "ok"}]}
    # the engines on each server's devices took its role, and each server reports those engines
    infos = asyncio.run(engine_infos(pd.url, MODEL))
    assert {r: i.device_index for r, i in infos.items()} == {"prefill": 0, "decode": 1}, infos
    p_engines = status(pd.mgmt, "v2")["resource"]["dpInstMap"]
    d_engines = status(pd.d_mgmt, "v2")["resource"]["dpInstMap"]
    assert len(p_engines) == len(d_engines) == 1 and set(p_engines) != set(d_engines)
    assert httpx.get(pd.d_mgmt + "/metrics-json").status_code == 200


@pytest.mark.parametrize("hdrs, status_code, message", [
    ({"req-id": "a1", "d-target": "127.0.0.1"}, 400, "DMI request must have req-type, req-id, d-target headers"),
    ({"req-id": "a" * 1025, "d-target": "127.0.0.1", "req-type": "prefill"}, 400,
     "The length of req-id cannot exceed 1024"),
    ({"req-id": "xyz", "d-target": "127.0.0.1", "req-type": "prefill"}, 400, "Invalid req-id, the character of req-id"),
    ({"req-id": "a1", "d-target": "127.0.0.1", "req-type": "decode"}, 400,
     "Parameter req-type must be prefill but got decode"),
    ({"req-id": "a1", "d-target": "localhost", "req-type": "prefill"}, 400, "Parameter d-target must be an IPv4 address"),
    ({"req-id": "a1", "d-target": "127.0.0.1", "req-type": "prefill", "is-recompute": "yes"}, 400,
     "Parameter is-recompute is an optional parameter. When it is set, it must be true or false."),
    ({"req-id": "a1", "d-target": "127.0.0.2", "req-type": "prefill"}, 503, "No decode server is linked at d-target"),
])
def test_header_errors_give_the_references_status_and_message(pd, hdrs, status_code, message):
    wait_status(pd.mgmt, "RoleReady")
    r = httpx.post(pd.base + "/generate", json=pd_body(0, False), headers=hdrs, timeout=30)
    assert r.status_code == status_code and r.json()["error"].startswith(message), r.text
    assert r.json()["error_type"] == ("Bad Request" if status_code == 400 else "Service Unavailable")


def test_role_and_parameter_refusals(pd):
    r = httpx.post(pd.d_base + "/generate", json=pd_body(0, False), headers=headers(pd, "a2"), timeout=30)
    assert r.status_code == 400
    assert r.json()["error"] == "DMI inference requests can be sent only to the prefill node, but this node is decode"
    assert httpx.get(pd.base + "/dresult").json()["error"] == "Only the Decode node supports dresult but you send to prefill"
    stop = {"inputs": "hi", "parameters": {"stop": ["a"], "max_new_tokens": 4}}
    r = httpx.post(pd.base + "/generate", json=stop, headers=headers(pd, "a3"), timeout=30)
    assert r.status_code == 422 and "stop is not supported in dmi mode" in r.json()["error"], r.text
    r = httpx.post(pd.base + "/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 2, "max_tokens": 4},
                   headers=headers(pd, "a4"), timeout=30)
    assert r.status_code == 400 and "n must be 1 in dmi mode" in r.text, r.text


def test_a_req_id_in_flight_is_refused_and_free_again_once_it_ends(pd):
    """req-id is "a globally unique request id": a second request with the id of one still under way here is a 400
    (it would take the first one's frames), and the id is free again once its last frame went out."""
    frames = Frames(pd.d_base)
    long = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 400, "do_sample": False}}
    r = httpx.post(pd.base + "/generate_stream", json=long, headers=headers(pd, "e1"), timeout=60)
    assert r.status_code == 200 and r.json()["isLastResp"] is False, r.text
    again = httpx.post(pd.base + "/generate", json=pd_body(0, False), headers=headers(pd, "e1"), timeout=30)
    assert again.status_code == 400 and "req-id e1 is already in flight" in again.json()["error"], again.text
    assert frames.until_last("e1")[-1][0] == "lastData"
    r = httpx.post(pd.base + "/generate", json=pd_body(0, False), headers=headers(pd, "e1"), timeout=60)
    assert r.status_code == 200 and frames.until_last("e1")[-1][0] == "lastData", r.text


def test_tgi_stream_through_dresult_equals_a_co_located_run(pd, tiny_model_dir):
    frames = Frames(pd.d_base)
    assert frames.status == 200
    expected = co_located(tiny_model_dir, seeded=True)
    for i in range(2):
        req_id = f"{i + 1:x}f00d"
        r = httpx.post(pd.base + "/generate_stream", json=pd_body(i, True), headers=headers(pd, req_id), timeout=60)
        first = r.json()
        assert r.status_code == 200 and first["reqId"] == req_id and first["isStream"] is True, r.text
        assert first["isLastResp"] is False
        got = frames.until_last(req_id)
        kinds = [kind for kind, _ in got]
        assert kinds[-1] == "lastData" and set(kinds[:-1]) == {"data"}, kinds
        events = sse_events(first["output"]) + [e for _, body in got for e in sse_events(body.decode())]
        assert [e["token"]["id"] for e in events] == expected[i]
        assert events[-1]["generated_text"] is not None and all(e["generated_text"] is None for e in events[:-1])
    infos = asyncio.run(engine_infos(pd.url, MODEL))
    assert infos["decode"].prompt_tokens_total == 0 and infos["decode"].generation_tokens_total > 0, infos


def test_whole_bodies_come_as_last_data_in_every_family(pd):
    frames = Frames(pd.d_base)
    prompt = pd_body(0, False)["inputs"]
    cases = [
        ("/generate", pd_body(0, False), lambda b: b["generated_text"]),
        ("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0},
         lambda b: b["choices"][0]["text"]),
        ("/infer", {"inputs": prompt, "stream": False, "parameters": {"max_new_tokens": TOKENS}},
         lambda b: b["generated_text"]),
    ]
    texts = []
    for n, (path, body, text_of) in enumerate(cases):
        req_id = f"b0{n}"
        r = httpx.post(pd.base + path, json=body, headers=headers(pd, req_id), timeout=60)
        assert r.status_code == 200 and r.json() == {"reqId": req_id, "isStream": False}, r.text
        [(kind, last)] = frames.until_last(req_id)
        assert kind == "lastData"
        texts.append(text_of(json.loads(last)))
    assert len(set(texts)) == 1 and texts[0]


def test_openai_stream_ends_with_done_and_short_requests_answer_at_once(pd):
    frames = Frames(pd.d_base)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": True,
            "stop": ["zzzz"]}  # stop words pass on the OpenAI routes
    r = httpx.post(pd.base + "/v1/chat/completions", json=body, headers=headers(pd, "c1"), timeout=60)
    assert r.status_code == 200 and r.json()["isLastResp"] is False, r.text
    got = frames.until_last("c1")
    assert got[-1][0] == "lastData" and got[-1][1].endswith(b"data: [DONE]\n\n")
    one = {"inputs": "hi", "parameters": {"max_new_tokens": 1, "details": True}}
    r = httpx.post(pd.base + "/generate_stream", json=one, headers=headers(pd, "c2"), timeout=60)
    answer = r.json()
    assert answer["isLastResp"] is True and sse_events(answer["output"])[-1]["details"]["generated_tokens"] == 1


def test_keepalive_and_a_new_connection_closing_the_old(pd):
    old = Frames(pd.d_base)
    started = time.monotonic()
    assert old.next(timeout=10)[1] == "ka"  # nothing sent for over 5 s
    assert time.monotonic() - started > 4.5
    Frames(pd.d_base)
    rid, kind, body = old.next(timeout=10)
    assert (rid, kind) == ("0xffffffffffffffff", "close") and b"close the old one" in body
    assert old.next(timeout=10)[1] == "ended"


LONG = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 3000}}


def long_stream(pd, req_id: str) -> Frames:
    """A long stream sent to the prefill server, once its first relayed frame reached /dresult."""
    frames = Frames(pd.d_base)
    r = httpx.post(pd.base + "/generate_stream", json=LONG, headers=headers(pd, req_id), timeout=60)
    assert r.status_code == 200 and r.json()["isLastResp"] is False
    assert frames.next()[1] == "data"
    return frames


def test_a_dead_prefill_server_ends_in_retry_and_the_recompute_runs(pd):
    body = LONG
    frames = long_stream(pd, "d1")
    pd.kill("gateway")
    got = frames.until_last("d1", timeout=30)
    assert got[-1][0] == "retry" and json.loads(got[-1][1]) == body
    pd.start("gateway")
    pd.wait_started("gateway", 2)
    assert httpx.post(pd.mgmt + "/v1/role/prefill", json=ROLE_P).json() == {"result": "ok"}
    wait_status(pd.mgmt, "RoleReady")
    again = {**body, "parameters": {"max_new_tokens": 8}}
    r = httpx.post(pd.base + "/generate_stream", json=again, headers=headers(pd, "d1", **{"is-recompute": "true"}),
                   timeout=60)
    assert r.status_code == 200, r.text
    assert frames.until_last("d1")[-1][0] == "lastData"


def test_engines_dying_after_the_first_token_end_in_an_error_frame(pd):
    """Last: it leaves no engine."""
    frames = long_stream(pd, "e1")
    pd.kill("engine-0")
    pd.kill("engine-1")
    got = frames.until_last("e1", timeout=30)
    assert got[-1][0] == "error" and b"no engine is serving" in got[-1][1], got[-1]
