"""A failure after a stream began: `data: {"error": {...}}` then `data: [DONE]` (serving-anchors §3).

A stack whose e2eTimeout is 1 s ends long generations with a real engine timeout mid-stream.
"""

from __future__ import annotations

import openai
import pytest

from tests.integration.stack import running_stack, sse_events
from tests.integration.test_openai_api import MESSAGES, PROMPT, client, post

LONG = {"max_tokens": 100000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def short_stack(tmp_path_factory, tiny_model_dir):
    # Room for 8000 new tokens: more than the tiny model generates in a second, however fast the engine.
    with running_stack(tmp_path_factory.mktemp("openai-e2e"), tiny_model_dir, ServerConfig={"e2eTimeout": 1}, **{
            "BackendConfig.ModelDeployConfig": {"maxSeqLen": 8192},
            "BackendConfig.ScheduleConfig": {"maxIterTimes": 8000}}) as stack:
        yield stack


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": True}),
    ("/v1/completions", {"prompt": PROMPT, "stream": True, "n": 2, "temperature": 0.7}),
])
def test_a_timeout_mid_stream_is_an_error_event_then_done(short_stack, path, body):
    r = post(short_stack, path, {"model": short_stack.model, **LONG, **body})
    assert r.status_code == 200
    assert r.text.endswith("data: [DONE]\n\n")
    events = sse_events(r.text[: -len("data: [DONE]\n\n")])
    assert len(events) > 2 and all("choices" in e for e in events[:-1])
    error = events[-1]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and error["code"] == "timeout" and "timeout" in error["message"]


def test_the_client_raises_on_the_error_event_and_a_plain_request_gets_500(short_stack):
    api = client(short_stack)
    long = {"max_tokens": 100000, "temperature": 0, "extra_body": {"ignore_eos": True}}
    with pytest.raises(openai.APIError, match="timeout"):
        for _ in api.chat.completions.create(model=short_stack.model, messages=MESSAGES, stream=True, **long):
            pass
    with pytest.raises(openai.InternalServerError) as err:
        api.completions.create(model=short_stack.model, prompt=PROMPT, **long)
    assert err.value.code == "timeout"
    done = api.completions.create(model=short_stack.model, prompt=PROMPT, max_tokens=4)
    assert done.choices[0].finish_reason == "length"
