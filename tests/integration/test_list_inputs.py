"""The list form of inputs (seed 003, reference §2.6) in every family that allows it, through all four
services: a text-only list answers exactly like its joined string; MindIE's shape errors are each
family's 4xx; an unsafe media item gets the safety refusal that says why, before anything is fetched;
a safe one gets the text-only refusal (the served model is text-only)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from text_generation import Client

from tests.integration.stack import post, running_stack, sse_events
from tests.integration.test_triton_api import sse_blocks
from tests.media_items import PNG_URL, image, text

PROMPT = "My name is Olivier and I"
PIECES = ["My name ", "is Olivier", " and I"]  # joined with no separator: PROMPT
GREEDY = {"do_sample": False, "max_new_tokens": 8}
ALLOWED_HOST = "images.example.com"


class Recorder:
    """An HTTP server on 127.0.0.1 that answers every GET with ``body`` and records the paths asked for
    (here no media URL may ever reach it)."""

    def __init__(self, body: bytes = b"\x89PNG\r\n\x1a\n"):
        hits = self.hits = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def recorder():
    rec = Recorder()
    yield rec
    rec.server.shutdown()


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    """A media root with cat.png, clip.mp4, talk.wav, tool.exe, a sparse 21 MB big.png and a link escaping
    to ../outside.png."""
    base = tmp_path_factory.mktemp("media")
    root = base / "root"
    root.mkdir()
    (root / "cat.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    (root / "clip.mp4").write_bytes(b"\0\0\0\x18ftypmp42")
    (root / "talk.wav").write_bytes(b"RIFF\0\0\0\0WAVE")
    (root / "tool.exe").write_bytes(b"MZ")
    with open(root / "big.png", "wb") as f:
        f.truncate(21 * 1024 * 1024)
    (base / "outside.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (root / "link.png").symlink_to(base / "outside.png")
    return root


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir, media_root):
    with running_stack(tmp_path_factory.mktemp("list-inputs"), tiny_model_dir,
                       ServerConfig={"maxRequestLength": 1},
                       Switchboard={"mediaRoot": str(media_root), "allowedMediaDomains": [ALLOWED_HOST, "localhost"]},
                       **{"BackendConfig.ModelDeployConfig": {"maxInputTokenLen": 64}}) as stack:
        yield stack


def pieces() -> list[dict]:
    return [text(p) for p in PIECES]


# ---- a text-only list answers like its string, in every family --------------------------------


def test_tgi_text_list_equals_the_string_on_every_route(stack):
    by_client = Client(stack.url).generate(PROMPT, max_new_tokens=8, do_sample=False)
    expected = by_client.generated_text
    for inputs in (PROMPT, pieces()):
        root = post(stack, "/", {"inputs": inputs, "parameters": {**GREEDY, "details": True}})
        assert root.status_code == 200, root.text
        assert root.json()[0]["generated_text"] == expected
        assert [t["id"] for t in root.json()[0]["details"]["tokens"]] == [t.id for t in by_client.details.tokens]
        assert post(stack, "/generate", {"inputs": inputs, "parameters": GREEDY}).json()["generated_text"] == expected
        events = sse_events(post(stack, "/generate_stream", {"inputs": inputs, "parameters": GREEDY}).text)
        assert events[-1]["generated_text"] == expected


def test_tgi_return_full_text_uses_the_joined_text(stack):
    full = post(stack, "/generate", {"inputs": pieces(), "parameters": {**GREEDY, "return_full_text": True}})
    plain = post(stack, "/generate", {"inputs": PROMPT, "parameters": {**GREEDY, "return_full_text": True}})
    assert full.status_code == 200 and full.json() == plain.json()


def test_native_text_list_equals_the_string(stack):
    def infer(inputs, stream=False):
        return post(stack, "/infer", {"inputs": inputs, "stream": stream, "parameters": {**GREEDY, "details": True}})
    plain, listed = infer(PROMPT).json(), infer(pieces()).json()
    assert listed["generated_text"] == plain["generated_text"]
    assert listed["details"]["generated_token_ids"] == plain["details"]["generated_token_ids"]
    assert sse_events(infer(pieces(), True).text)[-1]["generated_text"] == plain["generated_text"]


def test_triton_text_list_equals_the_string(stack):
    path = f"/v2/models/{stack.model}/generate"
    by_string = post(stack, path, {"text_input": PROMPT, "parameters": GREEDY}).json()["text_output"]
    listed = post(stack, path, {"text_input": pieces(), "parameters": GREEDY})
    assert listed.status_code == 200, listed.text
    assert listed.json()["text_output"] == by_string
    streamed = post(stack, path + "_stream", {"text_input": pieces(), "parameters": GREEDY})
    assert "".join(e["text_output"] for e in sse_blocks(streamed.text)) == by_string


def test_vllm_text_list_equals_the_string(stack):
    body = {"max_tokens": 8, "temperature": 0}
    by_string = post(stack, "/generate", {"prompt": PROMPT, **body})
    listed = post(stack, "/generate", {"prompt": pieces(), **body})
    assert listed.status_code == 200, listed.text
    assert listed.json() == by_string.json() and listed.json()["text"][0].startswith(PROMPT + " ")


def test_openai_chat_text_parts_equal_the_string(stack):
    api = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=60)
    def ask(content):
        return api.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": content}],
                                           max_tokens=8, temperature=0)
    plain = ask(PROMPT)
    parts = ask([{"type": "text", "text": p} for p in PIECES])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


# ---- MindIE's shape errors --------------------------------------------------------------------

MINDIE_ROUTES = ["/", "/generate", "/generate_stream", "/infer", "vllm", "triton"]
SHAPE_ERRORS = [
    ([], "arr is empty"),
    ([text("a"), {"type": "text", "text": 5}], "Request param text must be string"),
    ([text("a"), {"type": "image_url"}], "Request param image_url null"),
    ([text("a"), {"type": "image_url", "image_url": None}], "Request param image_url null"),
    ([text("a"), {"type": "video_url", "video_url": None}], "Request param video_url null"),
    ([text("a"), {"type": "audio_url", "audio_url": {"url": None}}], "Request param audio_url null"),
    ([text("a")] + [image(PNG_URL)] * 21, "The number of multimodal url should be no more than 20"),
    ([{"type": "picture", "picture": "x"}], "type must be one of"),
    (["plain string item"], "must be an object"),
]


def send(stack, route: str, items, parameters=None) -> httpx.Response:
    """``items`` as the list input of a MindIE-family route (TGI, native, vLLM, Triton)."""
    parameters = parameters or {"max_new_tokens": 2}
    if route == "vllm":
        return post(stack, "/generate", {"prompt": items, "max_tokens": 2})
    if route == "triton":
        return post(stack, f"/v2/models/{stack.model}/generate", {"text_input": items, "parameters": parameters})
    return post(stack, route, {"inputs": items, "parameters": parameters})


def assert_422(r: httpx.Response, route: str, fragment: str) -> str:
    assert r.status_code == 422, (route, r.text)
    body = r.json()
    assert set(body) == {"error", "error_type"}, body
    tgi = route in ("/", "/generate", "/generate_stream")
    assert body["error_type"] == ("validation" if tgi else "Input Validation Error"), (route, body)
    assert fragment in body["error"], (route, body["error"])
    return body["error"]


@pytest.mark.parametrize("items, fragment", SHAPE_ERRORS, ids=lambda v: str(v)[:40])
def test_shape_errors_are_422_in_every_mindie_family(stack, items, fragment):
    for route in MINDIE_ROUTES:
        assert_422(send(stack, route, items), route, fragment)


@pytest.mark.parametrize("items, fragment", SHAPE_ERRORS, ids=lambda v: str(v)[:40])
def test_shape_errors_are_openai_400s_naming_the_param(stack, items, fragment):
    fragment = "Request param content len should not be 0" if not items else fragment
    r = post(stack, "/v1/chat/completions", {"model": stack.model, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": items}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error", error
    assert error["param"].startswith("messages[1].content"), error


# ---- media: the safety refusal first, then the text-only one ----------------------------------


def unsafe_sources(port: int) -> list[tuple[str, str]]:
    """(source, why) for items shared.media refuses; every URL would reach the recorder."""
    return [
        ("../outside.png", "'..'"),
        ("sub/../../outside.png", "'..'"),
        ("/etc/hostname.png", "outside the media root"),
        ("link.png", "outside the media root"),
        ("tool.exe", "extension .exe"),
        ("big.png", "more than the 20 MB limit"),
        (f"http://127.0.0.1:{port}/cat.png", "loopback"),
        (f"http://[::1]:{port}/cat.png", "loopback"),
        (f"http://2130706433:{port}/cat.png", "loopback"),
        ("http://169.254.169.254/latest/meta-data/cat.png", "link-local"),
        ("http://10.0.0.7/cat.png", "private"),
        (f"http://evil.example.net:{port}/cat.png", "not on the media allow-list"),
        (f"http://user:pw@{ALLOWED_HOST}/cat.png", "user name or password"),
        (f"ftp://{ALLOWED_HOST}/cat.png", "scheme"),
        ("data:image/bmp;base64,Qk0AAAAAAAAAAA==", "data: URL type image/bmp"),
    ]


def test_unsafe_items_get_the_safety_4xx_before_any_fetch(stack, media_root, recorder):
    outside = str(media_root.parent / "outside.png")
    for source, why in unsafe_sources(recorder.port) + [(outside, "outside the media root")]:
        for route in MINDIE_ROUTES:
            message = assert_422(send(stack, route, [text("What is this?"), image(source)]), route, why)
            assert "text-only" not in message and "media item 0" in message
    assert recorder.hits == []


def test_unsafe_items_in_chat_are_openai_400s_naming_the_part(stack, recorder):
    for source, why in unsafe_sources(recorder.port):
        content = [text("What is this?"), {"type": "image_url", "image_url": {"url": source}}]
        r = post(stack, "/v1/chat/completions", {"model": stack.model, "messages": [
            {"role": "user", "content": [text("Hi")]}, {"role": "user", "content": content}]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert why in error["message"] and error["param"] == "messages[1].content[1]", error
    assert recorder.hits == []


def safe_sources(port: int) -> list[str]:
    """Images the media policy admits: without a vision-language model each gets the text-only refusal."""
    return ["cat.png", PNG_URL, f"https://{ALLOWED_HOST}/cat.png", f"https://cdn.{ALLOWED_HOST}/a.jpg",
            f"http://localhost:{port}/cat.png"]


def input_key(route: str) -> str:
    return {"vllm": "prompt", "triton": "text_input"}.get(route, "inputs")


def test_a_safe_item_gets_the_text_only_422_in_every_family(stack, media_root, recorder):
    for source in safe_sources(recorder.port) + [str(media_root / "cat.png")]:
        for route in MINDIE_ROUTES:
            message = assert_422(send(stack, route, [text("What is this?"), image(source)]), route, "text-only")
            assert message == f"{input_key(route)}[1]: image inputs are not supported: the served model is text-only."
    for kind, source in (("video", "clip.mp4"), ("audio", "talk.wav")):
        r = send(stack, "/generate", [{"type": f"{kind}_url", f"{kind}_url": source}, text("What is this?")])
        assert assert_422(r, "/generate", "text-only").startswith(f"inputs[0]: {kind} inputs are not supported")
    assert recorder.hits == []


def test_a_safe_item_in_chat_gets_the_text_only_400(stack, recorder):
    api = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=60)
    for source in safe_sources(recorder.port):
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(model=stack.model, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": source}}]}])
        error = caught.value.body
        assert "the served model is text-only" in error["message"] and error["param"] == "messages[0].content[1]"
    assert recorder.hits == []


def test_still_serving_afterwards(stack):
    r = post(stack, "/generate", {"inputs": pieces(), "parameters": GREEDY})
    assert r.status_code == 200, r.text
