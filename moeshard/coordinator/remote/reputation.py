"""Node reputation: what this coordinator has learnt about each node id, kept across runs.

Storj's beta scores with forgetting (whitepaper v3 s. 4.15): an event with outcome v (+1 good,
-1 bad) updates

    alpha' = lambda * alpha + w+ * (1 + v) / 2        score = alpha / (alpha + beta)
    beta'  = lambda * beta  + w- * (1 - v) / 2

so evidence n events old weighs lambda**n. Per node id: an audit score (audits of its replies,
proofs of possession), an availability score (calls and probes answered) and an EWMA of round trips;
score = audit score * availability. The parameters and why: docs/security.md, "Reputation".

Cheap on the hot path: events update an in-memory delta per node; `flush` (every few seconds
from the caller, and on `close`) folds them into the sqlite file in one transaction. Every
update is affine (x -> lambda*x + w), so a node's delta is one map x -> p*x + a, applied to the
row as stored at commit time: coordinators sharing the file (WAL, a busy timeout) all keep
their evidence; none overwrites a failure another one saw. A file that is not a reputation
database is refused with one line naming it, not moved aside: it holds the evidence against
liars, and starting afresh silently would clear it.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections import Counter, defaultdict
from dataclasses import astuple, dataclass, field, fields, replace
from pathlib import Path

from moeshard.coordinator.remote.policy import VETTING_AUDITS, rate_for
from moeshard.moe.errors import MoeshardError
from moeshard.moe.identity.keys import home

log = logging.getLogger(__name__)

DB_NAME = "reputation.sqlite"  # in the moeshard home
FORMAT, SCHEMA = "moeshard-reputation", 1  # the meta table's 'format' and 'schema'
PRIOR = 0.5  # alpha0 = beta0 of every score: Beta(1/2, 1/2)
AUDIT_LAMBDA, AUDIT_PASS_W, AUDIT_FAIL_W = 0.99, 1.0, 20.0
AUDIT_DQ, AUDIT_SUSPECT = 0.8, 0.95  # a node that failed, with an audit score below: DQ; suspect
UP_LAMBDA, UP_W, LATENCY_ALPHA = 0.999, 1.0, 0.05
RANK_K = 1.0  # rank_weight: a node with score 0 costs 1 + RANK_K times as much
FLUSH_INTERVAL_S, BUSY_TIMEOUT_S = 10.0, 5.0


class ReputationError(MoeshardError):
    """The reputation database is unreadable, foreign or from a newer moeshard."""


def default_path() -> Path:
    return home() / DB_NAME


def rank_weight(score: float, k: float = RANK_K) -> float:
    """Factor on a node's cost in holder choice: 1 for a perfect record, 1.75 for a new id."""
    return 1.0 + k * (1.0 - min(max(score, 0.0), 1.0))


@dataclass
class Record:
    """A node's evidence: one row of the `nodes` table (same column order)."""

    audit_alpha: float = PRIOR
    audit_beta: float = PRIOR
    up_alpha: float = PRIOR
    up_beta: float = PRIOR
    latency_ms: float | None = None
    audits_passed: int = 0  # its replies recomputed by a coordinator
    audits_failed: int = 0
    possession_passed: int = 0  # proofs of possession
    possession_failed: int = 0
    calls_ok: int = 0  # calls and probes answered
    calls_failed: int = 0  # ... failed or timed out

    audit_score = property(lambda r: r.audit_alpha / (r.audit_alpha + r.audit_beta))
    availability = property(lambda r: r.up_alpha / (r.up_alpha + r.up_beta))
    score = property(lambda r: r.audit_score * r.availability)
    audits_seen = property(lambda r: r.audits_passed + r.audits_failed)  # audits of its replies
    failed = property(lambda r: r.audits_failed + r.possession_failed)  # audits and proofs
    disqualified = property(lambda r: r.failed > 0 and r.audit_score < AUDIT_DQ)
    suspect = property(lambda r: r.failed > 0 and r.audit_score < AUDIT_SUSPECT)


