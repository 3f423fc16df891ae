"""A TCP relay that holds every chunk a fixed time in each direction: added latency where the
kernel has no netem (`python -m moeshard.bench.delay_relay LISTEN_PORT HOST:PORT ONE_WAY_MS`).

It runs inside a node's network namespace, in front of the node (an nftables redirect sends
the node's port to it), so a coordinator's round trip to that node grows by 2 x ONE_WAY_MS;
bytes are relayed unchanged (TLS passes through). Each direction of a connection has a reader
thread that stamps chunks with their due time and a writer thread that sleeps until then:
`time.sleep` keeps sub-millisecond delays (asyncio's epoll timeouts round up to 1 ms).
"""

from __future__ import annotations

import queue
import socket
import sys
import threading
import time

CHUNK = 1 << 16


def _pump(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
    """Copy src to dst, each chunk sent `delay_s` after it was read; then half-close dst."""
    due: queue.SimpleQueue = queue.SimpleQueue()

    def deliver() -> None:
        while True:
            at, data = due.get()
            if data is None:
                break
            left = at - time.monotonic()
            if left > 0:
                time.sleep(left)
            try:
                dst.sendall(data)
            except OSError:
                break
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    writer = threading.Thread(target=deliver, daemon=True)
    writer.start()
    try:
        while data := src.recv(CHUNK):
            due.put((time.monotonic() + delay_s, data))
    except OSError:
        pass
    due.put((0.0, None))
    writer.join()


def _connection(client: socket.socket, target: tuple[str, int], delay_s: float) -> None:
    try:
        upstream = socket.create_connection(target, timeout=5)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pump, args=(upstream, client, delay_s), daemon=True)
    back.start()
    _pump(client, upstream, delay_s)
    back.join()
    client.close()
    upstream.close()


def serve(listen_port: int, target: tuple[str, int], delay_s: float) -> None:
    listener = socket.create_server(("0.0.0.0", listen_port), reuse_port=False)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_connection, args=(client, target, delay_s), daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m moeshard.bench.delay_relay LISTEN_PORT HOST:PORT ONE_WAY_MS")
        return 2
    host, port = argv[1].rsplit(":", 1)
    serve(int(argv[0]), (host, int(port)), float(argv[2]) / 1e3)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
