"""LoRA adapters end to end (reference §3.15-§3.18, §3.22-§3.26): the load and unload answers, each
family running a loaded adapter, the model list, and the refusals once it is gone or in PD split mode.

One stack for the module (SmolLM2 with maxLoras 1 and maxLoraRank 8) and real PEFT adapters made here:
random LoRA weights scaled down, so an adapter's greedy text differs from the base model's yet stays text,
and equals what transformers + peft make with it.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared import lora
from shared.lora import Outcome, message
from tests.lora_adapters import make_adapter, peft_greedy
from tests.integration.stack import post, running_stack, sse_events

PROMPT = "My name is Olivier and I"
TOKENS = 12
MAX_RANK = 8
ROLE = {"local": {"server_ip": "10.0.0.1", "device": [{"device_ip": "10.0.1.1", "device_logical_id": "0"}]}}


@dataclass(frozen=True)
class Adapters:
    paths: dict[str, Path]  # first (rank 8), second (rank 4), wide (rank 16), dora (first with use_dora)
    first_text: str  # the greedy continuation of PROMPT by transformers + peft with "first"


def greedy_text(adapter: Path, model_dir: Path) -> str:
    """transformers + peft's greedy continuation of PROMPT with the adapter."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokens, _ = peft_greedy(model_dir, adapter, [tokenizer(PROMPT).input_ids], TOKENS)[0]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def adapter(model_dir: Path, folder: Path, rank: int, seed: int) -> Path:
    return make_adapter(model_dir, folder, seed=seed, r=rank, alpha=2 * rank, b_scale=0.2)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, smol_dir) -> Adapters:
    folder = tmp_path_factory.mktemp("adapters")
    first_text = greedy_text(adapter(smol_dir, folder / "first", MAX_RANK, 1), smol_dir)
    adapter(smol_dir, folder / "second", 4, 2)
    adapter(smol_dir, folder / "wide", 2 * MAX_RANK, 3)
    dora = shutil.copytree(folder / "first", folder / "dora")
    settings = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    return Adapters({name: folder / name for name in ("first", "second", "wide", "dora")}, first_text)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smol_dir):
    with running_stack(tmp_path_factory.mktemp("lora"), smol_dir, Switchboard={"kvCacheMemoryMb": 128},
                       **{"BackendConfig.ModelDeployConfig": {"maxLoras": 1, "maxLoraRank": MAX_RANK}}) as s:
        yield s


def manage(stack, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(stack.mgmt_url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=180)


def load(stack, name: str, path, **extra) -> httpx.Response:
    return manage(stack, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra})


def unload(stack, name: str) -> httpx.Response:
    return manage(stack, "/v1/unload_lora_adapter", {"lora_name": name})


def said(r: httpx.Response, status: int, text: str) -> None:
    """MindIE's answer: plain text (not JSON-quoted) sent as application/json."""
    assert (r.status_code, r.text) == (status, text), r.text
    assert r.headers["content-type"].startswith("application/json")


# ---- texts each family generates, greedy --------------------------------------------------------


def tgi_text(stack, adapter_id: str | None = None) -> str:
    params = {"max_new_tokens": TOKENS, "do_sample": False, **({"adapter_id": adapter_id} if adapter_id else {})}
    r = post(stack, "/generate", {"inputs": PROMPT, "parameters": params})
    assert r.status_code == 200, r.text
    return r.json()["generated_text"]


def completion(stack, model: str) -> httpx.Response:
    return post(stack, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": TOKENS,
                                           "temperature": 0, "ignore_eos": True})


def chat(stack, model: str) -> httpx.Response:
    return post(stack, "/v1/chat/completions", {"model": model, "max_tokens": TOKENS, "temperature": 0,
                                                "messages": [{"role": "user", "content": PROMPT}]})


def vllm(stack, model: str) -> httpx.Response:
    return post(stack, "/generate", {"prompt": PROMPT, "model": model, "max_tokens": TOKENS, "temperature": 0,
                                     "ignore_eos": True})


def model_ids(stack) -> list[str]:
    return [card["id"] for card in httpx.get(stack.url + "/v1/models").json()["data"]]


