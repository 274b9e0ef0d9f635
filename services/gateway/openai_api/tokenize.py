"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` (beside MindIE's ``/v1/tokenizer``), OpenAI-shaped errors.

``/tokenize`` takes a ``prompt`` (encoded as ``/v1/completions`` encodes it; ``add_special_tokens`` default
true) or chat ``messages`` (rendered as ``/v1/chat/completions`` renders them, with ``tools``,
``chat_template_kwargs``, ``add_generation_prompt`` default true or ``continue_final_message``) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; its count equals the ``prompt_tokens`` those routes
report. ``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``. A body with TGI's ``inputs`` is TGI's
``/tokenize`` (``services/gateway/tgi/tokenize.py``).
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, Router, post

from services.gateway.common.content import admit, chat_media
from services.gateway.openai_api.errors import OPENAI_EXCEPTION_HANDLERS, bad_param, content_error, model_not_found
from services.gateway.openai_api.schemas import PARSE_ERROR, chat_messages, template_options
from services.gateway.openai_api.tools import parse_tools
from services.gateway.tgi.tokenize import is_tgi, tgi_tokenize
from services.gateway.web.validation import MAX_INPUT_CHARS, Fields, parse_json_object
from shared.messages import Tokenize

MAX_DETOKENIZE_IDS = 1048576


@post("/tokenize", status_code=200)
async def tokenize(request: Request) -> Response:
    gateway = request.app.state.gateway
    data = parse_json_object(await request.body(), PARSE_ERROR)
    if is_tgi(data):
        return await tgi_tokenize(request, data)
    _check_model(data, gateway)
    f = Fields(data)
    strs = bool(f.boolean("return_token_strs", False))
    message = _chat(data, f, gateway) if data.get("messages") is not None else _prompt(data, f)
    message.token_strs = strs
    result = await gateway.tokenize(message)
    return Response({"count": len(result.ids), "max_model_len": gateway.cfg.deploy.max_seq_len, "tokens": result.ids,
                     "token_strs": result.strs if strs else None}, media_type="application/json")


@post("/detokenize", status_code=200)
async def detokenize(request: Request) -> Response:
    gateway = request.app.state.gateway
    data = parse_json_object(await request.body(), PARSE_ERROR)
    _check_model(data, gateway)
    ids = data.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise bad_param("tokens", "tokens must be an array of token ids (integers).")
    if len(ids) > MAX_DETOKENIZE_IDS:
        raise bad_param("tokens", f"tokens must have at most {MAX_DETOKENIZE_IDS} ids, got {len(ids)}.")
    return Response({"prompt": await gateway.detokenize(ids)}, media_type="application/json")


def _check_model(data: dict[str, Any], gateway) -> None:
    """``model`` is optional; when given it must be the served model or a loaded adapter."""
    model = data.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_param("model", "model must be a string.")
    if gateway.served().adapter(model, "model") is None:
        raise model_not_found(model)


def _prompt(data: dict[str, Any], f: Fields) -> Tokenize:
    prompt = data.get("prompt")
    if not isinstance(prompt, str):
        raise bad_param("prompt", "prompt (a string) or messages is required.")
    if len(prompt) > MAX_INPUT_CHARS:
        raise bad_param("prompt", f"prompt must have at most {MAX_INPUT_CHARS} characters, got {len(prompt)}.")
    return Tokenize(text=prompt, add_special_tokens=bool(f.boolean("add_special_tokens", True)))


def _chat(data: dict[str, Any], f: Fields, gateway) -> Tokenize:
    if data.get("prompt") is not None:
        raise bad_param("prompt", "give either prompt or messages, not both.")
    messages, listed = chat_messages(data.get("messages"))
    admit(listed, gateway.media_policy, content_error, gateway.modalities())
    turn, kwargs = template_options(data, f)  # (as chat reads them: a template of the client's own is refused)
    tools = parse_tools(data)
    return Tokenize(messages=messages, tools=tools.declared if tools else [], tool_choice=tools.choice if tools else "",
                    chat_template_kwargs=kwargs, parts=chat_media(listed), **turn)


ROUTES = [Router("/", route_handlers=[tokenize, detokenize], exception_handlers=OPENAI_EXCEPTION_HANDLERS)]
