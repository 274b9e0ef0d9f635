"""The URL and address rules of media (``shared.media``): http(s) URLs, IP-literal hosts however
encoded, non-global addresses, the domain allow-list and the private networks admitted.

The checks take any object with the policy's ``domains`` and ``private_networks``; they never
touch the network (``services/tokenizer/media/fetch.py`` resolves names and checks each address
with :func:`check_address`).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from urllib.parse import quote, urlsplit

import msgspec

from shared.errors import validation

DOMAINS_ENV = "ALLOWED_MEDIA_DOMAINS_ENV"
_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\Z")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_PRINTABLE = "".join(chr(c) for c in range(33, 127))  # kept as is in a request line; the rest is %-encoded


class RemoteTarget(msgspec.Struct, frozen=True):
    """A checked http(s) URL, split for a connection of one's own."""

    scheme: str
    host: str  # lower-case, IDNA; an IP literal in its canonical form
    port: int
    target: str  # path and query, as sent in the request line
    ip: str = ""  # set when the host is an IP literal

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == (443 if self.scheme == "https" else 80) else f"{host}:{self.port}"


def check_url(url: str, where: str, policy) -> RemoteTarget:
    """One http(s) URL (a request's or a redirect's) against the policy; 422 naming ``where``."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise validation(f"{where}: malformed URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise validation(f"{where}: URL scheme {scheme or '(none)'!r} is not allowed (http or https only)")
    if "@" in parts.netloc:
        raise validation(f"{where}: a URL must not carry a user name or password")
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise validation(f"{where}: a URL must not contain whitespace or control characters")
    host = _normal_host(parts.hostname or "", where)
    ip = ip_literal(host)
    if ip is not None:
        host = str(ip)
        check_address(ip, where, policy)
    if not host_allowed(host, policy.domains):
        raise validation(f"{where}: host {host} is not on the media allow-list "
                         f"(Switchboard.allowedMediaDomains or {DOMAINS_ENV})")
    if port == 0:
        raise validation(f"{where}: port 0 is not a valid port")
    target = quote((parts.path or "/") + (f"?{parts.query}" if parts.query else ""), safe=_PRINTABLE)
    port = port if port is not None else (443 if scheme == "https" else 80)
    return RemoteTarget(scheme, host, port, target, str(ip) if ip else "")


def _normal_host(host: str, where: str) -> str:
    host = host.rstrip(".").lower()
    if not host:
        raise validation(f"{where}: the URL has no host")
    if ":" in host:  # an IPv6 literal (urlsplit took off the brackets)
        return host
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError:
        raise validation(f"{where}: host {host!r} is not a valid host name") from None


def ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address an IP-literal host means to the resolver, in any encoding inet_aton accepts
    (``127.1``, ``2130706433``, ``0x7f.0.0.1``, ``0177.0.0.1``); None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if re.fullmatch(r"[0-9a-fA-FxX.]+", host) and host[0].isdigit():
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def address_problem(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """Why media may not come from ``ip`` ("loopback", "private", ...); "" for a global address.
    IPv6 addresses that embed an IPv4 one (mapped, 6to4, NAT64) are judged by it as well."""
    embedded = _embedded(ip)
    if embedded is not None and (problem := address_problem(embedded)):
        return problem
    for name in ("unspecified", "loopback", "link_local", "multicast", "private", "reserved"):
        if getattr(ip, f"is_{name}"):
            return name.replace("_", "-")
    return "" if ip.is_global else "non-global"


def _embedded(ip) -> ipaddress.IPv4Address | None:
    """The IPv4 address inside an IPv4-mapped, 6to4 or NAT64 IPv6 address."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.ipv4_mapped or ip.sixtofour


def check_address(ip, where: str, policy, host: str = "") -> None:
    """422 when ``ip`` (an IP-literal host, or what ``host`` resolved to) is not global and not in one
    of the policy's private networks."""
    problem = address_problem(ip)
    if problem and not _admitted(ip, policy.private_networks):
        inner = _embedded(ip)
        shown = f"{ip} ({inner})" if inner is not None else str(ip)
        what = f"host {host} resolves to {shown}, a {problem} address" if host else f"{shown} is a {problem} address"
        raise validation(f"{where}: {what}; media are never fetched from one "
                         "unless Switchboard.allowPrivateMediaAddresses admits it")


def _admitted(ip, networks) -> bool:
    """``ip``, or the IPv4 address it embeds, lies in one of ``networks``."""
    candidates = [a for a in (ip, _embedded(ip)) if a is not None]
    return any(a.version == n.version and a in n for a in candidates for n in networks)


def private_networks(setting: bool | list[str]) -> tuple:
    """allowPrivateMediaAddresses as networks: true = every address, a list = those networks (CIDR or
    single addresses); ValueError names the bad entry."""
    if setting is True:
        return (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
    if setting is False:
        return ()
    out = []
    for i, entry in enumerate(setting):
        try:
            out.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"[{i}]: expected an IP network such as 10.1.0.0/16 or an address, got {entry!r}") from None
    return tuple(out)


def host_allowed(host: str, domains: tuple[str, ...]) -> bool:
    """``host`` is an allow-list entry or a subdomain of one."""
    return any(host == d or (not _is_ip(d) and host.endswith("." + d)) for d in domains)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


# ---- the allow-list ---------------------------------------------------------------------------


def normalize_domain(entry: str) -> str:
    """An allow-list entry: a host name (IDNA, lower-case, no trailing dot) or an IP address in its
    canonical form; ValueError says what is wrong."""
    text = entry.strip().rstrip(".").lower() if isinstance(entry, str) else ""
    if not text:
        raise ValueError("expected a host name or an IP address, got an empty entry")
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        pass
    try:
        name = text.encode("idna").decode("ascii")
    except UnicodeError:
        raise ValueError(f"{entry!r} is not a valid host name") from None
    if len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        raise ValueError(f"{entry!r} is not a host name (a scheme, port, path or '*' does not belong here)")
    return name
