"""Triton stopInfer (reference §3.30): ending a running stream by its client id, and the body's rules."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.integration.test_triton_api import PROMPT, model_path, post


async def test_stop_infer_ends_a_running_stream(tiny_stack):
    body = {"id": "a123", "text_input": PROMPT, "parameters": {"max_new_tokens": 512, "do_sample": False,
                                                               "details": True}}
    url = tiny_stack.url + model_path(tiny_stack, "/generate_stream")
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", url, json=body) as r:
            lines = r.aiter_lines()
            seen = 0
            async for line in lines:
                seen += line.startswith("data:")
                if seen == 3:
                    break
            stop = await http.post(tiny_stack.url + model_path(tiny_stack, "/stopInfer"), json={"id": "a123"})
            stopped_at = time.monotonic()
            assert stop.status_code == 200 and stop.json() == {"id": "a123"}
            rest = [json.loads(line[len("data:"):]) async for line in lines if line.startswith("data:")]
            assert time.monotonic() - stopped_at < 5
    final = rest[-1]["details"]
    assert final["finish_reason"] == "stop_sequence" and 3 <= final["generated_tokens"] < 512
    again = await asyncio.to_thread(post, tiny_stack, model_path(tiny_stack, "/stopInfer"), {"id": "a123"})
    assert again.status_code == 404
    assert again.json() == {"error": "RequestId is a123 not found.", "error_type": "NotFoundError"}
    info = await tiny_stack.wait_engine_idle()
    assert (info.running, info.waiting) == (0, 0)


@pytest.mark.parametrize("body,message", [
    (b"{nope", "Failed to parse"), ({}, "Not found id."), ({"id": None}, "id must not be null."),
    ({"id": 5}, "id must be string type."), ({"id": "a b"}, "The id can contain only"),
    ({"id": "x" * 257}, "The id can contain only"), ({"id": ""}, "The id can contain only"),
])
def test_stop_infer_validation(tiny_stack, body, message):
    r = post(tiny_stack, model_path(tiny_stack, "/stopInfer"), body)
    assert r.status_code == 422 and r.json()["error_type"] == "Input Validation Error"
    assert message in r.json()["error"]


def test_stop_infer_unknown_id_is_404(tiny_stack):
    r = post(tiny_stack, model_path(tiny_stack, "/stopInfer"), {"id": "never-sent"})
    assert r.status_code == 404
    assert r.json() == {"error": "RequestId is never-sent not found.", "error_type": "NotFoundError"}


async def test_stop_infer_ends_every_running_request_its_id_names(tiny_stack):
    """Two running streams a client gave the same id: stopInfer ends both (none is left unstoppable)."""
    body = {"id": "twice", "text_input": PROMPT, "parameters": {"max_new_tokens": 512, "do_sample": False,
                                                                "details": True}}
    url = tiny_stack.url + model_path(tiny_stack, "/generate_stream")

    async def run(http: httpx.AsyncClient, started: asyncio.Event) -> dict:
        async with http.stream("POST", url, json=body) as r:
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[len("data:"):]))
                    started.set()
            return events[-1]["details"]

    async with httpx.AsyncClient(timeout=60) as http:
        flags = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.ensure_future(run(http, flag)) for flag in flags]
        await asyncio.wait_for(asyncio.gather(*(flag.wait() for flag in flags)), 30)
        stop = await http.post(tiny_stack.url + model_path(tiny_stack, "/stopInfer"), json={"id": "twice"})
        assert stop.status_code == 200
        ends = await asyncio.wait_for(asyncio.gather(*streams), 30)
    assert all(e["finish_reason"] == "stop_sequence" and e["generated_tokens"] < 512 for e in ends)
