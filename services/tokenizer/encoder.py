"""Prompt encoding with MindIE's length rules (reference §2.6, ModelDeployConfig.truncation)."""

from __future__ import annotations

import functools

import msgspec

from shared.config import ModelDeployConfig
from shared.errors import ErrorInfo, ErrorKind, validation
from shared.model_folder import ModelFolderError
from services.tokenizer.tools import plain, takes_tools, with_tools
from shared.messages import EngineRequest, GenerateRequest, Sampling, Tokenize, encode

MAX_TOKENS_NUM = 1048576
SHORTEN = ("shorten it, or have its last {limit} tokens kept where the API takes that (parameters.truncate on TGI's "
           "/generate, /generate_stream and POST /; truncate_prompt_tokens on OpenAI's chat and completions)")


def input_limit(deploy: ModelDeployConfig) -> int:
    """The most prompt tokens a request may have: min(maxInputTokenLen, maxSeqLen - 1)."""
    return min(deploy.effective_max_input_len, MAX_TOKENS_NUM)


def encode_prompt(tokenizer, req: GenerateRequest, deploy: ModelDeployConfig) -> list[int]:
    if req.prompt_ids is not None:
        ids = list(req.prompt_ids)
    elif req.messages is not None:
        ids = render_chat(tokenizer, req, deploy)
    else:
        refuse_surely_too_long(tokenizer, req.prompt, req.truncate, deploy, "the prompt")
        ids = tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
    if not ids:
        raise validation("the prompt is empty after tokenization")
    if req.truncate and req.truncate < len(ids):
        check_truncate(req.truncate, len(ids), deploy)
        ids = ids[-req.truncate :]
    return apply_length_limit(ids, deploy)


def check_truncate(truncate: int, tokens: int, deploy: ModelDeployConfig) -> None:
    """A request's truncate keeps the prompt's last ``truncate`` tokens: more than the limit is refused (as TGI
    and vLLM refuse it), not cut again by the deployment's truncation to a slice without the prompt's end."""
    limit = input_limit(deploy)
    if truncate > limit:
        raise validation(f"the prompt has {tokens} tokens and the request's truncate keeps its last {truncate}, more "
                         f"than the limit of {limit} (min(maxInputTokenLen, maxSeqLen - 1)): truncate at most {limit}")


def refuse_surely_too_long(tokenizer, text: str, truncate: int, deploy: ModelDeployConfig, what: str) -> None:
    """Refuse, before tokenizing it, a prompt longer than the limit's tokens could hold even at the vocabulary's
    longest token (twice over, for normalizers): a 4 MiB prompt took the tokenizer ~4 s, and every other request
    waited behind it. A prompt that is to be cut (``truncate``, or a deployment that truncates) is tokenized."""
    limit = input_limit(deploy)
    too_long = len(text) > 2 * limit and len(text) > 2 * limit * longest_token(tokenizer)
    if too_long and not (deploy.truncates or truncate):
        raise validation(f"{what} has {len(text)} characters: more than the limit of {limit} tokens "
                         f"(min(maxInputTokenLen, maxSeqLen - 1)) can hold; {SHORTEN.format(limit=limit)}")


@functools.cache
def longest_token(tokenizer) -> int:
    """The most characters one token of the vocabulary (added tokens too) stands for."""
    return max((len(piece) for piece in tokenizer.get_vocab()), default=1)


def apply_length_limit(ids: list[int], deploy: ModelDeployConfig) -> list[int]:
    limit = input_limit(deploy)
    if len(ids) <= limit:
        return ids
    if not deploy.truncates:
        raise validation(
            f"the prompt has {len(ids)} tokens, more than the limit of {limit} "
            f"(min(maxInputTokenLen, maxSeqLen - 1)); {SHORTEN.format(limit=limit)}"
        )
    return ids[-limit:] if deploy.truncates_left else ids[:limit]


def check_request_ids(req: GenerateRequest, vocab_size: int) -> None:
    """The token ids a request's prompt names are in the vocabulary."""
    if req.prompt_ids is not None:
        check_token_ids(req.prompt_ids, vocab_size)


def with_sampling_ids(tokenizer, req: GenerateRequest, vocab_size: int) -> GenerateRequest:
    """The request as the engine takes it: the token ids its sampling names (logit_bias keys, allowed_token_ids)
    checked against the vocabulary, and vLLM's ``bad_words`` as the ids the engine bans (``bad_words_ids``)."""
    sampling = req.sampling
    check_token_ids(list(sampling.logit_bias), vocab_size, "logit_bias")
    check_token_ids(sampling.allowed_token_ids, vocab_size, "allowed_token_ids")
    banned = bad_words_ids(tokenizer, sampling.bad_words, vocab_size) if sampling.bad_words else []
    check_allowed_left(tokenizer, sampling, {ids[0] for ids in banned if len(ids) == 1})
    if not sampling.bad_words:
        return req
    return msgspec.structs.replace(req, sampling=msgspec.structs.replace(sampling, bad_words=[], bad_words_ids=banned))


