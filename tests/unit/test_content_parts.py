"""The one list-form parser (services/gateway/common/content.py): items → ContentPart in order, MindIE's
shape errors, each family's error shape, and the order of the media checks (shared.media's safety
checks first, then the text-only refusal)."""

from __future__ import annotations

import pytest

from services.gateway.common.content import admit, mindie_input, parse_list
from services.gateway.openai_api.errors import OpenAIError, content_error
from services.gateway.web.validation import text_input
from shared.errors import ErrorKind, SwitchboardError, validation
from shared.media import MediaPolicy
from shared.messages import ContentPart, MediaRef
from tests.media_items import PNG_URL, image, text


def error_of(call) -> SwitchboardError:
    with pytest.raises(SwitchboardError) as caught:
        call()
    return caught.value


@pytest.fixture
def root(tmp_path):
    """A media root holding cat.png, a big.png over the 20 MB image limit and a tool.exe."""
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "cat.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    (folder / "tool.exe").write_bytes(b"MZ")
    with open(folder / "big.png", "wb") as f:
        f.truncate(21 * 1024 * 1024)  # sparse: no 21 MB written
    (tmp_path / "outside.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return folder


# ---- parsing ----------------------------------------------------------------------------------


def test_text_items_are_concatenated_in_order_without_a_separator():
    listed = parse_list([text("My name "), text("is"), text(" Olivier")], "inputs")
    assert listed.text == "My name is Olivier" and not listed.has_media
    assert listed.parts == (ContentPart("text", "My name "), ContentPart("text", "is"), ContentPart("text", " Olivier"))


def test_every_media_form_becomes_a_media_ref_in_client_order():
    items = [image("/data/a.png"), text("and"), {"type": "video_url", "video_url": {"url": "https://h/v.mp4"}},
             {"type": "audio_url", "audio_url": "b.wav"}, image({"url": PNG_URL, "detail": "low"}),
             {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]
    listed = parse_list(items, "messages[0].content")
    assert [p.type for p in listed.parts] == ["image", "text", "video", "audio", "image", "audio"]
    assert [p.media for p in listed.parts if p.media] == [
        MediaRef("image", "/data/a.png"), MediaRef("video", "https://h/v.mp4"), MediaRef("audio", "b.wav"),
        MediaRef("image", PNG_URL), MediaRef("audio", "data:audio/wav;base64,UklGRg==")]
    assert listed.text == "and"
    assert [where for where, _ in listed.media()] == [f"messages[0].content[{j}]" for j in (0, 2, 3, 4, 5)]


@pytest.mark.parametrize("items, message, param", [
    ([], "Inputs arr is empty", "inputs"),
    (["hi"], "inputs[0] must be an object", "inputs[0]"),
    ([{"text": "hi"}], "inputs[0].type must be a string", "inputs[0].type"),
    ([{"type": "image"}], "inputs[0].type must be one of text, image_url", "inputs[0].type"),
    ([text("a"), {"type": "text", "text": 5}], "Request param text must be string", "inputs[1].text"),
    ([{"type": "text"}], "Request param text must be string", "inputs[0].text"),
    ([{"type": "image_url"}], "Request param image_url null", "inputs[0].image_url"),
    ([{"type": "video_url", "video_url": None}], "Request param video_url null", "inputs[0].video_url"),
    ([{"type": "audio_url", "audio_url": {}}], "Request param audio_url null", "inputs[0].audio_url.url"),
    ([image("")], "Request param image_url null", "inputs[0].image_url"),
    ([image(5)], "Request param image_url must be string", "inputs[0].image_url"),
    ([{"type": "input_audio"}], "Request param input_audio null", "inputs[0].input_audio"),
    ([{"type": "input_audio", "input_audio": {"data": "AA=="}}], "format", "inputs[0].input_audio.format"),
])
def test_shape_errors_use_mindies_texts_and_name_the_item(items, message, param):
    error = error_of(lambda: parse_list(items, "inputs"))
    assert error.kind is ErrorKind.VALIDATION and message in error.message and error.param == param


def test_openai_shape_errors_are_openai_errors_naming_the_param():
    error = error_of(lambda: parse_list([text("a"), image(None)], "messages[2].content", content_error))
    assert isinstance(error, OpenAIError) and error.param == "messages[2].content[1].image_url"


def test_mindie_input_checks_a_string_or_the_joined_text_of_a_text_only_list():
    def check(value):
        return text_input(value, "inputs")
    assert mindie_input("hi", "inputs", check) == ("hi", None)
    joined, listed = mindie_input([text("h"), text("i")], "inputs", check)
    assert joined == "hi" and listed.parts == (ContentPart("text", "h"), ContentPart("text", "i"))
    assert "must be 1 to" in error_of(lambda: mindie_input([text("")], "inputs", check)).message
    assert "must be string type" in error_of(lambda: mindie_input(5, "inputs", check)).message
    assert mindie_input([image("a.png")], "inputs", check)[0] == ""  # media only: the text is not required


# ---- admission: safety first, then the text-only refusal --------------------------------------


def test_text_only_lists_are_admitted():
    admit([None, parse_list([text("a")], "inputs")], MediaPolicy())


def unsafe_cases(root) -> list[tuple[list, str]]:
    return [
        ([image("cat.png")], "local media files are not allowed"),  # no root configured
        ([image(str(root.parent / "outside.png"))], "outside the media root"),
        ([image("../outside.png")], "'..'"),
        ([image("sub/../../outside.png")], "'..'"),
        ([image("http://127.0.0.1/cat.png")], "loopback"),
        ([image("http://169.254.169.254/latest/meta-data.png")], "link-local"),
        ([image("http://2130706433/cat.png")], "loopback"),
        ([image("https://evil.example.net/cat.png")], "not on the media allow-list"),
        ([image("tool.exe")], "extension .exe"),
        ([image("big.png")], "more than the 20 MB limit"),
        ([image("ftp://host/cat.png")], "scheme"),
        ([text("x")] + [image(PNG_URL)] * 21, "The number of multimodal url should be no more than 20"),
    ]


def test_unsafe_items_get_the_safety_refusal_not_the_text_only_one(root):
    policy = MediaPolicy(root=str(root.resolve()), domains=("images.example.com",))
    for items, why in unsafe_cases(root):
        used = MediaPolicy() if why.startswith("local media") else policy
        error = error_of(lambda items=items, used=used: admit([parse_list(items, "inputs")], used))
        assert error.kind is ErrorKind.VALIDATION and why in error.message, (items[-1], error.message)
        assert "text-only" not in error.message


def test_a_safe_item_gets_the_text_only_refusal_naming_it(root):
    policy = MediaPolicy(root=str(root.resolve()), domains=("images.example.com",))
    for source in ("cat.png", PNG_URL, "https://images.example.com/cat.png", "https://cdn.images.example.com/a.jpg"):
        listed = parse_list([text("What is this?"), image(source)], "inputs")
        error = error_of(lambda listed=listed: admit([listed], policy))
        assert error.message == "inputs[1]: image inputs are not supported: the served model is text-only."
        assert error.param == "inputs[1]"


def test_the_safety_refusal_names_the_item_across_messages_for_openai(root):
    policy = MediaPolicy(root=str(root.resolve()))
    first = parse_list([image(PNG_URL)], "messages[0].content", content_error)
    second = parse_list([text("and"), image("../x.png")], "messages[2].content", content_error)
    error = error_of(lambda: admit([first, None, second], policy, content_error))
    assert isinstance(error, OpenAIError) and error.param == "messages[2].content[1]" and "'..'" in error.message


def test_tgis_markdown_images_are_those_with_an_empty_alt_text():
    """TGI's rule (``![](…)``): a pasted document's ``![build status](…)`` is text (it was fetched as an image)."""
    from services.gateway.common.content import markdown_images

    listed = markdown_images("Look: ![](cat.png) and ![a badge](https://example.com/b.svg)", "inputs")
    assert [(p.type, p.text or p.media.source) for p in listed.parts] == [
        ("text", "Look: "), ("image", "cat.png"), ("text", " and ![a badge](https://example.com/b.svg)")]
    assert markdown_images("![a cat](cat.png) Hi", "inputs") is None


def test_an_image_urls_detail_is_one_of_openais():
    ok = parse_list([image({"url": PNG_URL, "detail": "low"})], "content", validation)
    assert ok.parts[0].media.source == PNG_URL
    err = error_of(lambda: parse_list([image({"url": PNG_URL, "detail": "ultra"})], "content", validation))
    assert err.param == "content[0].image_url.detail" and "low, high or auto" in err.message
