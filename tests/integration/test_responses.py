"""OpenAI's Responses API through the ``openai`` SDK, unmodified: text with instructions equal to the chat completion
of the same conversation, a function call round trip, ``text.format`` json_schema, the stream's events in order,
``previous_response_id``, retrieve and delete; and the stored responses shared by two gateway processes and kept
across a gateway's restart (a JetStream bucket of the deployment's nats-server)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest

from switchboard.natsd import die_with_parent, free_port
from tests.integration.cluster import Cluster
from tests.integration.test_openai_api import client

INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
ASK = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_text_with_instructions_equals_the_chat_completion(smol_stack):
    api = client(smol_stack)
    answer = api.responses.create(model=smol_stack.model, instructions=INSTRUCTIONS, input=ASK, temperature=0,
                                  max_output_tokens=24)
    assert answer.object == "response" and answer.id.startswith("resp_") and answer.status in ("completed", "incomplete")
    chat = api.chat.completions.create(model=smol_stack.model, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK}])
    assert answer.output_text == chat.choices[0].message.content and "Paris" in answer.output_text
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                       chat.usage.completion_tokens)
    cut = api.responses.create(model=smol_stack.model, input=ASK, temperature=0, max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_a_function_call_its_output_and_the_final_answer(smol_stack):
    api = client(smol_stack)
    first = api.responses.create(model=smol_stack.model, input="What is the weather like in Paris today?",
                                 tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                                 temperature=0, max_output_tokens=60)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    final = api.responses.create(model=smol_stack.model, tools=[WEATHER], tool_choice="none", temperature=0,
                                 max_output_tokens=30, input=[
                                     {"role": "user", "content": "What is the weather like in Paris today?"},
                                     {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                      "arguments": call.arguments},
                                     {"type": "function_call_output", "call_id": call.call_id,
                                      "output": "18 degrees and sunny"}])
    assert final.output_text and not [item for item in final.output if item.type == "function_call"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_text_format_json_schema_holds(smol_stack, seed):
    answer = client(smol_stack).responses.create(
        model=smol_stack.model, input="Invent a person.", max_output_tokens=60, temperature=0.9, top_p=0.95,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
        extra_body={"seed": seed})
    jsonschema.validate(json.loads(answer.output_text), PERSON)


def test_the_stream_gives_its_events_in_order_and_the_same_text(smol_stack):
    api = client(smol_stack)
    with api.responses.stream(model=smol_stack.model, input=ASK, temperature=0, max_output_tokens=60) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    whole = api.responses.create(model=smol_stack.model, input=ASK, temperature=0, max_output_tokens=60)
    assert final.output_text == whole.output_text and whole.status == "completed"  # get_final_response needs it
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    body = {"model": smol_stack.model, "input": ASK, "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", smol_stack.url + "/v1/responses", json=body, timeout=60) as r:
        numbers = [json.loads(line[6:])["sequence_number"] for line in r.iter_lines() if line.startswith("data: ")]
    assert numbers == list(range(len(numbers)))


def test_with_tools_declared_text_and_arguments_stream_as_they_are_made(smol_stack):
    """Agents always declare tools: the text streams token by token all the same, and a forced call's arguments
    as they are made (both came as one delta at the end), adding up to the body's."""
    api = client(smol_stack)
    ask = dict(model=smol_stack.model, input="Tell me a story about a cat.", tools=[WEATHER], temperature=0,
               max_output_tokens=16, store=False)
    with api.responses.stream(**ask) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    whole = api.responses.create(**ask)
    assert len(deltas) > 4 and "".join(deltas) == whole.output_text
    forced = dict(ask, input="What is the weather like in Paris today?", tool_choice="required",
                  max_output_tokens=40, parallel_tool_calls=False)
    body = api.responses.create(**forced)
    with api.responses.stream(**forced) as stream:
        arguments = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
    (call,) = [item for item in body.output if item.type == "function_call"]
    assert len(arguments) > 1 and "".join(arguments) == call.arguments


