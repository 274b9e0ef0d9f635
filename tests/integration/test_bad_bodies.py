"""Every bad body on every POST route that reads JSON is a 4xx in the called family's shape, never a 500.

A fixed table (deep nesting, bytes that are not UTF-8, NaN/Infinity, numbers no 64-bit type holds,
a top level that is not an object, empty and truncated bodies, a huge key, a body over the limit) is
sent to every route; then each route's valid body is rewritten at every key, at every depth, with a
value of each wrong JSON type, and each of its strings made huge. A few rewrites are still valid (null
means "the default", a long prompt may be tokenized): those may succeed, but nothing
may fail with a 5xx or an error body of another family's shape. Afterwards each valid body succeeds.
"""

from __future__ import annotations

import copy
import gzip
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import httpx
import pytest

from tests.integration.stack import running_stack

MAX_REQUEST_MB = 1
HUGE_FLOAT, NOT_A_NUMBER, INFINITY = "\x00huge\x00", "\x00nan\x00", "\x00inf\x00"
LITERALS = {json.dumps(HUGE_FLOAT): "1e400", json.dumps(NOT_A_NUMBER): "NaN", json.dumps(INFINITY): "-Infinity"}
WRONG_VALUES = [{}, [], "x", True, None, -1, 0.5, 2**70, {"k": [{}]}, [[None]], HUGE_FLOAT, NOT_A_NUMBER, INFINITY]
ROLE_V1 = {"local": {"server_ip": "10.0.0.1", "device": [{"device_ip": "10.0.1.1", "device_logical_id": "0"}]},
           "peers": [{"server_ip": "10.0.0.2", "device": [{"device_ip": "10.0.1.2"}]}]}
ROLE_V2 = {"local": [{"server_ip": "10.0.0.1", "host_ip": "10.0.0.1", "dp_inst_list": [
    {"dp_inst_id": "0", "device": [{"device_id": "0", "device_ip": "10.0.1.1", "rank_id": "0"}]}]}], "peers": []}


@dataclass(frozen=True)
class Route:
    path: str
    family: str  # openai, tgi, mindie (native, Triton, vLLM) or role
    body: dict[str, Any]  # a valid body
    plane: str = "business"


def routes(model: str) -> list[Route]:
    tgi = {"inputs": "Hello", "parameters": {"max_new_tokens": 1, "do_sample": False, "stop": ["zz"], "top_k": 5,
                                             "details": True, "truncate": 8}, "stream": False}
    triton_text = {"id": "t1", "text_input": "Hello", "parameters": {"max_new_tokens": 1, "details": True,
                                                                      "priority": 3}}
    tgi_list = {**tgi, "inputs": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}
    return [
        Route("/", "tgi", tgi),
        Route("/", "tgi", tgi_list),
        Route("/generate", "tgi", tgi),
        Route("/generate_stream", "tgi", {**tgi, "stream": True}),
        Route("/generate", "mindie", {"prompt": "Hello", "model": model, "max_tokens": 1, "temperature": 0.5,
                                      "top_k": 5, "stop": ["zz"], "stop_token_ids": [5], "stream": False}),
        Route("/v1/chat/completions", "openai", {
            "model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_tokens": 1, "stop": ["zz"], "response_format": {"type": "text"}, "tools": [],
            "chat_template_kwargs": {"enable_thinking": False}, "logprobs": True, "top_logprobs": 1}),
        Route("/v1/completions", "openai", {"model": model, "prompt": ["Hi", "there"], "max_tokens": 1,
                                            "logprobs": 1, "stop": "zz", "seed": 7, "stream": False}),
        Route("/v1/completions", "openai", {"model": model, "prompt": [[1, 2], [3]], "max_tokens": 1,
                                            "stream": True, "stream_options": {"include_usage": True}}),
        Route("/infer", "mindie", {"inputs": [{"type": "text", "text": "Hi"}],
                                   "parameters": {"max_new_tokens": 1, "priority": 3, "timeout": 30}}),
        Route("/infer_token", "mindie", {"input_id": [1, 2, 3], "parameters": {"max_new_tokens": 1},
                                         "stream": False}),
        Route("/v1/tokenizer", "mindie", {"inputs": "Hi there", "do_decode": True}),
        Route(f"/v2/models/{model}/infer", "mindie", {
            "id": "i1", "inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32", "data": [[1, 2, 3]]}],
            "outputs": [{"name": "output0", "parameters": {"binary_data": False}}],
            "parameters": {"max_new_tokens": 1}}),
        Route(f"/v2/models/{model}/generate", "mindie", triton_text),
        Route(f"/v2/models/{model}/generate_stream", "mindie", triton_text),
        Route(f"/v2/models/{model}/generate", "mindie", {**triton_text, "text_input": [{"type": "text", "text": "Hi"}]}),
        Route("/generate", "mindie", {"prompt": [{"type": "text", "text": "Hello"}], "max_tokens": 1}),
        Route(f"/v2/models/{model}/stopInfer", "mindie", {"id": "nobody"}),
        Route("/v1/role/flex", "role", ROLE_V1, "management"),
        Route("/v2/role/prefill", "role", ROLE_V2, "management"),
    ]