# ---- the answers before any engine is asked -----------------------------------------------------


def test_bodies_are_checked_with_mindies_answers(stack, adapters):
    path = str(adapters.paths["first"])
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        said(manage(stack, route, b"not json"), 200, lora.NOT_JSON)
        said(manage(stack, route, b"[1]"), 200, lora.NOT_JSON)
        said(manage(stack, route, {"lora_name": "bad name", "lora_path": path}), 503, lora.INVALID_NAME)
        said(manage(stack, route, {"lora_name": "x\n", "lora_path": path}), 503, lora.INVALID_NAME)  # ($ took it)
        said(manage(stack, route, {"lora_path": path}), 503, lora.INVALID_NAME)
    said(load(stack, "ok", "/adapters/../first"), 503, lora.INVALID_PATH)
    said(manage(stack, "/v1/load_lora_adapter", {"lora_name": "ok"}), 503, lora.INVALID_PATH)
    for key in ("master_model", "master_mode"):
        r = load(stack, "ok", path, **{key: "other-model"})
        assert r.status_code == 200 and r.text.startswith(message(Outcome.INVALID, "ok")), r.text
        assert f"{key} 'other-model'" in r.text
    r = load(stack, stack.model, path)
    assert r.status_code == 200 and r.text.startswith(message(Outcome.INVALID, stack.model)), r.text
    r = load(stack, "None", path)  # TGI's adapter_id and vLLM's model say "None" for the base model
    assert r.status_code == 200 and r.text.startswith(message(Outcome.INVALID, "None")), r.text
    assert "None" not in [m["id"] for m in httpx.get(stack.url + "/v1/models").json()["data"]]


def test_pd_split_mode_refuses_adapters(stack, adapters):
    try:
        assert httpx.post(stack.mgmt_url + "/v1/role/prefill", json=ROLE).status_code == 200
        r = load(stack, "first", adapters.paths["first"])
        assert r.status_code == 200 and "not supported in PD split mode" in r.text, r.text
        tgi = post(stack, "/generate", {"inputs": PROMPT, "parameters": {"adapter_id": "first"}})
        assert tgi.status_code == 422 and "PD split" in tgi.json()["error"]
        assert tgi.json()["error_type"] == "validation"
        openai = completion(stack, "first")
        assert openai.status_code == 400 and openai.json()["error"]["param"] == "model"
        assert "PD split" in openai.json()["error"]["message"]
        v = vllm(stack, "first")
        assert v.status_code == 422 and "PD split" in v.json()["error"]
        assert model_ids(stack) == [stack.model]
    finally:
        httpx.post(stack.mgmt_url + "/v1/role/flex", json=ROLE)


# ---- the engines' answers -----------------------------------------------------------------------


def test_loads_the_engines_refuse(stack, adapters, tmp_path):
    missing = tmp_path / "no-such-adapter"
    said(load(stack, "ghost", missing), 200, message(Outcome.NOT_FOUND, "ghost", str(missing)))
    r = load(stack, "wide", adapters.paths["wide"])
    assert r.status_code == 200 and r.text.startswith(message(Outcome.RANK, "wide")), r.text
    r = load(stack, "dora", adapters.paths["dora"])
    assert r.status_code == 200 and r.text.startswith(message(Outcome.INVALID, "dora")), r.text
    said(unload(stack, "ghost"), 200, message(Outcome.MISSING, "ghost"))
    assert model_ids(stack) == [stack.model]


def test_a_loaded_adapter_serves_every_family_until_unloaded(stack, adapters):
    base = tgi_text(stack)
    said(load(stack, "first", adapters.paths["first"]), 200, message(Outcome.ADDED, "first"))
    said(load(stack, "first", adapters.paths["first"]), 200, message(Outcome.ALREADY, "first"))
    try:
        text = tgi_text(stack, "first")  # at once: the 200 came after the heartbeats listed it
        assert text == adapters.first_text != base  # as transformers + peft make it
        assert tgi_text(stack, stack.model) == base == tgi_text(stack, "None")
        check_families(stack, text)
        check_model_cards(stack, adapters)
    finally:
        said(unload(stack, "first"), 200, message(Outcome.REMOVED, "first"))
    check_refused_after_unload(stack)


