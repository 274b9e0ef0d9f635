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
