"""Fields shared by chat and completions: model, n, stream, and the vLLM-style sampling fields.

Ranges follow reference §3.25/§3.26/§5 (the vLLM flavour, ``openAiSupport: "vllm"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.openai_api.errors import bad_param, model_not_found
from services.gateway.validation import FLT_MAX, INT32_MAX, Fields
from shared.config import Config
from shared.messages import Sampling

SEED_MAX = 2**63 - 1
GREEDY_BELOW = 1e-5  # vLLM: a temperature this small means greedy decoding


@dataclass(frozen=True)
class Common:
    model: str
    n: int
    stream: bool
    include_usage: bool
    sampling: Sampling
    truncate: int  # keep the last n prompt tokens; 0 = off


def parse_common(data: dict[str, Any], cfg: Config, served: str, logprobs: int | None) -> Common:
    """Check the fields every OpenAI generation request has; ``logprobs`` is the family's reading."""
    f = Fields(data)
    model = _model(f, served)
    stream = bool(f.boolean("stream", False))
    sampling = sampling_from(f, cfg, logprobs)
    n = _n(f, cfg, sampling)
    return Common(model, n, stream, _include_usage(f, stream), sampling, _truncate(f, cfg))


def _model(f: Fields, served: str) -> str:
    model = f.data.get("model")
    if model is None:
        raise bad_param("model", "you must provide a model parameter")
    if not isinstance(model, str) or not model:
        raise bad_param("model", "model must be a non-empty string.")
    if model != served:
        raise model_not_found(model)
    return model


def _include_usage(f: Fields, stream: bool) -> bool:
    if f.data.get("stream_options") is None:
        return False
    if not stream:
        raise bad_param("stream_options", "stream_options can only be given when stream is true.")
    options = Fields(f.obj("stream_options").data, "stream_options.")
    options.boolean("continuous_usage_stats", False)
    return bool(options.boolean("include_usage", False))


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


def sampling_from(f: Fields, cfg: Config, logprobs: int | None) -> Sampling:
    _refuse_unsupported(f)
    temperature = f.number("temperature", 1.0, 0.0, FLT_MAX, lo_open=False, hi_open=False)
    greedy = temperature < GREEDY_BELOW
    return Sampling(
        do_sample=not greedy,
        temperature=1.0 if greedy else temperature,
        top_k=_top_k(f),
        top_p=f.number("top_p", 1.0, 0.0, 1.0, lo_open=True, hi_open=False),
        repetition_penalty=f.number("repetition_penalty", 1.0, 0.0, 2.0, lo_open=True, hi_open=False),
        presence_penalty=f.number("presence_penalty", 0.0, -2.0, 2.0, lo_open=False, hi_open=False),
        frequency_penalty=f.number("frequency_penalty", 0.0, -2.0, 2.0, lo_open=False, hi_open=False),
        seed=f.integer("seed", None, 0, SEED_MAX),
        max_new_tokens=_max_tokens(f, cfg),
        stop=f.stop_list("stop"),
        stop_token_ids=_stop_token_ids(f),
        ignore_eos=bool(f.boolean("ignore_eos", False)),
        include_stop_str_in_output=bool(f.boolean("include_stop_str_in_output", False)),
        logprobs=logprobs,
    )


def _truncate(f: Fields, cfg: Config) -> int:
    """vLLM's truncate_prompt_tokens: -1 keeps as many as the model takes."""
    value = f.integer("truncate_prompt_tokens", None, -1, INT32_MAX)
    if value is None:
        return 0
    if value == 0:
        raise bad_param("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 or in [1, 2147483647], got 0.")
    return cfg.deploy.effective_max_input_len if value == -1 else value


def _max_tokens(f: Fields, cfg: Config) -> int:
    default = cfg.schedule.max_iter_times
    legacy = f.integer("max_tokens", default, 0, INT32_MAX, lo_open=True)
    return f.integer("max_completion_tokens", legacy, 0, INT32_MAX, lo_open=True)


def _top_k(f: Fields) -> int:
    top_k = f.integer("top_k", -1, -1, INT32_MAX)
    if top_k == 0:
        raise bad_param("top_k", "top_k must be -1 (disabled) or in (0, 2147483647], got 0.")
    return max(top_k, 0)


def _stop_token_ids(f: Fields) -> list[int]:
    value = f.data.get("stop_token_ids")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise bad_param("stop_token_ids", "stop_token_ids must be an array of integers.")
    return sorted({i for i in value if 0 <= i <= INT32_MAX})  # out-of-range ids are dropped, as MindIE does


def _refuse_unsupported(f: Fields) -> None:
    """Fields that would change the answer in ways this server cannot honour: a clear 400, not silence."""
    if f.boolean("use_beam_search", False):
        raise bad_param("use_beam_search", "use_beam_search is not supported.")
    if f.boolean("skip_special_tokens", True) is False:
        raise bad_param("skip_special_tokens",
                        "skip_special_tokens=false is not supported: special tokens are always skipped.")
    if f.data.get("logit_bias"):
        raise bad_param("logit_bias", "logit_bias is not supported.")
    if f.integer("min_tokens", 0, 0, INT32_MAX):
        raise bad_param("min_tokens", "min_tokens is not supported.")
