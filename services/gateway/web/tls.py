"""HTTPS with mutual TLS for the gateway's listeners (reference §1.1, §2.2).

With ``ServerConfig.httpsEnabled`` every listener serves TLS 1.2+ with its certificate and key,
REQUIRES a client certificate signed by one of its CA files, and refuses revoked client certificates
when CRL files are named. A listener that serves the business plane uses the ``tls*`` keys; a separate
management listener the ``managementTls*`` keys, a separate metrics listener the ``metricsTls*`` keys.
Paths are absolute or relative to the config file's folder; CA files of every plane are under
``tlsCaPath``, CRL files under their plane's ``*CrlPath``. Any problem is a :class:`ConfigError`
naming the key and the path.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import NamedTuple

from shared.config import Config, ConfigError, ServerConfig

PLANES = ("business", "management", "metrics")
PREFIX = {"business": "tls", "management": "managementTls", "metrics": "metricsTls"}
ATTR = {"business": "tls", "management": "management_tls", "metrics": "metrics_tls"}


class TlsKeys(NamedTuple):
    """One listener's TLS keys; ``prefix`` (tls, managementTls, metricsTls) names them in messages."""

    prefix: str
    ca_file: list[str]
    cert: str
    pk: str
    pk_pwd: str
    crl_path: str
    crl_files: list[str]

    def key(self, name: str) -> str:
        return f"ServerConfig.{self.prefix}{name}"


def keys_for(server: ServerConfig, plane: str) -> TlsKeys:
    """The keys of ``plane``'s listener: planes on one address and port share a listener, which uses
    the keys of its first plane in business, management, metrics order."""
    addresses = {"business": (server.ip_address, server.port),
                 "management": (server.management_ip, server.management_listen_port),
                 "metrics": (server.management_ip, server.metrics_port)}
    owner = next(name for name in PLANES if addresses[name] == addresses[plane])
    return TlsKeys(PREFIX[owner], *(getattr(server, f"{ATTR[owner]}_{field}") for field in TlsKeys._fields[1:]))


def server_contexts(cfg: Config) -> dict[str, ssl.SSLContext]:
    """plane -> the SSLContext of its listener (one context per distinct key set); {} when HTTPS is off."""
    if not cfg.server.https_enabled:
        return {}
    built: dict[str, ssl.SSLContext] = {}
    contexts = {}
    for plane in PLANES:
        keys = keys_for(cfg.server, plane)
        if keys.prefix not in built:
            built[keys.prefix] = server_context(cfg, keys)
        contexts[plane] = built[keys.prefix]
    return contexts


def server_context(cfg: Config, keys: TlsKeys) -> ssl.SSLContext:
    """TLS 1.2+, this key set's certificate and key, client certificates required, verified, CRL-checked."""
    _check_names(keys)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["http/1.1"])
    _load_chain(ctx, cfg, keys)
    ca_dir, crl_dir = cfg.resolve_path(cfg.server.tls_ca_path), cfg.resolve_path(keys.crl_path)
    for name in keys.ca_file:
        _load_verify(ctx, keys.key("CaFile"), (ca_dir / name).resolve(), b"-----BEGIN CERTIFICATE-----", "certificate")
    for name in keys.crl_files:
        _load_verify(ctx, keys.key("CrlFiles"), (crl_dir / name).resolve(), b"-----BEGIN X509 CRL-----", "CRL")
    if keys.crl_files:
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return ctx


def _check_names(keys: TlsKeys) -> None:
    if not 1 <= len(keys.ca_file) <= 3 or not all(keys.ca_file):
        raise ConfigError(f"{keys.key('CaFile')}: 1 to 3 CA file names are needed with httpsEnabled, "
                          f"got {keys.ca_file}")
    if len(keys.crl_files) > 3 or not all(keys.crl_files):
        raise ConfigError(f"{keys.key('CrlFiles')}: at most 3 CRL file names, got {keys.crl_files}")
    for name, value in (("Cert", keys.cert), ("Pk", keys.pk)):
        if not value:
            raise ConfigError(f"{keys.key(name)}: a file is needed with httpsEnabled")


def _load_chain(ctx: ssl.SSLContext, cfg: Config, keys: TlsKeys) -> None:
    cert = _readable(keys.key("Cert"), cfg.resolve_path(keys.cert))
    pk = _readable(keys.key("Pk"), cfg.resolve_path(keys.pk))
    if b"-----BEGIN CERTIFICATE-----" not in cert.read_bytes():
        raise ConfigError(f"{keys.key('Cert')}: no PEM certificate in {cert}")
    pem = pk.read_bytes()
    if b"PRIVATE KEY-----" not in pem:
        raise ConfigError(f"{keys.key('Pk')}: no PEM private key in {pk}")
    encrypted = b"ENCRYPTED" in pem
    password = _passphrase(cfg, keys) if keys.pk_pwd else None
    if encrypted and password is None:
        raise ConfigError(f"{keys.key('PkPwd')}: {pk} is encrypted; name a file holding its passphrase")
    try:
        ctx.load_cert_chain(cert, pk, password=_no_password if password is None else password)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"{keys.key('Pk')}: {pk} is not the key of the certificate {cert}") from None
        if encrypted:
            raise ConfigError(f"{keys.key('PkPwd')}: the passphrase in {cfg.resolve_path(keys.pk_pwd)} "
                              f"does not decrypt {pk}") from None
        raise ConfigError(f"{keys.key('Cert')}: cannot load {cert} with the key {pk}: {exc.reason or exc}") from None


def _passphrase(cfg: Config, keys: TlsKeys) -> bytes:
    """The first line of the ``*PkPwd`` file."""
    lines = _readable(keys.key("PkPwd"), cfg.resolve_path(keys.pk_pwd)).read_bytes().splitlines()
    return lines[0] if lines else b""


def _no_password() -> bytes:
    raise ConfigError("the private key is encrypted and no passphrase file is configured")  # never prompt


def _load_verify(ctx: ssl.SSLContext, key: str, path: Path, marker: bytes, what: str) -> None:
    """Add a CA certificate or CRL file to the context's trust store."""
    if marker not in _readable(key, path).read_bytes():
        raise ConfigError(f"{key}: no PEM {what} in {path}")
    try:
        ctx.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ConfigError(f"{key}: cannot load {path}: {exc.reason or exc}") from None


def _readable(key: str, path: Path) -> Path:
    """``path`` if it is a readable file, else a ConfigError naming ``key``."""
    if not path.exists():
        raise ConfigError(f"{key}: file not found: {path}")
    if not path.is_file():
        raise ConfigError(f"{key}: not a file: {path}")
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror}") from None
    return path
