"""Images through all four services on a SmolVLM (Idefics3) folder whose text model is the real SmolLM2:
every family's outputs for a prompt with images equal transformers' own ``generate`` token for token;
the same image as a data: URL, a local path under the media root, an allowed URL and TGI's markdown
``![](…)`` in ``inputs`` gives the same tokens; two images give different outputs; text-only and image
requests running together each answer as alone; a kind the model does not take and bytes that are no
image are 422s, and unsafe items are refused before anything is fetched; a media server that never answers
holds neither text nor other media requests, and its request ends with the fetch's 422, not the gateway's 503."""

from __future__ import annotations

import base64
import io
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from text_generation import Client
from transformers import AutoTokenizer

from tests.integration.stack import post, running_stack, sse_events
from tests.integration.test_list_inputs import Recorder, assert_422, send
from tests.media_items import image, text
from tests.media_items import data_url, png_bytes, test_image
from tests.vlm_oracles import hf_generate, placeholder

NEW = 12
GREEDY = {"max_new_tokens": NEW, "do_sample": False}
CAT, DOG = test_image(1), test_image(2)
SILENT_WAIT_S = 31  # just past the 30 s a tokenizer has to answer a request without media


@pytest.fixture(scope="module")
def server():
    srv = Recorder(png_bytes(CAT))
    yield srv
    srv.server.shutdown()


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-media")
    (root / "cat.png").write_bytes(png_bytes(CAT))
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    (root / "clip.mp4").write_bytes(b"\0\0\0\x18ftypmp42")
    return root


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smolvlm_dir, media_root):
    with running_stack(tmp_path_factory.mktemp("vision"), smolvlm_dir,
                       Switchboard={"mediaRoot": str(media_root), "allowedMediaDomains": ["localhost"],
                                    "allowPrivateMediaAddresses": ["127.0.0.0/8"],
                                    "mediaFetchTimeoutSeconds": SILENT_WAIT_S}) as stack:
        yield stack


@pytest.fixture(scope="module")
def want(smolvlm_dir):
    """transformers' greedy tokens, per image, for "Describe <image> briefly." as a raw prompt."""
    prompt = f"Describe {placeholder(smolvlm_dir)} briefly."
    return {name: hf_generate(smolvlm_dir, [img], text=prompt, max_new_tokens=NEW)
            for name, img in (("cat", CAT), ("dog", DOG))}


def described(source: str) -> list[dict]:
    return [text("Describe "), image(source), text(" briefly.")]


def tgi_ids(stack, inputs) -> list[int]:
    r = post(stack, "/generate", {"inputs": inputs, "parameters": {**GREEDY, "details": True}})
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


@pytest.fixture(scope="module")
def silent_request(stack):
    """A request whose image is on a server that accepts connections (the kernel's backlog) and never answers,
    sent in the background: the module's other tests run while its fetch waits SILENT_WAIT_S."""
    silent = socket.create_server(("127.0.0.1", 0))
    pool = ThreadPoolExecutor(1)
    pending = pool.submit(send, stack, "/generate", described(f"http://localhost:{silent.getsockname()[1]}/cat.png"))
    time.sleep(1.0)
    yield pending
    pending.result(timeout=SILENT_WAIT_S + 30)
    pool.shutdown()
    silent.close()


def test_a_media_server_that_never_answers_holds_no_other_request(stack, want, silent_request):
    """Before: the tokenizer fetched inside its request callback, so every request waited behind the fetch
    (503s after 30 s)."""
    for _ in range(3):
        started = time.monotonic()
        r = post(stack, "/generate", {"inputs": "Hello", "parameters": GREEDY}, timeout=10)
        assert r.status_code == 200 and time.monotonic() - started < 10, r.text
    r = post(stack, "/generate", {"inputs": described(data_url(CAT)), "parameters": {**GREEDY, "details": True}},
             timeout=20)
    assert [t["id"] for t in r.json()["details"]["tokens"]] == want["cat"]
    assert not silent_request.done()


def test_tgi_image_equals_transformers_from_every_source(stack, media_root, server, want):
    sources = [data_url(CAT), "cat.png", str(media_root / "cat.png"), f"http://localhost:{server.port}/cat.png"]
    for source in sources:
        assert tgi_ids(stack, described(source)) == want["cat"], source
    assert server.hits == ["/cat.png"]
    markdown = f"Describe ![]({data_url(CAT)}) briefly."
    assert tgi_ids(stack, markdown) == want["cat"]
    by_client = Client(stack.url, timeout=60).generate(markdown, **GREEDY)
    assert [t.id for t in by_client.details.tokens] == want["cat"]


def test_two_images_give_different_outputs(stack, want):
    assert want["cat"] != want["dog"]
    assert tgi_ids(stack, described(data_url(DOG))) == want["dog"]


