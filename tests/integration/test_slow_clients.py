"""Slow clients: a request head or body that does not arrive in time gets 408 and a closed socket,
while other requests are served and answers (streams included) are never cut; connections beyond
maxConnections get 503 until some close (headerTimeoutSeconds, bodyTimeoutSeconds, maxConnections)."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.integration.stack import running_stack, sse_events

TIMEOUT_S = 1  # headerTimeoutSeconds and bodyTimeoutSeconds
ORIGIN = "http://localhost:3000"  # corsAllowOrigins
MAX_CONNECTIONS = 100
SLACK_S = 4  # how long past its deadline a slow socket may stay open
GOOD = {"inputs": "My name is", "parameters": {"max_new_tokens": 2, "do_sample": False}}
BODY = json.dumps(GOOD).encode()
HEAD = (b"POST /generate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(BODY))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    with running_stack(tmp_path_factory.mktemp("slow-clients"), tiny_model_dir,
                       Switchboard={"headerTimeoutSeconds": TIMEOUT_S, "bodyTimeoutSeconds": TIMEOUT_S,
                                    "maxConnections": MAX_CONNECTIONS,
                                    "corsAllowOrigins": [ORIGIN]}) as stack:  # (CORS shares this stack)
        yield stack


def connect(url: str, data: bytes = b"") -> socket.socket:
    address = urlsplit(url)
    sock = socket.create_connection((address.hostname, address.port), timeout=5)
    sock.sendall(data)
    return sock


def read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes; fails if it is still open at ``deadline``."""
    chunks = []
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return b"".join(chunks)
        except TimeoutError:
            raise AssertionError(f"still open past the deadline, got {b''.join(chunks)[:200]!r}") from None
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length, leaving a keep-alive connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head


def assert_timed_out(answer: bytes, phase: str) -> None:
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["error_type"] == "Request Timeout" and f"request {phase} was not received" in body["error"]


