"""Why a node could not be reached, in words a user can act on.

grpc reports a plaintext client talking to a TLS node (or the other way round) as
UNAVAILABLE, the same as a node that is not there.  `why_unreachable` looks at the address
itself: nothing listening, or something listening that does (or does not) answer a TLS
handshake, which is what `--insecure` on one side and not on the other looks like."""

from __future__ import annotations

import socket
import ssl

NOT_TLS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "UNEXPECTED_RECORD", "HTTP_REQUEST")


def why_unreachable(addr: str, tls: bool, timeout: float = 2.0) -> str:
    """A short reason for a node at HOST:PORT that did not answer; `tls`: whether this client
    spoke TLS to it."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    speaks = speaks_tls(host, int(port), timeout)
    if speaks is None:
        return "unreachable (nothing accepts connections there)"
    if speaks and not tls:
        return (
            "unreachable: it speaks TLS, and --insecure is plaintext (drop --insecure, or start "
            "the node with --insecure)"
        )
    if not speaks and tls:
        return (
            "unreachable: it does not speak TLS (a node started with --insecure? then pass "
            "--insecure here too, on loopback only)"
        )
    return "unreachable"


def speaks_tls(host: str, port: int, timeout: float) -> bool | None:
    """Whether host:port answers a TLS handshake (an alert, such as a missing client
    certificate, counts: the server speaks TLS); None if no connection can be made."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # (what answers is asked, not who)
    context.set_alpn_protocols(["h2"])
    try:
        raw = socket.create_connection((host, port), timeout)
    except OSError:
        return None
    try:
        with context.wrap_socket(raw, server_hostname=host or None):
            return True
    except ssl.SSLError as exc:
        return not any(reason in str(exc) for reason in NOT_TLS)
    except OSError:  # closed or reset without a TLS answer
        return False
    finally:
        raw.close()
