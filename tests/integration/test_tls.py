"""HTTPS with mutual TLS (ServerConfig.httpsEnabled): certificates from `switchboard certs`, one real stack.

The business listener uses the encrypted key with its passphrase file and a CRL; the management
listener trusts a second CA as well (managementTlsCaFile), which shows each plane uses its own keys.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.gateway.web.tls import server_contexts
from shared.config import ConfigError, load_config
from tests.conftest import write_config
from tests.integration.stack import READY_PREFIX, running_stack

HEADER_TIMEOUT_S = 4
GENERATE = {"inputs": "My name is Olivier and I", "parameters": {"max_new_tokens": 5}}
TLS_VERSIONS = [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3]
BUSINESS_TLS = {
    "httpsEnabled": True, "tlsCaPath": "security/ca/", "tlsCaFile": ["ca.pem"],
    "tlsCert": "security/certs/server.pem", "tlsPk": "security/keys/server.key.enc.pem",
    "tlsPkPwd": "security/pass/key_pwd.txt", "tlsCrlPath": "security/certs/", "tlsCrlFiles": ["server_crl.pem"],
}
SERVER_TLS = {
    **BUSINESS_TLS,
    "managementTlsCaFile": ["ca.pem", "../../other/ca/ca.pem"],  # file names are under tlsCaPath
    "managementTlsCert": "security/certs/server.pem", "managementTlsPk": "security/keys/server.key.pem",
    "managementTlsCrlPath": "security/certs/",
    "managementTlsCrlFiles": ["server_crl.pem", "../../other/certs/server_crl.pem"],
    "metricsTlsCaFile": ["ca.pem"], "metricsTlsCert": "security/certs/server.pem",
    "metricsTlsPk": "security/keys/server.key.pem", "metricsTlsCrlPath": "security/certs/",
    "metricsTlsCrlFiles": ["server_crl.pem"],
}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """root/security (the server's CA, as `make certs` lays it out) and root/other (a second CA)."""
    root = tmp_path_factory.mktemp("tls")
    procs = [subprocess.Popen([sys.executable, "-m", "switchboard.certs", "--out", str(root / name)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name in ("security", "other")]
    for proc in procs:
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, output
        assert output.count("\n") == 1 and output.startswith("certs: "), output  # quiet: one summary line
    return root


@pytest.fixture(scope="module")
def tls_stack(pki, tiny_model_dir):
    with running_stack(pki, tiny_model_dir, ServerConfig=SERVER_TLS,
                       Switchboard={"headerTimeoutSeconds": HEADER_TIMEOUT_S}) as stack:
        yield stack


def client(pki: Path, cert: str | None = "client", issuer: str = "security", tls_max=None) -> httpx.Client:
    """An httpx client trusting the server's CA, presenting ``issuer``'s ``cert`` (None: no certificate)."""
    ctx = ssl.create_default_context(cafile=pki / "security/ca/ca.pem")
    if cert:
        ctx.load_cert_chain(pki / issuer / f"certs/{cert}.pem", pki / issuer / f"keys/{cert}.key.pem")
    if tls_max:
        ctx.maximum_version = tls_max
    return httpx.Client(verify=ctx, timeout=30)


def assert_refused(http: httpx.Client, url: str) -> None:
    """The TLS handshake fails or the connection closes: no HTTP response at all."""
    with http, pytest.raises(httpx.TransportError):
        http.get(url)


# ---- the stack --------------------------------------------------------------------------------


def test_ready_line_shows_https(tls_stack):
    assert any(line.startswith(READY_PREFIX + tls_stack.url) for line in tls_stack.output)
    assert tls_stack.url.startswith("https://")


@pytest.mark.parametrize("tls_max", TLS_VERSIONS, ids=["tls1.2", "tls1.3"])
def test_valid_client_gets_normal_responses(tls_stack, pki, tls_max):
    with client(pki, tls_max=tls_max) as http:
        generated = http.post(tls_stack.url + "/generate", json=GENERATE)
        health = http.get(tls_stack.mgmt_url + "/health")
        metrics = http.get(tls_stack.metrics_url + "/metrics")
    assert generated.status_code == 200, generated.text
    assert isinstance(generated.json()["generated_text"], str)
    assert health.status_code == 200
    assert metrics.status_code == 200 and "request_received_total" in metrics.text


@pytest.mark.parametrize("tls_max", TLS_VERSIONS, ids=["tls1.2", "tls1.3"])
@pytest.mark.parametrize("plane", ["url", "mgmt_url", "metrics_url"])
def test_client_without_certificate_is_refused(tls_stack, pki, plane, tls_max):
    assert_refused(client(pki, cert=None, tls_max=tls_max), getattr(tls_stack, plane) + "/health")


@pytest.mark.parametrize("tls_max", TLS_VERSIONS, ids=["tls1.2", "tls1.3"])
@pytest.mark.parametrize("plane", ["url", "mgmt_url"])
def test_revoked_client_is_refused(tls_stack, pki, plane, tls_max):
    assert_refused(client(pki, cert="revoked_client", tls_max=tls_max), getattr(tls_stack, plane) + "/health")


@pytest.mark.parametrize("tls_max", TLS_VERSIONS, ids=["tls1.2", "tls1.3"])
def test_client_of_another_ca_is_refused_where_that_ca_is_not_trusted(tls_stack, pki, tls_max):
    assert_refused(client(pki, issuer="other", tls_max=tls_max), tls_stack.url + "/v1/models")
    assert_refused(client(pki, issuer="other", tls_max=tls_max), tls_stack.metrics_url + "/metrics")
    with client(pki, issuer="other", tls_max=tls_max) as http:  # managementTlsCaFile lists the other CA
        assert http.get(tls_stack.mgmt_url + "/health").status_code == 200
    assert_refused(client(pki, cert="revoked_client", issuer="other"), tls_stack.mgmt_url + "/health")


@pytest.mark.parametrize("plane", ["url", "mgmt_url"])
def test_plain_http_to_the_tls_port_gets_no_http_response(tls_stack, plane):
    port = int(getattr(tls_stack, plane).rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        received = _read_until_closed(sock)
    assert not received.startswith(b"HTTP/"), received[:80]
    with pytest.raises(httpx.TransportError):
        httpx.get(getattr(tls_stack, plane).replace("https://", "http://") + "/health", timeout=10)


@pytest.mark.parametrize("plane", ["url", "mgmt_url"])
def test_a_connection_that_never_starts_its_handshake_is_closed_at_the_head_deadline(tls_stack, pki, plane):
    """asyncio's own handshake timeout (60 s) held it 15 times headerTimeoutSeconds before."""
    port = int(getattr(tls_stack, plane).rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=HEADER_TIMEOUT_S + 6) as sock:
        opened = time.monotonic()
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            closed = False
    assert closed and time.monotonic() - opened < HEADER_TIMEOUT_S + 6
    with client(pki) as http:  # the listener serves on
        assert http.get(getattr(tls_stack, plane) + ("/v1/models" if plane == "url" else "/health")).status_code == 200


def test_readme_curl_example(tls_stack, pki):
    """The seed's mutual-TLS curl request, with the files `make certs` writes."""
    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    body = {"inputs": "My name is Olivier and I", "parameters": {
        "best_of": 1, "decoder_input_details": False, "details": False, "do_sample": True, "max_new_tokens": 20,
        "repetition_penalty": 2, "return_full_text": False, "seed": 12, "temperature": 0.1, "top_k": 1,
        "top_p": 0.9, "truncate": 1024}, "stream": True}
    sec = pki / "security"
    done = subprocess.run(
        ["curl", "-sS", "--location", "--request", "POST", tls_stack.url + "/generate",
         "--header", "Content-Type: application/json", "--cacert", str(sec / "ca/ca.pem"),
         "--cert", str(sec / "certs/client.pem"), "--key", str(sec / "keys/client.key.pem"),
         "--data-raw", json.dumps(body), "--write-out", "\n%{http_code}"],
        capture_output=True, text=True, timeout=60,
    )
    text, status = done.stdout.rsplit("\n", 1)
    assert (done.returncode, status) == (0, "200"), done.stderr
    assert "generated_text" in text


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


# ---- configuration errors (no stack) ---------------------------------------------------------


def contexts(pki: Path, **server) -> dict:
    """server_contexts() of a config beside the stack's (so relative paths match) with ``server`` patched."""
    path = pki / "unit-config.json"
    (pki / "unit").mkdir(exist_ok=True)
    path.write_text(write_config(pki / "unit", pki, ServerConfig={**SERVER_TLS, **server}).read_text())
    return server_contexts(load_config(path))


def config_error(pki: Path, **server) -> str:
    with pytest.raises(ConfigError) as info:
        contexts(pki, **server)
    return str(info.value)


def test_contexts_require_client_certificates_tls12_and_crl(pki):
    built = contexts(pki)
    business, management, metrics = built["business"], built["management"], built["metrics"]
    assert len({id(business), id(management), id(metrics)}) == 3  # split planes: one key set each
    for ctx in built.values():
        assert ctx.verify_mode == ssl.CERT_REQUIRED
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
        assert ctx.verify_flags & ssl.VERIFY_CRL_CHECK_LEAF
    assert management.cert_store_stats()["x509_ca"] == 2 and business.cert_store_stats()["x509_ca"] == 1


def test_shared_listener_uses_the_business_keys(pki):
    """management and metrics on the business port: their (missing) keys are not needed."""
    built = contexts(pki, port=1025, managementPort=1025, metricsPort=1025, managementTlsCert="missing.pem",
                     metricsTlsCert="missing.pem")
    assert built["business"] is built["management"] is built["metrics"]


def test_https_off_ignores_tls_keys(pki):
    assert contexts(pki, httpsEnabled=False, tlsCert="missing.pem") == {}


@pytest.mark.parametrize(("server", "expected"), [
    ({"tlsCert": "security/certs/missing.pem"}, "ServerConfig.tlsCert: file not found: {root}/security/certs/missing.pem"),
    ({"tlsPk": "/nowhere/key.pem"}, "ServerConfig.tlsPk: file not found: /nowhere/key.pem"),
    ({"tlsCaFile": ["missing_ca.pem"]}, "ServerConfig.tlsCaFile: file not found: {root}/security/ca/missing_ca.pem"),
    ({"tlsCrlFiles": ["missing_crl.pem"]}, "ServerConfig.tlsCrlFiles: file not found: {root}/security/certs/missing_crl.pem"),
    ({"tlsPkPwd": "security/pass/missing.txt"}, "ServerConfig.tlsPkPwd: file not found: {root}/security/pass/missing.txt"),
    ({"managementTlsCert": "security/certs/management/server.pem"},
     "ServerConfig.managementTlsCert: file not found: {root}/security/certs/management/server.pem"),
    ({"metricsTlsCaFile": ["metrics_ca.pem"]}, "ServerConfig.metricsTlsCaFile: file not found: {root}/security/ca/metrics_ca.pem"),
    ({"tlsCaFile": []}, "ServerConfig.tlsCaFile: 1 to 3 CA file names are needed with httpsEnabled, got []"),
    ({"tlsCaFile": ["ca.pem"] * 4}, "ServerConfig.tlsCaFile: 1 to 3 CA file names"),
    ({"tlsCrlFiles": ["server_crl.pem"] * 4}, "ServerConfig.tlsCrlFiles: at most 3 CRL file names"),
    ({"tlsPkPwd": ""}, "ServerConfig.tlsPkPwd: {root}/security/keys/server.key.enc.pem is encrypted; name a file"),
    ({"tlsPkPwd": "security/certs/server.pem"}, "ServerConfig.tlsPkPwd: the passphrase in {root}/security/certs/server.pem does not decrypt"),
    ({"tlsPk": "security/keys/client.key.pem", "tlsPkPwd": ""}, "ServerConfig.tlsPk: {root}/security/keys/client.key.pem is not the key of the certificate"),
    ({"tlsCert": "security/keys/server.key.pem"}, "ServerConfig.tlsCert: no PEM certificate in {root}/security/keys/server.key.pem"),
    ({"tlsCaFile": ["../certs/server_crl.pem"]}, "ServerConfig.tlsCaFile: no PEM certificate in"),
    ({"tlsCrlFiles": ["server.pem"]}, "ServerConfig.tlsCrlFiles: no PEM CRL in {root}/security/certs/server.pem"),
])
def test_bad_tls_material_names_the_key_and_path(pki, server, expected):
    assert config_error(pki, **server).startswith(expected.format(root=pki))


def test_serve_with_a_missing_certificate_exits_2_with_the_key_and_path(pki, tmp_path):
    config = write_config(tmp_path, pki, ServerConfig={**SERVER_TLS, "tlsCert": str(pki / "nowhere.pem")})
    done = subprocess.run([sys.executable, "-m", "switchboard.cli", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == f"switchboard: {config}: ServerConfig.tlsCert: file not found: {pki / 'nowhere.pem'}"
    assert "Traceback" not in done.stdout + done.stderr
