"""Throw-away TLS certificates for tests: a CA, a server certificate for 127.0.0.1 and a client certificate,
all signed by the CA (``make_certs``), written as PEM files into a directory of the caller's. What a real
etcd run with ``--client-cert-auth`` is given in ``kvwire.testing.etcd``; never for anything but tests."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.write_bytes(pem)
    path.chmod(0o600)


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey],
    *,
    ca: bool = False,
    usage: tuple[x509.ObjectIdentifier, ...] = (),
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer[0])
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usage)), critical=False)
    if ExtendedKeyUsageOID.SERVER_AUTH in usage:
        san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer[1], hashes.SHA256())


def make_certs(folder: Path, client: str = "kvwire-engine") -> CertFiles:
    """A CA, a server certificate for 127.0.0.1 / localhost, a client certificate named ``client``."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("kvwire test CA", ca_key, (_name("kvwire test CA"), ca_key), ca=True)
    out = CertFiles(*(folder / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")))
    out.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    server, client_auth = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH
    # The server's is a client's too: etcd's JSON gateway dials etcd's own gRPC port with it, and a
    # server run with --client-cert-auth refuses it otherwise ("tls: bad certificate").
    for cert_path, key_path, who, usage in (
        (out.server_cert, out.server_key, "etcd", (server, client_auth)),
        (out.client_cert, out.client_key, client, (client_auth,)),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(who, key, (ca.subject, ca_key), usage=usage)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, key_path)
    return out
