"""One sampling parser per parameter dialect; the real differences between families are passed in.

* MindIE's ``parameters`` object (TGI, native ``/infer``, Triton): seeds 002-004, reference §3.22,
  §3.27, §3.29-§3.31 and §5. TGI and native take top_k in (0, 2^31-1] and top_p in (0, 1); Triton
  takes top_k in [0, 2^31-1], top_p in (0, 1] and, as the KServe generate extension, ``max_tokens``
  when ``max_new_tokens`` is absent (litellm's ``triton/`` client sends exactly that).
* vLLM's top-level fields (OpenAI chat and completions, vLLM ``/generate``): reference §3.23b,
  §3.25, §3.26. repetition_penalty is (0, 2] on the OpenAI routes and (0, FLT_MAX] on ``/generate``;
  the max_tokens default is the family's.

A temperature below ``GREEDY_BELOW`` means greedy decoding on every family (the engine applies the
same threshold to whatever reaches it, so a tiny temperature can never overflow the sampler).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from services.gateway.common.guided import guided
from services.gateway.web.validation import FLT_MAX, INT32_MAX, UINT64_MAX, Fields
from shared.errors import validation
from shared.messages import Sampling

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS
SEED_MAX = 2**63 - 1  # vLLM dialect: unsigned, at most 2^63-1 (reference §5)
STOP_TOTAL = 32768


# ---- MindIE's parameters object -------------------------------------------------------------


@dataclass(frozen=True)
class MindieDialect:
    top_k_zero: bool  # top_k 0 (disabled) accepted
    top_p_one: bool  # top_p 1.0 accepted
    max_tokens_alias: bool  # KServe generate: parameters.max_tokens when max_new_tokens is absent


TGI = MindieDialect(top_k_zero=False, top_p_one=False, max_tokens_alias=False)
NATIVE = TGI
TRITON = MindieDialect(top_k_zero=True, top_p_one=True, max_tokens_alias=True)
MAX_NEW_TOKENS_DEFAULT = 20
# TGI's parameters that MindIE's own routes (/infer, Triton's generate) do not take, with the values asking nothing
TGI_ONLY = {"grammar": (None,), "truncate": (None, 0), "top_n_tokens": (None, 0), "decoder_input_details": (None, False),
            "return_full_text": (None, False), "best_of": (None, 1), "adapter_id": (None, "None")}


def refuse_tgi_only(p: Fields, route: str) -> None:
    """A TGI parameter asking for something ``route`` does not do is a 422 naming it (as the object's fields are
    named: ``parameters.`` by default), not ignored."""
    for name, idle in TGI_ONLY.items():
        value = p.data.get(name)
        if not any(type(value) is type(v) and value == v for v in idle):  # True is not 1, 0.0 is not 0
            field = f"{p.where or 'parameters.'}{name}"
            raise validation(f"{field} is a TGI parameter: {route} (send it to /generate or /generate_stream).", field)


def mindie_sampling(p: Fields, dialect: MindieDialect, logprobs: int | None = None) -> Sampling:
    """The ``parameters`` object of TGI, native and Triton bodies."""
    p.boolean("watermark", False)
    if p.data.get("frequency_penalty") is not None:  # TGI's (a share of all tokens); MindIE's routes have none
        raise validation("frequency_penalty is not supported on this route; repetition_penalty is.", "frequency_penalty")
    return Sampling(
        do_sample=p.boolean("do_sample"),
        temperature=p.number("temperature", 1.0, 0.0, FLT_MAX, lo_open=True, hi_open=False),
        top_k=p.integer("top_k", 0, 0, INT32_MAX, lo_open=not dialect.top_k_zero),
        top_p=p.number("top_p", 1.0, 0.0, 1.0, lo_open=True, hi_open=not dialect.top_p_one),
        typical_p=p.number("typical_p", 1.0, 0.0, 1.0, lo_open=True, hi_open=False),
        repetition_penalty=p.number("repetition_penalty", 1.0, 0.0, FLT_MAX, lo_open=True, hi_open=False),
        seed=p.integer("seed", None, 0, UINT64_MAX, lo_open=True),  # (0, 2^64-1], seeds 003 and 004
        max_new_tokens=_max_new_tokens(p, dialect),
        stop=p.stop_list("stop"),
        logprobs=logprobs,
    )


def _max_new_tokens(p: Fields, dialect: MindieDialect) -> int:
    default = MAX_NEW_TOKENS_DEFAULT
    if dialect.max_tokens_alias:
        default = p.integer("max_tokens", default, 0, INT32_MAX, lo_open=True)
    return p.integer("max_new_tokens", default, 0, INT32_MAX, lo_open=True)


# ---- vLLM's top-level fields ----------------------------------------------------------------


@dataclass(frozen=True)
class VllmDialect:
    repetition_max: float  # OpenAI routes: 2.0; vLLM /generate: FLT_MAX
    max_tokens_default: int
    prompt_only: bool = False  # max_tokens may be 0 (completions with echo: the prompt's logprobs alone, as vLLM)


def vllm_sampling(f: Fields, dialect: VllmDialect, logprobs: int | None = None) -> Sampling:
    """The sampling fields of OpenAI chat/completions and vLLM ``/generate`` bodies."""
    _refuse_unsupported(f)
    temperature = f.number("temperature", 1.0, 0.0, FLT_MAX, lo_open=False, hi_open=False)
    greedy = temperature < GREEDY_BELOW
    max_new_tokens = _max_tokens(f, dialect)
    return Sampling(
        do_sample=not greedy,
        temperature=1.0 if greedy else temperature,
        top_k=_top_k(f),
        top_p=f.number("top_p", 1.0, 0.0, 1.0, lo_open=True, hi_open=False),
        repetition_penalty=f.number("repetition_penalty", 1.0, 0.0, dialect.repetition_max, lo_open=True,
                                    hi_open=False),
        presence_penalty=f.number("presence_penalty", 0.0, -2.0, 2.0, lo_open=False, hi_open=False),
        frequency_penalty=f.number("frequency_penalty", 0.0, -2.0, 2.0, lo_open=False, hi_open=False),
        seed=f.integer("seed", None, 0, SEED_MAX),
        max_new_tokens=max_new_tokens,
        stop=_stop(f),
        stop_token_ids=_stop_token_ids(f),
        ignore_eos=bool(f.boolean("ignore_eos", False)),
        include_stop_str_in_output=bool(f.boolean("include_stop_str_in_output", False)),
        logprobs=logprobs,
        grammar=guided(f),
        min_p=f.number("min_p", 0.0, 0.0, 1.0, lo_open=False, hi_open=False),
        logit_bias=_logit_bias(f),
        min_tokens=_min_tokens(f, max_new_tokens),
        skip_special_tokens=bool(f.boolean("skip_special_tokens", True)),
        allowed_token_ids=_allowed_token_ids(f),
        bad_words=_bad_words(f),
    )


BAD_WORDS_MAX = 1024  # words, and characters per word


def _allowed_token_ids(f: Fields) -> list[int]:
    """vLLM's ``allowed_token_ids``: a non-empty array of token ids (the tokenizer checks them against the
    vocabulary), duplicates dropped."""
    value = f.data.get("allowed_token_ids")
    if value is None:
        return []
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise validation("allowed_token_ids must be an array of token ids.", "allowed_token_ids")
    if not value:
        raise validation("allowed_token_ids must not be empty (leave it out to allow every token).",
                         "allowed_token_ids")
    if min(value) < 0:
        raise validation(f"allowed_token_ids: token id {min(value)} is negative.", "allowed_token_ids")
    return sorted(set(value))


def _bad_words(f: Fields) -> list[str]:
    """vLLM's ``bad_words``: up to 1024 non-blank strings of up to 1024 characters."""
    value = f.data.get("bad_words")
    if value is None:
        return []
    if not isinstance(value, list) or any(not isinstance(w, str) for w in value):
        raise validation("bad_words must be an array of strings.", "bad_words")
    if len(value) > BAD_WORDS_MAX:
        raise validation(f"bad_words must have at most {BAD_WORDS_MAX} words, got {len(value)}.", "bad_words")
    for word in value:
        if not word.strip() or len(word) > BAD_WORDS_MAX:
            raise validation(f"bad_words items must be 1 to {BAD_WORDS_MAX} characters and not blank, got {word!r:.40}.",
                             "bad_words")
    return value


