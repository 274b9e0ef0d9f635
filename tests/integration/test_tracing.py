"""One OpenTelemetry trace per request across gateway -> tokenizer -> engine, carried in NATS messages.

The first test runs the services in this process (one event loop, as the runner would run each
alone) so the SDK's in-memory exporter sees every span; the second runs `switchboard serve` with an
OTLP endpoint and reads what each service process exported.
"""

from __future__ import annotations

import asyncio
import http.server
import importlib
import json
import threading

import httpx
import msgspec
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.trace import SpanKind, StatusCode

from shared.config import load_config
from switchboard.natsd import EmbeddedNats
from tests.conftest import write_config
from tests.integration.stack import Stack

SERVICES = ("metrics", "tokenizer", "engine", "gateway")
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"  # the trace a client's traceparent names


@pytest.fixture(scope="module")
def exporter(spans):
    spans.clear()  # this module's spans only
    return spans


async def start_in_process(cfg, url: str, stop: asyncio.Event, services=None) -> list[asyncio.Task]:
    """Each service (``services``: (name, its config) pairs; default: SERVICES with ``cfg``), one after another."""
    tasks = []
    for name, own in services or [(name, cfg) for name in SERVICES]:
        ready = asyncio.Event()
        serve = importlib.import_module(f"services.{name}.service").serve
        tasks.append(asyncio.create_task(serve(own, url, stop, ready.set)))
        await asyncio.wait_for(ready.wait(), 120)
    return tasks


async def post_until(port: int, body: dict, done, headers: dict | None = None) -> httpx.Response:
    """POST /generate until ``done(response)`` says so (at most 100 tries, 0.1 s apart); the last response."""
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(100):
            r = await client.post(f"http://127.0.0.1:{port}/generate", json=body, headers=headers)
            if done(r):
                break
            await asyncio.sleep(0.1)
    return r