def test_stream_native_vllm_and_triton_equal_transformers(stack, smolvlm_dir, want):
    tok = AutoTokenizer.from_pretrained(smolvlm_dir)
    expected = tok.decode(want["cat"], skip_special_tokens=True)
    items = described(data_url(CAT))
    events = sse_events(post(stack, "/generate_stream", {"inputs": items, "parameters": GREEDY}).text)
    assert [e["token"]["id"] for e in events] == want["cat"]
    infer = post(stack, "/infer", {"inputs": items, "stream": False, "parameters": {**GREEDY, "details": True}})
    assert infer.status_code == 200, infer.text
    assert infer.json()["details"]["generated_token_ids"] == want["cat"]
    vllm = post(stack, "/generate", {"prompt": items, "max_tokens": NEW, "temperature": 0})
    assert vllm.status_code == 200, vllm.text
    assert vllm.json()["text"][0].endswith(expected)
    triton = post(stack, f"/v2/models/{stack.model}/generate", {"text_input": items, "parameters": GREEDY})
    assert triton.status_code == 200, triton.text
    assert triton.json()["text_output"] == expected


def test_openai_client_chat_with_an_image_equals_transformers(stack, smolvlm_dir):
    question = "What is in this image?"
    messages = [{"role": "user", "content": [{"type": "text", "text": question}, {"type": "image"}]}]
    expected = hf_generate(smolvlm_dir, [CAT], messages=messages, max_new_tokens=NEW)
    api = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=60)
    conversation = [{"role": "user", "content": [{"type": "text", "text": question},
                                                 {"type": "image_url", "image_url": {"url": data_url(CAT)}}]}]
    out = api.chat.completions.create(model=stack.model, max_tokens=NEW, temperature=0, messages=conversation)
    tok = AutoTokenizer.from_pretrained(smolvlm_dir)
    assert out.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
    assert out.usage.prompt_tokens > 20  # the image's tokens count as prompt tokens
    counted = httpx.post(stack.url + "/tokenize", json={"messages": conversation}, timeout=60).json()
    assert counted["count"] == out.usage.prompt_tokens == len(counted["tokens"])  # vLLM's /tokenize, image included


def test_anthropic_client_with_an_image_block_equals_transformers(stack, smolvlm_dir):
    import anthropic

    question = "What is in this image?"
    messages = [{"role": "user", "content": [{"type": "text", "text": question}, {"type": "image"}]}]
    expected = AutoTokenizer.from_pretrained(smolvlm_dir).decode(
        hf_generate(smolvlm_dir, [CAT], messages=messages, max_new_tokens=NEW), skip_special_tokens=True)
    api = anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0, timeout=60)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png_bytes(CAT)).decode()}
    conversation = [{"role": "user", "content": [{"type": "text", "text": question},
                                                 {"type": "image", "source": source}]}]
    out = api.messages.create(model=stack.model, max_tokens=NEW, extra_body={"temperature": 0}, messages=conversation)
    assert out.content[0].text == expected and out.stop_reason in ("max_tokens", "end_turn")
    counted = api.messages.count_tokens(model=stack.model, messages=conversation)
    assert counted.input_tokens == out.usage.input_tokens > 20  # the image's tokens counted as the request's
    lossless = io.BytesIO()
    CAT.save(lossless, format="WEBP", lossless=True)  # WebP (and GIF), as Anthropic's API takes them: same pixels
    source.update(media_type="image/webp", data=base64.b64encode(lossless.getvalue()).decode())
    webp = api.messages.create(model=stack.model, max_tokens=NEW, extra_body={"temperature": 0}, messages=conversation)
    assert webp.content[0].text == expected


def test_text_and_image_requests_together_answer_as_alone(stack, want):
    plain = {"inputs": "The capital of France is", "parameters": {**GREEDY, "details": True}}
    alone = [t["id"] for t in post(stack, "/generate", plain).json()["details"]["tokens"]]
    jobs = [("plain", plain), ("cat", {"inputs": described(data_url(CAT))}), ("dog", {"inputs": described(data_url(DOG))})]
    jobs = jobs * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: (job[0], post(stack, "/generate", {
            "inputs": job[1]["inputs"], "parameters": {**GREEDY, "details": True}})), jobs))
    for name, r in results:
        assert r.status_code == 200, r.text
        ids = [t["id"] for t in r.json()["details"]["tokens"]]
        assert ids == (alone if name == "plain" else want[name]), name


