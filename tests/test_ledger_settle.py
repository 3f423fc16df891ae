"""Settlements only from parties with business (issue 34): a node takes a `Settle` only for a
session it issued receipts in to that client, once per session, at a bounded rate, and writes
nothing for the others; the coordinator's honest flow settles exactly once per session per
node, a retry after a lost reply included; and `ledger summary` keeps the calls a settlement
covers apart from receipts the node alone signed. Real node processes over mutual TLS on
loopback (`--allow-any`: strangers may call), and the bookkeeping (node/settlements.py) alone."""

from __future__ import annotations

import base64
import os
import time
from collections import Counter

import grpc
import numpy as np
import pytest
from helpers import client_key, node_process

from moeshard.coordinator.remote.accounts import Accounts
from moeshard.coordinator.remote.transport import PeerSpec, dial
from moeshard.moe.identity.keys import generate
from moeshard.moe.identity.receipts import Totals, make_settlement
from moeshard.moe.identity.tls import client_tls
from moeshard.moe.ledger import LedgerWriter, receipt_body, settlement_body, summary, verify
from moeshard.moe.ledger.read import Report, entries
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc
from moeshard.node.limits import Refused
from moeshard.node.settlements import SETTLE_BURST, Settlements

FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
ALREADY_EXISTS = grpc.StatusCode.ALREADY_EXISTS
BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture(scope="module")
def open_node(converted, tmp_path_factory):
    """A node over mutual TLS open to any client (`--allow-any`), its ledger in a temporary
    file; (node, model, ledger path, dial(key) -> stub)."""
    d = tmp_path_factory.mktemp("settle-node")
    model = ModelDir(converted("qwen3_moe"))
    node = node_process(
        model.path, "--ledger", d / "node.jsonl", "--key", d / "node.pem", allow_any=True
    )
    channels = []

    def stub_for(key):
        channel, _ = dial(PeerSpec(node.addr, node.node_id), client_tls(key), 5)
        channels.append(channel)
        return pb_grpc.ExpertNodeStub(channel)

    yield node, model, d / "node.jsonl", stub_for
    for channel in channels:
        channel.close()
    node.stop()


def forward(model, session: bytes, request_id: int = 1) -> pb.ForwardRequest:
    rng = np.random.default_rng(request_id)
    H = model.config.hidden_size
    return pb.ForwardRequest(
        model_id=model.model_id,
        layer=model.config.moe_layers[0],
        request_id=request_id,
        session=session,
        hidden=codec.encode(rng.standard_normal((2, H), dtype=np.float32)),  # [2, H]
        ids=codec.encode(np.array([[0, 3], [3, -1]]), codec.I32),  # [2, 2]
        weights=codec.encode(rng.random((2, 2), dtype=np.float32)),  # [2, 2]
    )


def written(path, receipt: pb.Receipt, timeout: float = 10.0) -> int:
    """The node's ledger size once it holds `receipt` (receipts are written queued, in
    order: the ones before it are there too)."""
    entry = base64.b64encode(receipt.SerializeToString(deterministic=True))
    deadline = time.monotonic() + timeout
    while not path.exists() or entry not in path.read_bytes():  # (made on the first write)
        assert time.monotonic() < deadline, "the receipt never reached the node's ledger"
        time.sleep(0.05)
    return path.stat().st_size


def refused(stub, settlement) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Settle(settlement, timeout=5)
    return caught.value


def test_a_strangers_settle_without_receipts_in_the_session_is_refused_and_not_written(
    open_node, tmp_path
):
    node, model, ledger, stub_for = open_node
    honest, stranger = client_key(), generate(tmp_path / "stranger.pem")
    honest_stub, stranger_stub = stub_for(honest), stub_for(stranger)
    session = os.urandom(16)
    reply = honest_stub.Forward(forward(model, session), timeout=10)
    assert reply.HasField("receipt")
    size = written(ledger, reply.receipt)
    before = verify(ledger).kinds
    totals = Totals()
    totals.add(reply.receipt)
    # a session nobody had receipts in, and the honest client's session signed by the stranger
    for s in (os.urandom(16), session):
        settlement = make_settlement(stranger, s, node.node_id, model.model_id, 1, totals)
        error = refused(stranger_stub, settlement)
        assert error.code() == FAILED_PRECONDITION, error.details()
        assert "no receipts issued to this client" in error.details()
    time.sleep(0.2)
    assert ledger.stat().st_size == size and verify(ledger).kinds == before
    # the honest client settles its own session once
    mine = make_settlement(honest, session, node.node_id, model.model_id, 1, totals)
    assert honest_stub.Settle(mine, timeout=5).accepted
    assert verify(ledger).kinds["settlement"] == before["settlement"] + 1


