"""Media items for the tests: a real 1x1 PNG as a data: URL (safe by default: no fetch, no root, no
allow-list needed), item builders in seed 003's shape, and deterministic test images."""

from __future__ import annotations

import base64
import io

import numpy as np

PNG_1X1 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
PNG_URL = f"data:image/png;base64,{PNG_1X1}"


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(source) -> dict:
    return {"type": "image_url", "image_url": source}


def test_image(seed: int, size=(96, 80)):
    """A deterministic colourful RGB image (``size`` = width, height): seeded gradients plus seeded
    noise, so two seeds give clearly different pixels (and different vision features)."""
    from PIL import Image

    width, height = size
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = []
    for _ in range(3):
        fx, fy, phase = rng.uniform(0.02, 0.2), rng.uniform(0.02, 0.2), rng.uniform(0, 2 * np.pi)
        channels.append(127.5 + 100 * np.sin(fx * x + fy * y + phase))
    pixels = np.stack(channels, -1) + rng.normal(0, 20, (height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


test_image.__test__ = False  # not a pytest test, despite the name


def png_bytes(image) -> bytes:
    """The image encoded as PNG."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image) -> str:
    """The image as a ``data:image/png;base64,...`` URL (what an OpenAI-style client sends)."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
