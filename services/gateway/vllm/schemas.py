"""vLLM ``/generate`` bodies (reference §3.23b): every parameter top-level, ``prompt`` required."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.common.content import ListInput, mindie_input
from services.gateway.common.sampling import VllmDialect, vllm_sampling
from services.gateway.common.served import Served
from services.gateway.web.validation import FLT_MAX, Fields, text_input
from shared.errors import ErrorKind, SwitchboardError, validation
from shared.messages import Sampling


@dataclass(frozen=True)
class VllmRequest:
    prompt: str
    sampling: Sampling
    n: int
    best_of: int
    stream: bool
    adapter: str = ""  # the LoRA adapter named by ``model``; "" = the base model
    listed: ListInput | None = None  # ``prompt`` in the list form (``prompt`` is then its joined text)


# what a vLLM /generate body may hold (reference §3.23b, and the sampling and guided-decoding fields it shares with
# the OpenAI routes); anything else is refused (vLLM's own server builds SamplingParams(**body), which refuses it)
FIELDS = frozenset({
    "prompt", "model", "stream", "n", "best_of", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "stop", "stop_token_ids", "include_stop_str_in_output", "min_tokens",
    "logit_bias", "use_beam_search", "bad_words", "allowed_token_ids", "logits_processors", "prompt_logprobs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "structured_outputs",
    "inputs"})  # TGI's prompt: beside ``prompt`` the body is still vLLM's and it is set aside (reference §3.23)


def parse_vllm(data: dict[str, Any], served: Served, max_iter_times: int, max_n: int) -> VllmRequest:
    """``served``: the model and adapter names ``model`` may take (reference §3.23b: the LoRA id)."""
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise validation(f"{unknown[0]} is not a field of vLLM's /generate (it takes "
                         f"{', '.join(sorted(FIELDS - {'inputs'}))}).", unknown[0])
    f = Fields(data)
    if data.get("prompt_logprobs") is not None:  # /generate answers text only
        raise validation("prompt_logprobs is not supported on /generate; /v1/completions and /v1/chat/completions "
                         "take it.", "prompt_logprobs")
    prompt, listed = mindie_input(data.get("prompt"), "prompt", lambda text: text_input(text, "prompt"))
    adapter = _adapter(f.string("model"), served)
    sampling = vllm_sampling(f, VllmDialect(repetition_max=FLT_MAX, max_tokens_default=max_iter_times))
    n, best_of = _n_best_of(f, max_n)
    return VllmRequest(prompt, sampling, n, best_of, f.boolean("stream", False), adapter, listed)


def _adapter(name: str | None, served: Served) -> str:
    """The adapter ``model`` names: "" for absent, "None" or the served model's name."""
    if name is None or name == "None":
        return ""
    if not 1 <= len(name) <= 256:
        raise validation(f"model must be 1 to 256 characters long, got {len(name)}.", "model")
    adapter = served.adapter(name, "model")
    if adapter is None:
        raise SwitchboardError(ErrorKind.NOT_FOUND, f"Model {name} not found.")
    return adapter


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
