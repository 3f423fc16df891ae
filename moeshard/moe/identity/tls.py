"""Mutual TLS bound to identity keys, with grpcio's own TLS.

grpcio's TLS (BoringSSL) does not offer Ed25519 signatures, and its Python API accepts a
client certificate only if it chains to a configured root. So, as libp2p's TLS handshake
does, the TLS key is a fresh ECDSA P-256 key per process and the certificate carries the
identity: an extension holding the Ed25519 public key and its signature over the TLS key
(`BINDING_PREFIX` + SubjectPublicKeyInfo). The handshake proves possession of the TLS key; the
extension proves the identity key authorised it; the id is the hash of the identity key.

- TLS 1.3 only: grpcio has no TLS version setting in Python, so moe/__init__.py leaves TLS
  1.2 only RSA-signed suites, which no ECDSA key can use (a node checks it at start with
  `accepts_tls12`; a client refuses a node whose TLS key is not ECDSA).
- A node's certificate is self-signed. A client fetches it first (`fetch_node_identity`, a
  TLS 1.3 handshake that checks the binding and compares the id with the one it pins), then
  opens the gRPC channel with exactly that certificate as its only root: any other key is
  refused by the TLS layer itself.
- A client's certificate is issued by `OPEN_ISSUER`, a P-256 key derived from a published
  constant. It confers no trust (anyone can issue with it); it exists only so that grpcio
  asks for and accepts client certificates at all. The node reads the client's certificate
  from the call's auth context and takes the id from its binding (`peer_identity`).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import socket
import ssl
import tempfile
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from moeshard.moe.identity.keys import Identity, IdentityError, key_id, verify

BINDING_OID = x509.ObjectIdentifier("2.25.158834913417402358914591383128374209846")
BINDING_PREFIX = b"moeshard-tls-identity-v1:"
TLS_NAME = "moeshard"  # every certificate's DNS name; gRPC checks it (target name override)
OPEN_ISSUER_SEED = b"moeshard open client-certificate issuer v1 (public, confers no trust)"
VALID_DAYS = 3650


def _open_issuer_key() -> ec.EllipticCurvePrivateKey:
    scalar = int.from_bytes(hashlib.sha256(OPEN_ISSUER_SEED).digest(), "big")
    return ec.derive_private_key(scalar, ec.SECP256R1())


def _der_binding(public_raw: bytes, signature: bytes) -> bytes:
    """SEQUENCE { OCTET STRING public key (32), OCTET STRING signature (64) } in DER."""
    body = bytes([0x04, len(public_raw)]) + public_raw + bytes([0x04, len(signature)]) + signature
    return bytes([0x30, len(body)]) + body


def _parse_binding(der: bytes) -> tuple[bytes, bytes]:
    if len(der) != 2 + 2 + 32 + 2 + 64 or der[:2] != bytes([0x30, 100]):
        raise IdentityError("malformed identity binding in the peer's certificate")
    if der[2:4] != bytes([0x04, 32]) or der[36:38] != bytes([0x04, 64]):
        raise IdentityError("malformed identity binding in the peer's certificate")
    return der[4:36], der[38:102]


def _spki(public: ec.EllipticCurvePublicKey) -> bytes:
    return public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _certificate(identity: Identity, tls_key, issuer_key, issuer_name: str, ca: bool):
    """A certificate for `tls_key` carrying `identity`'s binding, signed by `issuer_key`."""
    now = datetime.datetime.now(datetime.UTC)
    binding = identity.sign(BINDING_PREFIX + _spki(tls_key.public_key()))
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.id)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(tls_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.UnrecognizedExtension(BINDING_OID, _der_binding(identity.public_raw, binding)),
            critical=False,
        )
        .sign(issuer_key, hashes.SHA256())
    )


def _pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _open_issuer_certificate() -> bytes:
    key = _open_issuer_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "moeshard open issuer")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _pem(cert)


@dataclass(frozen=True)
class TLSMaterial:
    """PEM bytes for grpcio: this process's TLS key and certificate chain, and the root a
    node trusts for client certificates."""

    key: bytes
    chain: bytes
    client_root: bytes


def node_tls(identity: Identity) -> TLSMaterial:
    """A node's TLS key and self-signed certificate bound to its identity."""
    tls_key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(identity, tls_key, tls_key, identity.id, ca=True)
    return TLSMaterial(_key_pem(tls_key), _pem(cert), _open_issuer_certificate())


