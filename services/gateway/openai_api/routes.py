"""OpenAI routes: /v1/models, /v1/models/{model}, /v1/chat/completions, /v1/completions. The model routes
answer Anthropic's SDK (an ``anthropic-version`` header) in Anthropic's shape: it lists models at the same path."""

from __future__ import annotations

import dataclasses
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, TypeVar

from litestar import Request, Response, Router, get, post, route
from litestar.exceptions import MethodNotAllowedException
from litestar.params import FromPath

from services.gateway.anthropic.errors import error_response as anthropic_error_response
from services.gateway.common.content import ListInput, admit, chat_media, media_place
from services.gateway.openai_api.chat_responses import chat_body, chat_chunks
from services.gateway.openai_api.completion_responses import completion_body, completion_chunks
from services.gateway.openai_api.errors import (
    OPENAI_EXCEPTION_HANDLERS,
    bad_param,
    content_error,
    model_not_found,
)
from services.gateway.openai_api.params import Common
from services.gateway.openai_api.runner import build_call
from services.gateway.openai_api.schemas import ChatRequest, CompletionRequest, parse_chat, parse_completion
from services.gateway.openai_api.sse import DONE, error_event
from services.gateway.request import lifecycle
from services.gateway.request.call import Call
from services.gateway.web import off_loop
from services.gateway.web.request_ids import client_request_id
from shared.errors import ErrorKind, SwitchboardError

if TYPE_CHECKING:
    from services.gateway.core import Gateway

R = TypeVar("R", ChatRequest, CompletionRequest)
STARTED_AT = int(time.time())  # the gateway imports this module once, as it starts
OWNER = "MindIE Server"


def model_card(model: str, parent: str | None = None, root: str | None = None) -> dict[str, Any]:
    """A model's card; a LoRA adapter's names its base model as ``parent`` (reference §3.17, §3.18). With
    ``root`` (the list's cards, as vLLM's and MindIE's): where its weights are, and the base's parent null."""
    card = {"id": model, "object": "model", "created": STARTED_AT, "owned_by": OWNER}
    if root is not None:
        card.update(root=root, parent=parent)
    elif parent is not None:
        card["parent"] = parent
    return card


def cards(gateway: Gateway) -> dict[str, dict[str, Any]]:
    """Every servable name's card by name: the base model first, then each loaded adapter by name (none in
    PD split mode, where requests cannot name them)."""
    served = gateway.served()
    paths = {} if served.pd_split else gateway.adapter_paths()
    longest = {"max_model_len": gateway.cfg.deploy.max_seq_len}  # vLLM's: what clients size prompts by
    base = {**model_card(served.model, root=gateway.cfg.model.model_weight_path), **longest}
    engine = gateway.engine_info()
    if engine is not None:  # what its weights and KV cache are stored in (vLLM's cards carry no such field)
        base.update(dtype=engine.dtype, quantization=engine.quantization, kv_cache_dtype=engine.kv_dtype or engine.dtype)
    return {served.model: base, **{name: {**model_card(name, served.model, paths[name]), **longest}
                                   for name in sorted(paths)}}


