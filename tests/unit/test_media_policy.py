"""shared/media.py: every media item is checked before anything is fetched; each refusal is a 422
that names the item and the rule. Local paths use real files (symlinks, a FIFO, a sparse file)."""

from __future__ import annotations

import base64
import copy
import json
import os

import pytest

from shared.config import ConfigError, load_config, parse_config
from shared.errors import ErrorKind, SwitchboardError
from shared.media import MB, MediaPolicy, base64_size, check_request, sniff
from shared.media_urls import ip_literal, normalize_domain, private_networks
from shared.messages import MediaRef
from tests.conftest import DEFAULT_CONFIG

JPEG = b"\xff\xd8\xff\xe0" + b"\x00\x10JFIF" + bytes(100)
PNG = b"\x89PNG\r\n\x1a\n" + bytes(100)
LOOPBACK = private_networks(["127.0.0.1"])


def data_url(content: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(content).decode()}"


def refusal(refs, policy) -> str:
    with pytest.raises(SwitchboardError) as caught:
        check_request(refs, policy)
    assert caught.value.kind is ErrorKind.VALIDATION and caught.value.info.status == 422
    return caught.value.message


def image(source: str) -> list[MediaRef]:
    return [MediaRef("image", source)]


@pytest.fixture
def root(tmp_path):
    """A media root with one image, a subfolder, and a folder beside it that is outside."""
    media = tmp_path / "media"
    (media / "sub").mkdir(parents=True)
    (media / "cat.jpg").write_bytes(JPEG)
    (media / "sub" / "dog.png").write_bytes(PNG)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.jpg").write_bytes(JPEG)
    return media


@pytest.fixture
def policy(root):
    return MediaPolicy(root=os.path.realpath(root), domains=("example.com", "127.0.0.1"))


# ---- defaults: nothing is fetched -------------------------------------------------------------------


def test_the_default_config_fetches_nothing():
    policy = MediaPolicy.from_config(load_config(DEFAULT_CONFIG), environ={})
    assert (policy.root, policy.domains, policy.private_networks) == ("", (), ())
    assert "Switchboard.mediaRoot is not set" in refusal(image("/data/multimodal_inputs/a.jpg"), policy)
    assert "not on the media allow-list" in refusal(image("https://example.com/a.jpg"), policy)
    assert "127.0.0.1 is a loopback address" in refusal(image("http://127.0.0.1/a.jpg"), policy)
    assert check_request(image(data_url(PNG)), policy)[0].origin == "data"  # inline, nothing to fetch


def test_at_most_20_media_items():
    policy = MediaPolicy()
    assert len(check_request([MediaRef("image", data_url(PNG))] * 20, policy)) == 20
    message = refusal([MediaRef("image", data_url(PNG))] * 21, policy)
    assert message == "The number of multimodal url should be no more than 20 (got 21)"


def test_an_unknown_kind_or_an_empty_source_is_refused():
    assert "unknown kind 'pdf'" in refusal([MediaRef("pdf", data_url(PNG))], MediaPolicy())
    assert "media item 0 (image): the source is empty" in refusal(image(" "), MediaPolicy())
    assert "control characters" in refusal(image("cat.jpg\x00"), MediaPolicy())
    assert "scheme 'ftp' is not supported" in refusal(image("ftp://example.com/a.jpg"), MediaPolicy())


def test_the_refusal_names_the_item():
    refs = [MediaRef("image", data_url(PNG)), MediaRef("video", data_url(PNG))]
    assert refusal(refs, MediaPolicy()).startswith("media item 1 (video): ")


# ---- local files ------------------------------------------------------------------------------------


def test_local_files_under_the_root(root, policy):
    real = os.path.realpath(root)
    relative, absolute, url, nested = check_request(
        [MediaRef("image", "cat.jpg"), MediaRef("image", str(root / "cat.jpg")),
         MediaRef("image", f"file://{root}/cat.jpg"), MediaRef("image", "sub/dog.png")], policy)
    assert relative.path == absolute.path == url.path == os.path.join(real, "cat.jpg")
    assert relative.size == len(JPEG) and relative.origin == "local"
    assert nested.path == os.path.join(real, "sub", "dog.png")


