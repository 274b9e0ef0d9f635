"""Limits: maxLinkNum (that many requests in progress, twice as many waiting, beyond that 429 + Retry-After), and
a prompt surely over the prompt limit, refused before it is tokenized."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from switchboard.natsd import EmbeddedNats
from tests.conftest import write_config
from tests.integration.stack import Stack
from tests.integration.test_openai_api import post

# Long enough to still be running a second later, however fast the engine is.
LONG = {"prompt": "My name is Olivier and I", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def one_link_stack(tmp_path_factory, tiny_model_dir):
    with EmbeddedNats() as url:
        config = write_config(tmp_path_factory.mktemp("limits"), tiny_model_dir, Switchboard={"natsUrl": url},
                              ServerConfig={"maxLinkNum": 1}, **{"BackendConfig.ScheduleConfig": {"maxIterTimes": 2000}})
        stack = Stack(config, url)
        try:
            yield stack.start()
        finally:
            stack.stop()


async def test_beyond_links_and_queue_is_429_in_each_family_shape(one_link_stack):
    url = one_link_stack.url
    async with httpx.AsyncClient(timeout=60) as client:
        busy = [asyncio.create_task(client.post(url + "/generate", json=LONG)) for _ in range(3)]
        await asyncio.sleep(1.0)  # one running, two waiting
        native = await client.post(url + "/infer", json={"inputs": "hi"})
        assert native.status_code == 429 and native.headers["retry-after"] == "1"
        assert native.json()["error_type"] == "Model Overloaded" and "maxLinkNum 1" in native.json()["error"]
        tgi = await client.post(url + "/generate", json={"inputs": "hi"})
        assert tgi.status_code == 429 and tgi.json()["error_type"] == "overloaded"
        oai = await client.post(url + "/v1/completions", json={"model": one_link_stack.model, "prompt": "hi"})
        assert oai.status_code == 429 and oai.json()["error"]["type"] == "rate_limit_error"
        done = await asyncio.gather(*busy)
        assert [r.status_code for r in done] == [200, 200, 200]  # the waiting ones were served in turn
        ok = await client.post(url + "/infer", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        assert ok.status_code == 200, ok.text
    await asyncio.sleep(0.5)  # the refusals are counted (request_refused_total), the served requests as received
    metrics = {(s.name, s.labels.get("api"), s.labels.get("status")): s.value
               for family in text_string_to_metric_families(httpx.get(one_link_stack.metrics_url + "/metrics").text)
               for s in family.samples if s.name in ("request_refused_total", "request_received_total")}
    assert metrics[("request_refused_total", "mindie", "429")] == 1
    assert metrics[("request_refused_total", "tgi", "429")] == 1
    assert metrics[("request_refused_total", "openai-completions", "429")] == 1
    assert metrics[("request_received_total", "vllm", None)] == 3 and metrics[("request_received_total", "mindie", None)] == 1


def test_a_conversation_surely_over_the_limit_is_refused_before_it_is_tokenized(tiny_stack):
    """A message surely over the limit (500 kB here, within this stack's 1 MB body limit; a user's 4 MB took the
    tokenizer ~4 s while every other request waited) on chat and Anthropic: refused from its rendered length, as
    a prompt is on the other routes, rather than tokenized first."""
    huge = "word " * 100_000
    started = time.monotonic()
    chat = post(tiny_stack, "/v1/chat/completions", {"model": tiny_stack.model, "max_tokens": 1,
                                                     "messages": [{"role": "user", "content": huge}]})
    anthropic = post(tiny_stack, "/v1/messages", {"model": tiny_stack.model, "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": huge}]})
    assert (chat.status_code, anthropic.status_code) == (400, 400), (chat.text[:300], anthropic.text[:300])
    assert "the conversation (as its chat template renders it) has" in chat.json()["error"]["message"]
    assert "characters: more than the limit" in anthropic.json()["error"]["message"]
    assert time.monotonic() - started < 3.0
