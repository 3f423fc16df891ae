"""What zeroconf hears about moeshard services, bounded, and grouped by the node id each
announcement proves (discovery.py turns the groups into pinned, dialled nodes).

Why not zeroconf's own `get_service_info`: it resolves one name at a time (1 s each for a
name nobody answers: 30 fake names took a browse from 5.5 s to 33.7 s), gives one SRV record
per name, and reads a cache in which a unique record flushes the other records of its name
heard more than 1 s earlier (RFC 6762 10.2). An attacker answering under a node's instance
name with the node's own signed announcement and its own address could so evict the node's
address, and 2 of 3 browses dialled the attacker. Here every SRV, TXT and A record heard is
kept (a few per name), whoever sent it; each announcement is grouped under the id it proves,
with every address heard under its names, and the pin check decides which address is the node.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from zeroconf import (
    DNSOutgoing,
    DNSQuestion,
    RecordUpdate,
    RecordUpdateListener,
    Zeroconf,
    current_time_millis,
)
from zeroconf.const import _CLASS_IN, _FLAGS_QR_QUERY, _TYPE_A, _TYPE_SRV, _TYPE_TXT

from moeshard.moe.identity.signed import check_announcement

log = logging.getLogger(__name__)

MAX_NAMES = 256  # instance names tracked at once (a flood of names cannot grow memory)
MAX_PER_NAME = 4  # TXT and SRV records kept per name (newest), addresses kept per host
MAX_HOSTS = 2 * MAX_NAMES * MAX_PER_NAME  # host names whose addresses are kept (newest)
MAX_EVICTED = 16 * MAX_NAMES  # silent names evicted, remembered (keys only) to be taken back
MAX_WARNINGS = 1024  # (name, kind) pairs remembered so each warning is logged once
RECHECK_S = 30.0  # a cached announcement check is redone after this (expiry moves on)
FIRST_ASK_S = 0.25  # the wait after a name's first query; doubled after each unanswered one
ASK_ROUND_S = 0.05  # the asker sends one batch of questions at most this often...
ASK_PER_ROUND = 32  # ...for at most this many names (so a flood of names cannot make us flood)


def parse_txt(payload: bytes) -> dict[str, str]:
    """A DNS-SD TXT record's key=value strings (length-prefixed, RFC 6763 6.1)."""
    out: dict[str, str] = {}
    i = 0
    while i < len(payload):
        n = payload[i]
        item = payload[i + 1 : i + 1 + n]
        i += 1 + n
        key, _, value = item.partition(b"=")
        if key:
            out.setdefault(key.decode(errors="replace"), value.decode(errors="replace"))
    return out


class Warnings:
    """Log each (name, kind of reason) once; remembers at most MAX_WARNINGS pairs (then the
    oldest are forgotten, so a flood of bad names cannot grow memory or the log without
    bound: at most one line per new pair, and no more than the flood's own rate)."""

    def __init__(self, cap: int = MAX_WARNINGS):
        self.cap = cap
        self.seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.lock = threading.Lock()

    def warn(self, name: str, kind: str, message: str, *args) -> None:
        with self.lock:
            if (name, kind) in self.seen:
                return
            self.seen[(name, kind)] = None
            while len(self.seen) > self.cap:
                self.seen.popitem(last=False)
        log.warning(message, *args)


WARNINGS = Warnings()  # per process: browses repeat, and so do records


@dataclass
class NameRecords:
    """The records heard under one instance name (from anyone answering for it)."""

    first_seen: float
    promised: bool = False  # its SRV was heard with its PTR (a responder, not a bare name)
    txts: deque = field(default_factory=lambda: deque(maxlen=MAX_PER_NAME))  # TXT payloads
    srvs: deque = field(default_factory=lambda: deque(maxlen=MAX_PER_NAME))  # (port, host key)

    @property
    def answered(self) -> bool:
        return bool(self.txts and self.srvs)


@dataclass
class NodeRecords:
    """One node id's announcement (the newest valid one heard) and every address heard
    under the names that carried it, best first (discovery's `address_rank`, then newest)."""

    node_id: str
    fields: dict[str, str]  # the announcement's TXT fields
    names: list[str]  # instance names it was heard under
    endpoints: list[tuple[str, int]]  # (ip, port) to try, in order


