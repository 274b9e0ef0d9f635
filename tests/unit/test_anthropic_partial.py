"""A cut-short tool input read as the anthropic SDK reads a streamed one (jiter's partial mode, which the SDK
uses): every prefix of real arguments gives the same object (services/gateway/anthropic/partial.py)."""

from __future__ import annotations

import json

import jiter
import pytest

from services.gateway.anthropic.partial import partial_object

ARGUMENTS = [
    {"city": "Paris", "unit": "celsius"},
    {"query": 'say "hi"\\n', "limit": -12, "ratio": 0.5e-3, "ok": True, "none": None, "off": False},
    {"items": [1, 2, {"b": [True, None, "x"]}, []], "nested": {"deep": {"er": "é😀"}}, "n": 10},
]


@pytest.mark.parametrize("arguments", ARGUMENTS, ids=lambda a: next(iter(a)))
@pytest.mark.parametrize("spaced", [False, True], ids=["compact", "spaced"])
def test_every_prefix_reads_as_the_sdk_reads_it(arguments, spaced):
    text = json.dumps(arguments, ensure_ascii=False, **({} if spaced else {"separators": (",", ":")}))
    for cut in range(1, len(text) + 1):
        prefix = text[:cut]
        assert partial_object(prefix) == jiter.from_json(prefix.encode(), partial_mode=True), prefix


def test_what_begins_no_object_is_none():
    assert partial_object("") is None and partial_object("[1, 2") is None and partial_object("nonsense") is None