def check_allowed_left(tokenizer, sampling: Sampling, banned: set[int]) -> None:
    """``allowed_token_ids`` leaves a token the first one may be: not every allowed token is a one-token bad word,
    nor, under ``min_tokens``, one that would end the answer (EOS, a stop id). The engine would otherwise keep to
    the allow-list and break the others (a degenerate answer with a 200)."""
    allowed = set(sampling.allowed_token_ids)
    if not allowed:
        return
    if allowed <= banned:
        raise validation("allowed_token_ids: every allowed token is one of bad_words; no token is left to sample.",
                         "allowed_token_ids")
    ending = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos or tokenizer.eos_token_id is None
                                             else {tokenizer.eos_token_id})
    if sampling.min_tokens and allowed <= banned | ending:
        raise validation("allowed_token_ids: every allowed token is a bad word or ends the answer (EOS, "
                         "stop_token_ids), which min_tokens keeps out; no token is left to sample.",
                         "allowed_token_ids")


def bad_words_ids(tokenizer, words: list[str], vocab_size: int) -> list[list[int]]:
    """vLLM's reading of ``bad_words``: each word's tokens as it starts a text and, where that differs in its first
    token only (tokenizers that mark a word's leading space), as it follows a space, so it is banned at the start
    and in the middle of an answer."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(bare)
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    check_token_ids([i for ids in out for i in ids], vocab_size, "bad_words")
    return [ids for ids in out if ids]


def check_token_ids(ids: list[int], vocab_size: int, param: str | None = None) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise validation(f"{param + ': ' if param else ''}token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                         param)


def template_turn(req: GenerateRequest | Tokenize) -> dict[str, bool]:
    """How the rendered conversation ends: the assistant's turn opened (the default), no turn added, or the
    last (assistant) message left open for the answer to continue (vLLM's continue_final_message; Anthropic's
    prefill)."""
    if req.continue_final_message:
        return {"add_generation_prompt": False, "continue_final_message": True}
    return {"add_generation_prompt": req.add_generation_prompt}


def load_tokenizer(path: str):
    """The folder's tokenizer, its chat template compiled; files that parse but do not make a tokenizer (a
    tokenizer.json of ``{}``) are a ModelFolderError naming them, not a traceback."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - whatever the tokenizers library raises of a malformed file
        raise ModelFolderError(f"{path}: transformers cannot make its tokenizer of tokenizer.json, tokenizer_config.json "
                               f"and the vocabulary files: {type(exc).__name__}: {exc}") from None
    check_chat_template(tokenizer, path)
    return tokenizer


def check_chat_template(tokenizer, folder: str) -> None:
    """The model's chat template compiles (a start-up error naming it, not a 400 on every chat request)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = getattr(tokenizer, "chat_template", None)
    for name, text in (template.items() if isinstance(template, dict) else [("", template)]):
        if not isinstance(text, str):
            continue
        try:
            _compile_jinja_template(text)
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateSyntaxError and whatever its parser raises
            where = "chat_template.jinja or tokenizer_config.json's chat_template" + (f" ({name})" if name else "")
            raise ModelFolderError(f"{folder}: the chat template ({where}) does not compile: {exc}") from None


def render_chat(tokenizer, req: GenerateRequest | Tokenize, deploy: ModelDeployConfig | None = None) -> list[int]:
    """The conversation through the model's chat template, ending with the assistant's turn opened (or, as the
    request asks, with no turn added, or the last message left open for the answer to continue). With ``deploy``
    (a generation), a rendering surely over the prompt limit is refused before it is tokenized."""
    if not getattr(tokenizer, "chat_template", None):
        raise validation("the model has no chat_template in its tokenizer_config.json; use /v1/completions")
    messages, extra = req.messages, {}
    if req.tools:
        messages, extra = with_tools(tokenizer, req.messages, req.tools, req.tool_choice)
    elif not takes_tools(tokenizer):
        messages = plain(req.messages)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **template_turn(req), **extra,
                                             **req.chat_template_kwargs)
    except Exception as exc:  # a template error is the caller's messages not fitting the template
        raise validation(f"the messages do not fit the model's chat template: {exc}") from None
    if deploy is not None:
        refuse_surely_too_long(tokenizer, text, req.truncate, deploy, "the conversation (as its chat template renders it)")
    return tokenizer(text, add_special_tokens=False).input_ids


def check_media_prompt(ids: list[int], req: GenerateRequest, deploy: ModelDeployConfig) -> list[int]:
    """A prompt with media as it is: cutting it would part image tokens from their features, so a
    prompt over the limit (or over ``truncate``) is refused instead of truncated."""
    limit = input_limit(deploy)
    if req.truncate and req.truncate < len(ids):
        limit = min(limit, req.truncate)
    if len(ids) > limit:
        raise validation(f"the prompt with its media has {len(ids)} tokens, more than the limit of {limit}; "
                         "a prompt with media is not truncated: send fewer or smaller media or a shorter text")
    return ids


MB = 1 << 20


def too_large(request: EngineRequest, limit: int) -> ErrorInfo | None:
    """A 413 for a request whose preprocessed media exceed what one bus message (``limit`` bytes) may carry."""
    size = len(encode(request))
    if size <= limit:
        return None
    return ErrorInfo(ErrorKind.TOO_LARGE, f"the request's preprocessed media are {size / MB:.1f} MB, more than "
                                          f"a bus message's limit of {limit / MB:.1f} MB: send fewer or smaller media")
