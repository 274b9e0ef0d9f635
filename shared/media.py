"""Media items of a multimodal request: what may be fetched, checked before anything is fetched.

By default nothing is fetched. ``Switchboard.mediaRoot`` admits local files under one folder (MindIE's
own root is ``/data/multimodal_inputs/``; ours has no default), ``Switchboard.allowedMediaDomains``
together with the comma-separated environment variable ``ALLOWED_MEDIA_DOMAINS_ENV`` (MindIE's name;
the two lists are joined, so a deployment can add hosts without editing the file) admits http(s)
URLs from those hosts and their subdomains, and base64 ``data:`` URLs carry media inline (images as the
seed says; audio and video as OpenAI's ``input_audio`` and vLLM's clients send them).

The rules (reference §2.6 and seed 003): at most 20 media items per request; images up to 20 MB
(jpg, jpeg, png, and the gif and webp OpenAI's and Anthropic's APIs take too; base64 as a data: URL), video up to 512 MB (mp4, avi, wmv), audio up to
20 MB (mp3, wav, flac); a per-request total (``Switchboard.mediaMaxRequestMb``). A local path:
no ``..`` component, a relative path is relative to the root, its real path (symlinks resolved)
stays under the root's real path, and it is a non-empty regular file with the kind's extension.
``file://`` URLs are local paths (host empty or ``localhost``). A URL: http or https, no user
name or password, a host on the allow-list; an IP-literal host, however encoded (``2130706433``,
``0x7f.1``, ``[::ffff:127.0.0.1]``), is refused when loopback, link-local, private, multicast,
unspecified, reserved or otherwise not global, unless ``Switchboard.allowPrivateMediaAddresses``
admits it (``true``: any address; a list of networks: those).
The URL and address rules live in ``shared.media_urls``. Names are resolved, every resolved address
checked the same way, redirects re-checked and sizes and times enforced by the fetcher
(``services/tokenizer/media/fetch.py``).

:func:`check_request` only reads filesystem metadata; a refusal is a 422 whose message names the
media item (its position among the request's media, from 0) and the rule.
"""

from __future__ import annotations

import base64
import os
import re
import stat
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import msgspec

from shared.config import Config, ConfigError
from shared.errors import ErrorKind, SwitchboardError, validation
from shared.media_urls import DOMAINS_ENV, check_url, normalize_domain, private_networks
from shared.messages import MediaRef

MB = 1024 * 1024
MAX_ITEMS = 20  # "The number of multimodal url should be no more than 20" (reference §2.6)
ITEM_LIMITS = {"image": 20 * MB, "video": 512 * MB, "audio": 20 * MB}
EXTENSIONS = {"image": ("jpg", "jpeg", "png", "gif", "webp"), "video": ("mp4", "avi", "wmv"), "audio": ("mp3", "wav", "flac")}
DATA_TYPES = {  # the data: URL types of each kind; the content's signature is checked too
    "image": ("image/jpeg", "image/jpg", "image/png", "image/gif", "image/webp"),
    "video": ("video/mp4", "video/avi", "video/x-msvideo", "video/x-ms-wmv"),
    "audio": ("audio/wav", "audio/x-wav", "audio/wave", "audio/mpeg", "audio/mp3", "audio/flac", "audio/x-flac"),
}
KIND_NAMES = {"image": "images", "video": "videos", "audio": "audio clips"}
MAX_REDIRECTS = 5
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


@dataclass(frozen=True)
class MediaPolicy:
    """What may be fetched and how much; build it once at start with :meth:`from_config`."""

    root: str = ""  # real path of the media root; "" = local files are refused
    domains: tuple[str, ...] = ()  # normalized allow-list; () = remote media are refused
    private_networks: tuple = ()  # non-global networks media may come from; see allowPrivateMediaAddresses
    max_items: int = MAX_ITEMS
    item_limits: dict[str, int] = field(default_factory=lambda: dict(ITEM_LIMITS))
    request_limit: int = 600 * MB
    item_timeout_s: float = 30.0  # one item: name resolution, connection, redirects and body
    request_timeout_s: float = 120.0  # all the media of one request
    max_redirects: int = MAX_REDIRECTS

    @classmethod
    def from_config(cls, cfg: Config, environ=os.environ) -> MediaPolicy:
        """The policy of ``cfg`` plus ``ALLOWED_MEDIA_DOMAINS_ENV``; ConfigError names the bad key."""
        s = cfg.switchboard
        return cls(
            root=_real_root(cfg) if s.media_root else "",
            domains=tuple(dict.fromkeys([normalize_domain(d) for d in s.allowed_media_domains] + _env_domains(environ))),
            private_networks=private_networks(s.allow_private_media_addresses),
            request_limit=s.media_max_request_mb * MB,
            item_timeout_s=float(s.media_fetch_timeout_seconds),
            request_timeout_s=float(s.media_request_timeout_seconds),
        )