def test_half_requests_get_408_and_are_closed_while_others_are_served(stack):
    half_heads = [connect(stack.url, HEAD[: len(HEAD) // 2]) for _ in range(50)]
    half_bodies = [connect(stack.url, HEAD + BODY[: len(BODY) // 2]) for _ in range(20)]
    silent = connect(stack.url)
    kept_alive = connect(stack.url, HEAD + BODY)
    assert read_response(kept_alive).startswith(b"HTTP/1.1 200 ")
    kept_alive.sendall(HEAD[:20])  # a second request on the connection, begun and never finished
    opened = time.monotonic()
    try:
        r = httpx.post(stack.url + "/generate", json=GOOD, timeout=10)
        assert r.status_code == 200, r.text
        deadline = opened + TIMEOUT_S + SLACK_S
        for sock in [*half_heads, silent, kept_alive]:
            assert_timed_out(read_until_closed(sock, deadline), "head")
        for sock in half_bodies:
            assert_timed_out(read_until_closed(sock, deadline), "body")
    finally:
        for sock in [*half_heads, *half_bodies, silent, kept_alive]:
            sock.close()
    assert httpx.post(stack.url + "/generate", json=GOOD, timeout=10).status_code == 200


def test_a_body_that_never_comes_gets_its_408_in_the_routes_family_shape(stack):
    chat = json.dumps({"model": stack.model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    for path, body in [("/v1/chat/completions", chat), ("/v1/messages", chat)]:
        head = (b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                % (path.encode(), len(body)))
        sock = connect(stack.url, head + body[: len(body) // 2])
        try:
            answer = read_until_closed(sock, time.monotonic() + TIMEOUT_S + SLACK_S)
        finally:
            sock.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        error = json.loads(answer.partition(b"\r\n\r\n")[2])
        if path == "/v1/messages":
            assert error["type"] == "error" and "request body was not received" in error["error"]["message"]
        else:
            assert "request body was not received" in error["error"]["message"], error


def test_a_body_arriving_in_pieces_within_the_deadline_is_served(stack):
    sock = connect(stack.url, HEAD)
    try:
        for i in range(0, len(BODY), 8):
            time.sleep(TIMEOUT_S / 2 / (len(BODY) / 8))
            sock.sendall(BODY[i:i + 8])
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
    finally:
        sock.close()


def test_a_stream_longer_than_the_timeouts_is_not_cut(stack):
    """The client stops reading for twice the timeouts after the first event; the rest still arrives."""
    body = {"inputs": "My name is", "parameters": {"max_new_tokens": 500, "do_sample": False, "details": True}}
    with httpx.stream("POST", stack.url + "/generate_stream", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = r.iter_text()
        text = next(chunks)
        time.sleep(2 * TIMEOUT_S)
        text += "".join(chunks)
    events = sse_events(text)
    assert events[-1]["generated_text"] is not None, events[-1]
    assert len(events) == events[-1]["details"]["generated_tokens"] > 100


def test_connections_beyond_the_cap_get_503_until_some_close(stack):
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            held.append(connect(stack.url, b"GET /v1/models HTTP/1.1\r\nHost: test\r\n\r\n"))
            assert read_response(held[-1]).startswith(b"HTTP/1.1 200 ")  # then idle, kept alive
        r = httpx.get(stack.url + "/v1/models", timeout=10)  # in the shape of the family the path is
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        error = r.json()["error"]
        assert error["type"] == "service_unavailable_error" and "maxConnections" in error["message"]
        r = httpx.post(stack.url + "/generate", json=GOOD, timeout=10)
        assert r.status_code == 503 and r.json()["error_type"] == "Service Unavailable", r.text
        assert httpx.get(stack.mgmt_url + "/v1/config", timeout=10).status_code == 200  # its own listener
        held[0].sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\n\r\n")
        assert read_response(held[0]).startswith(b"HTTP/1.1 200 ")  # admitted connections go on
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while (status := httpx.get(stack.url + "/v1/models", timeout=10).status_code) != 200:
        assert time.monotonic() < deadline, f"still {status} after the held connections closed"
        time.sleep(0.05)


def test_a_browser_on_an_allowed_origin_may_call_and_others_may_not(stack, tiny_stack):
    """Switchboard.corsAllowOrigins: the preflight and the answer carry Access-Control-Allow-Origin for it, not for
    another origin; a deployment that allows none (tiny_stack, the default) sends no CORS header."""
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    r = httpx.options(stack.url + "/v1/chat/completions", headers=preflight, timeout=10)
    assert r.status_code in (200, 204) and r.headers["access-control-allow-origin"] == ORIGIN, r.headers
    assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.post(stack.url + "/generate", json=GOOD, headers={"Origin": ORIGIN}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(stack.url + "/v1/models", headers={"Origin": "http://evil.example"}, timeout=10)
    assert "access-control-allow-origin" not in other.headers
    plain = httpx.get(tiny_stack.url + "/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def refusals(stack) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(stack.metrics_url + "/metrics", timeout=10).text
    return {(s.labels["api"], s.labels["status"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "request_refused_total"}


def test_bodies_cut_short_are_counted_as_the_client_saw_them_not_as_server_errors(stack):
    """A body the deadline ends is a refusal with its 408 (Litestar called the disconnect a 500); a client that
    leaves mid-upload is neither a refusal nor a failure (499), on every family."""
    before = refusals(stack)
    chat = json.dumps({"model": stack.model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    for path in ("/v1/chat/completions", "/v1/messages", "/generate"):
        head = (b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                % (path.encode(), len(chat)))
        timed_out = connect(stack.url, head + chat[:10])
        left = connect(stack.url, head + chat[:10])
        left.close()
        try:
            assert read_until_closed(timed_out, time.monotonic() + TIMEOUT_S + SLACK_S).startswith(b"HTTP/1.1 408 ")
        finally:
            timed_out.close()
    deadline, want = time.monotonic() + 10, {("openai-chat", "408"): 1, ("anthropic", "408"): 1, ("tgi", "408"): 1}
    while {key: refusals(stack).get(key, 0) - before.get(key, 0) for key in want} != want:
        assert time.monotonic() < deadline, refusals(stack)
        time.sleep(0.2)
    assert not any(status.startswith("5") for _, status in refusals(stack)), refusals(stack)
