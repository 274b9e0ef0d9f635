"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (reference §3.15, §3.16, §6 rows 10-11).

Answers are MindIE's: plain text (not JSON-quoted) sent as ``application/json``, 200 for every outcome,
503 for a malformed ``lora_name`` or ``lora_path``; a body that is not a JSON object is a 200 too. Both
``master_model`` (MindIE's source) and ``master_mode`` (its documentation) name the base model; empty or
absent means the served one.

The gateway checks the body, then asks every engine (``lora_engines.py``): a load is all or nothing (an
engine that fails or does not answer undoes it on the others), and the answer comes once the engines'
heartbeats list the adapter, so a request sent right after the 200 runs with it. LoRA is refused in PD
split mode (``inferMode`` "dmi" or a prefill/decode role); an unload still runs there, to free what was
loaded before the role was set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response, post

from services.gateway.admin import lora_engines
from services.gateway.admin.lora_engines import FAILED, Answer
from services.gateway.common.served import PD_SPLIT
from services.gateway.web.validation import BodyError, read_json_object
from shared import lora
from shared.lora import Outcome
from shared.messages import LoraCommand

log = logging.getLogger("switchboard.gateway")


class Refused(Exception):
    """A request answered before any engine is asked."""

    def __init__(self, answer: Answer):
        super().__init__(answer.text)
        self.answer = answer


@dataclass(frozen=True)
class Load:
    name: str
    path: str


def _object(body: bytes) -> dict[str, Any]:
    try:
        return read_json_object(body)
    except BodyError:
        raise Refused(Answer(200, lora.NOT_JSON)) from None


def _name(data: dict[str, Any]) -> str:
    name = data.get("lora_name")
    if not lora.valid_name(name):
        raise Refused(Answer(503, lora.INVALID_NAME))
    return name


def _path(data: dict[str, Any]) -> str:
    path = data.get("lora_path")
    if not lora.valid_path(path):
        raise Refused(Answer(503, lora.INVALID_PATH))
    return path


def _check_master(data: dict[str, Any], name: str, model: str) -> None:
    """``master_model`` (or ``master_mode``) must be the served model; empty or absent means it."""
    key = "master_model" if data.get("master_model") is not None else "master_mode"
    master = data.get(key)
    if master in (None, "", model):
        return
    shown = master if isinstance(master, str) else repr(master)
    raise Refused(Answer(200, lora.message(Outcome.INVALID, name,
                                           detail=f"{key} '{shown}' is not the served model '{model}'.")))


NO_ADAPTER = "None"  # TGI's adapter_id and vLLM /generate's model default (reference §3.22, §3.23b): the base model


def parse_load(body: bytes, model: str, pd_split: bool) -> Load:
    """The adapter to load, or :class:`Refused` with MindIE's answer (checked in MindIE's order: JSON,
    name, path, then what only this server checks: the master model, the name, PD split mode)."""
    data = _object(body)
    name, path = _name(data), _path(data)
    _check_master(data, name, model)
    if name == model:
        raise Refused(Answer(200, lora.message(Outcome.INVALID, name,
                                               detail=f"'{name}' is the name of the served model.")))
    if name == NO_ADAPTER:
        raise Refused(Answer(200, lora.message(Outcome.INVALID, name, detail=f"'{name}' is the name TGI's "
                                               "adapter_id and vLLM's model use for no adapter (the base model).")))
    if pd_split:
        raise Refused(Answer(200, f"{FAILED}{PD_SPLIT}."))
    return Load(name, path)


def parse_unload(body: bytes) -> str:
    """The adapter to unload, or :class:`Refused`."""
    return _name(_object(body))


def _text(answer: Answer) -> Response:
    return Response(answer.text.encode(), status_code=answer.status, media_type="application/json")


@post("/v1/load_lora_adapter", status_code=200)
async def load_lora_adapter(request: Request) -> Response:
    gateway = request.app.state.gateway
    try:
        load = parse_load(await request.body(), gateway.model, gateway.pd_split)
    except Refused as refused:
        return _text(refused.answer)
    answer = await lora_engines.run(gateway, LoraCommand(op="load", name=load.name, path=load.path))
    log.info("lora load", extra={"adapter": load.name, "path": load.path, "status": answer.status,
                                 "answer": answer.text})
    return _text(answer)


@post("/v1/unload_lora_adapter", status_code=200)
async def unload_lora_adapter(request: Request) -> Response:
    gateway = request.app.state.gateway
    try:
        name = parse_unload(await request.body())
    except Refused as refused:
        return _text(refused.answer)
    answer = await lora_engines.run(gateway, LoraCommand(op="unload", name=name))
    log.info("lora unload", extra={"adapter": name, "status": answer.status, "answer": answer.text})
    return _text(answer)


ROUTES = [load_lora_adapter, unload_lora_adapter]
