"""Fields shared by chat and completions: model, n, stream, and the vLLM-style sampling fields.

Ranges follow reference §3.25/§3.26/§5 (the vLLM flavour, ``openAiSupport: "vllm"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from services.gateway.common.sampling import VllmDialect, vllm_sampling
from services.gateway.common.served import Served
from services.gateway.openai_api.errors import bad_param, model_not_found
from services.gateway.openai_api.response_format import response_format
from services.gateway.openai_api.token_fields import prompt_logprobs_field
from services.gateway.web.validation import INT32_MAX, Fields
from shared.config import Config
from shared.messages import Sampling

COMPLETIONS_MAX_TOKENS = 16


@dataclass(frozen=True)
class Common:
    model: str
    n: int
    stream: bool
    include_usage: bool
    sampling: Sampling
    truncate: int  # keep the last n prompt tokens; 0 = off
    adapter: str = ""  # the LoRA adapter ``model`` names; "" = the base model
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats (with include_usage)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs' tokens are "token_id:<id>"
    cache_salt: str = ""  # vLLM's: prefix-cache blocks shared only by requests giving the same salt
    request_id: str = ""  # vLLM's: the response's id is <prefix>-<request_id> ("": a random one)
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs with k alternatives (token_fields.py)
    return_token_ids: bool = False  # vLLM's: the prompt's and the answer's token ids beside the text


def parse_common(data: dict[str, Any], cfg: Config, served: Served, logprobs: int | None, chat: bool,
                 echo: bool = False) -> Common:
    """Check the fields every OpenAI generation request has; ``served`` names the model and the adapters
    ``model`` may take; ``logprobs`` is the family's reading; ``echo`` (completions): max_tokens may be 0, the
    prompt scored alone (OpenAI's legacy API and vLLM take that).

    max_tokens defaults to maxIterTimes for chat (reference §3.25) and to 16 for completions, as
    OpenAI's and vLLM's completions APIs do."""
    f = Fields(data)
    model = _model(f)
    if model in TGI_MODELS and model != served.model and model not in served.adapters:
        model = served.model  # (the answer names the served model, as TGI's names its model id)
    adapter = _adapter(model, served)
    stream = bool(f.boolean("stream", False))
    dialect = VllmDialect(repetition_max=2.0, max_tokens_default=cfg.schedule.max_iter_times if chat else COMPLETIONS_MAX_TOKENS,
                          prompt_only=echo and not chat)
    sampling = vllm_sampling(f, dialect, logprobs)
    grammar = response_format(f.data.get("response_format"))
    if grammar is not None:
        if sampling.grammar is not None:
            raise bad_param("response_format", "response_format cannot be combined with vLLM's guided decoding "
                                               "fields: give one.")
        sampling = msgspec.structs.replace(sampling, grammar=grammar)
    n = _n(f, cfg, sampling)
    include_usage, continuous = _usage_options(f, stream)
    _refuse_extras(f)
    prompt_k = prompt_logprobs_field(f, stream)
    if prompt_k is not None:
        sampling = msgspec.structs.replace(sampling, prompt_logprobs=prompt_k)
    return Common(model, n, stream, include_usage, sampling, _truncate(f, cfg), adapter, continuous,
                  bool(f.boolean("return_tokens_as_token_ids", False)), _non_empty(f, "cache_salt"),
                  _non_empty(f, "request_id"), prompt_k, bool(f.boolean("return_token_ids", False)))


REFUSED = {  # OpenAI's and vLLM's fields that would change the answer in ways this server cannot honour
    "functions": "functions (OpenAI's deprecated function calling) is not supported; declare them as tools.",
    "function_call": "function_call is not supported; use tools and tool_choice.",
    "audio": "audio output is not supported.",
    "prediction": "predicted outputs are not supported.",
    "web_search_options": "web search is not supported.",
    "prompt_embeds": "prompt_embeds is not supported; send text or token ids.",
    "mm_processor_kwargs": "mm_processor_kwargs is not supported: media are processed as the model's processor "
                           "does by default.",
    "vllm_xargs": "vllm_xargs is not supported.",
    "kv_transfer_params": "kv_transfer_params is not supported; prefill/decode disaggregation is configured "
                          "per engine (README, engineRole).",
}


def _refuse_extras(f: Fields) -> None:
    """A 400 for each field in REFUSED, for output modalities other than text and a priority other than 0
    (vLLM's answer when priority scheduling is not enabled); ``user`` is typed (OpenAI's end-user id, unused)."""
    for name, message in REFUSED.items():
        if f.data.get(name):
            raise bad_param(name, message)
    modalities = f.data.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_param("modalities", 'only text output is supported: modalities must be ["text"].')
    if f.integer("priority", 0, -INT32_MAX - 1, INT32_MAX):
        raise bad_param("priority", "priority scheduling is not enabled on the OpenAI routes (MindIE's native "
                                    "and Triton routes take priority [1, 5]); send priority 0 or none.")
    f.string("user")


def _non_empty(f: Fields, key: str) -> str:
    value = f.string(key, "")
    if f.data.get(key) is not None and not value:
        raise bad_param(key, f"{key} must be a non-empty string.")
    return value


def _model(f: Fields) -> str:
    model = f.data.get("model")
    if model is None:
        raise bad_param("model", "you must provide a model parameter")
    if not isinstance(model, str) or not model:
        raise bad_param("model", "model must be a non-empty string.")
    return model


# TGI's Messages API serves its one model whatever a request names: its docs have clients send "tgi", and
# huggingface_hub's InferenceClient sends "dummy" to a URL
TGI_MODELS = ("tgi", "dummy")


def _adapter(model: str, served: Served) -> str:
    """The LoRA adapter ``model`` names ("" for the served model); 404 model_not_found for any other name."""
    adapter = served.adapter(model, "model")
    if adapter is None:
        raise model_not_found(model)
    return adapter


def _usage_options(f: Fields, stream: bool) -> tuple[bool, bool]:
    """stream_options' include_usage and continuous_usage_stats."""
    if f.data.get("stream_options") is None:
        return False, False
    if not stream:
        raise bad_param("stream_options", "stream_options can only be given when stream is true.")
    options = Fields(f.obj("stream_options").data, "stream_options.")
    return (bool(options.boolean("include_usage", False)), bool(options.boolean("continuous_usage_stats", False)))


def _n(f: Fields, cfg: Config, sampling: Sampling) -> int:
    sc = cfg.schedule
    limit = min(sc.max_n, sc.max_batch_size, sc.prefill_batch_size)
    n = f.integer("n", 1, 1, limit)
    best_of = f.integer("best_of", n, 1, 128)
    if best_of != n:
        raise bad_param("best_of", f"best_of must equal n ({n}): ranking extra samples is not supported, "
                                   f"got {best_of}.")
    if n > 1 and not sampling.sampling:
        raise bad_param("n", "n must be 1 when temperature is 0: greedy decoding would give n identical choices.")
    return n


def _truncate(f: Fields, cfg: Config) -> int:
    """vLLM's truncate_prompt_tokens: -1 keeps as many as the model takes."""
    value = f.integer("truncate_prompt_tokens", None, -1, INT32_MAX)
    if value is None:
        return 0
    if value == 0:
        raise bad_param("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 or in [1, 2147483647], got 0.")
    return cfg.deploy.effective_max_input_len if value == -1 else value