def test_an_assistants_refusal_part_is_its_text(tiny_stack):
    """Replayed conversations carry OpenAI's refusal parts (to_input_list()): they are the assistant's words, as
    on chat (they were a 400)."""
    said = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "I cannot."},
            {"role": "user", "content": "Why?"}]
    refused = [said[0], {"type": "message", "role": "assistant",
                         "content": [{"type": "refusal", "refusal": "I cannot."}]}, said[2]]
    api = client(tiny_stack)
    assert api.responses.input_tokens.count(model=tiny_stack.model, input=refused).input_tokens == \
        api.responses.input_tokens.count(model=tiny_stack.model, input=said).input_tokens


def test_previous_response_id_retrieve_and_delete(smol_stack):
    api = client(smol_stack)
    first = api.responses.create(model=smol_stack.model, input="My name is Ada.", temperature=0, max_output_tokens=8)
    second = api.responses.create(model=smol_stack.model, input="What is my name?", previous_response_id=first.id,
                                  temperature=0, max_output_tokens=8)
    chat = api.chat.completions.create(model=smol_stack.model, temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert api.responses.retrieve(second.id).output_text == second.output_text
    api.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(second.id)
    with pytest.raises(openai.BadRequestError):
        api.responses.create(model=smol_stack.model, input="x", previous_response_id=second.id)
    unstored = api.responses.create(model=smol_stack.model, input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(unstored.id)


@pytest.mark.parametrize("body, param", [
    ({"input": ASK, "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": 5}, "input"),
    ({"input": ASK, "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": ASK, "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": ASK, "tools": [{"type": "web_search"}]}, "tools[0]"),
    # the chat checks' errors name the Responses fields (flat tools and text.format)
    ({"input": ASK, "tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name"),
    ({"input": ASK, "text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format.schema"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    ({"input": ASK, "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": ASK, "background": True}, "background"),
    ({"input": ASK, "prompt_cache_key": 7}, "prompt_cache_key"),
    ({"input": ASK, "temperature": 3}, "temperature"),
    ({"input": ASK, "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": ASK, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": ASK, "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools"}},
     "tool_choice"),
    ({"input": [{"role": "user", "content": ASK}, {"type": "function_call_output", "call_id": "call_nope", "output": "sunny"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}]},
     "input[0].content[0]"),
    ({"input": ASK, "metadata": "x"}, "metadata"), ({"input": ASK, "metadata": {"a": 1}}, "metadata.a"),
    ({"input": ASK, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"), ({"input": ASK, "user": 123}, "user"),
    ({"input": ASK, "service_tier": "ultra"}, "service_tier"),
    ({"input": ASK, "stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"input": [{"role": "user", "content": "q"}, {"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[1].call_id"),
    # a tool's image output, which this text model cannot see (it was dropped: the model saw an empty result)
    ({"input": [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                                   "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": [
                    {"type": "input_text", "text": "see:"}, {"type": "input_image", "image_url": "data:x"}]}],
      "tools": [WEATHER]}, "input[2].output[1]"),
])
def test_bad_bodies_get_openai_shaped_400s(tiny_stack, body, param):
    r = httpx.post(tiny_stack.url + "/v1/responses", json={"model": tiny_stack.model, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_routes_and_queries_it_does_not_serve_are_openai_shaped_4xx(tiny_stack):
    api = client(tiny_stack)
    stored = api.responses.create(model=tiny_stack.model, input="Hi", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError, match="stream"):
        api.responses.retrieve(stored.id, stream=True)
    with pytest.raises(openai.BadRequestError, match="include"):
        api.responses.retrieve(stored.id, include=["message.output_text.logprobs"])
    assert api.responses.retrieve(stored.id, stream=False).id == stored.id
    for method, path, status in [("GET", "/v1/responses", 405), ("POST", "/v1/embeddings", 404),
                                 ("GET", f"/v1/responses/{stored.id}/input_items", 400),
                                 ("POST", f"/v1/responses/{stored.id}/cancel", 400),
                                 ("POST", "/v1/responses/resp_nope/cancel", 404)]:
        r = httpx.request(method, tiny_stack.url + path, json={}, timeout=30)
        assert r.status_code == status and r.json()["error"]["type"] == "invalid_request_error", r.text
    with pytest.raises(openai.BadRequestError, match="background"):
        api.responses.cancel(stored.id)
    for odd in ("a*b", "a%3Eb", "a%20b", "abc%0A", "a..b", "%00"):  # no key NATS stores: none stored (were 503s)
        for method in ("GET", "DELETE"):
            r = httpx.request(method, f"{tiny_stack.url}/v1/responses/{odd}", timeout=30)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (odd, r.text)
    for previous in ("", "a b", "x>"):
        r = httpx.post(tiny_stack.url + "/v1/responses", timeout=30, json={
            "model": tiny_stack.model, "input": "Hi", "max_output_tokens": 1, "previous_response_id": previous})
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", (previous, r.text)
    counted = api.responses.input_tokens.count(model=tiny_stack.model, input="Hi", instructions="Be brief.")
    answered = api.responses.create(model=tiny_stack.model, input="Hi", instructions="Be brief.", max_output_tokens=1)
    assert counted.input_tokens == answered.usage.input_tokens > 0
    r = httpx.get(tiny_stack.url + "/v1/messages/batches", timeout=30)  # Anthropic's prefix: its shape
    assert r.status_code == 404 and r.json()["type"] == "error"


def test_a_call_cut_by_max_output_tokens_is_incomplete(smol_stack):
    """A forced call whose arguments max_output_tokens cut short is an "incomplete" item (an agent loop must not
    run it); the whole ones before it stay "completed"."""
    api = client(smol_stack)
    cut = api.responses.create(model=smol_stack.model, input="What is the weather in Paris?", tools=[WEATHER],
                               tool_choice="required", max_output_tokens=40, temperature=0, store=False)
    calls = [item for item in cut.output if item.type == "function_call"]
    assert cut.status == "incomplete" and calls
    for call in calls:
        try:
            json.loads(call.arguments)
            assert call.status == "completed"
        except ValueError:
            assert call.status == "incomplete"
    assert calls[-1].status == "incomplete"


def test_fields_at_their_defaults_and_hints_are_taken(tiny_stack):
    """What Responses clients send beside the conversation: fields at their defaults (null, empty) and hints that
    change nothing in an answer here (a prompt-cache key, a service tier, an end user's id)."""
    body = {"model": tiny_stack.model, "input": ASK, "max_output_tokens": 2, "store": False, "include": [],
            "stream_options": None, "conversation": None, "prompt": None, "top_logprobs": 0,
            "max_tool_calls": None, "background": False, "prompt_cache_key": "conversation-7",
            "service_tier": "auto", "safety_identifier": "user-1",
            "reasoning": {"effort": None, "summary": None}}  # (what OpenAI echoes for a model that does not reason)
    r = httpx.post(tiny_stack.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text


def test_cache_salt_keeps_cached_blocks_among_responses_of_the_same_salt(tiny_stack):
    """vLLM's cache_salt on Responses too: a long input seen under another salt finds nothing cached."""
    text = " ".join(f"r{i}" for i in range(12))  # the tiny stack takes inputs of at most 64 tokens
    cached = []
    for salt in ("tenant-a", "tenant-b", "tenant-a"):
        body = {"model": tiny_stack.model, "input": text, "max_output_tokens": 1, "store": False, "cache_salt": salt}
        r = httpx.post(tiny_stack.url + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 200, r.text
        cached.append(r.json()["usage"]["input_tokens_details"]["cached_tokens"])
    assert cached[:2] == [0, 0] and cached[2] >= 16
    bad = httpx.post(tiny_stack.url + "/v1/responses", json={"model": tiny_stack.model, "input": text,
                                                             "cache_salt": ""}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt", bad.text


def test_stored_responses_are_shared_by_gateways_and_outlive_a_restart(tmp_path, tiny_model_dir):
    """Two gateways on one bus share the stored responses (across a restart of one); then a deployment stop
    asked of one makes the other refuse new inference at once (it took requests it could not finish until the
    services stopped), its stream in flight running to its end."""
    cluster = Cluster(tmp_path, tiny_model_dir, engines=1, tokenizers=1)
    second = None
    try:
        cluster.wait_ready()
        config = json.loads(cluster.config.read_text())
        config["ServerConfig"].update(port=free_port(), managementPort=free_port(), metricsPort=free_port())
        (tmp_path / "second.json").write_text(json.dumps(config))
        url2 = f"http://127.0.0.1:{config['ServerConfig']['port']}"
        second = subprocess.Popen([sys.executable, "-m", "switchboard.cli", "gateway", "--config",
                                   str(tmp_path / "second.json"), "--nats", cluster.url, "--name", "gateway-2"],
                                  stdout=open(tmp_path / "gateway-2.log", "ab"), stderr=subprocess.STDOUT,
                                  preexec_fn=die_with_parent)
        wait_ok(f"http://127.0.0.1:{config['ServerConfig']['managementPort']}/v2/health/ready")
        one = openai.OpenAI(base_url=cluster.base + "/v1", api_key="x", max_retries=0, timeout=60)
        two = openai.OpenAI(base_url=url2 + "/v1", api_key="x", max_retries=0, timeout=60)
        model = config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelName"]
        first = one.responses.create(model=model, input="Hello", temperature=0, max_output_tokens=4)
        follow = two.responses.create(model=model, input="Again", previous_response_id=first.id, temperature=0,
                                      max_output_tokens=4)
        alone = two.responses.create(model=model, input="Again", temperature=0, max_output_tokens=4, store=False)
        assert follow.usage.input_tokens > alone.usage.input_tokens  # it saw the first turn
        assert two.responses.retrieve(first.id).output_text == first.output_text
        cluster.kill("gateway")
        cluster.start("gateway")
        cluster.wait_ready()
        assert one.responses.retrieve(follow.id).output_text == follow.output_text
        one.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            two.responses.retrieve(first.id)
        stop_one_and_see_the_other_refuse(cluster.mgmt, url2, f"http://127.0.0.1:{config['ServerConfig']['managementPort']}")
    finally:
        if second is not None:
            os.kill(second.pid, signal.SIGTERM)
            second.wait(15)
        cluster.stop()


def stop_one_and_see_the_other_refuse(mgmt_one: str, url_two: str, mgmt_two: str) -> None:
    import threading
    import time

    long = {"inputs": "My name is", "parameters": {"max_new_tokens": 300, "do_sample": False}}
    streamed: list[str] = []
    with httpx.stream("POST", url_two + "/generate_stream", json=long, timeout=60) as stream:
        chunks = stream.iter_text()
        streamed.append(next(chunks))
        stopper = threading.Thread(target=lambda: httpx.get(mgmt_one + "/stopService", timeout=60))
        stopper.start()
        deadline = time.monotonic() + 5
        while httpx.get(mgmt_two + "/v2/health/ready", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "the other gateway still says it is ready"
            time.sleep(0.05)
        refused = httpx.post(url_two + "/generate", json={"inputs": "hi"}, timeout=10)
        assert refused.status_code == 503, refused.text
        streamed.extend(chunks)
    stopper.join(60)
    assert '"generated_text":"' in "".join(streamed).replace(" ", "")  # the stream in flight ran to its end


def wait_ok(url: str, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} not ready after {timeout} s"
        time.sleep(0.2)
