"""The PEM files of a TLS etcd (``TlsFiles``) and a throw-away PKI for them: ``kfp-elastic etcd
--tls-dir``, local TLS demos and tests (needs the ``cryptography`` package).

``generate_test_pki(directory)`` writes, as PEM files:

* ``ca.pem``: the CA that signs everything below (its key is not kept);
* ``server.pem`` / ``server-key.pem``: etcd's certificate, SAN ``IP:127.0.0.1``, ``IP:::1`` and
  ``DNS:localhost``, usable for server *and* client auth (etcd's own gateway and the health
  check present it as a client certificate when ``--client-cert-auth`` is on);
* ``client.pem`` / ``client-key.pem``: a client certificate (CN ``kfp-elastic-client``);
* ``other-ca.pem`` plus ``other-client.pem`` / ``other-client-key.pem``: an unrelated CA and a
  client certificate it signed, for negative tests.

Keys are ECDSA P-256 (fast to make, accepted by etcd and gRPC). Never use these in production.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

_VALIDITY = datetime.timedelta(days=2)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for etcd's client port: CA, server certificate and key.

    With ``client_cert_auth`` etcd demands a client certificate signed by ``ca``
    (``--trusted-ca-file --client-cert-auth``); the health check and ``etcdctl`` then present
    the server certificate as their client certificate, so it must allow client auth too (as
    etcd's own gateway requires); ``generate_test_pki`` makes such a
    certificate. Without it etcd only serves TLS and ``ca`` is what clients trust (etcd would
    demand client certificates whenever it got a CA file).
    """

    ca: Path
    cert: Path
    key: Path
    client_cert_auth: bool = True


@dataclass(frozen=True)
class TestPki:
    """Paths of everything ``generate_test_pki`` wrote."""

    __test__ = False  # not a pytest test class

    server: TlsFiles
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_client_cert: Path
    other_client_key: Path

    @property
    def ca(self) -> Path:
        return self.server.ca


def generate_test_pki(directory: str | os.PathLike[str], client_cert_auth: bool = True) -> TestPki:
    """Write a CA, server and client certificates (and an unrelated CA) into ``directory``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)

    def new_key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def name(common_name: str) -> x509.Name:
        return x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kfp-elastic test"),
                x509.NameAttribute(NameOID.COMMON_NAME, common_name),
            ]
        )

    def write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None) -> None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            key_path = path.with_name(path.stem + "-key.pem")
            key_path.write_bytes(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
            key_path.chmod(0o600)

    def make_ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = new_key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(common_name))
            .issuer_name(name(common_name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        return cert, key

    def make_leaf(
        common_name: str,
        ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
        usages: list[x509.ObjectIdentifier],
        sans: list[x509.GeneralName] | None = None,
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        ca_cert, ca_key = ca
        key = new_key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common_name))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_encipherment=True,
                    content_commitment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    ca = make_ca("kfp-elastic test CA")
    other_ca = make_ca("kfp-elastic unrelated CA")
    server = make_leaf(
        "etcd",
        ca,
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        [
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
            x509.DNSName("localhost"),
        ],
    )
    client = make_leaf("kfp-elastic-client", ca, [ExtendedKeyUsageOID.CLIENT_AUTH])
    other_client = make_leaf("kfp-elastic-client", other_ca, [ExtendedKeyUsageOID.CLIENT_AUTH])

    write(out / "ca.pem", ca[0], None)
    write(out / "server.pem", *server)
    write(out / "client.pem", *client)
    write(out / "other-ca.pem", other_ca[0], None)
    write(out / "other-client.pem", *other_client)
    return TestPki(
        server=TlsFiles(
            ca=out / "ca.pem",
            cert=out / "server.pem",
            key=out / "server-key.pem",
            client_cert_auth=client_cert_auth,
        ),
        client_cert=out / "client.pem",
        client_key=out / "client-key.pem",
        other_ca=out / "other-ca.pem",
        other_client_cert=out / "other-client.pem",
        other_client_key=out / "other-client-key.pem",
    )
