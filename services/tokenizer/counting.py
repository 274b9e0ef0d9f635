"""Token counts without generating: ``/v1/tokenizer`` (MindIE), ``/tokenize`` and ``/detokenize`` (vLLM),
Anthropic's ``count_tokens``. A text is encoded as a completion request encodes it, a conversation as a
chat request renders it (the same template, tools and turn), so the counts equal what those requests
report as their prompt tokens."""

from __future__ import annotations

from services.tokenizer.detokenizer import token_pieces
from services.tokenizer.encoder import render_chat
from shared.errors import SwitchboardError
from shared.messages import Detokenize, Detokenized, Tokenize, Tokenized

MEDIA_COUNT_TIMEOUT_S = 25.0  # under the gateway's 30 s wait for a count


def tokenize(tokenizer, req: Tokenize) -> Tokenized:
    offsets: list[tuple[int, int]] = []
    if req.messages is not None:
        try:
            ids = render_chat(tokenizer, req)
        except SwitchboardError as exc:
            return Tokenized(ids=[], pieces=[], error=exc.message)
    else:
        encoded = tokenizer(req.text, add_special_tokens=req.add_special_tokens, return_offsets_mapping=req.offsets)
        ids = encoded.input_ids
        if req.offsets:
            offsets = [(start, stop) for start, stop in encoded.offset_mapping]
    strs = tokenizer.convert_ids_to_tokens(ids) if req.token_strs else []
    return Tokenized(ids=ids, pieces=token_pieces(tokenizer, ids), strs=strs, offsets=offsets)


async def tokenize_with_media(tokenizer, req: Tokenize, media, policy) -> Tokenized:
    """A conversation with media (``req.parts``), fetched and expanded by the processor (``media``, a
    MediaProcessor) as a request's are."""
    try:
        prepared = await media.prepare(req, tokenizer, policy, MEDIA_COUNT_TIMEOUT_S)
    except SwitchboardError as exc:
        return Tokenized(ids=[], pieces=[], error=exc.message)
    strs = tokenizer.convert_ids_to_tokens(prepared.ids) if req.token_strs else []
    return Tokenized(ids=prepared.ids, pieces=[], strs=strs)


def detokenize(tokenizer, req: Detokenize, vocab_size: int) -> Detokenized:
    bad = next((i for i in req.ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        return Detokenized(error=f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return Detokenized(text=tokenizer.decode(req.ids))