COLUMNS = [f.name for f in fields(Record)]
COUNTS = COLUMNS[COLUMNS.index("audits_passed") :]  # the counters, never forgotten
SHOWN = ("score", "audit_score", "availability", "disqualified", "suspect")  # besides COLUMNS
SELECT_ONE = f"SELECT {', '.join(COLUMNS)} FROM nodes WHERE node_id = ?"
SELECT_ALL = f"SELECT node_id, {', '.join(COLUMNS)} FROM nodes"
UPSERT = f"INSERT OR REPLACE INTO nodes VALUES ({', '.join('?' * (len(COLUMNS) + 1))})"
SCHEMA_SQL = [
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    f"CREATE TABLE nodes (node_id TEXT PRIMARY KEY, {', '.join(COLUMNS)})",
    f"INSERT INTO meta VALUES ('format', '{FORMAT}'), ('schema', '{SCHEMA}')",
]


def _step(m: list, lam: float, *adds: float) -> None:
    """Follow the affine map m = [p, a, ...] (x -> p*x + a, p shared) by x -> lam*x + add, in
    place: one event's beta update (lam, w+ or 0, w- or 0), or a whole later map."""
    m[0] *= lam
    for i, add in enumerate(adds, 1):
        m[i] = lam * m[i] + add


@dataclass
class Delta:
    """The events of one node since the last flush, as the map they make on a Record."""

    audit: list = field(default_factory=lambda: [1.0, 0.0, 0.0])  # [p, +alpha, +beta]
    up: list = field(default_factory=lambda: [1.0, 0.0, 0.0])
    latency: list = field(default_factory=lambda: [1.0, 0.0])  # [q, +latency]
    counts: Counter = field(default_factory=Counter)

    def apply(self, r: Record) -> Record:
        (p, a, b), (pu, au, bu), (q, c) = self.audit, self.up, self.latency
        latency = r.latency_ms
        if q < 1:  # without an earlier figure: the samples' own weighted mean
            latency = c / (1 - q) if latency is None else q * latency + c
        audit = (p * r.audit_alpha + a, p * r.audit_beta + b)
        up = (pu * r.up_alpha + au, pu * r.up_beta + bu)
        return Record(*audit, *up, latency, *(getattr(r, k) + self.counts[k] for k in COUNTS))

    def then(self, later: Delta) -> Delta:
        out = Delta([*self.audit], [*self.up], [*self.latency], self.counts + later.counts)
        for k in ("audit", "up", "latency"):
            _step(getattr(out, k), *getattr(later, k))
        return out