def test_dot_dot_is_refused_even_when_it_stays_inside(root, policy):
    assert "must not contain '..'" in refusal(image("sub/../cat.jpg"), policy)
    assert "must not contain '..'" in refusal(image("../outside/secret.jpg"), policy)


def test_a_symlink_escaping_the_root_is_refused(root, policy):
    (root / "escape.jpg").symlink_to(root.parent / "outside" / "secret.jpg")
    (root / "linked").symlink_to(root.parent / "outside")
    assert "escape.jpg is outside the media root" in refusal(image("escape.jpg"), policy)
    assert "is outside the media root" in refusal(image("linked/secret.jpg"), policy)
    (root / "inside.jpg").symlink_to(root / "cat.jpg")  # a link that stays inside is fine
    assert check_request(image("inside.jpg"), policy)[0].path == os.path.join(os.path.realpath(root), "cat.jpg")


def test_paths_outside_the_root_say_so_whether_or_not_they_exist(root, policy):
    assert "is outside the media root" in refusal(image(str(root.parent / "outside" / "secret.jpg")), policy)
    assert "is outside the media root" in refusal(image("/nonexistent/x.jpg"), policy)
    assert "does not exist" in refusal(image("missing.jpg"), policy)


def test_only_regular_files(root, policy):
    (root / "folder.jpg").mkdir()
    os.mkfifo(root / "pipe.jpg")
    assert "folder.jpg is not a regular file" in refusal(image("folder.jpg"), policy)
    assert "pipe.jpg is not a regular file" in refusal(image("pipe.jpg"), policy)


def test_a_device_file_is_refused(root, policy):
    try:
        os.mknod(root / "null.jpg", 0o666 | 0o020000, os.makedev(1, 3))
    except (PermissionError, OSError):
        pytest.skip("cannot create a device node here")
    assert "null.jpg is not a regular file" in refusal(image("null.jpg"), policy)


def test_extensions_per_kind(root, policy):
    (root / "cat.bmp").write_bytes(b"BM")
    (root / "noext").write_bytes(JPEG)
    assert "extension .bmp is not allowed for images (allowed: jpg, jpeg, png, gif, webp)" in refusal(image("cat.bmp"), policy)
    assert "extension (none) is not allowed" in refusal(image("noext"), policy)
    assert "extension .jpg is not allowed for videos (allowed: mp4, avi, wmv)" in refusal(
        [MediaRef("video", "cat.jpg")], policy)
    assert "not allowed for audio clips (allowed: mp3, wav, flac)" in refusal([MediaRef("audio", "cat.jpg")], policy)
    (root / "UPPER.JPG").write_bytes(JPEG)
    assert check_request(image("UPPER.JPG"), policy)


def test_size_limits_per_kind_from_metadata(root, policy):
    with open(root / "big.jpg", "wb") as f:
        f.truncate(21 * MB)  # sparse: nothing is written
    with open(root / "clip.mp4", "wb") as f:
        f.truncate(21 * MB)
    (root / "empty.png").write_bytes(b"")
    assert "big.jpg is 21 MB, more than the 20 MB limit for images" in refusal(image("big.jpg"), policy)
    assert check_request([MediaRef("video", "clip.mp4")], policy)[0].size == 21 * MB
    assert "empty.png is empty" in refusal(image("empty.png"), policy)


def test_the_request_total_counts_what_is_known(root, policy):
    for name in ("a.mp4", "b.mp4"):
        with open(root / name, "wb") as f:
            f.truncate(400 * MB)
    message = refusal([MediaRef("video", "a.mp4"), MediaRef("video", "b.mp4")], policy)
    assert "media total 800 MB, more than the per-request limit of 600 MB (Switchboard.mediaMaxRequestMb)" in message


def test_a_file_url_with_a_host_is_refused(root, policy):
    assert "must name this machine" in refusal(image("file://server/cat.jpg"), policy)


