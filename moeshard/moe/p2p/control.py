"""A client of go-libp2p-daemon's control socket (`p2pd`, see `moeshard.moe.p2p.daemon`).

Each request opens its own connection to the daemon's Unix socket, writes one Request and
reads the Response, every message preceded by its length as an unsigned varint. A DHT query
that finds many answers sends them after the Response, between a BEGIN and an END. A stream
request (STREAM_OPEN) leaves its connection open as the stream itself: after the Response,
the bytes on it are the remote peer's. For STREAM_HANDLER the daemon dials an address of
ours for each incoming stream and writes a StreamInfo before the remote peer's bytes.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from moeshard.moe.errors import MoeshardError
from moeshard.moe.p2p import addrs
from moeshard.moe.p2p import p2pd_pb2 as pb

MAX_MESSAGE = 4 << 20  # the daemon's own limit on a control message


@dataclass(frozen=True)
class PeerInfo:
    peer_id: str  # base58
    addrs: tuple[str, ...]  # text multiaddrs


class P2PError(MoeshardError):
    """The daemon refused a request, or its socket broke."""


def send_message(sock: socket.socket, message) -> None:
    data = message.SerializeToString()
    sock.sendall(addrs.uvarint(len(data)) + data)


def read_message(sock: socket.socket, message_type):
    """One length-prefixed message from `sock`, parsed as `message_type`."""
    length = shift = 0
    while True:
        byte = sock.recv(1)
        if not byte:
            raise P2PError("the p2p daemon closed the connection")
        length |= (byte[0] & 0x7F) << shift
        shift += 7
        if not byte[0] & 0x80:
            break
        if shift > 35:
            raise P2PError("malformed length from the p2p daemon")
    if length > MAX_MESSAGE:
        raise P2PError(f"a {length}-byte message from the p2p daemon (at most {MAX_MESSAGE})")
    data = bytearray()
    while len(data) < length:
        chunk = sock.recv(length - len(data))
        if not chunk:
            raise P2PError("the p2p daemon closed the connection mid-message")
        data += chunk
    message = message_type()
    message.ParseFromString(bytes(data))
    return message


def _peer(info) -> PeerInfo:
    return PeerInfo(addrs.peer_id_text(info.id), tuple(_texts(info.addrs)))


def _texts(raw_addrs) -> list[str]:
    out = []
    for raw in raw_addrs:
        try:
            out.append(addrs.decode(raw))
        except MoeshardError:  # an address in a protocol moeshard does not speak: skipped
            continue
    return out


class Control:
    """Requests to one daemon, by the path of its control socket."""

    def __init__(self, socket_path: str, timeout_s: float = 30.0):
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise P2PError(f"p2p daemon at {self.socket_path}: {exc.strerror or exc}") from None
        return sock

    def _ask(self, request, keep: bool = False):
        """(the Response, the connection if `keep`, else None). An ERROR response raises."""
        sock = self._connect()
        try:
            send_message(sock, request)
            response = read_message(sock, pb.Response)
        except OSError as exc:
            sock.close()
            raise P2PError(f"p2p daemon at {self.socket_path}: {exc}") from None
        except BaseException:
            sock.close()
            raise
        if response.type == pb.Response.ERROR:
            sock.close()
            raise P2PError(f"p2p daemon: {response.error.msg}")
        if not keep:
            sock.close()
            return response, None
        return response, sock

    def identify(self) -> PeerInfo:
        response, _ = self._ask(pb.Request(type=pb.Request.IDENTIFY))
        return _peer(response.identify)

    def connect(self, peer_id: str, addresses: list[str], timeout_s: int = 10) -> None:
        request = pb.Request(type=pb.Request.CONNECT)
        request.connect.peer = addrs.peer_id_bytes(peer_id)
        request.connect.addrs.extend(addrs.encode(a) for a in addresses)
        request.connect.timeout = timeout_s
        self._ask(request)

    def disconnect(self, peer_id: str) -> None:
        request = pb.Request(type=pb.Request.DISCONNECT)
        request.disconnect.peer = addrs.peer_id_bytes(peer_id)
        self._ask(request)

    def peers(self) -> list[PeerInfo]:
        response, _ = self._ask(pb.Request(type=pb.Request.LIST_PEERS))
        return [_peer(p) for p in response.peers]

    def open_stream(
        self, peer_id: str, protocol: str, timeout_s: int = 10
    ) -> tuple[socket.socket, str]:
        """A byte stream to `peer_id` speaking `protocol`, and the address it went over (a
        `/p2p-circuit` one when relayed). The caller closes the socket."""
        request = pb.Request(type=pb.Request.STREAM_OPEN)
        request.stream_open.peer = addrs.peer_id_bytes(peer_id)
        request.stream_open.proto.append(protocol)
        request.stream_open.timeout = timeout_s
        response, sock = self._ask(request, keep=True)
        sock.settimeout(None)
        return sock, addrs.decode(response.stream_info.addr)

    def add_handler(self, protocol: str, listen_path: str) -> None:
        """Incoming streams of `protocol` are connected to the Unix socket at `listen_path`."""
        request = pb.Request(type=pb.Request.STREAM_HANDLER)
        request.stream_handler.addr = addrs.encode(f"/unix{listen_path}")
        request.stream_handler.proto.append(protocol)
        request.stream_handler.balanced = False
        self._ask(request)

    def provide(self, key: str, timeout_s: int = 30) -> None:
        """Announce in the DHT that this peer provides `key` (a provider record)."""
        request = pb.Request(type=pb.Request.DHT)
        request.dht.type = pb.DHTRequest.PROVIDE
        request.dht.cid = addrs.content_id(key)
        request.dht.timeout = timeout_s
        self._ask(request)

    def find_providers(self, key: str, count: int = 64, timeout_s: int = 10) -> list[PeerInfo]:
        """The peers the DHT says provide `key` (with the addresses it knows for them)."""
        request = pb.Request(type=pb.Request.DHT)
        request.dht.type = pb.DHTRequest.FIND_PROVIDERS
        request.dht.cid = addrs.content_id(key)
        request.dht.count = count
        request.dht.timeout = timeout_s
        return self._dht_stream(request)

    def find_peer(self, peer_id: str, timeout_s: int = 10) -> PeerInfo:
        request = pb.Request(type=pb.Request.DHT)
        request.dht.type = pb.DHTRequest.FIND_PEER
        request.dht.peer = addrs.peer_id_bytes(peer_id)
        request.dht.timeout = timeout_s
        response, _ = self._ask(request)
        return _peer(response.dht.peer)

    def _dht_stream(self, request) -> list[PeerInfo]:
        response, sock = self._ask(request, keep=True)
        found = []
        try:
            if response.dht.type != pb.DHTResponse.BEGIN:
                return [_peer(response.dht.peer)] if response.dht.HasField("peer") else []
            while True:
                item = read_message(sock, pb.DHTResponse)
                if item.type == pb.DHTResponse.END:
                    return found
                if item.HasField("peer"):
                    found.append(_peer(item.peer))
        except OSError as exc:
            raise P2PError(f"p2p daemon at {self.socket_path}: {exc}") from None
        finally:
            sock.close()
