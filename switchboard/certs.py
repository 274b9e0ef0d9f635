"""``switchboard certs`` (``make certs``): development TLS material for HTTPS with mutual TLS.

Uses the ``openssl`` command line (stdlib only, so ``python3 -m switchboard.certs`` works without the
venv). Writes, under ``--out`` (default ``security/``), the layout of MindIE's default config paths::

    ca/ca.pem, ca/ca.key.pem                      dev CA (signs everything below)
    certs/server.pem, keys/server.key.pem         server certificate (SAN 127.0.0.1, localhost) and key
    keys/server.key.enc.pem, pass/key_pwd.txt     the same key AES-256 encrypted, and its passphrase
    certs/client.pem, keys/client.key.pem         a client certificate
    certs/revoked_client.pem, keys/revoked_client.key.pem   a second client certificate, revoked
    certs/server_crl.pem                          the CA's CRL, listing the revoked client

RSA keys are 3072 bits (MindIE asks >= 3072). Existing files are overwritten.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KEY_BITS = 3072
KEYS = ("ca/ca.key.pem", "keys/server.key.pem", "keys/client.key.pem", "keys/revoked_client.key.pem")

CA_REQ = """[req]
distinguished_name = dn
x509_extensions = v3_ca
prompt = no
[dn]
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
"""
LEAF_EXT = """basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
extendedKeyUsage = {usage}
"""
SERVER_SAN = "subjectAltName = IP:127.0.0.1, DNS:localhost\n"
CA_CONF = """[ca]
default_ca = dev
[dev]
database = {work}/index.txt
crlnumber = {work}/crlnumber
certificate = {out}/ca/ca.pem
private_key = {out}/ca/ca.key.pem
default_md = sha256
default_crl_days = {days}
crl_extensions = crl_ext
[crl_ext]
authorityKeyIdentifier = keyid:always
"""


class CertError(RuntimeError):
    """An openssl command failed; the message carries its output."""


def openssl(*args: str) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise CertError(f"openssl {args[0]} failed: {(done.stderr or done.stdout).strip()}")


def make_keys(out: Path) -> None:
    """The four RSA keys, generated in parallel (each takes about a second)."""
    procs = [subprocess.Popen(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", f"rsa_keygen_bits:{KEY_BITS}",
                               "-out", str(out / key)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for key in KEYS]
    for proc in procs:
        output, _ = proc.communicate()
        if proc.returncode != 0:
            raise CertError(f"openssl genpkey failed: {output.strip()}")
    for key in KEYS:
        (out / key).chmod(0o600)


def sign(out: Path, work: Path, name: str, subject: str, ext: str, days: int) -> None:
    """certs/<name>.pem for keys/<name>.key.pem, signed by the dev CA with extensions ``ext``."""
    csr, ext_file = work / f"{name}.csr", work / f"{name}.ext"
    ext_file.write_text(ext)
    openssl("req", "-new", "-key", str(out / f"keys/{name}.key.pem"), "-subj", subject, "-out", str(csr))
    openssl("x509", "-req", "-in", str(csr), "-CA", str(out / "ca/ca.pem"), "-CAkey", str(out / "ca/ca.key.pem"),
            "-set_serial", f"0x{secrets.token_hex(16)}", "-days", str(days), "-sha256",
            "-extfile", str(ext_file), "-out", str(out / f"certs/{name}.pem"))


def make_ca(out: Path, work: Path, days: int) -> None:
    (work / "ca_req.cnf").write_text(CA_REQ)
    openssl("req", "-x509", "-new", "-key", str(out / "ca/ca.key.pem"), "-subj", "/O=Switchboard dev/CN=Switchboard dev CA",
            "-days", str(days), "-sha256", "-config", str(work / "ca_req.cnf"), "-out", str(out / "ca/ca.pem"))


def revoke_and_publish_crl(out: Path, work: Path, days: int) -> None:
    """Revoke certs/revoked_client.pem and write the CA's CRL to certs/server_crl.pem."""
    conf = work / "ca.cnf"
    conf.write_text(CA_CONF.format(work=work, out=out.resolve(), days=days))
    (work / "index.txt").write_text("")
    (work / "crlnumber").write_text("1000\n")
    openssl("ca", "-config", str(conf), "-revoke", str(out / "certs/revoked_client.pem"))
    openssl("ca", "-config", str(conf), "-gencrl", "-out", str(out / "certs/server_crl.pem"))


def encrypt_server_key(out: Path) -> None:
    """keys/server.key.enc.pem: the server key under AES-256, passphrase in pass/key_pwd.txt."""
    password = out / "pass/key_pwd.txt"
    password.write_text(secrets.token_urlsafe(24) + "\n")
    password.chmod(0o600)
    openssl("pkey", "-in", str(out / "keys/server.key.pem"), "-aes256", "-passout", f"file:{password}",
            "-out", str(out / "keys/server.key.enc.pem"))
    (out / "keys/server.key.enc.pem").chmod(0o600)


def make_all(out: Path, days: int = 365) -> None:
    if shutil.which("openssl") is None:
        raise CertError("the openssl command is needed (apt-get install openssl)")
    for folder in ("ca", "certs", "keys", "pass"):
        (out / folder).mkdir(parents=True, exist_ok=True, mode=0o700)
    make_keys(out)
    with tempfile.TemporaryDirectory(prefix="switchboard-certs-") as tmp:
        work = Path(tmp)
        make_ca(out, work, days * 10)
        sign(out, work, "server", "/O=Switchboard dev/CN=localhost", LEAF_EXT.format(usage="serverAuth") + SERVER_SAN, days)
        sign(out, work, "client", "/O=Switchboard dev/CN=client", LEAF_EXT.format(usage="clientAuth"), days)
        sign(out, work, "revoked_client", "/O=Switchboard dev/CN=revoked client", LEAF_EXT.format(usage="clientAuth"), days)
        revoke_and_publish_crl(out, work, days)
    encrypt_server_key(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="switchboard certs", description="Make development TLS certificates.")
    parser.add_argument("--out", default="security", help="output folder (default: security)")
    parser.add_argument("--days", type=int, default=365, help="validity of the leaf certificates in days")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        make_all(out, args.days)
    except (CertError, OSError) as exc:
        print(f"switchboard certs: {exc}", file=sys.stderr)
        return 1
    print(f"certs: dev CA, server (127.0.0.1, localhost; plain and encrypted key), client, revoked client + CRL "
          f"in {out}/ (RSA {KEY_BITS})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
