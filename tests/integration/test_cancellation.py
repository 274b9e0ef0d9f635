"""One lifecycle for every family: clients that go away at any moment free everything.

For each family (TGI, OpenAI chat and completions, vLLM, Triton, native) 10 streams and 10
non-stream requests are cancelled by their clients — some while waiting for one of maxLinkNum
slots, some before their first token, some mid-stream — and within 2 s nothing runs or waits in the
engine. Far more than maxLinkNum + 5 such cancellations later the server still serves maxLinkNum
requests at once, a request with more choices than maxLinkNum gets an answer, and /stopService drains.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.integration.stack import running_stack

MAX_LINK = 4
LONG = 1500  # tokens: far longer than any client here waits
PROMPT = "My name is Olivier and I"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    with running_stack(tmp_path_factory.mktemp("cancel"), tiny_model_dir,
                       ServerConfig={"maxLinkNum": MAX_LINK},
                       **{"BackendConfig.ScheduleConfig": {"maxIterTimes": LONG}}) as s:
        yield s


def requests_of(model: str) -> dict[str, tuple[str, dict, dict]]:
    """family -> (path, streaming body, non-streaming body), each asking for LONG tokens."""
    mindie = {"max_new_tokens": LONG}
    chat = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": LONG, "ignore_eos": True}
    completion = {"model": model, "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
    vllm = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
    triton = {"text_input": PROMPT, "parameters": mindie}
    messages = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": LONG,
                "temperature": 0}  # no ignore_eos in this API: greedy, which never draws the tiny model's EOS here
    responses = {"model": model, "input": PROMPT, "max_output_tokens": LONG, "store": False, "temperature": 0}
    return {
        "tgi": ("/generate_stream", {"inputs": PROMPT, "parameters": mindie}, {"inputs": PROMPT, "parameters": mindie}),
        "openai-chat": ("/v1/chat/completions", {**chat, "stream": True}, chat),
        "openai-completions": ("/v1/completions", {**completion, "stream": True}, completion),
        "anthropic": ("/v1/messages", {**messages, "stream": True}, messages),
        "openai-responses": ("/v1/responses", {**responses, "stream": True}, responses),
        "vllm": ("/generate", {**vllm, "stream": True}, vllm),
        "triton": (f"/v2/models/{model}/generate_stream", triton, triton),
        "native": ("/infer", {"inputs": PROMPT, "stream": True, "parameters": mindie},
                   {"inputs": PROMPT, "parameters": mindie}),
    }


def non_stream_path(family: str, path: str) -> str:
    return {"tgi": "/generate", "triton": path.replace("generate_stream", "generate")}.get(family, path)


async def stream_then_leave(url: str, body: dict, after: float) -> None:
    """Open a stream, read until ``after`` seconds have passed (or it is still waiting), then go away."""
    async with httpx.AsyncClient(timeout=30) as client:
        try:
            async with asyncio.timeout(after):
                async with client.stream("POST", url, json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    async for _ in r.aiter_bytes():
                        pass
        except TimeoutError:
            return
    raise AssertionError(f"{url} finished before its client left")


async def post_then_leave(url: str, body: dict, after: float) -> None:
    async with httpx.AsyncClient(timeout=after) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(url, json=body)


async def wait_idle(stack, within: float) -> None:
    """Within ``within`` s: /v1/status shows nothing running or waiting, and every KV block is free."""
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            status = (await client.get(stack.mgmt_url + "/v1/status")).json()["resource"]
            info = await stack.engine_info()
            if status["runningRequestNum"] == 0 and status["waitingRequestNum"] == 0 \
                    and info.running == 0 and info.waiting == 0 and info.free_blocks == info.total_blocks:
                return
            assert time.monotonic() < deadline, f"still busy {within} s after the clients left: {status}, {info}"
            await asyncio.sleep(0.05)


async def serves_max_link_at_once(stack) -> None:
    """maxLinkNum short requests at once all answer: no slot leaked."""
    async with httpx.AsyncClient(timeout=30) as client:
        replies = await asyncio.gather(*(client.post(stack.url + "/generate", json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": 3}}) for _ in range(MAX_LINK)))
    assert [r.status_code for r in replies] == [200] * MAX_LINK, [r.text for r in replies]


@pytest.mark.parametrize("family", ["tgi", "openai-chat", "openai-completions", "openai-responses", "anthropic", "vllm",
                                    "triton", "native"])
async def test_cancelled_requests_free_everything(stack, family):
    path, streaming, plain = requests_of(stack.model)[family]
    url = stack.url + path
    plain_url = stack.url + non_stream_path(family, path)
    # Staggered: the first ones hold the maxLinkNum slots, later ones wait for a slot when they leave
    # (10 at once: maxLinkNum in progress, the rest within the 2 x maxLinkNum queue).
    await asyncio.gather(*(stream_then_leave(url, streaming, 0.3 + 0.05 * i) for i in range(10)))
    await asyncio.gather(*(post_then_leave(plain_url, plain, 0.3 + 0.05 * i) for i in range(10)))
    await wait_idle(stack, within=2.0)
    await serves_max_link_at_once(stack)


async def test_leaving_before_the_first_token_and_after_the_last(stack):
    """A client gone at once (its request maybe not yet admitted) and one that read the whole stream."""
    url = stack.url + "/generate_stream"
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": LONG}}
    await asyncio.gather(*(stream_then_leave(url, body, 0.01) for _ in range(2 * MAX_LINK)))
    await asyncio.gather(*(stream_then_leave(url, body, 0.01) for _ in range(2 * MAX_LINK)))
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(url, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 5}})
        assert r.status_code == 200 and r.text.count("data: ") == 5
    await wait_idle(stack, within=2.0)
    await serves_max_link_at_once(stack)


async def test_more_choices_than_max_link_get_an_answer(stack):
    body = {"model": stack.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
            "temperature": 1.0}
    async with httpx.AsyncClient(timeout=30) as client:
        too_many = await client.post(stack.url + "/v1/chat/completions", json={**body, "n": MAX_LINK + 1})
        assert too_many.status_code == 400, too_many.text
        assert too_many.json()["error"]["param"] == "n" and "maxLinkNum" in too_many.json()["error"]["message"]
        fits = await client.post(stack.url + "/v1/chat/completions", json={**body, "n": MAX_LINK})
        assert fits.status_code == 200 and len(fits.json()["choices"]) == MAX_LINK
        vllm = await client.post(stack.url + "/generate", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0,
                                                                "n": 2, "best_of": MAX_LINK + 1})
        assert vllm.status_code == 422 and "maxLinkNum" in vllm.json()["error"], vllm.text


async def test_stop_service_still_drains_after_all_that(stack):
    """Last in this module: it stops the stack."""
    async with httpx.AsyncClient(timeout=60) as client:
        url = stack.url + "/generate_stream"
        stream = asyncio.create_task(client.post(url, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 40}}))
        await asyncio.sleep(0.2)
        stopped = await asyncio.wait_for(client.get(stack.mgmt_url + "/stopService"), 30)
        assert stopped.status_code == 200
        assert stream.done() and (await stream).text.count("data: ") == 40
    assert await asyncio.to_thread(stack.proc.wait, 30) == 0
