"""The call of one OpenAI request: prompts x n choices, each a session (vLLM's order)."""

from __future__ import annotations

from typing import Any

from services.gateway.common.sampling import choice_sampling
from services.gateway.request.call import Call
from services.gateway.request.context import SessionContext
from services.gateway.request.session import Session
from shared.messages import Sampling


def build_call(ctx: SessionContext, prompts: list[dict[str, Any]], sampling: Sampling, n: int, adapter: str = "",
               api: str = "") -> Call:
    """``prompts``: Session keyword arguments per prompt (``prompt``, ``prompt_ids``, ``messages`` …);
    every choice runs with the LoRA ``adapter`` ("" = the base model); ``api``: the route's family label."""
    sessions = [Session(ctx, p.get("prompt", ""), choice_sampling(sampling, j), adapter=adapter, api=api,
                        **{k: v for k, v in p.items() if k != "prompt"})
                for p in prompts for j in range(n)]
    return Call(ctx, sessions, n)
