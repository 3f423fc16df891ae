"""Which `Settle` calls a node takes: only from a client it did work for, once per session,
at a bounded rate; and a bounded memory of the sessions that makes that so.

A settlement is the counterparty's word on work the node's receipts claim, and the node
fsyncs it into its ledger; so a node takes one only where it has something to settle:

- the session is one the node issued receipts in, to the very client that sends the
  settlement (the key the per-client limits count under: its id over TLS), else
  FAILED_PRECONDITION;
- the session was not settled already (one settlement per session: the coordinator sends its
  totals once, at the end), else ALREADY_EXISTS, whose message says whether it is the same
  settlement again (a retry after a lost reply: it was delivered) or another one;
- the client is within SETTLE_RATE calls a second (a burst of SETTLE_BURST), counted before
  anything else is looked at, else RESOURCE_EXHAUSTED.

So a stranger's settlements cost the node a dictionary lookup and write nothing, and the
ledger grows by at most one settlement per session that had receipts.

The memory is bounded: at most `max_sessions` sessions (each a few dozen bytes) and
`max_clients` rate buckets. When full, the oldest settled session goes first, then the session
idle longest (every receipt refreshes its session); a dropped session can no longer be
settled (FAILED_PRECONDITION), which costs nothing but the node's copy of that settlement
(the coordinator keeps its own). An honest coordinator settles right after its last call, so
dropping its open session would take `max_sessions` new sessions, each paid for with a
Forward, in between.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import grpc

from moeshard.node.guard import TokenBucket
from moeshard.node.limits import Refused

MAX_SESSIONS = 4096  # sessions remembered (open and settled together)
MAX_CLIENTS = 4096  # clients whose Settle rate is remembered (the idlest is forgotten)
SETTLE_RATE = 1.0  # Settle calls per second per client, refused or not
SETTLE_BURST = 16.0  # ... in a burst of this many (several runs ending at once)


class Settlements:
    """The sessions this node issued receipts in, per client; thread-safe."""

    def __init__(
        self,
        max_sessions: int = MAX_SESSIONS,
        rate: float = SETTLE_RATE,
        burst: float = SETTLE_BURST,
        max_clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_sessions, self.max_clients = max_sessions, max_clients
        self.rate, self.burst, self.clock = rate, burst, clock
        self.lock = threading.Lock()
        # (session, client) -> receipts issued; oldest activity first
        self.open: OrderedDict[tuple[bytes, str], int] = OrderedDict()
        # (session, client) -> sha256 of the settlement accepted; oldest first
        self.settled: OrderedDict[tuple[bytes, str], bytes] = OrderedDict()
        self.buckets: OrderedDict[str, TokenBucket] = OrderedDict()  # client -> Settle calls
        self.dropped = 0  # open sessions forgotten before they were settled

    def issued(self, session: bytes, client: str) -> None:
        """The node signed a receipt in `session` into a reply to `client`."""
        key = (bytes(session), client)
        with self.lock:
            if key in self.settled:  # (work after the settlement: its receipts stay unsettled)
                return
            if key in self.open:
                self.open[key] += 1
                self.open.move_to_end(key)
                return
            while len(self.open) + len(self.settled) >= self.max_sessions:
                if self.settled:
                    self.settled.popitem(last=False)
                else:
                    self.open.popitem(last=False)
                    self.dropped += 1
            self.open[key] = 1

    def charge(self, client: str) -> None:
        """Refused (RESOURCE_EXHAUSTED) if `client` is over its Settle rate; else one call
        taken from it. First of all, before the message is looked at."""
        now = self.clock()
        with self.lock:
            bucket = self.buckets.get(client)
            if bucket is None:
                bucket = self.buckets[client] = TokenBucket(self.rate, self.burst)
                bucket.stamp = now
                while len(self.buckets) > self.max_clients:
                    self.buckets.popitem(last=False)
            self.buckets.move_to_end(client)
            if not bucket.take(1, now):
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"over this node's rate of {self.rate:g} Settle calls/s per client "
                    f"(in bursts of {self.burst:g})",
                    slow=True,
                )

    def admit(self, session: bytes, client: str, settlement: bytes) -> None:
        """Refused (with its status) unless `client` may settle `session`; `settlement`: the
        message's bytes (to tell a retry of the accepted one from another). The caller holds
        a lock from here to `accept`, so that two settlements of one session never pass."""
        key = (bytes(session), client)
        with self.lock:
            if key in self.settled:
                same = self.settled[key] == hashlib.sha256(settlement).digest()
                raise Refused(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"session {session.hex()[:8]} is settled already "
                    + (
                        "(this very settlement: it was delivered)"
                        if same
                        else "(by another settlement; a node takes one per session)"
                    ),
                )
            if key not in self.open:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"no receipts issued to this client in session {session.hex()[:8] or '-'}: "
                    f"nothing to settle",
                )

    def accept(self, session: bytes, client: str, settlement: bytes) -> None:
        """The settlement was kept in the ledger: the session takes no other."""
        key = (bytes(session), client)
        with self.lock:
            self.open.pop(key, None)
            self.settled[key] = hashlib.sha256(settlement).digest()
            while len(self.open) + len(self.settled) > self.max_sessions:
                self.settled.popitem(last=False)

    def stats(self) -> dict:
        with self.lock:
            return {"open": len(self.open), "settled": len(self.settled), "dropped": self.dropped}