def check_families(stack, text: str) -> None:
    stream = post(stack, "/generate_stream", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": TOKENS, "do_sample": False, "adapter_id": "first"}})
    assert sse_events(stream.text)[-1]["generated_text"] == text
    r = completion(stack, "first")
    assert r.status_code == 200 and r.json()["model"] == "first", r.text
    assert r.json()["choices"][0]["text"] == text
    r = vllm(stack, "first")
    assert r.status_code == 200 and r.json() == {"text": [f"{PROMPT} {text}"]}, r.text
    adapted, base = chat(stack, "first"), chat(stack, stack.model)
    assert adapted.status_code == 200 and adapted.json()["model"] == "first", adapted.text
    assert adapted.json()["choices"][0]["message"]["content"] != base.json()["choices"][0]["message"]["content"]


def check_model_cards(stack, adapters: Adapters) -> None:
    cards = httpx.get(stack.url + "/v1/models").json()["data"]
    weights = json.loads(stack.config_path.read_text())["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0][
        "modelWeightPath"]
    assert [c["id"] for c in cards] == [stack.model, "first"]
    assert cards[0]["parent"] is None and cards[0]["root"] == weights  # vLLM's and MindIE's
    assert cards[1] == {"id": "first", "object": "model", "created": cards[0]["created"], "owned_by": "MindIE Server",
                        "root": str(adapters.paths["first"]), "parent": stack.model, "max_model_len": cards[0]["max_model_len"]}
    assert httpx.get(stack.url + "/v1/models/first").json() == cards[1]


def check_refused_after_unload(stack) -> None:
    tgi = post(stack, "/generate", {"inputs": PROMPT, "parameters": {"adapter_id": "first"}})
    assert tgi.status_code == 422 and tgi.json()["error_type"] == "validation", tgi.text
    r = completion(stack, "first")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert chat(stack, "first").status_code == 404
    assert vllm(stack, "first").status_code == 404
    assert model_ids(stack) == [stack.model]
    assert httpx.get(stack.url + "/v1/models/first").status_code == 404


def test_unloading_lets_running_requests_finish_and_counts_against_max_loras(stack, adapters):
    said(load(stack, "first", adapters.paths["first"]), 200, message(Outcome.ADDED, "first"))
    finished: dict[str, httpx.Response] = {}
    running = threading.Thread(target=lambda: finished.setdefault("r", post(stack, "/generate", {
        "prompt": PROMPT, "model": "first", "max_tokens": 300, "temperature": 0, "ignore_eos": True})))
    running.start()
    try:
        wait_running(stack)
        said(unload(stack, "first"), 200, message(Outcome.REMOVED, "first"))
        said(load(stack, "first", adapters.paths["first"]), 200, message(Outcome.WAITING, "first"))
        r = load(stack, "second", adapters.paths["second"])  # maxLoras 1: "first" still holds its place
        assert r.status_code == 200 and r.text.startswith(
            "Call to load LoRA method failed: The number of LoRA adapters exceeds 'max_loras'"), r.text
        assert post(stack, "/generate", {"inputs": PROMPT, "parameters": {"adapter_id": "first"}}).status_code == 422
    finally:
        running.join(120)
    assert finished["r"].status_code == 200, finished["r"].text  # it ran to its end with the adapter
    said(load(stack, "second", adapters.paths["second"]), 200, message(Outcome.ADDED, "second"))
    said(unload(stack, "second"), 200, message(Outcome.REMOVED, "second"))


def wait_running(stack, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(stack.mgmt_url + "/v1/status").json()["resource"]["runningRequestNum"] == 0:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.05)


def test_request_counters_name_the_adapter(stack):
    text = httpx.get(stack.metrics_url + "/metrics").text
    received: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "request_received_total":  # summed over the api label
                received[s.labels["adapter"]] = received.get(s.labels["adapter"], 0) + s.value
    assert received["first"] >= 6 and received[""] >= 3, received
