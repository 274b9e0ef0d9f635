"""Fetching the media items that ``shared.media.check_request`` admitted: local files, data: URLs and
http(s) URLs, within the size and time limits of a :class:`~shared.media.MediaPolicy`.

A local file is opened again below the root one component at a time with ``O_NOFOLLOW`` (a folder
or the file swapped for a symlink after the check is refused), must still be a regular file within
the kind's limit, and is read up to that limit. A data: URL is decoded once, strictly. A URL's host
name is resolved here and every address it resolves to is checked (a name may not lead to loopback,
link-local or private addresses unless the policy allows them); the connection goes to a checked
address with the name in ``Host`` and SNI (``media/http.py``), so a second resolution cannot redirect it.
Redirects (at most ``MediaPolicy.max_redirects``) are each checked like the first URL. Content
is recognised by its signature (JPEG, PNG, MP4, ...), not by its name or Content-Type.

Every refusal or failure is a 422 (``SwitchboardError`` VALIDATION) saying which item and why, a
timeout included ("could not fetch media item 2 (image): timed out after 30 s").
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import os
import socket
import stat
from urllib.parse import urljoin

from services.tokenizer.media import http as media_http
from shared.errors import validation
from shared.media import (
    KIND_NAMES,
    CheckedMedia,
    MediaPolicy,
    check_request,
    formats,
    size_text,
    sniff,
)
from shared.media_urls import check_address, check_url
from shared.messages import MediaRef
from shared.aio import within

REDIRECTS = (301, 302, 303, 307, 308)
PARALLEL = 4  # items of one request fetched at once


class Budget:
    """The bytes one request's media may still bring (``Switchboard.mediaMaxRequestMb``)."""

    def __init__(self, limit: int):
        self.limit, self.left = limit, limit

    def take(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise validation(f"the request's media are more than the per-request limit of {size_text(self.limit)} "
                             "(Switchboard.mediaMaxRequestMb)")


async def fetch_refs(refs: list[MediaRef], policy: MediaPolicy, timeout_s: float | None = None) -> list[bytes]:
    """Check, then fetch, the media of one request (the tokenizer's entry point)."""
    return await fetch_all(check_request(refs, policy), policy, timeout_s)


async def fetch_all(items: list[CheckedMedia], policy: MediaPolicy, timeout_s: float | None = None) -> list[bytes]:
    """The contents of ``items`` in order, a few at a time, all within ``policy.request_timeout_s``
    (and ``timeout_s``, the time the request has left, when given); the first failure cancels the rest."""
    loop = asyncio.get_running_loop()
    limit = policy.request_timeout_s if timeout_s is None else min(policy.request_timeout_s, timeout_s)
    deadline, budget, gate = loop.time() + limit, Budget(policy.request_limit), asyncio.Semaphore(PARALLEL)

    async def one(item: CheckedMedia) -> bytes:
        async with gate:
            return await fetch(item, policy, budget, deadline)

    tasks = [asyncio.ensure_future(one(item)) for item in items]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def fetch(item: CheckedMedia, policy: MediaPolicy, budget: Budget | None = None,
                deadline: float | None = None) -> bytes:
    """One item's content, within the per-item timeout and ``deadline`` (event-loop time)."""
    budget = budget or Budget(policy.request_limit)
    loop = asyncio.get_running_loop()
    left = policy.item_timeout_s if deadline is None else min(policy.item_timeout_s, deadline - loop.time())
    try:
        return await within(_fetch(item, policy, budget), max(left, 0.0))
    except asyncio.TimeoutError:
        what = f"timed out after {left:g} s" if left >= policy.item_timeout_s else (
            "the request's media ran past their time limit")
        raise validation(f"could not fetch {_where(item)}: {what}") from None


def _where(item: CheckedMedia) -> str:
    return f"media item {item.index} ({item.kind})"


async def _fetch(item: CheckedMedia, policy: MediaPolicy, budget: Budget) -> bytes:
    if item.origin == "local":
        data = await asyncio.to_thread(_read_local, item, policy)
        budget.take(len(data))
    elif item.origin == "data":
        data = _decode_data(item)
        budget.take(len(data))
    else:
        data = await _fetch_remote(item, policy, budget)
    if item.origin != "data" and not sniff(item.kind, data[:16]):
        raise validation(f"{_where(item)}: the content is not {formats(item.kind)}")
    return data


# ---- local files ------------------------------------------------------------------------------


def _read_local(item: CheckedMedia, policy: MediaPolicy) -> bytes:
    fd = _open_below(policy.root, os.path.relpath(item.path, policy.root), _where(item))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise validation(f"{_where(item)}: local path {item.source} is not a regular file")
        data = f.read(item.limit + 1)
    if len(data) > item.limit:
        raise validation(f"{_where(item)}: local file {item.source} is more than the {size_text(item.limit)} "
                         f"limit for {KIND_NAMES[item.kind]}")
    return data


def _open_below(root: str, rel: str, where: str) -> int:
    """A read-only descriptor of ``rel`` under ``root``, no component of which may be a symlink."""
    names = rel.split(os.sep)
    if not rel or rel == os.curdir or os.pardir in names:
        raise validation(f"{where}: the local file is not below the media root")
    nofollow = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        for name in names[:-1]:
            inner = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | nofollow, dir_fd=fd)
            os.close(fd)
            fd = inner
        # O_NONBLOCK: a FIFO put in the file's place must not block the open.
        return os.open(names[-1], os.O_RDONLY | nofollow | getattr(os, "O_NONBLOCK", 0), dir_fd=fd)
    except OSError as exc:
        raise validation(f"{where}: the local file changed since it was checked or cannot be read "
                         f"({exc.strerror})") from None
    finally:
        os.close(fd)


