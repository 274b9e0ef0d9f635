"""vLLM ``/generate`` bodies (reference §3.23b): every parameter top-level, ``prompt`` required."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.validation import FLT_MAX, INT32_MAX, Fields, text_input
from shared.errors import ErrorKind, SwitchboardError, validation
from shared.messages import Sampling

INT63_MAX = 2**63 - 1
STOP_TOTAL = 32768


@dataclass(frozen=True)
class VllmRequest:
    prompt: str
    sampling: Sampling
    n: int
    best_of: int
    stream: bool


def parse_vllm(data: dict[str, Any], model: str, max_iter_times: int, max_n: int) -> VllmRequest:
    f = Fields(data)
    prompt = text_input(data.get("prompt"), "prompt")
    _check_model(f.string("model"), model)
    sampling = sampling_from(f, max_iter_times)
    f.boolean("skip_special_tokens", True)
    n, best_of = _n_best_of(f, max_n)
    return VllmRequest(prompt, sampling, n, best_of, f.boolean("stream", False))


def _check_model(name: str | None, served: str) -> None:
    if name is None or name in ("None", served):
        return
    if not 1 <= len(name) <= 256:
        raise validation(f"model must be 1 to 256 characters long, got {len(name)}.")
    raise SwitchboardError(ErrorKind.NOT_FOUND, f"Model {name} not found.")


def sampling_from(f: Fields, max_iter_times: int) -> Sampling:
    temperature = f.number("temperature", 1.0, 0.0, FLT_MAX, lo_open=False, hi_open=False)
    top_k = f.integer("top_k", -1, -1, INT32_MAX)
    if top_k == 0:
        raise validation("top_k must be -1 (disabled) or in (0, 2147483647], got 0.")
    return Sampling(
        do_sample=False if temperature == 0.0 else None,
        temperature=temperature or 1.0,
        top_k=max(top_k, 0),
        top_p=f.number("top_p", 1.0, 0.0, 1.0, lo_open=True, hi_open=False),
        repetition_penalty=f.number("repetition_penalty", 1.0, 0.0, FLT_MAX, lo_open=True, hi_open=False),
        presence_penalty=f.number("presence_penalty", 0.0, -2.0, 2.0, lo_open=False, hi_open=False),
        frequency_penalty=f.number("frequency_penalty", 0.0, -2.0, 2.0, lo_open=False, hi_open=False),
        seed=f.integer("seed", None, 0, INT63_MAX),
        max_new_tokens=f.integer("max_tokens", max_iter_times, 0, INT32_MAX, lo_open=True),
        stop=_stop(f),
        stop_token_ids=_stop_token_ids(f.data.get("stop_token_ids")),
        ignore_eos=f.boolean("ignore_eos", False),
        include_stop_str_in_output=bool(f.boolean("include_stop_str_in_output", False)),
    )


def _stop(f: Fields) -> list[str]:
    value = f.data.get("stop")
    if isinstance(value, str):
        if not 1 <= len(value) <= STOP_TOTAL:
            raise validation(f"stop must be 1 to {STOP_TOTAL} characters long, got {len(value)}.")
        return [value]
    return f.stop_list("stop", max_items=2**31)


def _stop_token_ids(value: Any) -> list[int]:
    """Ints only; ids outside [0, 2^31-1] are dropped and duplicates removed, as MindIE does."""
    if value is None:
        return []
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise validation("stop_token_ids must be array of integers type.")
    return list(dict.fromkeys(i for i in value if 0 <= i <= INT32_MAX))


def _n_best_of(f: Fields, max_n: int) -> tuple[int, int]:
    n = f.integer("n", 1, 1, 8192)
    if n > max_n:
        raise validation(f"n must be at most {max_n} (maxBatchSize and maxPrefillBatchSize), got {n}.")
    best_of = f.integer("best_of", n, 1, 128)
    if best_of < n:
        raise validation(f"best_of must be greater than or equal to n, got best_of {best_of} and n {n}.")
    if f.data.get("temperature") in (None, 0) and best_of > 1:
        raise validation("n and best_of must be 1 when temperature is 0 or absent (greedy).")
    return n, best_of