# ---- data: URLs -------------------------------------------------------------------------------------


def test_data_urls_of_allowed_images():
    jpeg, png, unpadded = check_request([MediaRef("image", data_url(JPEG, "image/jpeg")),
                                         MediaRef("image", data_url(PNG, "IMAGE/PNG")),
                                         MediaRef("image", data_url(PNG).rstrip("="))], MediaPolicy())
    assert (jpeg.size, png.size, unpadded.size) == (len(JPEG), len(PNG), len(PNG))


def test_base64_size_from_the_length():
    for n in range(40):
        text = base64.b64encode(bytes(n)).decode()
        assert base64_size(text) == base64_size(text.rstrip("=")) == n


def test_a_data_url_over_the_limit_is_refused_from_its_length():
    payload = "/9j/" + "A" * (base64.b64encode(bytes(20 * MB)).__len__())
    message = refusal(image(f"data:image/jpeg;base64,{payload}"), MediaPolicy())
    assert "the data: URL's content is 20.0 MB, more than the 20 MB limit for images" in message


@pytest.mark.parametrize("url, reason", [
    ("data:image/png;base64,iVBO!!!!", "base64 content is malformed"),
    ("data:image/png;base64,iVBORw0KGgoAAAAN=", "base64 content is malformed"),
    ("data:image/png;base64,iVBORw0KG", "base64 content is malformed"),
    ("data:image/png;base64,iVBO Rw0K", "base64 content is malformed"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:image/png;base64", "must be base64"),
    ("data:image/bmp;base64,Qk0AAAAA", "type image/bmp is not allowed for images"),
    ("data:;base64,iVBORw0KGgo=", "type (none) is not allowed"),
    (data_url(b"hello, not an image"), "the data: URL's content is not JPEG or PNG or GIF or WEBP"),
])
def test_malformed_or_wrong_data_urls(url, reason):
    assert reason in refusal(image(url), MediaPolicy())


def test_data_urls_carry_each_kind_in_its_own_types():
    assert check_request([MediaRef("audio", data_url(b"fLaC\0\0\0\x22", "audio/flac")),
                          MediaRef("video", data_url(b"\0\0\0\x18ftypmp42", "video/mp4"))], MediaPolicy())
    assert "type image/png is not allowed for audio" in refusal([MediaRef("audio", data_url(b"fLaC", "image/png"))],
                                                               MediaPolicy())
    assert "content is not MP4 or AVI or WMV" in refusal([MediaRef("video", data_url(b"RIFF", "video/mp4"))],
                                                       MediaPolicy())


def test_signatures():
    assert sniff("image", JPEG) == "JPEG" and sniff("image", PNG) == "PNG"
    assert sniff("video", b"\x00\x00\x00\x20ftypisom") == "MP4"
    assert sniff("video", b"RIFF\x00\x00\x00\x00AVI LIST") == "AVI"
    assert sniff("audio", b"RIFF\x00\x00\x00\x00WAVEfmt ") == "WAV"
    assert sniff("audio", b"ID3\x04") == "MP3" and sniff("audio", b"fLaC") == "FLAC"
    assert sniff("image", b"GIF89a") == "GIF" and sniff("image", b"RIFF\x00\x00\x00\x00WEBPVP8L") == "WEBP"
    assert sniff("image", b"BM\x00\x00") == "" and sniff("video", PNG) == "" and sniff("audio", b"GIF89a") == ""


# ---- remote URLs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("host, address, problem", [
    ("127.0.0.1", "127.0.0.1", "loopback"),
    ("2130706433", "127.0.0.1", "loopback"),  # one decimal integer
    ("0x7f.1", "127.0.0.1", "loopback"),  # hexadecimal, two parts
    ("0177.0.0.1", "127.0.0.1", "loopback"),  # octal
    ("127.1", "127.0.0.1", "loopback"),
    ("[::1]", "::1", "loopback"),
    ("[::ffff:127.0.0.1]", "::ffff:7f00:1 (127.0.0.1)", "loopback"),  # IPv4-mapped
    ("[2002:7f00:1::]", "2002:7f00:1:: (127.0.0.1)", "loopback"),  # 6to4
    ("169.254.169.254", "169.254.169.254", "link-local"),  # cloud metadata
    ("[fe80::1]", "fe80::1", "link-local"),
    ("[64:ff9b::a9fe:a9fe]", "64:ff9b::a9fe:a9fe (169.254.169.254)", "link-local"),  # NAT64
    ("10.0.0.1", "10.0.0.1", "private"),
    ("172.16.5.4", "172.16.5.4", "private"),
    ("0xc0a80101", "192.168.1.1", "private"),
    ("[fd00::1]", "fd00::1", "private"),
    ("100.64.0.1", "100.64.0.1", "non-global"),  # carrier-grade NAT
    ("224.0.0.1", "224.0.0.1", "multicast"),
    ("[ff02::1]", "ff02::1", "multicast"),
    ("0.0.0.0", "0.0.0.0", "unspecified"),
    ("0", "0.0.0.0", "unspecified"),
    ("[::]", "::", "unspecified"),
    ("240.0.0.1", "240.0.0.1", "private"),
])
def test_non_global_addresses_are_refused_however_written(host, address, problem):
    policy = MediaPolicy(domains=(address.split(" ")[0],))
    message = refusal(image(f"http://{host}:8080/cat.jpg"), policy)
    assert f"media item 0 (image): {address} is a {problem} address" in message
    assert "unless Switchboard.allowPrivateMediaAddresses admits it" in message


