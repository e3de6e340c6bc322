"""TLS for every hop: server and channel credentials from PEM files (mutual TLS when a client CA or a client
certificate is given), the same for aiohttp, and a throwaway CA for `voicemesh up --tls` on loopback."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from voicemesh import telemetry


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate and key; with `client_ca`, clients must present a certificate it signed (mTLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""

    def grpc_credentials(self) -> grpc.ServerCredentials:
        record_expiry(self.cert_file, "server")
        client_ca = _read(self.client_ca_file) if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(_read(self.key_file), _read(self.cert_file))],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )

    def ssl_context(self) -> ssl.SSLContext:
        record_expiry(self.cert_file, "server")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_file, self.key_file)
        if self.client_ca_file:
            context.load_verify_locations(self.client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


@dataclass(frozen=True)
class ClientTls:
    """How a client checks a server (`ca_file`; empty = the system's roots) and, for mTLS, who it is."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("a client certificate needs its key, and a key its certificate")
        if self.cert_file:
            record_expiry(self.cert_file, "client")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file) if self.ca_file else None,
            private_key=_read(self.key_file) if self.key_file else None,
            certificate_chain=_read(self.cert_file) if self.cert_file else None,
        )

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file or None)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


def secure_channel(target: str, tls: ClientTls | None, options: list[tuple[str, int | str]]) -> grpc.aio.Channel:
    """A channel to `target`: TLS when `tls` is given, plaintext otherwise."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.grpc_credentials(), options=options)


@dataclass(frozen=True)
class LocalCertificates:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, all signed by the CA."""

    ca_file: str
    server: ServerTls
    client: ClientTls


def local_certificates(directory: Path, days: int = 7) -> LocalCertificates:
    """Write a throwaway CA and loopback certificates into `directory` (for `voicemesh up --tls` and tests)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "voicemesh local CA")])
    now = datetime.datetime.now(datetime.UTC)
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), now, days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_file = _write_pem(directory / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    files = {}
    for role in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"voicemesh {role}")])
        builder = _builder(name, ca_name, key.public_key(), now, days).add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        cert = builder.sign(ca_key, hashes.SHA256())
        files[role] = (
            _write_pem(directory / f"{role}.pem", cert.public_bytes(serialization.Encoding.PEM)),
            _write_pem(
                directory / f"{role}-key.pem",
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                ),
            ),
        )
    return LocalCertificates(
        ca_file,
        ServerTls(*files["server"], client_ca_file=ca_file),
        ClientTls(ca_file, *files["client"]),
    )


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, now: datetime.datetime, days: int
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _write_pem(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    path.chmod(0o600)
    return str(path)


def record_expiry(cert_file: str, role: str) -> None:
    """Publish when a certificate this process serves or presents expires (`voicemesh_tls_certificate_expiry_...`):
    it is read once at start, so a renewed Secret takes effect only after a restart, and the alert says so."""
    certificate = x509.load_pem_x509_certificate(_read(cert_file))
    telemetry.CERTIFICATE_EXPIRY.labels(role).set(certificate.not_valid_after_utc.timestamp())


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read TLS file {path}: {error.strerror}") from error
