"""MindIE-native routes: /infer, /infer_token, /v1/tokenizer (reference §3.27, §3.28, §3.32)."""

from __future__ import annotations

ROUTES: list = []
