"""Triton / KServe v2 routes (reference §3.19–§3.21, §3.29–§3.31; §3.2 and §3.5 on the management plane)."""

from __future__ import annotations

ROUTES: list = []
MANAGEMENT_ROUTES: list = []
