"""The tokenizer's image decoding: what a client is told of bytes that are no image."""

from __future__ import annotations

import pytest

from services.tokenizer.media.multimodal import decode_image
from shared.errors import ErrorKind, SwitchboardError


@pytest.mark.parametrize("data, words", [
    (b"not an image at all", ("no image format", "PNG, JPEG")),
    (b"\x89PNG\r\n\x1a\n" + b"\0" * 64, ("cannot be decoded",)),
])
def test_bytes_that_are_no_image_are_a_422_naming_the_item_and_no_object(data, words):
    with pytest.raises(SwitchboardError) as caught:
        decode_image(data, 2)
    message = caught.value.message
    assert caught.value.kind is ErrorKind.VALIDATION and message.startswith("media item 2: the image cannot be decoded")
    assert "0x" not in message and "BytesIO" not in message, message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_is_white_as_transformers_makes_it(mode):
    """Before: a plain convert kept the colour under transparent pixels (black here): another image than the
    one transformers' processors (and vLLM) see, so other tokens."""
    import io

    import numpy as np
    from PIL import Image, ImageDraw
    from transformers.image_transforms import convert_to_rgb

    image = Image.new("RGBA", (24, 20), (0, 0, 0, 0))
    ImageDraw.Draw(image).ellipse((4, 2, 20, 18), fill=(220, 30, 30, 255))
    if mode == "LA":
        image = image.convert("LA")
    elif mode == "P":
        image = image.convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
        image.info["transparency"] = image.getpixel((0, 0))
    data = io.BytesIO()
    image.save(data, format="PNG", **({"transparency": image.info["transparency"]} if mode == "P" else {}))
    decoded = np.array(decode_image(data.getvalue(), 0))
    want = convert_to_rgb(Image.open(io.BytesIO(data.getvalue())), return_numpy=True)
    assert decoded.shape == want.shape and (decoded == want).all()
    assert (decoded[0, 0] == 255).all()  # a transparent corner is white
