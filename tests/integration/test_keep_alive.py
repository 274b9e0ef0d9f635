"""Streams that proxies keep open: a stream waiting for its first token (queued behind a long request on a
server of one slot) sends its family's keep-alive every streamKeepAliveSeconds, and the family's client still
reads the whole answer: SSE comments (OpenAI through the ``openai`` client, TGI through ``text-generation``,
Triton's generate_stream, MindIE's /infer), vLLM's empty chunks."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
from text_generation import Client

from tests.integration.stack import running_stack

EVERY = 0.2  # Switchboard.streamKeepAliveSeconds here
BLOCKER_TOKENS = 2000  # the request ahead: long enough to hold the one slot a few keep-alive intervals


@pytest.fixture(scope="module")
def one_slot_stack(tmp_path_factory, tiny_model_dir):
    with running_stack(tmp_path_factory.mktemp("keep-alive"), tiny_model_dir, ServerConfig={"maxLinkNum": 1},
                       Switchboard={"streamKeepAliveSeconds": EVERY},
                       **{"BackendConfig.ScheduleConfig": {"maxIterTimes": 2048}}) as stack:
        yield stack


@contextmanager
def queued_behind_a_long_request(stack):
    """While the block runs, the server's one slot is held by a long request: a stream, whose first token
    says it holds the slot (a fixed sleep was not enough on a loaded machine: the block's request got there
    first)."""
    body = {"model": stack.model, "prompt": "Once", "max_tokens": BLOCKER_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True}
    admitted = threading.Event()

    def ahead() -> bytes:
        data = b""
        with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for chunk in r.iter_raw():
                data += chunk
                if b"data: {" in data:
                    admitted.set()
        return data

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(ahead)
        assert admitted.wait(60), "the request ahead never started"
        started = time.monotonic()
        yield
        assert running.result().rstrip().endswith(b"data: [DONE]")
    assert time.monotonic() - started > 3 * EVERY, "the request ahead ended too soon to hold the stream back"


def raw_stream(stack, path: str, body: dict) -> tuple[bytes, float]:
    """The whole streamed body and the seconds to its first byte."""
    started, first, data = time.monotonic(), None, b""
    with httpx.stream("POST", stack.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            first = first or time.monotonic() - started
            data += chunk
    return data, first


def test_openai_sse_gets_comments_while_queued_and_the_client_reads_the_answer(one_slot_stack):
    stack = one_slot_stack
    body = {"model": stack.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
            "temperature": 0, "stream": True}
    with queued_behind_a_long_request(stack):
        data, first = raw_stream(stack, "/v1/chat/completions", body)
    head = data.split(b"data: ")[0]
    assert head.count(b": keep-alive\n\n") >= 2 and first < 3 * EVERY  # the first keep-alive came early
    assert data.rstrip().endswith(b"data: [DONE]")
    api = openai.OpenAI(base_url=stack.url + "/v1", api_key="x")
    with queued_behind_a_long_request(stack):
        chunks = list(api.chat.completions.create(**body))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_tgi_clients_read_through_keep_alives(one_slot_stack):
    stack = one_slot_stack
    with queued_behind_a_long_request(stack):
        responses = list(Client(stack.url, timeout=120).generate_stream("Hi", max_new_tokens=5))
    assert responses[-1].details.generated_tokens == 5


@pytest.mark.parametrize("path, body", [
    ("/v2/models/{model}/generate_stream", {"text_input": "Hi", "parameters": {"max_new_tokens": 5}}),
    ("/infer", {"inputs": "Hi", "stream": True, "parameters": {"max_new_tokens": 5}}),
], ids=["triton", "mindie"])
def test_sse_families_send_comments_while_queued(one_slot_stack, path, body):
    stack = one_slot_stack
    with queued_behind_a_long_request(stack):
        data, _ = raw_stream(stack, path.format(model=stack.model), body)
    blocks = [block for block in data.split(b"\n\n") if block.strip()]
    assert sum(block == b": keep-alive" for block in blocks) >= 2
    assert sum(block.startswith(b"data:") for block in blocks) >= 1


def test_vllm_streams_get_empty_chunks_while_queued(one_slot_stack):
    stack = one_slot_stack
    with queued_behind_a_long_request(stack):
        data, _ = raw_stream(stack, "/generate", {"prompt": "Hi", "max_tokens": 5, "stream": True})
    parts = data.split(b"\0")
    assert parts[-1] == b"" and sum(part == b"" for part in parts[:-1]) >= 2
    assert [p for p in parts if p]  # the answer's JSON chunks, which vLLM's client reads skipping empty ones
