"""Certificates made at test time: a CA, a server certificate for 127.0.0.1 and localhost, a client
certificate it issued, and a client certificate from another CA (the "wrong" one for mutual TLS).
EC P-256 keys: quick to make, and what both gRPC's BoringSSL and Node's OpenSSL take."""

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
class Pair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path  # issued `server` and `client`
    server: Pair  # for 127.0.0.1 and localhost
    client: Pair
    other_ca: Path  # issued `stranger` and nothing else
    stranger: Pair  # a client certificate `ca` did not issue


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(folder: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pair:
    pair = Pair(folder / f"{stem}.pem", folder / f"{stem}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pair.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    pair.key.chmod(0o600)
    return pair


def _builder(subject: str, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


_CA_USAGE = x509.KeyUsage(
    digital_signature=False,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def _ca(folder: Path, stem: str) -> tuple[Pair, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(stem, _name(stem), key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .sign(key, hashes.SHA256())
    )
    return _write(folder, stem, cert, key), cert, key


def _leaf(
    folder: Path,
    stem: str,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    usage: x509.ObjectIdentifier,
    names: list[x509.GeneralName],
) -> Pair:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _builder(stem, issuer[0].subject, key).add_extension(
        x509.ExtendedKeyUsage([usage]), critical=False
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return _write(folder, stem, builder.sign(issuer[1], hashes.SHA256()), key)


def make_pki(folder: Path) -> Pki:
    ca, ca_cert, ca_key = _ca(folder, "ca")
    other_ca, other_cert, other_key = _ca(folder, "other-ca")
    server_names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    return Pki(
        ca=ca.cert,
        server=_leaf(folder, "server", (ca_cert, ca_key), ExtendedKeyUsageOID.SERVER_AUTH, server_names),
        client=_leaf(folder, "client", (ca_cert, ca_key), ExtendedKeyUsageOID.CLIENT_AUTH, []),
        other_ca=other_ca.cert,
        stranger=_leaf(folder, "stranger", (other_cert, other_key), ExtendedKeyUsageOID.CLIENT_AUTH, []),
    )
