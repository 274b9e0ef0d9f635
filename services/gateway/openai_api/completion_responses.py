"""``text_completion`` bodies and streams (reference §3.26)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from services.gateway.common import finish
from services.gateway.openai_api.schemas import CompletionRequest
from services.gateway.openai_api.sse import Meta, UsagePlacement, sse, token_id_text
from services.gateway.openai_api.token_fields import prompt_logprobs_json, token_ids
from services.gateway.request.call import Call
from services.gateway.request.session import End
from shared.messages import TokenOut


class Logprobs:
    """The legacy logprobs object of one choice; offsets run on across a stream's chunks (in the text, also
    when ``as_ids``, vLLM's return_tokens_as_token_ids, shows each token as ``token_id:<id>``)."""

    def __init__(self, offset: int, as_ids: bool = False, k: int | None = None):
        self.offset = offset
        self.as_ids = as_ids
        self.k = k  # alternatives listed per token (None: all it has; prompt_logprobs may have asked more)

    def of(self, tokens: list[TokenOut]) -> dict[str, list]:
        body: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for token in tokens:  # each token's own text (a stop string's hold-back does not move it)
            text = token.own_text
            shown = token_id_text(token.id) if self.as_ids else text
            body["text_offset"].append(self.offset)
            body["token_logprobs"].append(token.logprob)
            body["tokens"].append(shown)
            top = None  # the prompt's first token has no logprob, nor alternatives (as OpenAI and vLLM)
            if token.logprob is not None:
                top = {shown: token.logprob}  # the token itself is always listed, as in vLLM
                for t in token.top[:self.k]:  # most likely first: alternatives with one text (parts of characters) keep
                    if t.id != token.id:  # the likeliest's logprob
                        top.setdefault(token_id_text(t.id) if self.as_ids else t.text, t.logprob)
            body["top_logprobs"].append(top)
            self.offset += len(text)
        return body


def echo_texts(req: CompletionRequest, call: Call) -> list[str]:
    """Per choice, the prompt text ``echo`` prepends ("" without echo)."""
    if not req.echo:
        return [""] * len(call)
    texts = []
    for index, started in enumerate(call.started):
        prompt = req.prompts[call.prompt_of(index)]
        texts.append(prompt.text if prompt.ids is None else "".join(started.prompt_texts))
    return texts


def _choice(index: int, text: str, logprobs: Any, end: End | None, req: CompletionRequest) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish.openai(end and end.finish_reason),
            "stop_reason": finish.vllm_stop_reason(end, req.common.sampling.stop_token_ids)}


def prompt_logprobs(req: CompletionRequest, call: Call, index: int) -> tuple[Logprobs, dict[str, list] | None]:
    """Choice ``index``'s logprobs tracker, and with ``echo`` and ``logprobs`` its prompt's part (the prompt
    tokens' logprobs, the first null), offsets from 0; else offsets start after the echoed text."""
    if req.echo and req.logprobs is not None:
        tracker = Logprobs(0, req.common.tokens_as_ids, req.logprobs)
        return tracker, tracker.of(call.sessions[index].prompt)
    return Logprobs(len(echo_texts(req, call)[index]), req.common.tokens_as_ids), None


def _joined(first: dict[str, list] | None, then: dict[str, list]) -> dict[str, list]:
    return then if first is None else {key: first[key] + then[key] for key in then}


async def completion_body(req: CompletionRequest, call: Call) -> dict[str, Any]:
    choices = []
    for index, (echo, end) in enumerate(zip(echo_texts(req, call), await call.results())):
        logprobs = None
        if req.logprobs is not None:
            tracker, prompt = prompt_logprobs(req, call, index)
            logprobs = _joined(prompt, tracker.of(end.tokens))
        choice = _choice(index, echo + end.text, logprobs, end, req)
        if req.common.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(call.sessions[index].prompt, req.common.prompt_logprobs)
        if req.common.return_token_ids:
            choice.update(prompt_token_ids=call.started[index].prompt_ids, token_ids=token_ids(end.tokens))
        choices.append(choice)
    meta = Meta.new("cmpl", "text_completion", req.common.model, req.common.request_id, call)
    return meta.body(choices, usage=call.usage())


async def completion_chunks(req: CompletionRequest, call: Call) -> AsyncIterator[bytes]:
    """With echo, each choice's prompt first; then text deltas, each choice's end, the usage (if asked)."""
    meta = Meta.new("cmpl", "text_completion", req.common.model, req.common.request_id, call)
    usage = UsagePlacement(call, req.common.include_usage, req.common.continuous_usage)
    echoes = echo_texts(req, call)
    wants_logprobs = req.logprobs is not None
    trackers = [Logprobs(len(echo), req.common.tokens_as_ids) for echo in echoes]
    ids = StreamedIds(req, call)
    late = set()  # choices whose echo waits for their prompt logprobs (they come with the first token)
    for index, echo in enumerate(echoes):
        if echo and wants_logprobs:
            late.add(index)
        elif echo:
            echoed = ids.on(_choice(index, echo, None, None, req), [])
            yield sse(meta.body([echoed], **usage.on_chunk(False, index)))
    async for step in call.steps():
        usage.count(step)
        if step.index in late:
            late.discard(step.index)
            trackers[step.index], prompt = prompt_logprobs(req, call, step.index)
            echoed = ids.on(_choice(step.index, echoes[step.index], prompt, None, req), [])
            yield sse(meta.body([echoed], **usage.on_chunk(False, step.index)))
        text = step.text
        ends = step.end is not None
        if not (text or ends or ((wants_logprobs or ids.wanted) and step.tokens)):
            continue
        logprobs = trackers[step.index].of(step.tokens) if wants_logprobs else None
        choice = ids.on(_choice(step.index, text, logprobs, step.end, req), step.tokens)
        yield sse(meta.body([choice], **usage.on_chunk(ends, step.index)))
    for closing in usage.closing(meta):
        yield sse(closing)


class StreamedIds:
    """vLLM's ``return_token_ids`` in a completions stream: each choice's first chunk carries its prompt's ids,
    every chunk the ids of the tokens it carries."""

    def __init__(self, req: CompletionRequest, call: Call):
        self.wanted = req.common.return_token_ids
        self.call = call
        self.sent: set[int] = set()

    def on(self, choice: dict[str, Any], tokens: list[TokenOut]) -> dict[str, Any]:
        if not self.wanted:
            return choice
        index = choice["index"]
        if index not in self.sent:
            self.sent.add(index)
            choice["prompt_token_ids"] = self.call.started[index].prompt_ids
        choice["token_ids"] = token_ids(tokens)
        return choice