async def test_one_trace_spans_all_three_services(tmp_path, tiny_model_dir, exporter):
    with EmbeddedNats() as url:
        config = write_config(tmp_path, tiny_model_dir, Switchboard={"natsUrl": url})
        port = json.loads(config.read_text())["ServerConfig"]["port"]
        stop = asyncio.Event()
        tasks = await start_in_process(load_config(config), url, stop)
        try:
            # the gateway serves once it has heard the engine's heartbeat; the client's trace goes on through it
            r = await post_until(port, {"inputs": "My name is", "parameters": {"max_new_tokens": 3}},
                                 lambda r: r.status_code != 503, {"traceparent": f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"})
            assert r.status_code == 200, r.text
            async with httpx.AsyncClient(timeout=60) as client:
                refused = await client.post(f"http://127.0.0.1:{port}/generate", json={"inputs": "x", "parameters": {
                    "temperature": "hot"}})
                failed = await client.post(f"http://127.0.0.1:{port}/generate", json={"inputs": "hello " * 3000})
            assert refused.status_code == 422 and failed.status_code == 422, (refused.text, failed.text)
            await asyncio.sleep(0.3)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
    finished = exporter.get_finished_spans()
    spans = {s.name: s for s in finished if s.name.split(".")[0] in ("gateway", "tokenizer", "engine")
             and f"{s.context.trace_id:032x}" == CLIENT_TRACE}
    gateway, tokenizer, engine = spans["gateway.request"], spans["tokenizer.request"], spans["engine.generate"]
    [server] = [s for s in finished if s.name == "POST /generate" and f"{s.context.trace_id:032x}" == CLIENT_TRACE]
    assert server.kind is SpanKind.SERVER and server.parent.span_id == 0xb7ad6b7169203331
    assert {k: server.attributes[k] for k in ("http.request.method", "http.route", "http.response.status_code")} == {
        "http.request.method": "POST", "http.route": "/generate", "http.response.status_code": 200}
    assert gateway.parent.span_id == server.context.span_id
    assert gateway.context.trace_id == tokenizer.context.trace_id == engine.context.trace_id
    assert tokenizer.parent.span_id == gateway.context.span_id
    assert engine.parent.span_id == tokenizer.context.span_id
    assert gateway.attributes["switchboard.finish_reason"] in ("length", "eos_token")
    assert tokenizer.attributes["switchboard.prompt_tokens"] == engine.attributes["switchboard.prompt_tokens"] == 3
    assert gateway.start_time <= tokenizer.start_time <= engine.start_time <= engine.end_time <= gateway.end_time
    assert server.start_time <= gateway.start_time <= gateway.end_time <= server.end_time
    # refused before it was received: its server span alone, a 4xx the client's (not an error status)
    [refusal] = [s for s in finished if s.name == "POST /generate" and s.attributes["http.response.status_code"] == 422
                 and not any(c.parent and c.parent.span_id == s.context.span_id for c in finished)]
    assert refusal.status.status_code is StatusCode.UNSET
    # failed once received (the prompt too long for the model): the gateway's span says why
    [too_long] = [s for s in finished if s.name == "gateway.request" and s.status.status_code is StatusCode.ERROR]
    assert "prompt" in too_long.status.description and "tokens" in too_long.status.description, too_long.status


async def test_the_kv_handoff_is_a_span_of_the_request_trace(tmp_path, tiny_model_dir, exporter):
    """With a prefill and a decode engine, the K/V transfer is a span in the request's trace."""
    with EmbeddedNats() as url:
        config = write_config(tmp_path, tiny_model_dir, Switchboard={"natsUrl": url, "kvCacheMemoryMb": 64})
        cfg = load_config(config)
        port = json.loads(config.read_text())["ServerConfig"]["port"]
        stop = asyncio.Event()
        roles = [("metrics", ""), ("tokenizer", ""), ("engine", "decode"), ("engine", "prefill"), ("gateway", "")]
        tasks = await start_in_process(cfg, url, stop, [(name, cfg if not role else msgspec.structs.replace(
            cfg, switchboard=msgspec.structs.replace(cfg.switchboard, engine_role=role))) for name, role in roles])
        try:
            # until the tokenizer has heard the decode engine and a request is handed off
            r = await post_until(port, {"inputs": "My name is " * 20, "parameters": {"max_new_tokens": 4}},
                                 lambda _: any(s.name == "engine.kv_transfer" for s in exporter.get_finished_spans()))
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.3)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
    finished = exporter.get_finished_spans()
    [transfer] = [s for s in finished if s.name == "engine.kv_transfer"]
    seen = [(s.name, s.attributes.get("switchboard.request_id"), f"{s.context.trace_id:x}"[:8], s.status.description)
            for s in finished]
    gateways = [s for s in finished if s.name == "gateway.request" and s.context.trace_id == transfer.context.trace_id]
    assert len(gateways) == 1, seen
    [gateway] = gateways
    request_id = gateway.attributes["switchboard.request_id"]
    assert transfer.attributes["switchboard.request_id"] == request_id, seen  # its first attempt, not a resumed one
    assert transfer.attributes["switchboard.outcome"] == "moved" and transfer.attributes["switchboard.kv_bytes"] > 0
    assert transfer.attributes["switchboard.kv_tokens"] == 61  # the prompt's 60 tokens and the first token's
    assert gateway.start_time <= transfer.start_time <= transfer.end_time <= gateway.end_time


class _Collector(http.server.BaseHTTPRequestHandler):
    """A minimal OTLP/HTTP receiver: keeps every ExportTraceServiceRequest it is sent."""

    received: list = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        type(self).received.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_spans_are_exported_over_otlp_when_an_endpoint_is_set(tmp_path, tiny_model_dir):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}/v1/traces"
    try:
        with EmbeddedNats() as url:
            stack = Stack(write_config(tmp_path, tiny_model_dir, Switchboard={"natsUrl": url, "otlpEndpoint": endpoint}),
                          url)
            try:
                stack.start()
                r = httpx.post(stack.url + "/generate", json={"inputs": "My name is", "parameters": {"max_new_tokens": 2}},
                               timeout=60)
                assert r.status_code == 200, r.text
            finally:
                assert stack.stop() == 0  # each service flushes its spans on the way out
    finally:
        server.shutdown()
    exported = {}
    for request in _Collector.received:
        for resource_spans in request.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
            for scope in resource_spans.scope_spans:
                exported.update({span.name: (service, span.trace_id) for span in scope.spans})
    assert exported["gateway.request"][0] == "switchboard-gateway"
    assert exported["tokenizer.request"][0] == "switchboard-tokenizer"
    assert exported["engine.generate"][0] == "switchboard-engine"
    assert len({exported[name][1] for name in ("gateway.request", "tokenizer.request", "engine.generate")}) == 1