def test_what_the_model_cannot_take_is_a_422(stack, server):
    r = send(stack, "/generate", [text("What is this?"), {"type": "video_url", "video_url": "clip.mp4"}])
    assert assert_422(r, "/generate", "video inputs are not supported: the served model takes image inputs only")
    broken = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode()
    for source in (broken, "broken.png"):
        assert_422(send(stack, "/generate", described(source)), "/generate", "the image cannot be decoded")
        chat = {"model": stack.model, "max_tokens": 2, "messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": source}}]}]}
        r = post(stack, "/v1/chat/completions", chat)  # the tokenizer's refusal names the item's place
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[2].content[1]", r.text
        r = post(stack, "/v1/responses", {"model": stack.model, "max_output_tokens": 2, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": source}]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0]", r.text
    for source, why in (("../cat.png", "'..'"), (f"http://127.0.0.2:{server.port}/x.png", "not on the media allow-list"),
                        ("http://169.254.169.254/cat.png", "link-local")):
        assert_422(send(stack, "/generate", described(source)), "/generate", why)
    assert server.hits.count("/x.png") == 0
    assert post(stack, "/generate", {"inputs": described(data_url(CAT)), "parameters": GREEDY}).status_code == 200


def test_a_request_whose_media_server_never_answers_ends_with_its_fetchs_422(silent_request):
    """Before: the gateway gave up on the tokenizer at 30 s (a 503), before the fetch's own timeout."""
    assert_422(silent_request.result(timeout=SILENT_WAIT_S + 30), "/generate", f"timed out after {SILENT_WAIT_S} s")


def test_the_text_before_an_image_is_served_from_the_prefix_cache(stack, smolvlm_dir):
    """Before: a prompt with an image keyed every block with the image, so a long system prompt was computed again
    for every image (and blocks computed for image requests were never a text request's). Now the blocks before
    the first image token are the text's, and the answer is still transformers' own."""
    system = {"role": "system", "content": "You are a careful assistant who describes pictures. " * 12}
    question = [{"type": "text", "text": "What is in this image?"}]
    text_only = post(stack, "/v1/chat/completions", {"model": stack.model, "max_tokens": 2, "temperature": 0,
                                                     "messages": [system, {"role": "user", "content": "Hello"}]})
    assert text_only.status_code == 200, text_only.text
    api = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=60)
    conversation = [system, {"role": "user", "content": question + [{"type": "image_url",
                                                                      "image_url": {"url": data_url(DOG)}}]}]
    out = api.chat.completions.create(model=stack.model, max_tokens=NEW, temperature=0, messages=conversation)
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * 5, out.usage  # the system prompt's blocks (about 130 tokens), not the image's
    expected = hf_generate(smolvlm_dir, [DOG], messages=[system, {"role": "user", "content": question + [
        {"type": "image"}]}], max_new_tokens=NEW)
    tok = AutoTokenizer.from_pretrained(smolvlm_dir)
    assert out.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)


def test_a_tools_screenshot_reaches_the_model_from_anthropic_responses_and_openai_alike(stack):
    """A tool that answers with an image (a screenshot): Anthropic's tool_result image block, the Responses API's
    input_image in a function_call_output, OpenAI chat's tool message with an image_url (before: 400s on the
    first two, "a tool's output is given to the model as text here")."""
    tool = {"name": "screenshot", "description": "Take a screenshot", "input_schema": {"type": "object"}}
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png_bytes(CAT)).decode()}
    anthropic_body = {"model": stack.model, "max_tokens": NEW, "temperature": 0, "tools": [tool], "messages": [
        {"role": "user", "content": "What is on screen?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "Here it is"}, {"type": "image", "source": source}]}]}]}
    anthropic = post(stack, "/v1/messages", anthropic_body)
    assert anthropic.status_code == 200, anthropic.text
    function = {"type": "function", "name": "screenshot", "parameters": {"type": "object"}}
    responses = post(stack, "/v1/responses", {"model": stack.model, "max_output_tokens": NEW, "temperature": 0,
                                              "store": False, "tools": [function], "input": [
        {"role": "user", "content": "What is on screen?"},
        {"type": "function_call", "call_id": "toolu_1", "name": "screenshot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "toolu_1", "output": [
            {"type": "input_text", "text": "Here it is"}, {"type": "input_image", "image_url": data_url(CAT)}]}]})
    assert responses.status_code == 200, responses.text
    chat = post(stack, "/v1/chat/completions", {"model": stack.model, "max_tokens": NEW, "temperature": 0, "tools": [
        {"type": "function", "function": {"name": "screenshot", "parameters": {"type": "object"}}}], "messages": [
        {"role": "user", "content": "What is on screen?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
            "name": "screenshot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": [
            {"type": "text", "text": "Here it is"}, {"type": "image_url", "image_url": {"url": data_url(CAT)}}]}]})
    assert chat.status_code == 200, chat.text
    prompt_tokens = chat.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 60  # the image's tokens are in the prompt
    assert anthropic.json()["usage"]["input_tokens"] == responses.json()["usage"]["input_tokens"] == prompt_tokens