class Reputation:
    """Evidence per node id in a sqlite file (":memory:": not kept); thread-safe."""

    def __init__(
        self,
        path: str | Path | None = None,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
    ):
        self.path = str(default_path() if path is None else path)
        self.flush_interval_s = flush_interval_s
        self._lock = threading.Lock()  # the in-memory state; never held during I/O
        self._db_lock = threading.Lock()  # the connection
        self._pending: dict[str, Delta] = defaultdict(Delta)  # events since the last flush
        self._flushing: dict[str, Delta] = {}  # events being written now
        self._db, self._base = _open(self.path, busy_timeout_s)  # _base: as of the last flush
        self._last_flush = time.monotonic()

    def record_audit(self, node_id: str, passed: bool) -> None:
        """An audit of the node's reply: the coordinator's recomputation gave its bits, or not."""
        self._audit(node_id, passed, ("audits_failed", "audits_passed"))

    def record_possession(self, node_id: str, passed: bool) -> None:
        """A proof-of-possession challenge: weighs like an audit, counted apart (not vetting)."""
        self._audit(node_id, passed, ("possession_failed", "possession_passed"))

    def record_call(self, node_id: str, ok: bool, latency_ms: float | None = None) -> None:
        """A call or probe answered (with its round trip, if measured) or failed/timed out."""
        with self._lock:
            d = self._pending[node_id]
            _step(d.up, UP_LAMBDA, UP_W * ok, UP_W * (not ok))
            d.counts["calls_ok" if ok else "calls_failed"] += 1
            if ok and latency_ms is not None:
                _step(d.latency, 1 - LATENCY_ALPHA, LATENCY_ALPHA * latency_ms)

    def _audit(self, node_id: str, passed: bool, kind: tuple[str, str]) -> None:
        with self._lock:
            d = self._pending[node_id]
            _step(d.audit, AUDIT_LAMBDA, AUDIT_PASS_W * passed, AUDIT_FAIL_W * (not passed))
            d.counts[kind[passed]] += 1

    def record(self, node_id: str) -> Record:
        """The node's evidence now (the file's as of the last flush, plus what is pending)."""
        with self._lock:
            r = replace(self._base[node_id]) if node_id in self._base else Record()
            for layer in (self._flushing, self._pending):
                if node_id in layer:
                    r = layer[node_id].apply(r)
            return r

    def score(self, node_id: str) -> float:
        return self.record(node_id).score

    def audits_seen(self, node_id: str) -> int:
        """Audits of its replies so far (proofs of possession do not vet its compute)."""
        return self.record(node_id).audits_seen

    def is_disqualified(self, node_id: str) -> bool:
        return self.record(node_id).disqualified

    def audit_rate(self, node_id: str, base_rate: float, vetting: int = VETTING_AUDITS) -> float:
        """How often to audit the node's calls (`policy.rate_for`): 1 while it is new (fewer
        than `vetting` audits) or suspect (a recent failure), else `base_rate`."""
        r = self.record(node_id)
        return rate_for(base_rate, vetting, r.audits_seen, r.suspect)

    def row(self, node_id: str) -> dict:
        """The node's figures for display (`moeshard cluster`, JSON-able)."""
        r = self.record(node_id)
        return {"node_id": node_id, **{k: getattr(r, k) for k in SHOWN}, **vars(r)}

    def snapshot(self) -> list[dict]:
        with self._lock:
            ids = sorted({*self._base, *self._flushing, *self._pending})
        return [self.row(i) for i in ids]

    def flush_if_due(self) -> None:
        """`flush` if flush_interval_s have passed since the last one (for a periodic thread)."""
        if time.monotonic() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self) -> bool:
        """Fold pending events into the file in one transaction; False if that fails (logged,
        kept for the next flush): the file stayed locked past the busy timeout, a full disk."""
        with self._db_lock:
            if self._db is None:
                return False
            with self._lock:
                self._flushing, self._pending = self._pending, defaultdict(Delta)
            self._last_flush = time.monotonic()  # (a failed flush too: retried when next due)
            try:
                base = self._commit(self._flushing)
            except sqlite3.Error as exc:
                log.warning("%s: reputation not saved (%s); retrying later", self.path, exc)
                with self._lock:  # the events not written, then the ones recorded meanwhile
                    early, self._flushing = self._flushing, {}
                    for node_id, later in self._pending.items():
                        early[node_id] = early[node_id].then(later) if node_id in early else later
                    self._pending = early
                return False
            with self._lock:
                self._base, self._flushing = base, {}
            return True

    def _commit(self, deltas: dict[str, Delta]) -> dict[str, Record]:
        db = self._db
        if not deltas:  # nothing to write: only read what other coordinators wrote
            return _rows(db)
        db.execute("BEGIN IMMEDIATE")  # the write lock first: read, fold, write as one step
        try:
            for node_id, delta in deltas.items():
                row = db.execute(SELECT_ONE, (node_id,)).fetchone()
                r = delta.apply(Record(*row) if row else Record())
                db.execute(UPSERT, (node_id, *astuple(r)))
            base = _rows(db)  # with what other coordinators wrote
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return base

    def close(self) -> None:
        self.flush()
        with self._db_lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def _rows(db: sqlite3.Connection) -> dict[str, Record]:
    return {row[0]: Record(*row[1:]) for row in db.execute(SELECT_ALL)}


def _open(path: str, busy_timeout_s: float) -> tuple[sqlite3.Connection, dict[str, Record]]:
    """The connection (schema made for a new file, checked otherwise) and the rows in it."""
    db, why = None, ""
    try:
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        db = sqlite3.connect(path, busy_timeout_s, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")  # readers do not wait for a writer, nor it for them
        db.execute("BEGIN IMMEDIATE")  # two coordinators creating it at once: one does
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables:
            for statement in SCHEMA_SQL:
                db.execute(statement)
            tables = {"meta", "nodes"}
        meta = dict(db.execute("SELECT key, value FROM meta")) if "meta" in tables else {}
        schema = meta.get("schema", "")
        if meta.get("format") != FORMAT:
            why = f"not a moeshard reputation database (no '{FORMAT}' meta)"
        elif not schema.isdigit() or int(schema) > SCHEMA:
            why = f"reputation schema {schema!r}, this moeshard reads schema {SCHEMA}"
        else:
            base = _rows(db)
        db.execute("COMMIT")
    except (sqlite3.Error, OSError) as exc:
        hint = "" if "locked" in str(exc) else "; move it aside to start afresh (losing it)"
        why = f"not a usable reputation database ({exc}){hint}"
    if why:
        if db is not None:
            db.close()
        raise ReputationError(f"{path}: {why}")
    return db, base
