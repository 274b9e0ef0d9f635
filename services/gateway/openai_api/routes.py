"""OpenAI routes: /v1/models, /v1/models/{model}, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

ROUTES: list = []
