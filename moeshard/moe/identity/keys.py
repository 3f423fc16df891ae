"""Identities: a persistent Ed25519 key per node and per client, and the id derived from it.

The id is the first 16 bytes of sha256(raw 32-byte public key) in lowercase base32 without
padding: 26 characters, short enough to copy, 128 bits so nobody can make a second key with the
same id. Nodes are pinned by it (`--peers ID@HOST:PORT`) and clients allowed by it (`--allow`).

Key files are PKCS#8 PEM, unencrypted, mode 0600, written to a temporary name and renamed so a
crash never leaves half a key; an existing key is never overwritten.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from moeshard.moe.errors import MoeshardError

ID_BYTES = 16
ID_LENGTH = 26  # base32 characters of ID_BYTES
CLIENT_KEY = "key.pem"  # in the moeshard home
NODE_KEY = "node-key.pem"  # in the node's shard directory


class IdentityError(MoeshardError):
    """A key file is missing, unreadable or not an Ed25519 key; a signature does not verify."""


def raw_public(public: ed25519.Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public: ed25519.Ed25519PublicKey | bytes) -> str:
    """The id of a public key (object or its 32 raw bytes)."""
    raw = public if isinstance(public, bytes) else raw_public(public)
    digest = hashlib.sha256(raw).digest()[:ID_BYTES]
    return base64.b32encode(digest).decode().rstrip("=").lower()


def looks_like_id(text: str) -> bool:
    return len(text) == ID_LENGTH and all(c in "abcdefghijklmnopqrstuvwxyz234567" for c in text)


class Identity:
    """A loaded private key: its id, its public key, and signing."""

    def __init__(self, private: ed25519.Ed25519PrivateKey, path: Path | None = None):
        self.private, self.path = private, path
        self.public = private.public_key()
        self.public_raw = raw_public(self.public)
        self.id = key_id(self.public_raw)

    def sign(self, message: bytes) -> bytes:
        return self.private.sign(message)

    def private_pem(self) -> bytes:
        return self.private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


def verify(public_raw: bytes, signature: bytes, message: bytes) -> bool:
    """Whether `signature` is the key's signature of `message` (False for a malformed key)."""
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(public_raw).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def generate(path: str | Path) -> Identity:
    """A new key written to `path` (mode 0600); refuses to replace an existing file."""
    path = Path(path)
    if path.exists():
        raise IdentityError(f"{path}: already exists (a key is never overwritten)")
    if not path.parent.is_dir():
        raise IdentityError(f"{path.parent}: no such directory for the key")
    identity = Identity(ed25519.Ed25519PrivateKey.generate(), path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.private_pem())
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # fails rather than replace a key written meanwhile
    except FileExistsError:
        raise IdentityError(f"{path}: already exists (a key is never overwritten)") from None
    except OSError as exc:
        raise IdentityError(f"{path}: cannot write the key ({exc.strerror})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return identity


def load(path: str | Path) -> Identity:
    """The key in `path`, or an IdentityError naming the file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise IdentityError(f"{path}: cannot read the key ({exc.strerror})") from None
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"{path}: not a PEM private key ({exc})") from None
    if not isinstance(private, ed25519.Ed25519PrivateKey):
        raise IdentityError(f"{path}: not an Ed25519 key")
    if path.stat().st_mode & 0o077:
        raise IdentityError(f"{path}: readable by others; chmod 600 {path}")
    return Identity(private, path)


def load_or_create(path: str | Path) -> Identity:
    """The key in `path`, created on first use."""
    return load_or_make(path)[0]


def load_or_make(path: str | Path) -> tuple[Identity, bool]:
    """The key in `path`, and whether this call made it (of several processes making it at
    once, one makes it and the others load that one)."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            return generate(path), True
        except IdentityError:
            if not path.exists():
                raise
    return load(path), False


def home() -> Path:
    """Where a client keeps its key: $MOESHARD_HOME, else $XDG_CONFIG_HOME/moeshard, else
    ~/.config/moeshard."""
    if os.environ.get("MOESHARD_HOME"):
        return Path(os.environ["MOESHARD_HOME"])
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "moeshard"


def client_identity(path: str | Path | None) -> Identity:
    """A client command's key: `--key FILE`, or the default one, created on first use."""
    return load(path) if path else load_or_create(home() / CLIENT_KEY)