# ---- data: URLs -------------------------------------------------------------------------------


def _decode_data(item: CheckedMedia) -> bytes:
    payload = item.source.partition(",")[2]
    try:
        data = base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except binascii.Error:
        raise validation(f"{_where(item)}: the data: URL's base64 content is malformed") from None
    if len(data) > item.limit:
        raise validation(f"{_where(item)}: the data: URL's content is more than the {size_text(item.limit)} limit")
    return data


# ---- http(s) ----------------------------------------------------------------------------------


async def _fetch_remote(item: CheckedMedia, policy: MediaPolicy, budget: Budget) -> bytes:
    where, url = _where(item), item.url
    too_big = f"more than the {size_text(item.limit)} limit for {KIND_NAMES[item.kind]}"
    for hop in range(policy.max_redirects + 1):
        label = where if hop == 0 else f"{where}, redirect {hop} to {url[:200]}"
        remote = check_url(url, label, policy)
        resp = await _connect(remote, label, policy)
        try:
            if resp.status in REDIRECTS:
                url = _redirect(url, resp, label)
                continue
            if resp.status != 200:
                raise validation(f"could not fetch {label}: the server answered {resp.status}")
            return await media_http.read_body(resp, item.limit, where, too_big, budget.take)
        finally:
            resp.close()
    raise validation(f"could not fetch {where}: more than {policy.max_redirects} redirects")


def _redirect(url: str, resp: media_http.Response, where: str) -> str:
    location = resp.headers.get("location", "")
    if not location:
        raise validation(f"could not fetch {where}: the server answered {resp.status} without a Location")
    return urljoin(url, location)


async def _connect(remote, where: str, policy: MediaPolicy) -> media_http.Response:
    """A response from the first of the host's checked addresses that accepts a connection."""
    addresses = [remote.ip] if remote.ip else await _resolve(remote, where, policy)
    failure = None
    for ip in addresses:
        try:
            return await media_http.get(remote, ip, where)
        except Exception as exc:  # noqa: BLE001 - the next address may answer; the last failure is raised
            failure = exc
    raise failure


async def _resolve(remote, where: str, policy: MediaPolicy) -> list[str]:
    """The host's addresses, every one of them checked: one bad address refuses the name."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(remote.host, remote.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise validation(f"could not fetch {where}: cannot resolve {remote.host} "
                         f"({getattr(exc, 'strerror', None) or exc})") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    for address in addresses:
        check_address(ipaddress.ip_address(address), where, policy, host=remote.host)
    if not addresses:
        raise validation(f"could not fetch {where}: {remote.host} has no address")
    return addresses
