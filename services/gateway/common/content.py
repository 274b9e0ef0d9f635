"""List-form inputs, one parser for every family (reference §2.6, §3.22-§3.27, §3.31).

TGI and native ``inputs``, Triton ``text_input``, vLLM ``prompt`` and OpenAI chat ``content`` may be a
list of items instead of a string; each becomes a :class:`~shared.messages.ContentPart`, in the
client's order:

- ``{"type": "text", "text": <string>}``;
- ``{"type": "image_url" | "video_url" | "audio_url", "<type>": <source>}``, where the source is a
  string (a local path, an http(s) URL or a data: URL: seed 003's form) or ``{"url": <string>}``
  (OpenAI's form; its ``detail``, low, high or auto, is taken: the model's processor reads every image one way);
- ``{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav" | "mp3" | …}}``
  (OpenAI's inline audio), read as a data: URL.

Text items are concatenated in order with no separator (reference §3.25: a list of only text parts
is "concatenated into one string"), so a text-only list gives the same prompt as that string.

Media items then pass, for the whole request at once, the checks of ``shared.media`` (MindIE's
limit of 20, then each item: an unsafe one gets the 4xx that says why, before anything is
fetched), and last the refusal of this text-only server. Shape errors use MindIE's texts (§2.6);
each family raises them in its own body through a ``Fail`` (MindIE and TGI: 422, OpenAI: 400
naming ``param``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from services.gateway.web.validation import json_kind
from shared.errors import SwitchboardError, validation
from shared.media import MediaPolicy, MediaRefused, check_request
from shared.messages import ContentPart, MediaRef

MEDIA_KINDS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
DETAILS = (None, "low", "high", "auto")
MARKDOWN_IMAGE = re.compile(r"!\[\]\(([^)\s]+)\)")  # TGI's: an empty alt text (``![a cat](…)`` is text)
AUDIO_MIME = {"mp3": "audio/mpeg", "wav": "audio/wav", "flac": "audio/flac"}
ITEM_TYPES = "text, image_url, video_url, audio_url or input_audio"
EMPTY_LIST = "Inputs arr is empty"

# (message, param) -> the family's validation error
Fail = Callable[[str, str], SwitchboardError]


@dataclass(frozen=True)
class ListInput:
    """One list-form input: where the client put it (``inputs``, ``messages[0].content``) and its parts."""

    where: str
    parts: tuple[ContentPart, ...]

    @property
    def text(self) -> str:
        """The text items, concatenated in order with no separator."""
        return "".join(part.text for part in self.parts if part.type == "text")

    @property
    def has_media(self) -> bool:
        return any(part.media is not None for part in self.parts)

    def media(self) -> list[tuple[str, ContentPart]]:
        """The media items with where each is (``inputs[1]``), in order."""
        return [(f"{self.where}[{j}]", part) for j, part in enumerate(self.parts) if part.media is not None]


def parse_list(items: list[Any], where: str, fail: Fail = validation, empty: str = EMPTY_LIST) -> ListInput:
    """The items of one list at ``where``; ``empty`` is the family's message for an empty list."""
    if not items:
        raise fail(f"{empty}: {where} must hold at least one item.", where)
    return ListInput(where, tuple(parse_item(item, f"{where}[{j}]", fail) for j, item in enumerate(items)))


def parse_item(item: Any, where: str, fail: Fail = validation) -> ContentPart:
    """One item: a text, or a media item whose source ``shared.media`` checks later."""
    if not isinstance(item, dict):
        raise fail(f'{where} must be an object like {{"type": "text", "text": <string>}}, got {json_kind(item)}.',
                   where)
    kind = item.get("type")
    if not isinstance(kind, str):
        raise fail(f"{where}.type must be a string ({ITEM_TYPES}), got {json_kind(kind)}.", f"{where}.type")
    if kind == "text":
        return _text_item(item, where, fail)
    if kind in MEDIA_KINDS:
        return ContentPart(MEDIA_KINDS[kind], media=MediaRef(MEDIA_KINDS[kind], _source(item, kind, where, fail)))
    if kind == "input_audio":
        return ContentPart("audio", media=MediaRef("audio", _input_audio(item, where, fail)))
    raise fail(f"{where}.type must be one of {ITEM_TYPES}, got {kind!r}.", f"{where}.type")


def _text_item(item: dict[str, Any], where: str, fail: Fail) -> ContentPart:
    text = item.get("text")
    if not isinstance(text, str):
        raise fail(f"Request param text must be string: {where}.text is {json_kind(text)}.", f"{where}.text")
    return ContentPart("text", text=text)


def _source(item: dict[str, Any], kind: str, where: str, fail: Fail) -> str:
    """A media item's path or URL: the string itself, or the ``url`` of an object."""
    value, at = item.get(kind), f"{where}.{kind}"
    if isinstance(value, dict):
        if value.get("detail") not in DETAILS:  # OpenAI's: its processor reads every image one way (auto)
            raise fail(f"{at}.detail must be one of low, high or auto, got {value['detail']!r}.", f"{at}.detail")
        value, at = value.get("url"), f"{at}.url"
    if value is None or value == "":
        raise fail(f"Request param {kind} null: {at} must be a non-empty path or URL.", at)
    if not isinstance(value, str):
        raise fail(f'Request param {kind} must be string or {{"url": <string>}}: {at} is {json_kind(value)}.', at)
    return value


