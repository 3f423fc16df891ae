"""Fair shares of a node among its clients, whatever their number of keys.

A client is a *flow*: its source address (an IPv6 address counts by its /64, what one host
or home is usually given) and, within that, its key. Keys are free under `--allow-any`, so
shares are split by address first and by key only among the keys of one address; loopback
tests, where every client has the same address, get fairness between keys.

`FairGate` admits holders in start-time fair queuing order (SFQ, Goyal et al. 1996): each
waiter gets the tag max(the virtual time, its flow's last finish tag) and costs its flow its
`cost` (rows); the waiter with the smallest tag goes next, so a client that asks for little
is served about as soon as it asks, however much others keep queued. Two levels: addresses
by their tags, then the keys of the chosen address by theirs. When the queue is full, the
newest waiter of the flow holding the most places is refused instead of the newcomer, as long
as that flow holds more than the newcomer would (longest-queue drop): a stranger who fills the
queue cannot keep others out of it.
"""

from __future__ import annotations

import ipaddress
import itertools
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

MAX_FLOWS = 4096  # finish tags kept before the ones at or below the virtual time are dropped


class Busy(Exception):
    """Refused for load (RESOURCE_EXHAUSTED): the message says why."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class Flow:
    address: str  # the source address ("" when unknown), an IPv6 one as its /64
    key: str  # the client's id (or its full peer string without identities)


def flow_of(client: str, peer: str) -> Flow:
    """The flow of a call from `client` (its key id, or '') whose grpc peer string is `peer`
    ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678", "unix:...")."""
    kind, _, rest = peer.partition(":")
    host = rest.rsplit(":", 1)[0].strip("[]") if kind in ("ipv4", "ipv6") else rest
    try:
        ip = ipaddress.ip_address(host)
        if ip.version == 6 and not ip.is_loopback:
            host = str(ipaddress.ip_network(f"{ip}/64", strict=False))
    except ValueError:
        pass
    return Flow(host, client or peer)


@dataclass(eq=False)
class _Waiter:
    flow: Flow
    cost: float
    big: bool
    seq: int
    event: threading.Event = field(default_factory=threading.Event)
    refused: str = ""  # set (with the event) when dropped from a full queue