def client_tls(identity: Identity) -> TLSMaterial:
    """A client's TLS key and certificate (issued by the open issuer) bound to its identity."""
    tls_key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(identity, tls_key, _open_issuer_key(), "moeshard open issuer", ca=False)
    issuer = _open_issuer_certificate()
    return TLSMaterial(_key_pem(tls_key), _pem(cert) + issuer, issuer)


@functools.lru_cache(maxsize=4096)
def certificate_identity(cert_bytes: bytes) -> str:
    """The id a certificate (PEM or DER) is bound to; IdentityError if it carries no valid
    binding of an identity key to its TLS key.

    Cached by the certificate's bytes: the answer depends on nothing else, and a node checks
    the caller's certificate on every call (parsing and verifying it took ~0.3 ms, half the
    cost of a unary call on loopback). A failure is not cached: it raises."""
    try:
        if cert_bytes.lstrip().startswith(b"-----BEGIN"):
            cert = x509.load_pem_x509_certificate(cert_bytes)
        else:
            cert = x509.load_der_x509_certificate(cert_bytes)
        ext = cert.extensions.get_extension_for_oid(BINDING_OID)
    except x509.ExtensionNotFound:
        raise IdentityError("the peer's certificate carries no moeshard identity") from None
    except ValueError as exc:
        raise IdentityError(f"the peer's certificate is malformed ({exc})") from None
    public_raw, signature = _parse_binding(ext.value.value)
    if not verify(public_raw, signature, BINDING_PREFIX + _spki(cert.public_key())):
        raise IdentityError("the peer's certificate binding does not verify (forged identity)")
    return key_id(public_raw)


def peer_identity(context) -> str | None:
    """The authenticated client id of a gRPC server call, or None without a client certificate."""
    pems = context.auth_context().get("x509_pem_cert")
    if not pems:
        return None
    return certificate_identity(pems[0])


def _client_context(mine: TLSMaterial, version: ssl.TLSVersion) -> ssl.SSLContext:
    """A Python `ssl` client context of exactly TLS `version` presenting our certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ctx.maximum_version = version
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the binding is checked by the caller, then pinned for gRPC
    ctx.set_alpn_protocols(["h2"])
    with tempfile.TemporaryDirectory(prefix="moeshard-tls-") as tmp:  # ssl loads from files
        chain, key = os.path.join(tmp, "chain.pem"), os.path.join(tmp, "key.pem")
        for path, data in ((chain, mine.chain), (key, mine.key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(chain, key)
    return ctx


def fetch_node_identity(
    host: str, port: int, mine: TLSMaterial, timeout: float = 3.0
) -> tuple[str, bytes]:
    """(id, PEM certificate) of the node at host:port, from a TLS 1.3 handshake in which we
    present our client certificate. OSError/ssl.SSLError if it does not speak TLS 1.3;
    IdentityError if its certificate carries no valid binding or its TLS key is not ECDSA (the
    gRPC channel then trusts exactly this certificate, and this process offers TLS 1.2 only
    with RSA-signed suites: an ECDSA key leaves that channel no TLS 1.2 to fall back to)."""
    ctx = _client_context(mine, ssl.TLSVersion.TLSv1_3)
    with socket.create_connection((host, port), timeout=timeout) as raw:
        with ctx.wrap_socket(raw, server_hostname=TLS_NAME) as conn:
            der = conn.getpeercert(binary_form=True)
    node_id = certificate_identity(der)
    if not isinstance(x509.load_der_x509_certificate(der).public_key(), ec.EllipticCurvePublicKey):
        raise IdentityError(f"node {node_id} at {host}:{port} has a TLS key that is not ECDSA")
    return node_id, ssl.DER_cert_to_PEM_cert(der).encode()


def accepts_tls12(host: str, port: int, mine: TLSMaterial, timeout: float = 3.0) -> bool:
    """Whether the TLS server at host:port completes a TLS 1.2 handshake with a client that
    presents `mine` (a node checks itself at start: see moe/__init__.py)."""
    ctx = _client_context(mine, ssl.TLSVersion.TLSv1_2)
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            with ctx.wrap_socket(raw, server_hostname=TLS_NAME):
                return True
    except (ssl.SSLError, ConnectionResetError):  # refused (an alert, or the socket closed)
        return False