def test_a_second_settle_of_a_session_is_refused(open_node, tmp_path):
    node, model, ledger, stub_for = open_node
    key = generate(tmp_path / "client.pem")
    stub = stub_for(key)
    session = os.urandom(16)
    reply = stub.Forward(forward(model, session), timeout=10)
    totals = Totals()
    totals.add(reply.receipt)
    first = make_settlement(key, session, node.node_id, model.model_id, 1, totals)
    assert stub.Settle(first, timeout=5).accepted
    settlements = verify(ledger).kinds["settlement"]
    error = refused(stub, first)  # the same again: a retry whose first reply was lost
    assert error.code() == ALREADY_EXISTS and "it was delivered" in error.details()
    totals.calls += 5
    more = make_settlement(key, session, node.node_id, model.model_id, 2, totals)
    error = refused(stub, more)
    assert error.code() == ALREADY_EXISTS and "one per session" in error.details()
    # work after the settlement does not open the session again
    written(ledger, stub.Forward(forward(model, session, 2), timeout=10).receipt)
    assert refused(stub, more).code() == ALREADY_EXISTS
    assert verify(ledger).kinds["settlement"] == settlements


FLOOD = 150  # settlements of sessions the flooder had no receipts in


def test_a_flood_of_settles_is_rate_limited_and_the_ledger_stays_bounded(open_node, tmp_path):
    """One key: 150 settlements of sessions it never had receipts in (each refusal beyond the
    first few is held TARPIT_S before it is sent, so a bigger flood only takes longer), then
    40 sessions it did have receipts in, each sent 5 times. Nothing of the first is written;
    of the rest at most the burst (plus the refill) is accepted and written, once per
    session; the other client still settles."""
    node, model, ledger, stub_for = open_node
    key = generate(tmp_path / "flooder.pem")
    stub = stub_for(key)
    sessions = [os.urandom(16) for _ in range(40)]
    totals = {}
    for i, session in enumerate(sessions):
        receipt = stub.Forward(forward(model, session, i), timeout=10).receipt
        totals[session] = Totals()
        totals[session].add(receipt)
    size = written(ledger, receipt)
    before = verify(ledger).kinds
    codes: dict[str, int] = {}
    t0 = time.monotonic()
    for _ in range(FLOOD):
        s = make_settlement(key, os.urandom(16), node.node_id, model.model_id, 1, Totals())
        try:
            stub.Settle(s, timeout=5)
            codes["accepted"] = codes.get("accepted", 0) + 1
        except grpc.RpcError as exc:
            codes[exc.code().name] = codes.get(exc.code().name, 0) + 1
    looked_at = codes.get(FAILED_PRECONDITION.name, 0)  # the rest refused unread
    assert "accepted" not in codes and codes[BUSY.name] == FLOOD - looked_at, codes
    assert SETTLE_BURST <= looked_at <= SETTLE_BURST + (time.monotonic() - t0) + 1
    assert ledger.stat().st_size == size
    time.sleep(2.0)  # two more settlements' worth of rate
    accepted, t0 = 0, time.monotonic()
    for _ in range(5):
        for session in sessions:
            s = make_settlement(key, session, node.node_id, model.model_id, 1, totals[session])
            try:
                accepted += stub.Settle(s, timeout=5).accepted
            except grpc.RpcError as exc:
                assert exc.code() in (BUSY, ALREADY_EXISTS), exc.details()
    elapsed = time.monotonic() - t0
    assert 1 <= accepted <= min(len(sessions), 2 + elapsed + 1)
    after = verify(ledger).kinds
    assert after["settlement"] == before["settlement"] + accepted
    assert after["receipt"] == before["receipt"]
    # another client is not held back by the flooder's rate
    other = generate(tmp_path / "other.pem")
    other_stub, session = stub_for(other), os.urandom(16)
    mine = Totals()
    mine.add(other_stub.Forward(forward(model, session), timeout=10).receipt)
    s = make_settlement(other, session, node.node_id, model.model_id, 1, mine)
    assert other_stub.Settle(s, timeout=5).accepted