class FairGate:
    """At most `slots` holders at once, of which at most `big_slots` with `big` set; up to
    `queue` more wait and are let in by fair tags (see the module docstring)."""

    def __init__(self, slots: int, queue: int, big_slots: int | None = None, what: str = "compute"):
        self.lock = threading.Lock()
        self.free, self.queue, self.what = slots, queue, what
        self.big_free = slots if big_slots is None else big_slots
        self.waiting: list[_Waiter] = []
        self.left = threading.Condition(self.lock)  # notified when a waiter leaves `waiting`
        self.vtime = 0.0  # the start tag of the last holder let in (address level)
        self.addr_finish: dict[str, float] = {}  # address -> finish tag of its last holder
        self.addr_vtime: dict[str, float] = {}  # address -> key-level virtual time
        self.key_finish: dict[Flow, float] = {}  # flow -> finish tag of its last holder
        self.seq = itertools.count()

    @contextmanager
    def hold(self, flow: Flow, cost: float, wait_s: float, big: bool = False):
        """Hold a place for the block; Busy when the queue is full of others no larger than
        this flow's share, when dropped from it for a smaller flow, or after `wait_s`."""
        self._enter(flow, cost, big, wait_s)
        try:
            yield
        finally:
            self._leave(big)

    def _enter(self, flow: Flow, cost: float, big: bool, wait_s: float) -> None:
        with self.lock:
            waiter = _Waiter(flow, cost, big, next(self.seq))
            if self._fits(waiter):  # (a free place has no fitting waiter: _leave lets them in)
                self._grant(waiter)
                return
            if len(self.waiting) >= self.queue:
                self._drop_for(waiter)
            self.waiting.append(waiter)
        if waiter.event.wait(wait_s):
            if waiter.refused:
                raise Busy(waiter.refused)
            return
        with self.lock:
            if waiter.event.is_set() and not waiter.refused:  # let in just as the wait ended
                return
            if waiter in self.waiting:
                self.waiting.remove(waiter)
                self.left.notify_all()
        raise Busy(waiter.refused or f"node busy: no {self.what} slot within {wait_s:.3g} s")

    def wait_none_waiting(self, flow: Flow, wait_s: float) -> bool:
        """Wait (at most `wait_s`) until no request of `flow` waits for a place; False if one
        still does."""
        with self.left:
            return self.left.wait_for(lambda: all(w.flow != flow for w in self.waiting), wait_s)

    def _leave(self, big: bool) -> None:
        with self.lock:
            self.free += 1
            self.big_free += big
            while self.waiting:
                nxt = self._next()
                if nxt is None:
                    break
                self.waiting.remove(nxt)
                self._grant(nxt)
                nxt.event.set()
                self.left.notify_all()

    # -- under self.lock ------------------------------------------------------------------------

    def _fits(self, waiter: _Waiter) -> bool:
        return self.free > 0 and (not waiter.big or self.big_free > 0)

    def _grant(self, waiter: _Waiter) -> None:
        """Let `waiter` in: take its place and advance its flow's tags."""
        self.free -= 1
        self.big_free -= waiter.big
        address, flow = waiter.flow.address, waiter.flow
        start = max(self.vtime, self.addr_finish.get(address, 0.0))
        self.vtime = start
        self.addr_finish[address] = start + waiter.cost
        local = self.addr_vtime.get(address, 0.0)
        key_start = max(local, self.key_finish.get(flow, 0.0))
        self.addr_vtime[address] = key_start
        self.key_finish[flow] = key_start + waiter.cost
        if len(self.key_finish) > MAX_FLOWS:
            self._forget()

    def _next(self) -> _Waiter | None:
        """The waiter to let in next: the address with the smallest tag among those with a
        waiter that fits, then its key with the smallest tag, then the oldest."""
        fitting = [w for w in self.waiting if self._fits(w)]
        if not fitting:
            return None

        def order(w: _Waiter) -> tuple[float, float, int]:
            address = w.flow.address
            addr_tag = max(self.vtime, self.addr_finish.get(address, 0.0))
            key_tag = max(self.addr_vtime.get(address, 0.0), self.key_finish.get(w.flow, 0.0))
            return addr_tag, key_tag, w.seq

        return min(fitting, key=order)

    def _drop_for(self, newcomer: _Waiter) -> None:
        """The queue is full: refuse the newest waiter of the largest flow if it holds more
        places than `newcomer`'s flow would, else Busy for the newcomer."""
        top = largest_flow([w.flow for w in self.waiting], newcomer.flow)
        if top is None:
            raise Busy(f"node busy: {len(self.waiting)} requests already wait for {self.what}")
        victim = max((w for w in self.waiting if w.flow == top), key=lambda w: w.seq)
        self.waiting.remove(victim)
        self.left.notify_all()
        victim.refused = (
            f"node busy: dropped from the {self.what} queue for a client with fewer requests "
            f"waiting"
        )
        victim.event.set()

    def _forget(self) -> None:
        """Drop finish tags that can no longer matter (at or below the virtual time)."""
        waiting = {w.flow for w in self.waiting}
        for flow, tag in list(self.key_finish.items()):
            local = self.addr_vtime.get(flow.address, 0.0)
            if tag <= local and flow not in waiting:
                del self.key_finish[flow]
        addresses = {f.address for f in self.key_finish} | {w.flow.address for w in self.waiting}
        for address in list(self.addr_finish):
            if address not in addresses and self.addr_finish[address] <= self.vtime:
                del self.addr_finish[address]
                self.addr_vtime.pop(address, None)


def largest_flow(flows: list[Flow], newcomer: Flow) -> Flow | None:
    """The flow that occurs most in `flows` if it occurs more often than `newcomer` would with
    one more, else None: compared by address when the addresses differ, by key within one."""
    if not flows:
        return None
    by_addr = Counter(f.address for f in flows)
    by_key = Counter(flows)
    top_addr = max(by_addr, key=by_addr.__getitem__)
    top = max((k for k in by_key if k.address == top_addr), key=by_key.__getitem__)
    if top_addr != newcomer.address:
        return top if by_addr[top_addr] > by_addr[newcomer.address] + 1 else None
    return top if by_key[top] > by_key[newcomer] + 1 else None
