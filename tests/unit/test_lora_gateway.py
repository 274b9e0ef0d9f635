"""The gateway's LoRA rules, without a bus: load/unload bodies, combining the engines' outcomes, the
heartbeats that settle a change, and each family's adapter field."""

from __future__ import annotations

import json

import pytest

from services.gateway.admin.lora import Refused, parse_load, parse_unload
from services.gateway.admin.lora_engines import combine_load, combine_unload, shows
from services.gateway.common.served import Served
from services.gateway.openai_api.schemas import parse_chat, parse_completion
from services.gateway.tgi.schemas import parse_tgi
from services.gateway.vllm.schemas import parse_vllm
from shared import lora
from shared.config import load_config
from shared.errors import ErrorKind, SwitchboardError
from shared.lora import Outcome, message
from shared.messages import Adapter, EngineInfo, LoraCommand, LoraReply
from tests.conftest import DEFAULT_CONFIG

MODEL = "base-model"


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def refused(call) -> tuple[int, str]:
    with pytest.raises(Refused) as caught:
        call()
    return caught.value.answer.status, caught.value.answer.text


# ---- load and unload bodies -------------------------------------------------------------------------


def test_a_valid_load_names_the_adapter_and_its_path():
    load = parse_load(body(lora_name="a_1-B", lora_path="/data/lora", master_model=MODEL), MODEL, False)
    assert (load.name, load.path) == ("a_1-B", "/data/lora")
    assert parse_load(body(lora_name="a", lora_path="rel/dir", master_mode=""), MODEL, False).path == "rel/dir"
    assert parse_load(body(lora_name="a", lora_path="x"), MODEL, False).name == "a"


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]", b'"text"', b"{"])
def test_a_body_that_is_not_a_json_object_is_a_200_saying_so(raw):
    assert refused(lambda: parse_load(raw, MODEL, False)) == (200, lora.NOT_JSON)
    assert refused(lambda: parse_unload(raw)) == (200, lora.NOT_JSON)


@pytest.mark.parametrize("name", [None, "", "a b", "a/b", "a.b", "x" * 257, 5, "ü"])
def test_a_bad_lora_name_is_a_503(name):
    assert refused(lambda: parse_load(body(lora_name=name, lora_path="/p"), MODEL, False)) == (503, lora.INVALID_NAME)
    assert refused(lambda: parse_unload(body(lora_name=name))) == (503, lora.INVALID_NAME)


@pytest.mark.parametrize("path", [None, "", "../x", "/a/../b", "a/..", "x\n", 3, "p" * 4097])
def test_a_bad_lora_path_is_a_503(path):
    assert refused(lambda: parse_load(body(lora_name="a", lora_path=path), MODEL, False)) == (503, lora.INVALID_PATH)


@pytest.mark.parametrize("key", ["master_model", "master_mode"])
def test_another_master_model_is_invalid_and_named(key):
    status, text = refused(lambda: parse_load(body(lora_name="a", lora_path="/p", **{key: "other"}), MODEL, False))
    assert status == 200
    assert text.startswith(message(Outcome.INVALID, "a")) and f"{key} 'other'" in text and MODEL in text


def test_an_adapter_cannot_take_the_models_name():
    status, text = refused(lambda: parse_load(body(lora_name=MODEL, lora_path="/p"), MODEL, False))
    assert status == 200 and text.startswith(message(Outcome.INVALID, MODEL)) and "served model" in text


def test_pd_split_mode_refuses_a_load_after_the_body_rules():
    status, text = refused(lambda: parse_load(body(lora_name="a", lora_path="/p"), MODEL, True))
    assert status == 200 and "not supported in PD split mode" in text
    assert refused(lambda: parse_load(body(lora_name="a b", lora_path="/p"), MODEL, True))[0] == 503


# ---- combining the engines' replies -----------------------------------------------------------------


def reply(outcome: Outcome, name: str = "a", path: str = "/p") -> LoraReply:
    return LoraReply(outcome=outcome.value, message=message(outcome, name, path))


def test_a_load_added_anywhere_is_added_and_waits_for_every_engine():
    verdict = combine_load("a", {"e1": reply(Outcome.ADDED), "e2": reply(Outcome.ALREADY)}, set())
    assert verdict.answer.status == 200 and verdict.answer.text == message(Outcome.ADDED, "a")
    assert verdict.undo == () and verdict.settle == ("e1", "e2")


def test_a_load_every_engine_had_is_already_added():
    verdict = combine_load("a", {"e1": reply(Outcome.ALREADY), "e2": reply(Outcome.ALREADY)}, {"e1", "e2"})
    assert verdict.answer.text == message(Outcome.ALREADY, "a") and verdict.undo == ()


@pytest.mark.parametrize("failure", [Outcome.INVALID, Outcome.NOT_FOUND, Outcome.RANK, Outcome.TOO_MANY])
def test_a_failure_on_one_engine_is_the_answer_and_undoes_the_others(failure):
    verdict = combine_load("a", {"e1": reply(Outcome.ADDED), "e2": reply(failure), "e3": reply(Outcome.ALREADY)},
                           {"e3"})
    assert verdict.answer == type(verdict.answer)(200, message(failure, "a", "/p"))
    assert verdict.undo == ("e1",) and verdict.settle == ()


def test_waiting_to_unload_undoes_the_engines_that_added_it():
    verdict = combine_load("a", {"e1": reply(Outcome.ADDED), "e2": reply(Outcome.WAITING)}, set())
    assert verdict.answer.text == message(Outcome.WAITING, "a") and verdict.undo == ("e1",)


def test_a_failure_wins_over_waiting_and_silence():
    verdict = combine_load("a", {"e1": None, "e2": reply(Outcome.WAITING), "e3": reply(Outcome.RANK)}, set())
    assert verdict.answer.text == message(Outcome.RANK, "a")
    assert verdict.undo == ("e1",)


def test_a_silent_engine_fails_the_load_with_a_503_and_is_undone_unless_it_held_the_adapter():
    verdict = combine_load("a", {"e1": reply(Outcome.ADDED), "e2": None, "e3": None}, {"e3"})
    assert verdict.answer.status == 503
    assert "e2, e3 did not answer" in verdict.answer.text and "'a' was not loaded" in verdict.answer.text
    assert verdict.undo == ("e1", "e2")


def test_an_engine_gone_from_the_bus_is_said_so_not_a_timeout():
    """NATS answers "no responders" at once for an engine that died a moment ago (its lease not yet out)."""
    verdict = combine_load("a", {"e1": None, "e2": None}, set(), timeout_s=120, gone=frozenset({"e1"}))
    assert verdict.answer.status == 503
    assert verdict.answer.text == ("Call to load LoRA method failed: engine e1 is gone (it died or stopped); "
                                   "engine e2 did not answer within 120 s; LoRA adapter 'a' was not loaded.")
    unload = combine_unload("a", {"e1": None}, gone=frozenset({"e1"}))
    assert unload.answer.status == 503 and "engine e1 is gone" in unload.answer.text, unload.answer.text


def test_an_unreadable_outcome_is_a_failure_with_the_engines_text():
    verdict = combine_load("a", {"e1": LoraReply(outcome="strange", message="engine says no")}, set())
    assert verdict.answer.text == "engine says no"


def test_an_unload_removed_anywhere_is_removed():
    verdict = combine_unload("a", {"e1": reply(Outcome.MISSING), "e2": reply(Outcome.REMOVED), "e3": None})
    assert verdict.answer.text == message(Outcome.REMOVED, "a") and verdict.settle == ("e1", "e2", "e3")


def test_an_unload_nobody_had_cannot_be_found_and_silence_everywhere_is_a_503():
    assert combine_unload("a", {"e1": reply(Outcome.MISSING), "e2": None}).answer.text == message(Outcome.MISSING, "a")
    assert combine_unload("a", {"e1": None}).answer.status == 503


def engine(instance: str, *adapters: str) -> EngineInfo:
    return EngineInfo(model=MODEL, loaded=True, device="cpu", dtype="float32", max_batch_size=8, total_blocks=10,
                      free_blocks=10, running=0, waiting=0, instance=instance,
                      adapters=[Adapter(a, f"/p/{a}") for a in adapters])


def test_a_load_shows_once_each_engine_still_live_lists_it():
    load = LoraCommand(op="load", name="a", path="/p")
    assert not shows(load, ("e1", "e2"), {"e1": engine("e1", "a"), "e2": engine("e2")})
    assert shows(load, ("e1", "e2"), {"e1": engine("e1", "a"), "e2": engine("e2", "b", "a")})
    assert shows(load, ("e1", "e2"), {"e1": engine("e1", "a")})  # e2 died meanwhile


def test_an_unload_shows_once_no_live_engine_lists_it():
    unload = LoraCommand(op="unload", name="a")
    assert not shows(unload, ("e1",), {"e1": engine("e1"), "e2": engine("e2", "a")})
    assert shows(unload, ("e1",), {"e1": engine("e1", "b"), "e2": engine("e2")})


# ---- each family's adapter field --------------------------------------------------------------------

SERVED = Served(MODEL, frozenset({"lora1"}))
PD = Served(MODEL, frozenset({"lora1"}), pd_split=True)


def kind_of(call) -> tuple[ErrorKind, str]:
    with pytest.raises(SwitchboardError) as caught:
        call()
    return caught.value.kind, caught.value.message


@pytest.mark.parametrize("adapter_id, adapter", [(None, ""), ("None", ""), (MODEL, ""), ("lora1", "lora1")])
def test_tgi_adapter_id_picks_the_adapter(adapter_id, adapter):
    params = {} if adapter_id is None else {"adapter_id": adapter_id}
    assert parse_tgi({"inputs": "hi", "parameters": params}, SERVED).adapter == adapter


def test_tgi_unknown_malformed_and_pd_split_adapter_ids_are_validation_errors():
    def tgi(adapter_id, served=SERVED):
        return lambda: parse_tgi({"inputs": "hi", "parameters": {"adapter_id": adapter_id}}, served)

    assert kind_of(tgi("other")) == (ErrorKind.VALIDATION, "adapter_id 'other' is not a loaded LoRA adapter.")
    assert kind_of(tgi("bad id!")) == (ErrorKind.VALIDATION, "The format of adapter_id is invalid.")
    kind, text = kind_of(tgi("lora1", PD))
    assert kind is ErrorKind.VALIDATION and "PD split" in text
    assert parse_tgi({"inputs": "hi", "parameters": {"adapter_id": MODEL}}, PD).adapter == ""


@pytest.mark.parametrize("model, adapter", [(None, ""), ("None", ""), (MODEL, ""), ("lora1", "lora1")])
def test_vllm_model_picks_the_adapter(model, adapter):
    data = {"prompt": "hi"} if model is None else {"prompt": "hi", "model": model}
    assert parse_vllm(data, SERVED, 16, 8).adapter == adapter


def test_vllm_unknown_model_is_404_and_pd_split_a_validation_error():
    assert kind_of(lambda: parse_vllm({"prompt": "hi", "model": "other"}, SERVED, 16, 8)) == \
        (ErrorKind.NOT_FOUND, "Model other not found.")
    assert kind_of(lambda: parse_vllm({"prompt": "hi", "model": "lora1"}, PD, 16, 8))[0] is ErrorKind.VALIDATION


@pytest.fixture(scope="module")
def cfg():
    return load_config(DEFAULT_CONFIG)


def test_openai_model_picks_the_adapter_and_keeps_the_name_sent(cfg):
    chat = parse_chat(body(model="lora1", messages=[{"role": "user", "content": "hi"}]), cfg, SERVED)
    assert (chat.common.model, chat.common.adapter) == ("lora1", "lora1")
    completion = parse_completion(body(model=MODEL, prompt="hi"), cfg, SERVED)
    assert (completion.common.model, completion.common.adapter) == (MODEL, "")


def test_openai_unknown_model_is_model_not_found_and_pd_split_a_bad_model(cfg):
    with pytest.raises(SwitchboardError) as caught:
        parse_completion(body(model="other", prompt="hi"), cfg, SERVED)
    assert caught.value.kind is ErrorKind.NOT_FOUND and caught.value.code == "model_not_found"
    with pytest.raises(SwitchboardError) as caught:
        parse_completion(body(model="lora1", prompt="hi"), cfg, PD)
    assert caught.value.kind is ErrorKind.VALIDATION and caught.value.param == "model"
