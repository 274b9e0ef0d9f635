"""OpenAI's Responses API on the business plane: ``POST /v1/responses`` (over the one request lifecycle, as a
chat completion of the same conversation), ``GET`` and ``DELETE /v1/responses/{id}``. Responses with
``store`` (the default where the deployment's NATS has JetStream) go to the shared bucket
(``shared/response_store.py``), so any gateway replica continues them (``previous_response_id``), reads
and deletes them, also after a restart. OpenAI's error shape."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, Router, delete, get, post
from litestar.params import FromPath

from services.gateway.common.content import admit, chat_media, media_place
from services.gateway.openai_api.errors import OPENAI_EXCEPTION_HANDLERS, OpenAIError, bad_param, content_error
from services.gateway.openai_api.runner import build_call
from services.gateway.request import lifecycle
from services.gateway.responses_api.responses import Builder, error_event, response_body, response_events
from services.gateway.responses_api.schemas import parse_responses, read_body, renamed
from services.gateway.web import off_loop
from shared.errors import ErrorKind, SwitchboardError
from shared.messages import Tokenize
from shared.response_store import ResponseStore


@post("/v1/responses", status_code=200)
async def create(request: Request) -> Response:
    gateway = request.app.state.gateway
    store: ResponseStore = gateway.responses
    data = read_body(await request.body())
    await store.ready()
    stored = _stored(data, store)
    previous = await _previous(data.get("previous_response_id"), store)
    req = await off_loop.read(request, parse_responses, data, previous, gateway.cfg, gateway.served())
    chat = req.chat
    try:
        admit(chat.listed, gateway.media_policy, content_error, gateway.modalities())
    except SwitchboardError as exc:
        raise renamed(exc, req.before, chat.messages) from None
    prompt = {"messages": chat.messages, "truncate": chat.common.truncate, "parts": chat_media(chat.listed),
              "cache_salt": chat.common.cache_salt}
    if chat.tools is not None:
        prompt.update(tools=chat.tools.declared, tool_choice=chat.tools.choice)
    call = build_call(gateway.context, [prompt], chat.common.sampling, 1, chat.common.adapter, "openai-responses")
    builder = Builder(req, stored)

    async def keep(obj: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        await store.put(obj["id"], {"response": obj, "conversation": conversation})

    saver = keep if stored else None
    try:
        return await lifecycle.respond(request, call, req.stream, lambda: response_body(builder, call, saver),
                                       lambda: response_events(builder, call, saver), error_event)
    except SwitchboardError as exc:  # the tokenizer's refusals name no field: the media item's place, or input
        if exc.kind is ErrorKind.VALIDATION and exc.param is None:
            raise renamed(bad_param(media_place(chat.listed, exc.message) or "messages", exc.message), req.before,
                          chat.messages) from None
        raise


@post("/v1/responses/input_tokens", status_code=200)
async def input_tokens(request: Request) -> Response:
    """The input tokens the same body's response would count (its instructions, previous turns and tools)."""
    gateway = request.app.state.gateway
    data = read_body(await request.body())
    previous = await _previous(data.get("previous_response_id"), gateway.responses)
    chat = (await off_loop.read(request, parse_responses, data, previous, gateway.cfg, gateway.served())).chat
    admit(chat.listed, gateway.media_policy, content_error, gateway.modalities())
    tools = chat.tools
    counted = await gateway.tokenize(Tokenize(messages=chat.messages, tools=tools.declared if tools else [],
                                              tool_choice=tools.choice if tools else "", parts=chat_media(chat.listed)))
    return Response({"object": "response.input_tokens", "input_tokens": len(counted.ids)},
                    media_type="application/json")


@post("/v1/responses/{response_id:str}/cancel", status_code=200)
async def cancel(request: Request, response_id: FromPath[str]) -> Response:
    await _record(request.app.state.gateway.responses, response_id)
    raise bad_param(None, "Only responses created with background=true can be cancelled; this server answers each "
                          "response in its request (background is not supported).")


@get("/v1/responses/{response_id:str}/input_items")
async def input_items(request: Request, response_id: FromPath[str]) -> Response:
    await _record(request.app.state.gateway.responses, response_id)
    raise bad_param(None, "listing a response's input items is not supported by this server; GET "
                          f"/v1/responses/{response_id} returns the response.")


@get("/v1/responses/{response_id:str}")
async def retrieve(request: Request, response_id: FromPath[str]) -> Response:
    _check_retrieve_query(request)
    record = await _record(request.app.state.gateway.responses, response_id)
    return Response(record["response"], media_type="application/json")


@delete("/v1/responses/{response_id:str}", status_code=200)
async def remove(request: Request, response_id: FromPath[str]) -> Response:
    store: ResponseStore = request.app.state.gateway.responses
    await _record(store, response_id)
    await store.delete(response_id)
    return Response({"id": response_id, "object": "response", "deleted": True}, media_type="application/json")


# GET /v1/responses/{id}'s query, each at the value this server answers (a stored response, whole, as JSON)
RETRIEVE_DEFAULTS = {"stream": ("false",), "include": ("",), "include[]": ("",), "include_obfuscation": ("false", "true"),
                     "starting_after": ()}


def _check_retrieve_query(request: Request) -> None:
    for key, values in request.query_params.dict().items():
        allowed = RETRIEVE_DEFAULTS.get(key)
        if allowed is None:
            raise bad_param(key, f"{key} is not a parameter of retrieving a response.")
        if any(value.lower() not in allowed for value in values):
            raise bad_param(key, f"{key}={values[-1]} is not supported by this server: a stored response is "
                                 "retrieved whole, as JSON (no stream, no include).")


def _stored(data: dict[str, Any], store: ResponseStore) -> bool:
    """store: true needs the bucket; left out, it stores where it can (OpenAI's default is true)."""
    if data.get("store") is True and not store.available:
        raise bad_param("store", f"this server cannot store responses ({store.why}); send store: false.")
    return data.get("store", True) is not False and store.available


async def _previous(response_id: str | None, store: ResponseStore) -> list[dict[str, Any]]:
    if response_id is None:
        return []
    if not await store.ready():
        raise bad_param("previous_response_id", f"this server keeps no responses ({store.why}).")
    record = await store.get(response_id)
    if record is None:
        raise bad_param("previous_response_id", f"Previous response with id '{response_id}' not found.")
    return record["conversation"]


async def _record(store: ResponseStore, response_id: str) -> dict[str, Any]:
    record = await store.get(response_id) if await store.ready() else None
    if record is None:
        raise OpenAIError(ErrorKind.NOT_FOUND, f"Response with id '{response_id}' not found.", None, "not_found")
    return record


ROUTES = [Router("/", route_handlers=[create, input_tokens, cancel, input_items, retrieve, remove],
                 exception_handlers=OPENAI_EXCEPTION_HANDLERS)]
