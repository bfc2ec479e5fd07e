"""Certificates for TLS tests, made with openssl (no network)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_certificates(root: Path) -> tuple[str, str, str]:
    """A CA, and a certificate for 127.0.0.1 it signed: ``(ca, certificate, key)`` paths."""
    ca_key, ca, key, csr, cert = (
        str(root / n) for n in ("ca.key", "ca.pem", "s.key", "s.csr", "s.pem")
    )
    (root / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")

    def openssl(command: str, **paths: str) -> None:
        args = command.format(**paths).split()
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    openssl(
        "req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=lamina-test-ca -keyout {k} -out {c}",
        k=ca_key,
        c=ca,
    )
    openssl("req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout {k} -out {r}", k=key, r=csr)
    openssl(
        "x509 -req -days 1 -in {r} -CA {c} -CAkey {k} -CAcreateserial -out {o} -extfile {e}",
        r=csr,
        c=ca,
        k=ca_key,
        o=cert,
        e=str(root / "san.ext"),
    )
    return ca, cert, key
