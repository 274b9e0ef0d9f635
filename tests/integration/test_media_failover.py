"""Failover with media: an engine killed while it streams answers to image requests (its features and
cache gone with it) and a tokenizer killed likewise; each stream ends exactly as an uninterrupted run,
because the gateway resumes the request with its media references, a live tokenizer fetches and
processes them again, and a live engine recomputes the prompt and the tokens already sent."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration import test_failover
from tests.integration.cluster import Cluster
from tests.media_items import data_url, test_image

TOKENS = 48


def media_body(i: int, seeded: bool) -> dict:
    params = {"max_new_tokens": TOKENS, "do_sample": True, "temperature": 0.9, "top_k": 50, "seed": 500 + i}
    return {"inputs": [{"type": "text", "text": "<|im_start|>user\nWhat is in this image?"},
                       {"type": "image_url", "image_url": data_url(test_image(i % 3))},
                       {"type": "text", "text": "<|im_end|>\n<|im_start|>assistant\n"}], "parameters": params}


@pytest.fixture
def cluster(tmp_path, smolvlm_dir, monkeypatch):
    monkeypatch.setattr(test_failover, "body", media_body)
    monkeypatch.setattr(test_failover, "STREAMS", 4)
    c = Cluster(tmp_path, smolvlm_dir, engines=2, tokenizers=2, Switchboard={"kvCacheMemoryMb": 128})  # a maxSeqLen sequence
    try:
        yield c.wait_ready()
    finally:
        c.stop()


@pytest.mark.parametrize("victim", ["engine-0", "tokenizer-0"])
def test_a_service_killed_mid_stream_loses_nothing_of_a_media_request(cluster, victim):
    expected = test_failover.reference(cluster, seeded=True)
    assert min(map(len, expected)) >= 8, expected
    streams = test_failover.Streams(cluster.base, seeded=True)
    asyncio.run(streams.run(fault=lambda: cluster.kill(victim), after_tokens=4))
    assert not any(streams.errors), (streams.errors, cluster.log_tails())
    assert streams.tokens == expected, cluster.log_tails()