def _input_audio(item: dict[str, Any], where: str, fail: Fail) -> str:
    """OpenAI's inline audio ``{"data": <base64>, "format": <ext>}`` as a data: URL."""
    value, at = item.get("input_audio"), f"{where}.input_audio"
    if value is None:
        raise fail(f'Request param input_audio null: {at} must be {{"data": <base64>, "format": <string>}}.', at)
    if not isinstance(value, dict):
        raise fail(f"{at} must be an object, got {json_kind(value)}.", at)
    data, fmt = value.get("data"), value.get("format")
    if not isinstance(data, str) or not data:
        raise fail(f"{at}.data must be a non-empty base64 string, got {json_kind(data)}.", f"{at}.data")
    if not isinstance(fmt, str) or not fmt:
        raise fail(f"{at}.format must be a non-empty string (wav, mp3, flac), got {json_kind(fmt)}.", f"{at}.format")
    return f"data:{AUDIO_MIME.get(fmt.lower(), 'audio/' + fmt.lower())};base64,{data}"


def markdown_images(text: str, where: str) -> ListInput | None:
    """TGI's way of putting images in a string ``inputs`` for a vision-language model: each
    ``![](<url>)`` is an image item in its place (TGI does this only for models that take images).
    None when the text has no such image."""
    parts: list[ContentPart] = []
    end = 0
    for match in MARKDOWN_IMAGE.finditer(text):
        if match.start() > end:
            parts.append(ContentPart("text", text=text[end:match.start()]))
        parts.append(ContentPart("image", media=MediaRef("image", match.group(1))))
        end = match.end()
    if not parts:
        return None
    if end < len(text):
        parts.append(ContentPart("text", text=text[end:]))
    return ListInput(where, tuple(parts))


def mindie_input(value: Any, where: str, check: Callable[[Any], str],
                 empty: str = EMPTY_LIST) -> tuple[str, ListInput | None]:
    """A MindIE-family text input (TGI, native, Triton, vLLM): a string, checked by the family's
    ``check``, or the list form, whose joined text ``check`` reads when the list holds only text."""
    if not isinstance(value, list):
        return check(value), None
    listed = parse_list(value, where, validation, empty)
    return (listed.text if listed.has_media else check(listed.text)), listed


def admit(inputs: Iterable[ListInput | None], policy: MediaPolicy, fail: Fail = validation,
          modalities: frozenset[str] = frozenset()) -> None:
    """Let a request's list-form inputs through, or raise: first ``shared.media``'s checks of every
    media item (the 20-item limit, then each item: the 4xx that says why, before anything is
    fetched), then the refusal of a media kind the served model does not take (``modalities``, from
    the engines' heartbeats; none for a text-only model)."""
    lists = [listed for listed in inputs if listed is not None and listed.has_media]
    media = [located for listed in lists for located in listed.media()]
    if not media:
        return
    _check_safety(media, policy, fail, lists[0].where)
    for where, part in media:
        if part.type not in modalities:
            what = (f"the served model takes {', '.join(sorted(modalities))} inputs only" if modalities
                    else "the served model is text-only")
            raise fail(f"{where}: {part.type} inputs are not supported: {what}.", where)


MEDIA_ITEM = re.compile(r"^media item (\d+)\b")


def media_place(inputs: Iterable[ListInput | None], message: str) -> str | None:
    """Where the media item an error names ("media item 2: the image cannot be decoded", the tokenizer's words)
    sits in the request (``messages[1].content[0]``); None when the message names none."""
    found = MEDIA_ITEM.match(message)
    media = [located for listed in inputs if listed is not None and listed.has_media for located in listed.media()]
    return media[int(found[1])][0] if found and int(found[1]) < len(media) else None


def prompt_parts(listed: ListInput | None) -> list[ContentPart]:
    """What a raw prompt's list sends on (``GenerateRequest.parts``): all its items when it has media
    (the tokenizer puts each media item's placeholder in its place), none for text only."""
    return list(listed.parts) if listed is not None and listed.has_media else []


def chat_media(lists: Iterable[ListInput]) -> list[ContentPart]:
    """A chat's media items in order of appearance (their places are the messages' ``{"type": <kind>}``)."""
    return [part for listed in lists for part in listed.parts if part.media is not None]


def template_content(listed: ListInput) -> list[dict[str, str]]:
    """A content list with media as the chat template reads it: text items, and ``{"type": <kind>}``
    where each media item goes (transformers' chat-template format)."""
    return [{"type": "text", "text": part.text} if part.media is None else {"type": part.type}
            for part in listed.parts]


def _check_safety(media: list[tuple[str, ContentPart]], policy: MediaPolicy, fail: Fail, where: str) -> None:
    """``shared.media``'s checks of the request's media together (its limits count them all); the
    refused item's place (``inputs[1]``) becomes the family's ``param``, the list's for a refusal of
    the whole request."""
    try:
        check_request([part.media for _, part in media], policy)
    except MediaRefused as exc:
        raise fail(exc.message, where if exc.index is None else media[exc.index][0]) from None