class CheckedMedia(msgspec.Struct, frozen=True, kw_only=True):
    """One media item that passed :func:`check_request`: what to fetch and its byte limit."""

    index: int  # position among the request's media, from 0
    kind: str  # image | video | audio
    origin: str  # local | data | remote
    source: str  # as the client gave it
    path: str = ""  # local: the real path, under the root
    url: str = ""  # remote: the URL without its fragment
    size: int = -1  # bytes, where known before the fetch (local and data); -1 = unknown
    limit: int  # the kind's byte limit


class MediaRefused(SwitchboardError):
    """A 422 from ``check_request``; ``index`` is the refused item's position among the request's media,
    None when the request as a whole is refused (too many items, too large together)."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(ErrorKind.VALIDATION, message)
        self.index = index


def check_request(refs: list[MediaRef], policy: MediaPolicy) -> list[CheckedMedia]:
    """Every media item of one request, checked in order; raises MediaRefused on the first refusal."""
    if len(refs) > policy.max_items:
        raise MediaRefused(f"The number of multimodal url should be no more than {policy.max_items} (got {len(refs)})")
    checked = []
    for i, ref in enumerate(refs):
        try:
            checked.append(check_item(i, ref, policy))
        except SwitchboardError as exc:
            raise MediaRefused(exc.message, i) from None
    total = sum(c.size for c in checked if c.size > 0)
    if total > policy.request_limit:
        raise MediaRefused(f"the request's media total {size_text(total)}, more than the per-request limit of "
                           f"{size_text(policy.request_limit)} (Switchboard.mediaMaxRequestMb)")
    return checked


def check_item(index: int, ref: MediaRef, policy: MediaPolicy) -> CheckedMedia:
    if ref.kind not in ITEM_LIMITS:
        raise validation(f"media item {index}: unknown kind {ref.kind!r} (expected image, video or audio)")
    source = ref.source
    if not isinstance(source, str) or not source.strip():
        raise validation(f"media item {index} ({ref.kind}): the source is empty")
    if any(ord(c) < 32 or ord(c) == 127 for c in source):
        raise validation(f"media item {index} ({ref.kind}): the source contains control characters")
    m = _SCHEME.match(source)
    scheme = m.group(1).lower() if m and len(m.group(1)) > 1 else ""
    if scheme in ("http", "https"):
        return _checked_remote(index, ref.kind, source, policy)
    if scheme == "data":
        return _checked_data(index, ref.kind, source, policy)
    if scheme == "file":
        return _checked_local(index, ref.kind, _file_url_path(index, ref.kind, source), policy)
    if scheme:
        raise validation(f"media item {index} ({ref.kind}): URL scheme {scheme!r} is not supported "
                         "(http, https, data or a local path)")
    return _checked_local(index, ref.kind, source, policy)


# ---- local files ------------------------------------------------------------------------------


def _checked_local(index: int, kind: str, path: str, policy: MediaPolicy) -> CheckedMedia:
    where = f"media item {index} ({kind})"
    if not policy.root:
        raise validation(f"{where}: local media files are not allowed (Switchboard.mediaRoot is not set)")
    if ".." in path.replace("\\", "/").split("/"):
        raise validation(f"{where}: a local path must not contain '..'")
    _check_extension(where, kind, path)
    # An absolute path replaces the root. Containment is judged before existence, so that a client
    # cannot learn which files exist outside the root.
    real = os.path.realpath(os.path.join(policy.root, path))
    if not _under(real, policy.root):
        raise validation(f"{where}: local file {path} is outside the media root (Switchboard.mediaRoot)")
    try:
        st = os.stat(real)
    except (OSError, ValueError):
        raise validation(f"{where}: local file {path} does not exist or cannot be read") from None
    if not stat.S_ISREG(st.st_mode):
        raise validation(f"{where}: local path {path} is not a regular file")
    if not os.access(real, os.R_OK):
        raise validation(f"{where}: local file {path} is not readable")
    _check_size(where, kind, st.st_size, policy, f"local file {path}")
    return CheckedMedia(index=index, kind=kind, origin="local", source=path, path=real,
                        size=st.st_size, limit=policy.item_limits[kind])


def _file_url_path(index: int, kind: str, source: str) -> str:
    parts = urlsplit(source)
    if parts.netloc not in ("", "localhost"):
        raise validation(f"media item {index} ({kind}): a file:// URL must name this machine (no host)")
    return unquote(parts.path)


def _check_extension(where: str, kind: str, path: str) -> None:
    ext = os.path.splitext(path)[1][1:].lower()
    if ext not in EXTENSIONS[kind]:
        raise validation(f"{where}: extension {'.' + ext if ext else '(none)'} is not allowed for "
                         f"{KIND_NAMES[kind]} (allowed: {', '.join(EXTENSIONS[kind])})")


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _check_size(where: str, kind: str, size: int, policy: MediaPolicy, what: str) -> None:
    limit = policy.item_limits[kind]
    if size > limit:
        raise validation(f"{where}: {what} is {size_text(size)}, more than the {size_text(limit)} limit for {KIND_NAMES[kind]}")
    if size == 0:
        raise validation(f"{where}: {what} is empty")


def size_text(size: int) -> str:
    return f"{size // MB} MB" if size % MB == 0 else f"{size / MB:.1f} MB"


# ---- data: URLs -------------------------------------------------------------------------------


def _checked_data(index: int, kind: str, source: str, policy: MediaPolicy) -> CheckedMedia:
    """``data:image/png;base64,...``: the type, the decoded size (from the length) and the alphabet are
    checked here, the payload is decoded once, by the fetcher."""
    where = f"media item {index} ({kind})"
    header, comma, payload = source[5:].partition(",")
    params = [p.strip().lower() for p in header.split(";")]
    allowed = DATA_TYPES.get(kind, ())
    if not comma or params[-1] != "base64" or len(params) < 2:
        raise validation(f"{where}: a data: URL must be base64 (data:<type>;base64,<data>)")
    if params[0] not in allowed:
        raise validation(f"{where}: data: URL type {params[0] or '(none)'} is not allowed for {KIND_NAMES[kind]}"
                         + f" (allowed: {', '.join(allowed)})")
    _check_size(where, kind, base64_size(payload), policy, "the data: URL's content")
    if len(payload) % 4 == 1 or ("=" in payload and len(payload) % 4) or not _BASE64.fullmatch(payload):
        raise validation(f"{where}: the data: URL's base64 content is malformed")
    if not sniff(kind, base64.b64decode(_padded(payload[:24]))):
        raise validation(f"{where}: the data: URL's content is not {formats(kind)}")
    return CheckedMedia(index=index, kind=kind, origin="data", source=source,
                        size=base64_size(payload), limit=policy.item_limits[kind])


def _padded(payload: str) -> str:
    return payload + "=" * (-len(payload) % 4)


def base64_size(payload: str) -> int:
    """Bytes that ``payload`` decodes to, padded or not, from its length alone."""
    body = len(payload) - (payload.endswith("=") + payload.endswith("=="))
    return body * 3 // 4


# ---- content ----------------------------------------------------------------------------------

_ASF = bytes.fromhex("3026b2758e66cf11a6d900aa0062ce6c")
_FORMATS = {"image": ("JPEG", "PNG", "GIF", "WEBP"), "video": ("MP4", "AVI", "WMV"), "audio": ("MP3", "WAV", "FLAC")}


def sniff(kind: str, head: bytes) -> str:
    """The format of content starting with ``head`` (16 bytes suffice) among the kind's allowed ones,
    by its signature ("PNG", "MP4", ...); "" when it is none of them."""
    riff = head[:4] == b"RIFF"
    found = {
        "JPEG": head[:3] == b"\xff\xd8\xff",
        "PNG": head[:8] == b"\x89PNG\r\n\x1a\n",
        "GIF": head[:6] in (b"GIF87a", b"GIF89a"),
        "WEBP": riff and head[8:12] == b"WEBP",
        "MP4": head[4:8] == b"ftyp",
        "AVI": riff and head[8:12] == b"AVI ",
        "WMV": head[:16] == _ASF,
        "MP3": head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0),
        "WAV": riff and head[8:12] == b"WAVE",
        "FLAC": head[:4] == b"fLaC",
    }
    return next((name for name in _FORMATS.get(kind, ()) if found[name]), "")


def formats(kind: str) -> str:
    """The kind's allowed formats, for messages: "JPEG or PNG"."""
    return " or ".join(_FORMATS[kind])


# ---- remote URLs ------------------------------------------------------------------------------


def _checked_remote(index: int, kind: str, source: str, policy: MediaPolicy) -> CheckedMedia:
    remote = check_url(source, f"media item {index} ({kind})", policy)
    return CheckedMedia(index=index, kind=kind, origin="remote", source=source,
                        url=f"{remote.scheme}://{remote.host_header}{remote.target}", limit=policy.item_limits[kind])



def _env_domains(environ) -> list[str]:
    out = []
    for entry in filter(None, (e.strip() for e in environ.get(DOMAINS_ENV, "").split(","))):
        try:
            out.append(normalize_domain(entry))
        except ValueError as exc:
            raise ConfigError(f"{DOMAINS_ENV}: {exc}") from None
    return out


def _real_root(cfg: Config) -> str:
    path = cfg.resolve_path(cfg.switchboard.media_root)
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        raise ConfigError(f"Switchboard.mediaRoot: {path} is not a directory")
    return real
