"""services/tokenizer/media/fetch.py against a real HTTP server on 127.0.0.1 and real files: what is
admitted arrives byte for byte; redirects, names, sizes and times are enforced while fetching."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import time

import pytest
import pytest_asyncio
from aiohttp import web

from services.tokenizer.media.fetch import fetch, fetch_all, fetch_refs
from shared.errors import ErrorKind, SwitchboardError
from shared.media import MB, MediaPolicy, check_request
from shared.media_urls import private_networks
from shared.messages import MediaRef

JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF" + os.urandom(2000)
PNG = b"\x89PNG\r\n\x1a\n" + os.urandom(3000)
LOOPBACK = private_networks(["127.0.0.1"])


class Server:
    """The test server's address and the paths it was asked for."""

    def __init__(self):
        self.hits: list[str] = []
        self.port = 0

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


async def _stream(request, content_type: str, pieces, delay: float = 0.0, length: int | None = None):
    resp = web.StreamResponse(headers={"Content-Type": content_type})
    if length is None:
        resp.enable_chunked_encoding()
    else:
        resp.content_length = length
    await resp.prepare(request)
    try:
        for piece in pieces:
            await resp.write(piece)
            if delay:
                await asyncio.sleep(delay)
    except (ConnectionError, asyncio.CancelledError):
        pass
    return resp


def _routes(server: Server) -> web.Application:
    async def image(request):
        return web.Response(body=JPEG, content_type="image/jpeg")

    async def photo(request):  # no extension: recognised by its signature
        return web.Response(body=PNG, content_type="application/octet-stream")

    async def chunked(request):
        return await _stream(request, "image/png", [PNG[:10], PNG[10:1000], PNG[1000:]])

    async def redirect(request):
        raise web.HTTPFound(request.query["to"])

    async def hops(request):
        n = int(request.match_info["n"])
        if n == 0:
            return await image(request)
        raise web.HTTPMovedPermanently(f"/hops/{n - 1}")

    async def announced(request):  # says 21 MB up front
        return await _stream(request, "image/jpeg", [JPEG[:100]], delay=2.0, length=21 * MB)

    async def endless(request):  # no length, more than 20 MB
        return await _stream(request, "image/jpeg", [JPEG[:4]] + [bytes(256 * 1024)] * 100)

    async def slow(request):  # a byte every 0.2 s
        return await _stream(request, "image/jpeg", [JPEG[i:i + 1] for i in range(50)], delay=0.2)

    async def silent(request):  # never answers
        await asyncio.sleep(10)
        return web.Response(body=JPEG)

    async def loop(request):
        raise web.HTTPFound("/loop")

    async def gzipped(request):
        return web.Response(body=JPEG, headers={"Content-Encoding": "gzip"})

    async def text(request):
        return web.Response(text="not an image")

    @web.middleware
    async def record(request, handler):
        server.hits.append(request.path_qs)
        return await handler(request)

    app = web.Application(middlewares=[record])
    app.add_routes([web.get("/img.jpg", image), web.get("/photo", photo), web.get("/chunked", chunked),
                    web.get("/redirect", redirect), web.get("/hops/{n}", hops), web.get("/announced", announced),
                    web.get("/endless", endless), web.get("/slow", slow), web.get("/silent", silent),
                    web.get("/gzip", gzipped), web.get("/text", text), web.get("/loop", loop)])
    return app