@dataclass
class Asking:
    """A tracked name whose records are being asked for (zeroconf's loop clock)."""

    name: str
    deadline: float  # asked no more after this
    next_ask: float = 0.0  # asked next at this time (0: at once)
    wait: float = FIRST_ASK_S  # the wait after the next question (doubled after each)
    asked: bool = False  # asked at least once
    seeded: bool = False  # zeroconf's cached records of it were taken (once)


class Records(RecordUpdateListener):
    """Listens to every record zeroconf receives; keeps those of tracked instance names.

    `track(name)` starts following a name (the browser saw it); one asker on zeroconf's event
    loop then asks the network for the records of every name being followed, batched into few
    packets, at most ASK_PER_ROUND names every ASK_ROUND_S (names whose SRV was heard with
    their PTR first), so a flood of names is answered by a bounded trickle. Thread-safe.
    """

    def __init__(self, zc: Zeroconf):
        super().__init__()
        self.zc = zc
        self.lock = threading.Lock()
        self.names: OrderedDict[str, NameRecords] = OrderedDict()  # name key -> records
        self.display: dict[str, str] = {}  # name key -> the name as announced
        self.hosts: OrderedDict[str, deque] = OrderedDict()  # host key -> addresses
        self.dropped = 0  # names not tracked because MAX_NAMES answered names were
        self.evicted: OrderedDict[str, str] = OrderedDict()  # silent names let go: key -> name
        self.changed = threading.Event()  # set on every new record of a tracked name
        self._checks: OrderedDict[bytes, tuple[dict, str, float]] = OrderedDict()
        self.asking: OrderedDict[str, Asking] = OrderedDict()  # name key -> its asking
        self.resolve_s = 1.0  # the last `track`'s: how long a name taken back is asked for
        self._wake = asyncio.Event()  # (created here: a 3.10+ Event binds its loop on use)
        self._asker = asyncio.run_coroutine_threadsafe(self._ask_loop(), zc.loop)
        zc.add_listener(self, None)

    def close(self) -> None:
        self._asker.cancel()
        self.zc.remove_listener(self)

    # -- following names ---------------------------------------------------------------------

    def track(self, name: str, resolve_s: float) -> bool:
        """Follow `name` and query its records for up to `resolve_s`; False if the table is
        full of names that answered (then the newcomer is dropped, and counted)."""
        key = name.lower()
        promised = self._srv_heard(name)
        with self.lock:
            self.resolve_s = resolve_s
            if key in self.names:
                return True
            if not self._make_room():
                self.dropped += 1
                return False
            self.names[key] = NameRecords(time.monotonic(), promised)
            self.display[key] = name
            self._start_asking(key, name, resolve_s)
        self.zc.loop.call_soon_threadsafe(self._wake.set)
        return True

    def _start_asking(self, key: str, name: str, resolve_s: float) -> None:
        """Queue `name` for the asker (lock held)."""
        self.asking[key] = Asking(name, self.zc.loop.time() + resolve_s)

    def _make_room(self) -> bool:
        """Room for one more name (lock held): if the table is full, the oldest name that has
        not answered is let go, its key kept in `evicted` so that an SRV or TXT heard for it
        later takes it back (a real node's answer can reach the event loop, busy with a
        flood of bare names, after its name was let go: one went missing so in 1 of 3 runs).
        False if every tracked name has answered."""
        if len(self.names) < MAX_NAMES:
            return True
        silent = next((k for k, r in self.names.items() if not r.answered and not r.promised), None)
        if silent is None:
            return False
        self.evicted[silent] = self.display.pop(silent)
        del self.names[silent]
        self.asking.pop(silent, None)
        while len(self.evicted) > MAX_EVICTED:
            self.evicted.popitem(last=False)
        return True

    def _take_back(self, key: str) -> NameRecords | None:
        """The entry of an evicted name an SRV or TXT was just heard for (lock held)."""
        name = self.evicted.get(key)
        if name is None or not self._make_room():
            return None
        del self.evicted[key]
        entry = self.names[key] = NameRecords(time.monotonic(), promised=True)
        self.display[key] = name
        return entry

    def _srv_heard(self, name: str) -> bool:
        """Whether zeroconf's cache holds an SRV record of `name` already. A node answers a
        browse with its PTR, SRV and TXT in one packet, so its name has one when the browser
        reports it; a flood of bare PTR names has none. Such a name is not evicted as silent
        before its records are taken from the cache on the event loop, which, busy with the
        flood, may come after hundreds of newer names (a real node went missing so)."""
        try:
            return bool(self.zc.cache.get_all_by_details(name, _TYPE_SRV, _CLASS_IN))
        except RuntimeError:  # (the cache changed under the read: as if not heard)
            return False

    async def _ask_loop(self) -> None:
        """The asker: rounds at least ASK_ROUND_S apart, each when a name is due or new."""
        loop = asyncio.get_running_loop()
        while True:
            next_due = self._ask_round(loop.time())
            wait = None if next_due is None else max(next_due - loop.time(), 0.0)
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except TimeoutError:
                pass
            self._wake.clear()
            await asyncio.sleep(ASK_ROUND_S)

    def _ask_round(self, now: float) -> float | None:
        """One round (event loop only): take what zeroconf's cache already holds for every
        name new to the asker, then query the network for the SRV and TXT records (and the
        addresses of the hosts they name) of up to ASK_PER_ROUND names that are due, those
        whose SRV came with their PTR first, in one message (zeroconf splits it into
        packets). A name is asked at least once, whatever the cache says (it may hold only
        the records that flushed the others), then again after 0.25, 0.5, 1 s... until it
        has answered or its time is up. Every responder answers a multicast query, so one
        query hears the node and an impostor. Returns when the next name is due (None: no
        name is being asked for)."""
        with self.lock:
            fresh = [k for k, a in self.asking.items() if not a.seeded]
            for key in fresh:
                self.asking[key].seeded = True
        if fresh:
            self._seed(fresh)
        with self.lock:
            due = [(k, a) for k, a in self.asking.items() if a.next_ask <= now]
            due.sort(key=lambda item: not (item[0] in self.names and self.names[item[0]].promised))
            due = due[:ASK_PER_ROUND]
        out = DNSOutgoing(_FLAGS_QR_QUERY)
        questions = 0
        with self.lock:
            for key, asking in due:
                entry = self.names.get(key)
                hosts = [h for _, h in entry.srvs if h not in self.hosts] if entry else []
                finished = entry is None or (entry.answered and not hosts)
                if asking.asked and (finished or now >= asking.deadline):
                    self.asking.pop(key, None)
                    continue
                out.add_question(DNSQuestion(asking.name, _TYPE_SRV, _CLASS_IN))
                out.add_question(DNSQuestion(asking.name, _TYPE_TXT, _CLASS_IN))
                for host in hosts:
                    out.add_question(DNSQuestion(host, _TYPE_A, _CLASS_IN))
                questions += 1
                asking.asked = True
                asking.next_ask = now + min(asking.wait, max(asking.deadline - now, 0.0))
                asking.wait *= 2
            next_due = min((a.next_ask for a in self.asking.values()), default=None)
        if questions:
            self.zc.async_send(out)
        return next_due

    def _seed(self, keys: list[str]) -> None:
        """Feed zeroconf's cached records of `keys` (and of the hosts their SRVs name) to
        `async_update_records`, as if just heard (event loop only)."""
        cache, now = self.zc.cache, current_time_millis()  # zeroconf's clock
        records = [r for k in keys for r in cache.async_entries_with_name(k)]
        hosts = {r.server_key for r in records if r.type == _TYPE_SRV}
        records += [r for h in hosts for r in cache.async_entries_with_name(h)]
        self.async_update_records(self.zc, now, [RecordUpdate(r, None) for r in records])

    def forget(self, name: str) -> None:
        with self.lock:
            self.asking.pop(name.lower(), None)
            self.evicted.pop(name.lower(), None)
            self.names.pop(name.lower(), None)
            self.display.pop(name.lower(), None)

    def silent(self) -> list[str]:
        """Tracked names nothing complete was heard for (PTR only, or no SRV/TXT)."""
        with self.lock:
            return [self.display[k] for k, r in self.names.items() if not r.answered]

    # -- zeroconf's event loop ---------------------------------------------------------------

    def async_update_records(self, zc, now: float, records) -> None:
        new, taken_back = False, []
        with self.lock:
            for update in records:  # SRV and TXT first: an A record may name a host they name
                r = update.new
                if r.type not in (_TYPE_SRV, _TYPE_TXT):
                    continue
                entry = self.names.get(r.key)
                if entry is None and not r.is_expired(now):
                    entry = self._take_back(r.key)
                    if entry is not None:
                        taken_back.append(self.display[r.key])
                if entry is None:
                    continue
                item = (r.port, r.server_key) if r.type == _TYPE_SRV else bytes(r.text)
                bucket = entry.srvs if r.type == _TYPE_SRV else entry.txts
                if r.is_expired(now):  # a goodbye
                    if item in bucket:
                        bucket.remove(item)
                elif item not in bucket:
                    bucket.append(item)
                    new = True
            for update in records:
                r = update.new
                if r.type != _TYPE_A or r.is_expired(now):
                    continue
                addrs = self.hosts.get(r.key)
                if addrs is None:
                    addrs = self.hosts[r.key] = deque(maxlen=MAX_PER_NAME)
                    while len(self.hosts) > MAX_HOSTS:
                        self.hosts.popitem(last=False)
                ip = socket.inet_ntoa(r.address)
                if ip not in addrs:
                    addrs.append(ip)
                    new = True
                self.hosts.move_to_end(r.key)
        if taken_back:  # its other records and its host's address, if not heard yet
            with self.lock:
                for name in taken_back:
                    self._start_asking(name.lower(), name, self.resolve_s)
            self._wake.set()
        if new:
            self.changed.set()

    def async_update_records_complete(self) -> None:
        pass

    # -- grouping ----------------------------------------------------------------------------

    def _check(self, payload: bytes) -> tuple[dict, str]:
        """(fields, why not valid or '') of one TXT payload; cached by its bytes (an Ed25519
        check per payload per browse round would add up), redone after RECHECK_S."""
        now = time.monotonic()
        hit = self._checks.get(payload)
        if hit is None or now - hit[2] > RECHECK_S:
            fields = parse_txt(payload)
            hit = (fields, check_announcement(fields), now)
            self._checks[payload] = hit
            while len(self._checks) > MAX_NAMES * MAX_PER_NAME:
                self._checks.popitem(last=False)
        return hit[0], hit[1]

    def nodes(self, rank) -> dict[str, NodeRecords]:
        """Node id -> its announcement and addresses. An invalid announcement is left out
        with one warning per name (only when no announcement of that name is valid: a
        node's previous record is no news). `rank(ip)` orders addresses, lower first."""
        with self.lock:
            names = [
                (self.display[k], list(r.txts), list(r.srvs))
                for k, r in self.names.items()
                if r.answered
            ]
            hosts = {k: list(v) for k, v in self.hosts.items()}
            checked = [
                (name, [self._check(p) for p in reversed(txts)], srvs) for name, txts, srvs in names
            ]
        out: dict[str, NodeRecords] = {}
        for name, announcements, srvs in checked:
            endpoints = [
                (ip, port)
                for port, host in reversed(srvs)  # newest first
                for ip in reversed(hosts.get(host, []))
            ]
            valid = [fields for fields, why in announcements if not why]
            if not valid:
                why = announcements[0][1]
                WARNINGS.warn(name, why.split(" (")[0], "discovery: ignoring %s: %s", name, why)
                continue
            for fields in valid:
                node = out.get(fields["node_id"])
                if node is None:
                    node = out[fields["node_id"]] = NodeRecords(fields["node_id"], fields, [], [])
                elif int(fields.get("exp", 0)) > int(node.fields.get("exp", 0)):
                    node.fields = fields
                node.names.append(name)
                node.endpoints += [e for e in endpoints if e not in node.endpoints]
        for node in out.values():
            node.endpoints.sort(key=lambda e: rank(e[0]))  # stable: newest first among equals
        return out
