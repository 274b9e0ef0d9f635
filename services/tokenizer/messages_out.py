"""What the tokenizer sends on for an encoded request: its ``Started`` to the gateway and its ``EngineRequest``."""

from __future__ import annotations

import math

import msgspec

from services.tokenizer.detokenizer import token_texts
from services.tokenizer.tools import tool_format
from shared.config import Config
from shared.messages import EngineRequest, GenerateRequest, MediaInputs, Started


def started(tok, instance: str, req: GenerateRequest, ids: list[int], seed: int, engine: str) -> Started:
    """The gateway's word that the request was taken: its prompt's size, its seed, who serves it."""
    out = Started(id=req.id, prompt_tokens=len(ids), seed=seed, tokenizer=instance, engine=engine,
                  tool_format=tool_format(tok) if req.tools else "")
    if req.return_prompt_ids:
        out.prompt_ids = ids
        out.prompt_texts = token_texts(tok, ids)
    return out


def engine_request(cfg: Config, instance: str, inbox: str, req: GenerateRequest, ids: list[int], seed: int,
                   media: MediaInputs | None = None) -> EngineRequest:
    """The engine's request: the prompt's ids, the sampling with its seed and bounds, and its deadline."""
    sampling = req.sampling
    # (a prompt-only request, max_new_tokens 0, samples one token with its prefill: ``forward`` keeps it back)
    max_new = min(max(sampling.max_new_tokens, 1), cfg.schedule.max_iter_times)
    e2e = float(cfg.server.e2e_timeout)
    limit = min(req.timeout_s or math.inf, e2e)
    return EngineRequest(
        id=req.id, trace=req.trace, prompt_ids=ids, reply_to=inbox, priority=req.priority,
        arrival=req.arrival, deadline=req.arrival + limit if req.arrival else None,
        deadline_reason="client timeout" if limit < e2e else "server e2eTimeout",
        sampling=msgspec.structs.replace(sampling, seed=seed, max_new_tokens=max_new),
        generated_ids=req.resume_ids, tokenizer=instance, adapter=req.adapter, media=media,
        cache_salt=req.cache_salt, probe=req.probe)
