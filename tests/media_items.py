"""Media items for the list-form tests: a real 1x1 PNG as a data: URL (safe by default: no fetch,
no root, no allow-list needed) and item builders in seed 003's shape."""

from __future__ import annotations

PNG_1X1 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
PNG_URL = f"data:image/png;base64,{PNG_1X1}"


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(source) -> dict:
    return {"type": "image_url", "image_url": source}
