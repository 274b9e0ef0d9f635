"""``text_completion`` bodies and streams (reference §3.26)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from services.gateway.openai_api.runner import Batch
from services.gateway.openai_api.schemas import CompletionRequest
from services.gateway.openai_api.sse import Meta, UsagePlacement, finish_reason
from shared.messages import TokenOut


class Logprobs:
    """The legacy logprobs object of one choice; offsets run on across a stream's chunks."""

    def __init__(self, offset: int):
        self.offset = offset

    def of(self, tokens: list[TokenOut]) -> dict[str, list]:
        body: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for token in tokens:
            body["text_offset"].append(self.offset)
            body["token_logprobs"].append(token.logprob)
            body["tokens"].append(token.text)
            top = {t.text: t.logprob for t in token.top}
            top.setdefault(token.text, token.logprob)  # the sampled token is always listed, as in vLLM
            body["top_logprobs"].append(top)
            self.offset += len(token.text)
        return body


def echo_texts(req: CompletionRequest, batch: Batch) -> list[str]:
    """Per choice, the prompt text ``echo`` prepends ("" without echo)."""
    if not req.echo:
        return [""] * len(batch)
    texts = []
    for index, started in enumerate(batch.started):
        prompt = req.prompts[batch.prompt_of(index)]
        texts.append(prompt.text if prompt.ids is None else "".join(started.prompt_texts))
    return texts


def _choice(index: int, text: str, logprobs: Any, reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason),
            "stop_reason": None}


async def completion_body(req: CompletionRequest, batch: Batch) -> dict[str, Any]:
    all_tokens = await batch.collect()
    choices = []
    for index, (echo, tokens) in enumerate(zip(echo_texts(req, batch), all_tokens)):
        logprobs = Logprobs(len(echo)).of(tokens) if req.logprobs is not None else None
        text = echo + "".join(t.text for t in tokens)
        choices.append(_choice(index, text, logprobs, batch.sessions[index].finish_reason))
    return Meta.new("cmpl", "text_completion", req.common.model).body(choices, usage=batch.usage())


async def completion_chunks(req: CompletionRequest, batch: Batch) -> AsyncIterator[dict[str, Any]]:
    """With echo, each choice's prompt first; then text deltas, each choice's end, the usage (if asked)."""
    meta = Meta.new("cmpl", "text_completion", req.common.model)
    usage = UsagePlacement(batch, req.common.include_usage)
    echoes = echo_texts(req, batch)
    trackers = [Logprobs(len(echo)) for echo in echoes]
    for index, echo in enumerate(echoes):
        if echo:
            yield meta.body([_choice(index, echo, None, None)], **usage.on_chunk(False))
    async for index, out in batch.events():
        text = "".join(t.text for t in out.tokens)
        ends = out.finish_reason is not None
        wants_logprobs = req.logprobs is not None
        if not (text or ends or (wants_logprobs and out.tokens)):
            continue
        logprobs = trackers[index].of(out.tokens) if wants_logprobs else None
        yield meta.body([_choice(index, text, logprobs, out.finish_reason)], **usage.on_chunk(ends))
    for closing in usage.closing(meta):
        yield closing