class LostReply:
    """A stub whose first Settle reaches the node but whose reply is lost (UNAVAILABLE)."""

    class Error(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "connection reset (test)"

    def __init__(self, stub):
        self.stub, self.calls = stub, 0

    def Settle(self, settlement, timeout=None):
        self.calls += 1
        reply = self.stub.Settle(settlement, timeout=timeout)
        if self.calls == 1:
            raise self.Error()
        return reply


def test_the_coordinator_settles_each_session_once_and_a_lost_reply_counts_as_delivered(
    open_node, tmp_path
):
    """Three runs (three Accounts, three sessions) on one node settle once each; the third's
    first reply is lost, and its retry is answered ALREADY_EXISTS, which is delivery."""
    node, model, ledger, stub_for = open_node
    stub = stub_for(client_key())
    info = stub.Info(pb.InfoRequest(nonce=os.urandom(16)), timeout=5)
    sessions = []
    for run in range(3):
        accounts = Accounts(client_key(), model.model_id, tmp_path / "moeshard.coordinator.jsonl")
        sessions.append(accounts.session)
        for i in range(1, 3):
            request = forward(model, accounts.session, i)
            reply = stub.Forward(request, timeout=10)
            accounts.record(node.node_id, request, reply, info.public_key)
        sender = LostReply(stub) if run == 2 else stub
        assert accounts.settle({node.node_id: sender}) == {node.node_id: ""}
        if run == 2:
            assert sender.calls == 2
        accounts.close()
    # the node's ledger: each session's two receipts and its one settlement
    report, kinds = Report(str(ledger)), Counter()
    for entry, content in entries(ledger, report):
        if entry["kind"] in ("receipt", "settlement") and content.session in sessions:
            kinds[entry["kind"], sessions.index(content.session)] += 1
    assert report.ok, report.describe()
    assert kinds == {
        (kind, run): n for kind, n in (("receipt", 2), ("settlement", 1)) for run in range(3)
    }
    work = summary(tmp_path / "moeshard.coordinator.jsonl").nodes[node.node_id]
    assert (work.calls, work.settled_calls, work.settlements, work.agrees) == (6, 6, 3, True)


# -- the summary: settled and unsettled calls apart -------------------------------------------


def receipt(key, model_id: str, session: bytes, request_id: int) -> pb.Receipt:
    from moeshard.moe.identity.receipts import make_receipt

    rng = np.random.default_rng(request_id)
    request = pb.ForwardRequest(
        model_id=model_id,
        layer=1,
        request_id=request_id,
        session=session,
        hidden=codec.encode(rng.standard_normal((1, 8), dtype=np.float32)),  # [1, 8]
        ids=codec.encode(np.array([[1]]), codec.I32),  # [1, 1]
        weights=codec.encode(np.ones((1, 1), dtype=np.float32)),  # [1, 1]
    )
    return make_receipt(key, model_id, request, b"out", [1], 1, 4096, 1)


def node_ledger(tmp_path):
    """(a node's key, a coordinator's key, a model id, the node's ledger path, its writer)."""
    node, coordinator = generate(tmp_path / "node.pem"), generate(tmp_path / "coord.pem")
    path = tmp_path / "node.jsonl"
    return node, coordinator, "ab" * 32, path, LedgerWriter(path, node, "node")


def test_self_signed_receipts_show_as_unsettled_and_nothing_agrees_about_them(tmp_path):
    """A node's ledger: 3 receipts of a session its coordinator settled, then 1,000 receipts
    the node signed for work nobody asked (half in sessions never settled, half appended to the
    settled session after its settlement)."""
    from moeshard.commands.ledger import _table

    node, coordinator, model_id, path, writer = node_ledger(tmp_path)
    session, totals = os.urandom(16), Totals()
    for i in range(3):
        r = receipt(node, model_id, session, i)
        writer.append("receipt", receipt_body(r, node.public_raw))
        totals.add(r)
    settlement = make_settlement(coordinator, session, node.id, model_id, 1, totals)
    writer.append("settlement", settlement_body(settlement))
    fakes = [os.urandom(16) for _ in range(5)]
    for i in range(1000):
        fake = fakes[i % 5] if i < 500 else session
        writer.append(
            "receipt", receipt_body(receipt(node, model_id, fake, 10 + i), node.public_raw)
        )
    writer.close()
    assert verify(path).ok  # the node's own file is well formed: verify is right to pass
    result = summary(path)
    work = result.nodes[node.id]
    assert (work.calls, work.settled_calls, work.unsettled_calls) == (1003, 3, 1000)
    assert (work.settlements, work.unsettled_sessions, work.agrees) == (1, 6, True)
    doc = work.as_dict()
    assert (doc["settled_calls"], doc["unsettled_calls"]) == (3, 1000)
    text = _table(result.report, [work])
    row = next(line for line in text.splitlines() if line.startswith(node.id[:12] + " "))
    assert row.split()[1:4] == ["1003", "3", "1000"] and row.split()[-1] == "yes"
    assert f"{node.id[:12]}: 1000 unsettled calls in 6 sessions: receipts this node signed " in text
    assert "it says nothing of unsettled calls" in text
    # receipts alone: nothing is said to agree
    alone = tmp_path / "alone.jsonl"
    writer = LedgerWriter(alone, node, "node")
    for i in range(1000):
        writer.append(
            "receipt", receipt_body(receipt(node, model_id, fakes[0], i), node.public_raw)
        )
    writer.close()
    work = summary(alone).nodes[node.id]
    assert (work.settled_calls, work.unsettled_calls, work.agrees) == (0, 1000, None)
    row = _table(summary(alone).report, [work]).splitlines()[2]
    assert row.split()[1:4] == ["1000", "0", "1000"] and row.split()[-1] == "-"


def test_fakes_before_the_settlement_of_their_session_are_unsettled_and_disagree(tmp_path):
    """A node that slips its own receipts into a settled session, ahead of the settlement:
    the settlement covers only the calls it states, and it disagrees."""
    node, coordinator, model_id, path, writer = node_ledger(tmp_path)
    session, totals = os.urandom(16), Totals()
    for i in range(13):
        r = receipt(node, model_id, session, i)
        writer.append("receipt", receipt_body(r, node.public_raw))
        if i < 3:
            totals.add(r)
    writer.append(
        "settlement",
        settlement_body(make_settlement(coordinator, session, node.id, model_id, 1, totals)),
    )
    writer.close()
    work = summary(path).nodes[node.id]
    assert (work.calls, work.settled_calls, work.unsettled_calls, work.agrees) == (13, 3, 10, False)
    assert "calls settled 3, ledger 13" in work.disagreements[0]


# -- the bookkeeping alone --------------------------------------------------------------------


def test_the_node_remembers_a_bounded_number_of_sessions_and_clients():
    now = [0.0]
    book = Settlements(max_sessions=4, rate=1.0, burst=2.0, max_clients=2, clock=lambda: now[0])
    s = [bytes([i]) * 16 for i in range(8)]
    for session in s[:3]:
        book.issued(session, "a")
    book.accept(s[0], "a", b"x")  # settled: the first to go when full
    book.issued(s[1], "a")  # s[1] busy again: s[2] is now the idlest open one
    book.issued(s[3], "b")
    book.issued(s[4], "b")  # full: the settled s[0] goes
    assert (s[0], "a") not in book.settled and len(book.open) == 4
    book.issued(s[5], "b")  # full, none settled: the idlest open session (s[2]) goes
    assert (s[2], "a") not in book.open and (s[1], "a") in book.open
    assert book.stats() == {"open": 4, "settled": 0, "dropped": 1}
    with pytest.raises(Refused) as caught:
        book.admit(s[2], "a", b"y")
    assert caught.value.code == FAILED_PRECONDITION
    with pytest.raises(Refused) as caught:
        book.admit(s[1], "b", b"y")  # another client's session
    assert caught.value.code == FAILED_PRECONDITION
    book.admit(s[1], "a", b"y")
    # the rate: a burst of 2, then one a second; clients beyond max_clients are forgotten
    book.charge("a")
    book.charge("a")
    with pytest.raises(Refused) as caught:
        book.charge("a")
    assert caught.value.code == BUSY
    now[0] += 1.0
    book.charge("a")
    book.charge("b")
    book.charge("c")
    assert list(book.buckets) == ["b", "c"]