@pytest_asyncio.fixture(scope="module")
async def server():
    state = Server()
    runner = web.AppRunner(_routes(state), shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.port = runner.addresses[0][1]
    yield state
    await runner.cleanup()


def policy(**fields) -> MediaPolicy:
    """Remote media from 127.0.0.1 and localhost, with loopback admitted (fields override)."""
    base = {"domains": ("127.0.0.1", "localhost"), "private_networks": LOOPBACK, "item_timeout_s": 5.0}
    return MediaPolicy(**{**base, **fields})


async def refusal(coro) -> str:
    with pytest.raises(SwitchboardError) as caught:
        await coro
    assert caught.value.kind is ErrorKind.VALIDATION and caught.value.info.status == 422
    return caught.value.message


async def get(url: str, p: MediaPolicy, kind: str = "image") -> bytes:
    return (await fetch_refs([MediaRef(kind, url)], p))[0]


# ---- http -------------------------------------------------------------------------------------------


async def test_an_admitted_url_arrives_byte_for_byte(server):
    assert await get(server.url("/img.jpg"), policy()) == JPEG
    assert await get(server.url("/photo"), policy()) == PNG
    assert await get(server.url("/chunked"), policy()) == PNG


async def test_loopback_is_refused_before_any_connection(server):
    before = len(server.hits)
    for url in (server.url("/img.jpg"), server.url("/img.jpg", "2130706433"), server.url("/img.jpg", "0x7f.1")):
        message = await refusal(get(url, policy(private_networks=())))
        assert "127.0.0.1 is a loopback address" in message
    assert len(server.hits) == before


async def test_a_name_is_refused_when_it_resolves_to_loopback(server):
    before = len(server.hits)
    checked = check_request([MediaRef("image", server.url("/img.jpg", "localhost"))], policy(private_networks=()))
    message = await refusal(fetch_all(checked, policy(private_networks=())))
    assert "host localhost resolves to 127.0.0.1, a loopback address" in message
    assert len(server.hits) == before
    assert await get(server.url("/img.jpg", "localhost"), policy()) == JPEG  # loopback admitted


async def test_redirects_are_followed_and_each_is_checked(server):
    assert await get(server.url("/hops/5"), policy()) == JPEG
    to_name = server.url(f"/redirect?to={server.url('/img.jpg', 'localhost')}")
    assert await get(to_name, policy()) == JPEG
    assert "more than 5 redirects" in await refusal(get(server.url("/hops/6"), policy()))
    nested = server.url(f"/redirect?to={server.url('/redirect?to=/hops/1')}")
    assert await get(nested, policy()) == JPEG


async def test_a_redirect_to_a_refused_place_is_not_followed(server):
    cases = {
        "http://127.0.0.2/img.jpg": "127.0.0.2 is a loopback address",  # loopback, outside 127.0.0.1/32
        "http://169.254.169.254/latest/meta-data": "169.254.169.254 is a link-local address",
        "http://[::ffff:10.0.0.1]/a.jpg": "(10.0.0.1) is a private address",
        "http://elsewhere.example/a.jpg": "host elsewhere.example is not on the media allow-list",
        "file:///etc/passwd": "URL scheme 'file' is not allowed",
        "http://user@127.0.0.1/a.jpg": "must not carry a user name",
    }
    for target, reason in cases.items():
        before = len(server.hits)
        message = await refusal(get(server.url(f"/redirect?to={target}"), policy()))
        assert message.startswith("media item 0 (image), redirect 1 to ") and reason in message
        assert len(server.hits) == before + 1  # only the redirect itself


async def test_a_redirect_loop_ends(server):
    before = len(server.hits)
    assert "could not fetch media item 0 (image): more than 5 redirects" in await refusal(get(server.url("/loop"), policy()))
    assert len(server.hits) == before + 6
    assert "more than 2 redirects" in await refusal(get(server.url("/hops/100"), policy(max_redirects=2)))


async def test_an_announced_size_over_the_limit_is_refused_before_the_body(server):
    start = time.monotonic()
    message = await refusal(get(server.url("/announced"), policy()))
    assert "the server announces 21 MB, more than the 20 MB limit for images" in message
    assert time.monotonic() - start < 1.5  # did not wait for the body


async def test_a_streamed_body_stops_at_the_limit(server):
    message = await refusal(get(server.url("/endless"), policy()))
    assert "media item 0 (image): the body is more than the 20 MB limit for images" in message
    small = policy(item_limits={"image": 100 * 1024, "video": MB, "audio": MB})
    assert "the body is more than the 0.1 MB limit" in await refusal(get(server.url("/endless"), small))


async def test_a_slow_body_times_out(server):
    start = time.monotonic()
    message = await refusal(get(server.url("/slow"), policy(item_timeout_s=0.5)))
    assert message == "could not fetch media item 0 (image): timed out after 0.5 s"
    assert time.monotonic() - start < 1.5
    assert "timed out" in await refusal(get(server.url("/silent"), policy(item_timeout_s=0.3)))


async def test_the_request_has_one_deadline_for_all_its_media(server):
    refs = [MediaRef("image", server.url("/slow")), MediaRef("image", server.url("/slow"))]
    start = time.monotonic()
    message = await refusal(fetch_refs(refs, policy(item_timeout_s=5.0, request_timeout_s=0.4)))
    assert "the request's media ran past their time limit" in message
    assert time.monotonic() - start < 1.5
    assert "ran past" in await refusal(fetch_refs(refs, policy(), timeout_s=0.3))


async def test_the_request_total_counts_fetched_bytes(server):
    refs = [MediaRef("image", server.url("/img.jpg")), MediaRef("image", server.url("/photo"))]
    message = await refusal(fetch_refs(refs, policy(request_limit=len(JPEG) + 100)))
    assert "more than the per-request limit" in message


async def test_bad_answers(server):
    assert "the server answered 404" in await refusal(get(server.url("/nothing.jpg"), policy()))
    assert "gzip-encoded body" in await refusal(get(server.url("/gzip"), policy()))
    assert "media item 0 (image): the content is not JPEG or PNG or GIF or WEBP" in await refusal(get(server.url("/text"), policy()))
    assert "the content is not MP4 or AVI or WMV" in await refusal(get(server.url("/img.jpg"), policy(), "video"))


async def test_an_unreachable_host_is_a_422(server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    message = await refusal(get(f"http://127.0.0.1:{port}/a.jpg", policy()))
    assert message.startswith(f"could not fetch media item 0 (image): cannot connect to 127.0.0.1:{port}")
    assert "cannot resolve" in await refusal(get("http://no-such-host.invalid/a.jpg", policy(domains=("invalid",))))


# ---- local files and data: URLs ---------------------------------------------------------------------


@pytest.fixture
def root(tmp_path):
    media = tmp_path / "media"
    (media / "sub").mkdir(parents=True)
    (media / "sub" / "cat.jpg").write_bytes(JPEG)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "cat.jpg").write_bytes(b"\xff\xd8\xff secret")
    return media


def local(root, **fields) -> MediaPolicy:
    return MediaPolicy(root=os.path.realpath(root), **fields)


async def test_local_files_and_data_urls_in_order(server, root):
    refs = [MediaRef("image", "sub/cat.jpg"), MediaRef("image", f"data:image/png;base64,{base64.b64encode(PNG).decode()}"),
            MediaRef("image", server.url("/img.jpg"))]
    both = MediaPolicy(root=os.path.realpath(root), domains=("127.0.0.1",), private_networks=LOOPBACK)
    assert await fetch_refs(refs, both) == [JPEG, PNG, JPEG]


async def test_a_folder_swapped_for_a_symlink_after_the_check_is_refused(root):
    checked = check_request([MediaRef("image", "sub/cat.jpg")], local(root))
    os.rename(root / "sub", root / "old")
    (root / "sub").symlink_to(root.parent / "outside")
    message = await refusal(fetch(checked[0], local(root)))
    assert "the local file changed since it was checked" in message


async def test_a_file_swapped_for_a_symlink_or_a_fifo_is_refused(root):
    checked = check_request([MediaRef("image", "sub/cat.jpg")], local(root))[0]
    os.remove(root / "sub" / "cat.jpg")
    (root / "sub" / "cat.jpg").symlink_to(root.parent / "outside" / "cat.jpg")
    assert "changed since it was checked" in await refusal(fetch(checked, local(root)))
    os.remove(root / "sub" / "cat.jpg")
    os.mkfifo(root / "sub" / "cat.jpg")  # must not block the open
    assert "is not a regular file" in await refusal(asyncio.wait_for(fetch(checked, local(root)), 2))


async def test_a_file_that_grew_past_the_limit_is_refused(root):
    checked = check_request([MediaRef("image", "sub/cat.jpg")], local(root))[0]
    os.truncate(root / "sub" / "cat.jpg", 21 * MB)
    assert "more than the 20 MB limit for images" in await refusal(fetch(checked, local(root)))


async def test_a_local_file_must_be_what_its_extension_says(root):
    (root / "fake.png").write_bytes(b"#!/bin/sh\necho hi\n")
    assert "the content is not JPEG or PNG or GIF or WEBP" in await refusal(fetch_refs([MediaRef("image", "fake.png")], local(root)))


async def test_nothing_is_fetched_when_any_item_is_refused(server, root):
    before = len(server.hits)
    refs = [MediaRef("image", server.url("/img.jpg")), MediaRef("image", "../outside/cat.jpg")]
    both = MediaPolicy(root=os.path.realpath(root), domains=("127.0.0.1",), private_networks=LOOPBACK)
    assert "media item 1 (image): a local path must not contain '..'" in await refusal(fetch_refs(refs, both))
    assert len(server.hits) == before