def test_admitted_private_networks():
    policy = MediaPolicy(domains=("127.0.0.1", "10.0.0.1", "::1"), private_networks=LOOPBACK)
    assert check_request(image("http://127.0.0.1:8080/a.jpg"), policy)[0].url == "http://127.0.0.1:8080/a.jpg"
    assert check_request(image("http://2130706433/a.jpg"), policy)[0].url == "http://127.0.0.1/a.jpg"
    assert check_request(image("http://[::ffff:127.0.0.1]/a.jpg"), MediaPolicy(
        domains=("::ffff:7f00:1",), private_networks=LOOPBACK))
    assert "10.0.0.1 is a private address" in refusal(image("http://10.0.0.1/a.jpg"), policy)
    assert "::1 is a loopback address" in refusal(image("http://[::1]/a.jpg"), policy)
    everything = MediaPolicy(domains=("10.0.0.1",), private_networks=private_networks(True))
    assert check_request(image("http://10.0.0.1/a.jpg"), everything)


def test_the_allow_list_admits_hosts_and_their_subdomains():
    policy = MediaPolicy(domains=(normalize_domain("Example.COM."), normalize_domain("bücher.de")))
    for url in ("https://example.com/a.jpg", "https://img.cdn.EXAMPLE.com:8443/a?x=1", "http://xn--bcher-kva.de/a",
                "http://bücher.de/a.png", "https://example.com./a.jpg"):
        assert check_request(image(url), policy)[0].origin == "remote"
    for url in ("https://badexample.com/a.jpg", "https://example.com.evil.net/a.jpg", "https://com/a.jpg"):
        assert "is not on the media allow-list" in refusal(image(url), policy)


def test_an_ip_entry_admits_only_itself():
    policy = MediaPolicy(domains=("8.8.8.8",))
    assert check_request(image("http://8.8.8.8/a.jpg"), policy)
    assert check_request(image("http://134744072/a.jpg"), policy)[0].url == "http://8.8.8.8/a.jpg"
    assert "not on the media allow-list" in refusal(image("http://1.8.8.8.8/a.jpg"), policy)


