"""One request never harms another, end to end on the default model: poisoned requests published straight
to the engine end alone with an error while healthy requests beside them produce their solo tokens."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import msgspec
import nats

from shared import subjects
from shared.errors import ErrorKind
from shared.messages import EngineRequest, Sampling, TokenBatch, TokenEvent, encode
from tests.integration.stack import Stack, sse_events

STREAM = ("Here is a long story about a dragon who lived in the mountains. One day,", 24)
PLAIN = ("The capital of France is", 16)
TINY_TEMPERATURE = ("My name is Olivier and I", 4)
VOCAB = 49152  # SmolLM2's
WAIT_S = 120


async def generate(client: httpx.AsyncClient, text: str, **parameters) -> list[int]:
    r = await client.post("/generate", json={"inputs": text, "parameters": {**parameters, "details": True}})
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


async def stream(client: httpx.AsyncClient, text: str, started: asyncio.Event | None = None, **parameters) -> list[int]:
    """POST /generate_stream; ``started`` is set once the first token event has arrived."""
    body = ""
    body_json = {"inputs": text, "parameters": {**parameters, "details": True}}
    async with client.stream("POST", "/generate_stream", json=body_json) as r:
        assert r.status_code == 200
        async for chunk in r.aiter_text():
            body += chunk
            if started is not None and "\n\n" in body:
                started.set()
    events = sse_events(body)
    assert events[-1]["details"]["finish_reason"] == "length", events[-1]
    return [e["token"]["id"] for e in events]


def greedy(max_new_tokens: int) -> dict:
    return {"do_sample": False, "max_new_tokens": max_new_tokens}


async def publish_poison(stack: Stack, prompt_ids: list[int], sampling: Sampling) -> list[TokenEvent]:
    """An EngineRequest straight onto the engine's subject; its events, up to the finishing one."""
    nc = await nats.connect(stack.nats_url)
    try:
        inbox = f"test.poison.{uuid.uuid4().hex}"
        sub = await nc.subscribe(inbox)
        request = EngineRequest(id=uuid.uuid4().hex, prompt_ids=prompt_ids, sampling=sampling, reply_to=inbox)
        await nc.publish(subjects.engine_generate(stack.model), encode(request))
        events: list[TokenEvent] = []
        while not events or events[-1].finish_reason is None:
            msg = await sub.next_msg(timeout=WAIT_S)
            events += [e for e in msgspec.msgpack.decode(msg.data, type=TokenBatch).events if e.id == request.id]
        return events
    finally:
        await nc.close()


def assert_error(events: list[TokenEvent], words: str) -> None:
    last = events[-1]
    assert last.finish_reason == "error" and last.error is not None, events
    assert last.error.kind is ErrorKind.INTERNAL
    assert last.error.message.startswith("engine failure for this request: ") and words in last.error.message


async def test_poisoned_requests_end_alone_and_healthy_ones_keep_their_solo_tokens(smol_stack):
    async with httpx.AsyncClient(base_url=smol_stack.url, timeout=WAIT_S) as client:
        solo_stream = await stream(client, STREAM[0], **greedy(STREAM[1]))
        solo_plain = await generate(client, PLAIN[0], **greedy(PLAIN[1]))
        solo_greedy = await generate(client, TINY_TEMPERATURE[0], **greedy(TINY_TEMPERATURE[1]))
        assert len(solo_stream) == STREAM[1] and len(solo_plain) == PLAIN[1]

        logged_before = len(smol_stack.output)
        started = asyncio.Event()
        healthy = [asyncio.create_task(stream(client, STREAM[0], started, **greedy(STREAM[1]))),
                   asyncio.create_task(generate(client, PLAIN[0], **greedy(PLAIN[1])))]
        await asyncio.wait_for(started.wait(), WAIT_S)  # both healthy requests are decoding now
        bad_id, bad_temperature, tiny_temperature = await asyncio.wait_for(asyncio.gather(
            publish_poison(smol_stack, [1, 2, VOCAB + 10], Sampling(max_new_tokens=8)),
            publish_poison(smol_stack, [1, 2, 3], Sampling(do_sample=True, temperature=float("nan"))),
            generate(client, TINY_TEMPERATURE[0], temperature=1e-300, max_new_tokens=TINY_TEMPERATURE[1]),
        ), WAIT_S)
        together_stream, together_plain = await asyncio.wait_for(asyncio.gather(*healthy), WAIT_S)

    assert together_stream == solo_stream
    assert together_plain == solo_plain
    assert tiny_temperature == solo_greedy
    assert_error(bad_id, f"token id {VOCAB + 10} is outside")
    assert_error(bad_temperature, "temperature is NaN")
    warnings = [line for line in smol_stack.output[logged_before:] if "the engine step fails for it" in line]
    assert len(warnings) == 2 and all('"level": "warning"' in line for line in warnings), warnings
    info = await smol_stack.wait_engine_idle()
    assert info.running == 0 and info.free_blocks == info.total_blocks
