"""The issue's own scale: streams whose first token is held back 40 s receive keep-alives every 15 s (the
default ``streamKeepAliveSeconds``) and complete through each family's real client.

The hold is a real queue: the engine runs one sequence at a time (maxBatchSize 1) and threads keep
priority-1 streams running or waiting for HOLD seconds, each thousands of tokens long, so every stream of
the default priority waits its turn from admission until the holders stop and leave (closing their
streams cancels them at once). All families wait at once, so the module costs one hold."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from text_generation import Client

from tests.integration.stack import running_stack

PING = b'event: ping\ndata: {"type": "ping"}\n\n'
EVERY = 15.0  # the default Switchboard.streamKeepAliveSeconds, left as it is
HOLD = 40.0
SLACK = 3.0
HOLDERS = 4  # priority-1 streams running or waiting: one that ends early (a random model's EOS) leaves no gap
HOLD_TOKENS = 4000  # each holder's length: seconds of steps, so a holder's next request is in long before it is needed


@pytest.fixture(scope="module")
def queue_stack(tmp_path_factory, tiny_model_dir):
    with running_stack(tmp_path_factory.mktemp("keep-alive-long"), tiny_model_dir, **{
            "BackendConfig.ScheduleConfig": {"maxBatchSize": 1, "maxPrefillBatchSize": 1, "maxIterTimes": HOLD_TOKENS},
            "BackendConfig.ModelDeployConfig": {"maxSeqLen": HOLD_TOKENS + 96},
            # a 2-core machine running this many streams may stall a service for a moment: a stall must not read
            # as a death here (the holders' attempts resumed behind the streams' would end the hold early)
            "Switchboard": {"leaseSeconds": 10.0}}) as stack:
        yield stack


def hold_the_engine(stack, stop: threading.Event) -> None:
    """Keep a priority-1 stream running or waiting until ``stop``, then leave (its request is cancelled)."""
    body = {"text_input": "Once", "parameters": {"priority": 1, "max_new_tokens": HOLD_TOKENS, "do_sample": False}}
    while not stop.is_set():
        with httpx.stream("POST", f"{stack.url}/v2/models/{stack.model}/generate_stream", json=body,
                          timeout=HOLD + 60) as r:
            assert r.status_code == 200, r.read()
            for _ in r.iter_raw():
                if stop.is_set():
                    break


def holding(stack, timeout: float) -> None:
    """Wait until every holder's request is in the engine (one running, the rest waiting)."""
    deadline = time.monotonic() + timeout
    while (info := asyncio.run(stack.engine_info())).running + info.waiting < HOLDERS:
        assert time.monotonic() < deadline, f"the holders are not in the engine: {info.running} + {info.waiting}"
        time.sleep(0.1)


def timed_raw(stack, path: str, body: dict) -> tuple[list[tuple[float, bytes]], float]:
    """Each chunk with its arrival time since the request started."""
    started, chunks = time.monotonic(), []
    with httpx.stream("POST", stack.url + path, json=body, timeout=HOLD + 60) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            chunks.append((time.monotonic() - started, chunk))
    return chunks, time.monotonic() - started


def openai_chat(stack):
    api = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", timeout=HOLD + 60, max_retries=0)
    chunks = list(api.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=5, stream=True))
    return chunks[-1].choices[0].finish_reason


def openai_responses(stack):
    api = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", timeout=HOLD + 60, max_retries=0)
    with api.responses.stream(model=stack.model, input="Hi", max_output_tokens=5, store=False) as stream:
        events = list(stream)  # cut by max_output_tokens, it ends with response.incomplete (no response.completed)
    return events[-1].response.status


def anthropic_messages(stack):
    api = anthropic.Anthropic(base_url=stack.url, api_key="x", timeout=HOLD + 60, max_retries=0)
    with api.messages.stream(model=stack.model, max_tokens=5, messages=[{"role": "user", "content": "Hi"}]) as s:
        return s.get_final_message().stop_reason


