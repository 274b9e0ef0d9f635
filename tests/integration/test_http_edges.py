"""HTTP as proxies and clients use it (an HTTP-level trial): every response carries RequestUUID and x-request-id
(the client's X-Request-Id echoed, and naming an OpenAI answer as vLLM names it), a body behind a UTF-8 BOM is
read, a request head h11 cannot take is answered in JSON with h11's status (431 for an oversized head, also one that
comes whole; 400 and a closed connection for Content-Length with Transfer-Encoding, RFC 9112 §6.3), and an
Upgrade header (h2c) is served as plain HTTP/1.1."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import openai


def raw(url: str, data: bytes) -> bytes:
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def test_every_response_has_its_ids_the_routers_own_404s_and_405s_too(tiny_stack):
    for method, url in (("GET", tiny_stack.url + "/nonexistent"), ("PUT", tiny_stack.url + "/generate"),
                        ("POST", tiny_stack.url + "/v1/embeddings"), ("POST", tiny_stack.mgmt_url + "/health"),
                        ("GET", tiny_stack.metrics_url + "/nope"), ("GET", tiny_stack.url + "/v1/models")):
        r = httpx.request(method, url, timeout=10)
        assert r.headers.get("requestuuid") and r.headers["x-request-id"] == r.headers["requestuuid"], (method, url)


def test_a_clients_x_request_id_is_echoed_and_names_the_answer(tiny_stack):
    chat = {"model": tiny_stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(tiny_stack.url + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "trace-abc-1"},
                   timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-abc-1"
    assert r.json()["id"] == "chatcmpl-trace-abc-1"
    named = httpx.post(tiny_stack.url + "/v1/chat/completions", json={**chat, "request_id": "mine"},
                       headers={"X-Request-Id": "trace-abc-2"}, timeout=60)
    assert named.json()["id"] == "chatcmpl-mine"  # the body's own request_id names it
    client = openai.OpenAI(base_url=tiny_stack.url + "/v1", api_key="unused")
    answer = client.completions.create(model=tiny_stack.model, prompt="hi", max_tokens=2,
                                       extra_headers={"X-Request-Id": "sdk-1"})
    assert answer.id == "cmpl-sdk-1" and answer._request_id == "sdk-1"
    odd = httpx.post(tiny_stack.url + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "a b"}, timeout=60)
    assert odd.headers["x-request-id"] == odd.headers["requestuuid"]  # not an id a header or body can carry


def test_a_body_behind_a_utf8_bom_is_read(tiny_stack):
    body = b"\xef\xbb\xbf" + json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 1}}).encode()
    r = httpx.post(tiny_stack.url + "/generate", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text


def test_heads_h11_cannot_take_get_json_with_h11s_status(tiny_stack):
    big = raw(tiny_stack.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
    assert big.startswith(b"HTTP/1.1 431 "), big[:100]
    assert json.loads(big.partition(b"\r\n\r\n")[2])["error_type"] == "Request Header Fields Too Large"
    whole = raw(tiny_stack.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
    assert whole.startswith(b"HTTP/1.1 431 "), whole[:100]  # one read: h11 limits only a head still arriving
    body = json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 1}}).encode()
    smuggled = raw(tiny_stack.url, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    assert smuggled.startswith(b"HTTP/1.1 400 ") and b"both Content-Length and Transfer-Encoding" in smuggled, smuggled
    bad = raw(tiny_stack.url, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
    assert bad.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in bad.lower(), bad[:200]
    assert "Invalid HTTP request" in json.loads(bad.partition(b"\r\n\r\n")[2])["error"]
    upgraded = httpx.get(tiny_stack.url + "/v1/models", headers={"Upgrade": "h2c", "Connection": "Upgrade"}, timeout=10)
    assert upgraded.status_code == 200
    assert httpx.get(tiny_stack.url + "/v1/models", timeout=10).status_code == 200


def test_a_target_in_absolute_form_routes_by_its_path(tiny_stack):
    """RFC 9112 §3.2.2: a server must accept ``POST http://host/path`` (clients set up for a proxy send it)."""
    host = urlsplit(tiny_stack.url).netloc.encode()
    body = json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 1}}).encode()
    answer = raw(tiny_stack.url, b"POST http://%s/generate?x=1 HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host, host, len(body), body))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


def test_health_answers_with_no_body_labelled_json(tiny_stack):
    for path in ("/health", "/v2/health/live", "/v2/health/ready"):
        r = httpx.get(tiny_stack.mgmt_url + path, timeout=10)
        assert r.status_code == 200 and r.content == b"" and "json" not in r.headers.get("content-type", ""), path