def anthropic_card(card: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's model object for an OpenAI card (its SDK's ``models.list`` / ``retrieve`` read these)."""
    created = datetime.fromtimestamp(card["created"], timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": card["id"], "display_name": card["id"], "created_at": created}


def asks_anthropic(request: Request) -> bool:
    return "anthropic-version" in request.headers  # every Anthropic SDK sends it; OpenAI's never does


@get("/v1/models")
async def list_models(request: Request) -> Response:
    data = list(cards(request.app.state.gateway).values())
    if asks_anthropic(request):
        listed = [anthropic_card(card) for card in data]
        body = {"data": listed, "has_more": False, "first_id": listed[0]["id"], "last_id": listed[-1]["id"]}
    else:
        body = {"object": "list", "data": data}
    return Response(body, media_type="application/json")


@get("/v1/models/{model:path}")
async def get_model(request: Request, model: FromPath[str]) -> Response:
    name = model.lstrip("/")  # a path parameter keeps its leading slash; names may contain slashes
    card = cards(request.app.state.gateway).get(name)
    if card is None and asks_anthropic(request):
        return anthropic_error_response(404, f"model: {name}")
    if card is None:
        raise model_not_found(name)
    return Response(anthropic_card(card) if asks_anthropic(request) else card, media_type="application/json")


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response:
    gateway = request.app.state.gateway
    req = named_by_client(await off_loop.read(request, parse_chat, await request.body(), gateway.cfg, gateway.served()),
                          request)
    admit(req.listed, gateway.media_policy, content_error, gateway.modalities())
    prompt = {"messages": req.messages, "chat_template_kwargs": req.chat_template_kwargs,
              "truncate": req.common.truncate, "parts": chat_media(req.listed), "cache_salt": req.common.cache_salt,
              "return_prompt_ids": req.common.return_token_ids, **req.turn}
    if req.tools is not None:
        prompt.update(tools=req.tools.declared, tool_choice=req.tools.choice)
    call = build_call(gateway.context, [prompt], req.common.sampling, req.common.n, req.common.adapter, "openai-chat")
    return await respond(request, req.common, call, "messages",
                         lambda: chat_body(req, call), lambda: chat_chunks(req, call), req.listed)


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response:
    gateway = request.app.state.gateway
    req = named_by_client(await off_loop.read(request, parse_completion, await request.body(), gateway.cfg,
                                              gateway.served()), request)
    prompts = [{"prompt": p.text, "prompt_ids": p.ids,
                "return_prompt_ids": (req.echo and p.ids is not None) or req.common.return_token_ids,
                "truncate": req.common.truncate, "cache_salt": req.common.cache_salt,
                "add_special_tokens": req.add_special_tokens} for p in req.prompts]
    call = build_call(gateway.context, prompts, req.common.sampling, req.common.n, req.common.adapter,
                      "openai-completions")
    return await respond(request, req.common, call, "prompt",
                         lambda: completion_body(req, call), lambda: completion_chunks(req, call))


def named_by_client(req: R, request: Request) -> R:
    """A body without vLLM's ``request_id`` is named by the client's X-Request-Id (``chatcmpl-<id>``, as vLLM
    names it)."""
    client = client_request_id(request)
    if not client or req.common.request_id:
        return req
    return dataclasses.replace(req, common=dataclasses.replace(req.common, request_id=client))


async def respond(request: Request, common: Common, call: Call, input_field: str,
                  body: Callable[[], Awaitable[dict]], chunks: Callable[[], AsyncIterator[bytes]],
                  listed: tuple[ListInput, ...] = ()) -> Response:
    """The shared lifecycle; the tokenizer's refusals (prompt too long, ids outside the vocabulary, a media item
    that does not decode), which name no field, are charged to the media item's place or ``input_field``."""
    try:
        return await lifecycle.respond(request, call, common.stream, body, chunks, error_event, trailer=DONE,
                                       stop_ok=True)
    except SwitchboardError as exc:
        if exc.kind is ErrorKind.VALIDATION and exc.param is None:
            raise bad_param(media_place(listed, exc.message) or input_field, exc.message) from None
        raise


@route(["/v1/models", "/v1/models/{model:path}"], http_method=["POST", "PUT", "PATCH", "DELETE"])
async def models_wrong_method(request: Request) -> None:
    raise MethodNotAllowedException(headers={"Allow": "GET, HEAD, OPTIONS"})  # as OPTIONS answers (HEAD: as GET)


@route(["/v1/chat/completions", "/v1/completions"], http_method=["GET", "PUT", "PATCH", "DELETE"])
async def generation_wrong_method(request: Request) -> None:
    raise MethodNotAllowedException(headers={"Allow": "OPTIONS, POST"})  # as OPTIONS answers


ROUTES = [Router("/", route_handlers=[list_models, get_model, chat_completions, completions,
                                      models_wrong_method, generation_wrong_method],
                 exception_handlers=OPENAI_EXCEPTION_HANDLERS)]