def fixed_table(valid: dict[str, Any]) -> list[tuple[str, bytes]]:
    """Bodies that are bad on every route, whatever it expects."""
    key = next(iter(valid))
    text = json.dumps(valid).encode()
    return [
        ("nested 10000 deep", b"[" * 10_000 + b"]" * 10_000),
        ("nested 10000 deep in a key", b'{"%s": ' % key.encode() + b"[" * 10_000 + b"]" * 10_000 + b"}"),
        ("nested objects 10000 deep", b'{"a":' * 10_000 + b"1" + b"}" * 10_000),
        ("unclosed nesting", b'{"a":' + b"[" * 100_000),
        ("not UTF-8", b"\xff\xfe{}"),
        ("not UTF-8 in a string", b'{"%s": "\xc3\x28"}' % key.encode()),
        ("lone surrogate", b'{"%s": "\\ud800"}' % key.encode()),
        ("NaN", b'{"%s": NaN}' % key.encode()),
        ("Infinity", b'{"%s": Infinity}' % key.encode()),
        ("-Infinity", b'{"%s": -Infinity}' % key.encode()),
        ("1e400", b'{"%s": 1e400}' % key.encode()),
        ("2**70", b'{"%s": %d}' % (key.encode(), 2**70)),
        ("-2**64", b'{"%s": %d}' % (key.encode(), -(2**64))),
        ("5000 digits", b'{"%s": %s}' % (key.encode(), b"9" * 5000)),
        ("array", b"[]"), ("string", b'"x"'), ("null", b"null"), ("number", b"3"), ("true", b"true"),
        ("empty", b""), ("blank", b" \r\n"), ("empty object", b"{}"),
        ("truncated", text[: len(text) // 2]), ("trailing garbage", text + b"x"), ("two objects", text + text),
        ("huge key", json.dumps({"k" * 900_000: 1}).encode()),
        ("too large", b'{"%s": "%s"}' % (key.encode(), b"z" * (MAX_REQUEST_MB * 1024 * 1024 + 10))),
    ]


def huge_strings(valid: dict[str, Any]) -> list[tuple[str, bytes]]:
    """Each string of a valid body made 200,000 characters long: refused where a limit is lower, else served."""
    return [(f"{'.'.join(map(str, path))} = 'y' * 200000", replaced(valid, path, "y" * 200_000))
            for path in paths(valid) if isinstance(value_at(valid, path), str)]


def value_at(body: Any, path: tuple) -> Any:
    for key in path:
        body = body[key]
    return body


def paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every key path and list index in a JSON value, depth first."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield (*prefix, key)
        yield from paths(child, (*prefix, key))


def replaced(body: dict[str, Any], path: tuple, value: Any) -> bytes:
    data = copy.deepcopy(body)
    value_at(data, path[:-1])[path[-1]] = value
    text = json.dumps(data)
    for marker, literal in LITERALS.items():
        text = text.replace(marker, literal)
    return text.encode()


def wrong_types(body: dict[str, Any]) -> list[tuple[str, bytes]]:
    return [(f"{'.'.join(map(str, path))} = {value!r}", replaced(body, path, value))
            for path in paths(body) for value in WRONG_VALUES]


def check_shape(route: Route, case: str, r: httpx.Response, may_succeed: bool) -> None:
    where = f"{route.path} [{route.family}] {case}: {r.status_code} {r.text[:300]}"
    if may_succeed and r.status_code == 200:
        return
    assert 400 <= r.status_code < 500, where
    assert r.headers["content-type"].startswith("application/json"), where
    body = r.json()
    if r.status_code == 413 and route.family != "openai":
        assert set(body) == {"message"}, where  # MindIE's own 413 shape (reference §2.2)
        return
    if route.family == "openai":
        assert r.status_code in (400, 404, 413), where
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, where
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], where
        return
    assert set(body) == {"error", "error_type"}, where
    assert all(isinstance(v, str) and v for v in body.values()), where
    if route.family == "tgi":
        assert r.status_code == 422 and body["error_type"] == "validation", where
    if route.family == "role":
        assert r.status_code == 422 and body["error_type"] == "Input validation error", where


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    with running_stack(tmp_path_factory.mktemp("bad-bodies"), tiny_model_dir,
                       ServerConfig={"maxRequestLength": MAX_REQUEST_MB},
                       **{"BackendConfig.ModelDeployConfig": {"maxInputTokenLen": 64}}) as stack:
        yield stack


def send_all(stack, route: Route, cases: list[tuple[str, bytes]], may_succeed: bool) -> int:
    base = stack.url if route.plane == "business" else stack.mgmt_url
    with httpx.Client(base_url=base, timeout=30, headers={"Content-Type": "application/json"}) as client:
        for case, body in cases:
            check_shape(route, case, client.post(route.path, content=body), may_succeed)
    return len(cases)


def test_every_bad_body_is_a_4xx_in_the_family_shape(stack):
    table = routes(stack.model)
    with ThreadPoolExecutor(4) as pool:
        fixed = pool.map(lambda r: send_all(stack, r, fixed_table(r.body), False), table)
        variants = pool.map(lambda r: send_all(stack, r, wrong_types(r.body) + huge_strings(r.body), True), table)
        sent = sum(fixed) + sum(variants)
    assert sent > 2000


def test_content_part_type_of_the_wrong_type_names_the_key(stack):
    for kind in ({}, [], 5, None):
        r = httpx.post(stack.url + "/v1/chat/completions", timeout=30,
                       json={"model": stack.model, "messages": [{"role": "user", "content": [{"type": kind}]}]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages[0].content[0].type", r.text


@pytest.mark.parametrize("body, problem", [
    (b"[" * 10_000, "deeper than 64 levels"),
    (b'{"inputs": "\xff"}', "not valid UTF-8"),
    (gzip.compress(b'{"inputs": "hi"}'), "gzip-compressed: this route takes JSON uncompressed"),
    (b'{"inputs": NaN}', "NaN is not a valid JSON number"),
    (b'{"inputs": -Infinity}', "-Infinity is not a valid JSON number"),
    (b'{"inputs": 1e400}', "too large for a 64-bit float"),
    (b'{"parameters": {"seed": 36893488147419103232}}', "parameters.seed is an integer outside the 64-bit range"),
    (b"[1]", "must be a JSON object, got array"),
    (b"", "empty"),
])
def test_the_message_names_the_problem(stack, body, problem):
    r = httpx.post(stack.url + "/infer", content=body, timeout=30)
    assert r.status_code == 422 and problem in r.json()["error"], r.text


def test_good_requests_still_succeed_afterwards(stack):
    for route in routes(stack.model):
        if route.path.endswith("/stopInfer"):
            continue  # a valid body naming no running request is a 404 by design
        base = stack.url if route.plane == "business" else stack.mgmt_url
        r = httpx.post(base + route.path, json=route.body, timeout=60)
        assert r.status_code == 200, f"{route.path}: {r.status_code} {r.text[:300]}"
