"""Who may call a node: the client ids it allows, checked on every ExpertNode call.

Over TLS the caller's id comes from its certificate's identity binding
(`moeshard.moe.identity.tls.peer_identity`, proven by the handshake). A node allows the ids given
with `--allow` (a comma-separated list, or a file of ids, one per line, `#` comments) or, with
`--allow-any`, every authenticated client. `--insecure` (plaintext on loopback, for debugging)
has no identities and allows every caller. Health checks are answered to everyone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from moeshard.moe.errors import MoeshardError
from moeshard.moe.identity.keys import IdentityError, looks_like_id
from moeshard.moe.identity.tls import peer_identity


class AccessDenied(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class AccessPolicy:
    tls: bool  # False: --insecure, nobody is identified
    allow: frozenset[str] = frozenset()  # client ids allowed (with tls)
    allow_any: bool = False  # every authenticated client (public compute)

    def caller(self, context) -> str:
        """The calling client's id ('' without TLS); AccessDenied if it may not call."""
        if not self.tls:
            return ""
        try:
            client = peer_identity(context)
        except IdentityError as exc:
            raise AccessDenied(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None
        if client is None:
            raise AccessDenied(grpc.StatusCode.UNAUTHENTICATED, "no client certificate")
        if not self.allow_any and client not in self.allow:
            raise AccessDenied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"client {client} is not allowed on this node (--allow)",
            )
        return client


def read_allow(spec: str) -> frozenset[str]:
    """Ids from `--allow`: a file of ids (one per line, # comments) or a comma-separated list."""
    path = Path(spec)
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise MoeshardError(f"--allow {spec}: cannot read ({exc})") from None
        items = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    else:
        items = [item.strip() for item in spec.split(",")]
    ids = [item for item in items if item]
    bad = [item for item in ids if not looks_like_id(item)]
    if bad:
        raise MoeshardError(
            f"--allow: '{bad[0]}' is not a client id (26 characters a-z2-7; `moeshard id KEY` "
            f"prints one)"
        )
    if not ids:
        raise MoeshardError(f"--allow {spec}: no client ids given")
    return frozenset(ids)