@pytest.mark.parametrize("url, reason", [
    ("http://user@example.com/a.jpg", "must not carry a user name or password"),
    ("http://user:pw@example.com/a.jpg", "must not carry a user name or password"),
    ("http://example.com@127.0.0.1/a.jpg", "must not carry a user name or password"),
    ("http://example.com:99999/a.jpg", "malformed URL"),
    ("http://example.com:0/a.jpg", "port 0"),
    ("http:///a.jpg", "has no host"),
    ("http://exa mple.com/a.jpg", "whitespace"),
    ("http://[::1/a.jpg", "malformed URL"),
])
def test_bad_urls(url, reason):
    assert reason in refusal(image(url), MediaPolicy(domains=("example.com",)))


def test_the_url_keeps_its_port_and_query_and_drops_its_fragment():
    checked = check_request(image("HTTPS://Img.Example.com:8443/a%20b/ü.jpg?size=2#top"),
                            MediaPolicy(domains=("example.com",)))[0]
    assert checked.url == "https://img.example.com:8443/a%20b/%C3%BC.jpg?size=2"


def test_ip_literal():
    assert str(ip_literal("3232235777")) == "192.168.1.1"
    assert ip_literal("example.com") is None and ip_literal("1abc.de") is None and ip_literal("1.2.3.4.5") is None


# ---- configuration ----------------------------------------------------------------------------------


def config(tmp_path, **switchboard):
    data = json.loads(DEFAULT_CONFIG.read_text())
    data = copy.deepcopy(data)
    data["Switchboard"].update(switchboard)
    return parse_config(json.dumps(data).encode(), source_dir=str(tmp_path))


def config_error(tmp_path, **switchboard) -> str:
    with pytest.raises(ConfigError) as caught:
        MediaPolicy.from_config(config(tmp_path, **switchboard), environ={})
    return str(caught.value)


def test_the_policy_from_the_config(tmp_path):
    (tmp_path / "media").mkdir()
    cfg = config(tmp_path, mediaRoot="media", allowedMediaDomains=["Images.Example.com", "10.1.2.3"],
                 allowPrivateMediaAddresses=["10.1.0.0/16", "::1"], mediaMaxRequestMb=100,
                 mediaFetchTimeoutSeconds=5, mediaRequestTimeoutSeconds=20)
    policy = MediaPolicy.from_config(cfg, environ={"ALLOWED_MEDIA_DOMAINS_ENV": " cdn.example.org , images.example.com,"})
    assert policy.root == os.path.realpath(tmp_path / "media")
    assert policy.domains == ("images.example.com", "10.1.2.3", "cdn.example.org")
    assert [str(n) for n in policy.private_networks] == ["10.1.0.0/16", "::1/128"]
    assert (policy.request_limit, policy.item_timeout_s, policy.request_timeout_s) == (100 * MB, 5.0, 20.0)
    assert check_request(image("http://10.1.2.3/a.jpg"), policy)


def test_media_config_errors_name_the_key(tmp_path):
    assert "Switchboard.allowedMediaDomains[1]: 'https://x.org' is not a host name" in config_error(
        tmp_path, allowedMediaDomains=["x.org", "https://x.org"])
    assert "Switchboard.allowedMediaDomains[0]: '*.x.org' is not a host name" in config_error(
        tmp_path, allowedMediaDomains=["*.x.org"])
    assert "Switchboard.allowPrivateMediaAddresses[1]: expected an IP network" in config_error(
        tmp_path, allowPrivateMediaAddresses=["10.0.0.0/8", "intranet"])
    assert "Switchboard.mediaRequestTimeoutSeconds: must be >= mediaFetchTimeoutSeconds (30), got 10" in config_error(
        tmp_path, mediaRequestTimeoutSeconds=10)
    assert "Switchboard.mediaMaxRequestMb" in config_error(tmp_path, mediaMaxRequestMb=0)
    assert "Switchboard.mediaRoot: " in config_error(tmp_path, mediaRoot="missing")


def test_a_bad_environment_entry_names_the_variable():
    with pytest.raises(ConfigError, match="ALLOWED_MEDIA_DOMAINS_ENV: 'http://x' is not a host name"):
        MediaPolicy.from_config(load_config(DEFAULT_CONFIG), environ={"ALLOWED_MEDIA_DOMAINS_ENV": "a.org,http://x"})