def tgi(stack):
    return list(Client(stack.url, timeout=int(HOLD + 60)).generate_stream("Hi", max_new_tokens=5))[-1].details.finish_reason


def test_streams_held_back_40_s_get_keep_alives_every_15_s_and_complete(queue_stack):
    stack = queue_stack
    stop = threading.Event()
    raw = {  # path -> (body, the family's keep-alive as it appears on the wire)
        "/v1/chat/completions": ({"model": stack.model, "messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 5, "stream": True}, b": keep-alive\n\n"),
        f"/v2/models/{stack.model}/generate_stream": ({"text_input": "Hi", "parameters": {"max_new_tokens": 5}},
                                                      b": keep-alive\n\n"),
        "/infer": ({"inputs": "Hi", "stream": True, "parameters": {"max_new_tokens": 5}}, b": keep-alive\n\n"),
        "/generate": ({"prompt": "Hi", "max_tokens": 5, "stream": True}, b"\0"),
        "/v1/messages": ({"model": stack.model, "max_tokens": 5, "stream": True,
                          "messages": [{"role": "user", "content": "Hi"}]}, PING),
    }
    clients = {"openai": openai_chat, "responses": openai_responses, "anthropic": anthropic_messages, "tgi": tgi}
    with ThreadPoolExecutor(HOLDERS + len(raw) + len(clients)) as pool:
        holders = [pool.submit(hold_the_engine, stack, stop) for _ in range(HOLDERS)]
        holding(stack, timeout=30)  # the holders own the engine before the streams arrive
        raw_runs = {path: pool.submit(timed_raw, stack, path, body) for path, (body, _) in raw.items()}
        client_runs = {name: pool.submit(run, stack) for name, run in clients.items()}
        time.sleep(HOLD)
        stop.set()
        for holder in holders:
            holder.result()
        answers = {name: run.result(timeout=60) for name, run in client_runs.items()}
        streams = {path: run.result(timeout=60) for path, run in raw_runs.items()}
    assert answers == {"openai": "length", "responses": "incomplete", "anthropic": "max_tokens", "tgi": "length"}
    for path, (chunks, ended) in streams.items():
        marker = raw[path][1]
        wire = b"".join(chunk for _, chunk in chunks)
        pings, silences = _keep_alives(chunks, marker)
        assert ended > HOLD - SLACK, (f"{path}: the hold did not hold (the stream ended at {ended:.1f} s): {wire[-600:]!r}"
                                      f"\n{chr(10).join(stack.output[-40:])}")
        assert len(pings) >= 2, f"{path}: keep-alives at {pings} in a stream that ended at {ended:.1f} s"
        assert max(silences) < EVERY + SLACK, f"{path}: silent for {max(silences):.1f} s (keep-alives at {pings})"
        assert all(EVERY - SLACK < silence for silence, _ in pings), f"{path}: keep-alives too early: {pings}"
        assert len(wire) > len(marker) * len(pings)  # the answer came after them
    body = b"".join(c for _, c in streams["/v1/chat/completions"][0])
    assert body.rstrip().endswith(b"data: [DONE]")
    assert json.loads(body.split(b"data: ")[1].split(b"\n\n")[0])["object"] == "chat.completion.chunk"


def _keep_alives(chunks: list[tuple[float, bytes]], marker: bytes) -> tuple[list[tuple[float, float]], list[float]]:
    """Each keep-alive as (the silence before it, when it came), and every silence on the wire: the time from
    the request (or the chunk before) to each chunk. What a stream sends at its start (an OpenAI role chunk,
    Anthropic's message_start and the ping that follows it) is a chunk like any other: a keep-alive is owed after
    EVERY seconds of silence, whatever came before."""
    pings, silences, last = [], [], 0.0
    for at, chunk in chunks:
        silences.append(at - last)
        if at > 1.0 and chunk.count(marker) and not chunk.replace(marker, b""):  # not the start's (Anthropic's ping)
            pings.extend([(at - last, at)] * chunk.count(marker))
        last = at
    return pings, silences or [float("inf")]