def _min_tokens(f: Fields, most: int) -> int:
    value = f.integer("min_tokens", 0, 0, INT32_MAX)
    if value > most:
        raise validation(f"min_tokens must be less than or equal to max_tokens={most}, got {value}.", "min_tokens")
    return value


def _logit_bias(f: Fields) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys) to a bias in [-100, 100]."""
    value = f.data.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise validation("logit_bias must be an object of token ids to numbers.", "logit_bias")
    bias = {}
    for key, number in value.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token <= INT32_MAX:
            raise validation(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias")
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not -100 <= number <= 100:
            raise validation(f"logit_bias[{key}] must be a number in [-100, 100], got {number!r}.", "logit_bias")
        bias[token] = float(number)
    return bias


def choice_sampling(sampling: Sampling, j: int) -> Sampling:
    """Choice ``j`` of a request with n choices: a given seed stays reproducible yet gives n different
    choices (seed + j); without one the tokenizer draws a seed per choice."""
    if j == 0 or sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=(sampling.seed + j) % (SEED_MAX + 1))


def _max_tokens(f: Fields, dialect: VllmDialect) -> int:
    """``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``."""
    value = f.integer("max_tokens", dialect.max_tokens_default, 0, INT32_MAX, lo_open=not dialect.prompt_only)
    return f.integer("max_completion_tokens", value, 0, INT32_MAX, lo_open=not dialect.prompt_only)


def _top_k(f: Fields) -> int:
    top_k = f.integer("top_k", -1, -1, INT32_MAX)
    if top_k == 0:
        raise validation("top_k must be -1 (disabled) or in (0, 2147483647], got 0.", "top_k")
    return max(top_k, 0)


def _stop(f: Fields) -> list[str]:
    """A string of 1..32768 characters, or a list of 1..1024-character items, 32768 in all (§3.23b)."""
    value = f.data.get("stop")
    if isinstance(value, str):
        if not 1 <= len(value) <= STOP_TOTAL:
            raise validation(f"stop must be 1 to {STOP_TOTAL} characters long, got {len(value)}.", "stop")
        return [value]
    return f.stop_list("stop", max_items=2**31)


def _stop_token_ids(f: Fields) -> list[int]:
    """Ints only; ids outside [0, 2^31-1] are dropped and duplicates removed, order kept (as MindIE)."""
    value = f.data.get("stop_token_ids")
    if value is None:
        return []
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise validation("stop_token_ids must be array of integers type.", "stop_token_ids")
    return list(dict.fromkeys(i for i in value if 0 <= i <= INT32_MAX))


def _refuse_unsupported(f: Fields) -> None:
    """Fields that would change the answer in ways this server cannot honour: a clear 4xx, not silence."""
    if f.boolean("use_beam_search", False):
        raise validation("use_beam_search is not supported.", "use_beam_search")
    f.boolean("spaces_between_special_tokens", True)  # typed; fast tokenizers (all served) join special tokens as
    # they are, as vLLM's fast detokenizer does whatever it says
    if f.data.get("logits_processors"):
        raise validation("logits_processors is not supported.", "logits_processors")
