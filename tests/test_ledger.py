"""Receipts, settlements and the ledger (issue 15): signing and checking, the hash-chained file
(append, continue, a flipped byte anywhere, a torn last line), summaries, the CLI, and a real
node on loopback that signs receipts, accepts a settlement into its ledger and refuses forged
ones."""

from __future__ import annotations

import io
import json
import os

import grpc
import numpy as np
import pytest
from helpers import client_key, flip_byte, moeshard_run, node_process

from moeshard.coordinator.remote.accounts import Accounts
from moeshard.coordinator.remote.transport import PeerSpec, dial
from moeshard.moe.identity.keys import generate
from moeshard.moe.identity.receipts import (
    Totals,
    check_receipt,
    check_settlement,
    make_receipt,
    make_settlement,
    receipt_mismatch,
)
from moeshard.moe.identity.tls import client_tls
from moeshard.moe.kernels.build import ARITHMETIC
from moeshard.moe.ledger import (
    LedgerError,
    LedgerWriter,
    audit_body,
    default_path,
    receipt_body,
    settlement_body,
    summary,
    verify,
)
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc

MODEL = "ab" * 32  # a model id
RECORD = 3 << 12  # bytes of one expert record (made up)
ARITH = ARITHMETIC  # the arithmetic the receipts name


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    return {name: generate(d / f"{name}.pem") for name in ("node", "coordinator", "other")}


def forward(session: bytes, request_id: int = 1, rows: int = 4, layer: int = 1, H: int = 16):
    """A Forward request routing `rows` rows to experts 2, 5, 7 (one empty row) and the bytes
    of a reply to it."""
    rng = np.random.default_rng(request_id)
    ids = np.array([[2, 5], [7, -1], [-1, -1], [5, 2]][:rows], dtype=np.int32)  # [T, 2]
    request = pb.ForwardRequest(
        model_id=MODEL,
        layer=layer,
        request_id=request_id,
        session=session,
        hidden=codec.encode(rng.standard_normal((rows, H), dtype=np.float32)),  # [T, H]
        ids=codec.encode(ids, codec.I32),
        weights=codec.encode(rng.random((rows, 2), dtype=np.float32)),  # [T, 2]
    )
    out = codec.encode(rng.standard_normal((rows, H)), codec.F64).data  # [T, H] f64
    return request, out


def receipt_for(key, request, out) -> pb.Receipt:
    ids = codec.decode(request.ids, "ids", (codec.I32,))
    experts = np.unique(ids[ids >= 0])
    rows = int((ids >= 0).any(axis=1).sum())
    return make_receipt(key, MODEL, request, out, experts, rows, len(experts) * RECORD, ARITH)


# -- receipts and settlements -----------------------------------------------------------------


def test_a_receipt_checks_and_any_change_to_it_does_not(keys):
    node = keys["node"]
    session = os.urandom(16)
    request, out = forward(session)
    receipt = receipt_for(node, request, out)
    assert list(receipt.experts) == [2, 5, 7] and receipt.rows == 3
    assert receipt.expert_bytes == 3 * RECORD and receipt.node_id == node.id
    assert check_receipt(receipt, node.public_raw, node.id, MODEL) == ""
    assert receipt_mismatch(receipt, request, out, RECORD) == ""
    # the node's key must be the receipt's node id's, and the node and model the expected ones
    assert "not its key's" in check_receipt(receipt, keys["other"].public_raw)
    assert "expected" in check_receipt(receipt, node.public_raw, keys["other"].id)
    assert "model" in check_receipt(receipt, node.public_raw, model_id="cd" * 32)
    # every field is signed
    for name, value in [
        ("session", os.urandom(16)),
        ("request_id", 2),
        ("layer", 3),
        ("experts", [2, 5]),
        ("rows", 30),
        ("expert_bytes", 1 << 40),
        ("input_sha256", bytes(32)),
        ("output_sha256", bytes(32)),
        ("model_id", "cd" * 32),
        ("arithmetic", ARITH + 1),
    ]:
        forged = pb.Receipt()
        forged.CopyFrom(receipt)
        if name == "experts":
            del forged.experts[:]
            forged.experts.extend(value)
        else:
            setattr(forged, name, value)
        assert "signature does not verify" in check_receipt(forged, node.public_raw), name
    # a receipt that is the node's own but not for this call
    other_request, other_out = forward(session, request_id=2)
    assert "request 1" in receipt_mismatch(receipt, other_request, out)
    assert "output hash" in receipt_mismatch(receipt, request, other_out)
    altered = pb.ForwardRequest()
    altered.CopyFrom(request)
    altered.hidden.data = bytes(len(request.hidden.data))
    assert "input hash" in receipt_mismatch(receipt, altered, out)
    # the same data read another way is another request: rows, a dtype, the reply's dtype
    for change in (
        lambda r: r.hidden.shape.__setitem__(0, r.hidden.shape[0] * 2),
        lambda r: setattr(r.hidden, "dtype", codec.BF16),
        lambda r: setattr(r, "out_dtype", codec.BF16),
        lambda r: setattr(r, "model_id", "cd" * 32),
    ):
        altered = pb.ForwardRequest()
        altered.CopyFrom(request)
        change(altered)
        assert "input hash" in receipt_mismatch(receipt, altered, out)
    assert "arithmetic" in receipt_mismatch(receipt, request, out, arithmetic=ARITH + 1)
    assert "expert bytes" in receipt_mismatch(receipt, request, out, RECORD * 2)
    inflated = receipt_for(node, *forward(session, rows=2))
    request2, out2 = forward(session, rows=2)
    assert receipt_mismatch(inflated, request2, out2) == ""
    bad = make_receipt(node, MODEL, request2, out2, [2, 5, 7, 9], 2, 4 * RECORD, ARITH)
    assert "claims experts" in receipt_mismatch(bad, request2, out2)
    bad = make_receipt(node, MODEL, request2, out2, [2, 5, 7], 5, 3 * RECORD, ARITH)
    assert "claims 5 rows" in receipt_mismatch(bad, request2, out2)


def test_a_settlement_checks_and_forged_ones_do_not(keys):
    coordinator, node, other = keys["coordinator"], keys["node"], keys["other"]
    totals = Totals(calls=4, rows=9, expert_bytes=5 * RECORD, audits_passed=1)
    settlement = make_settlement(coordinator, os.urandom(16), node.id, MODEL, 1, totals)
    assert check_settlement(settlement, node.id, MODEL) == ""
    assert "not this node" in check_settlement(settlement, other.id, MODEL)
    assert "model" in check_settlement(settlement, node.id, "cd" * 32)
    inflated = pb.Settlement()
    inflated.CopyFrom(settlement)
    inflated.calls = 400
    assert "signature does not verify" in check_settlement(inflated)
    # signed by another key in the coordinator's name
    forged = make_settlement(other, settlement.session, node.id, MODEL, 2, totals)
    forged.coordinator_id = coordinator.id
    assert "not its key's" in check_settlement(forged)
    forged.coordinator_key = coordinator.public_raw
    assert "signature does not verify" in check_settlement(forged)
    short = make_settlement(coordinator, b"x", node.id, MODEL, 1, totals)
    assert "session" in check_settlement(short)


# -- the ledger file --------------------------------------------------------------------------


def small_ledger(path, keys, session=None, receipts: int = 3) -> tuple[int, Totals]:
    """A coordinator's ledger: receipts from the node, an audit, a settlement that agrees;
    (entries, the node's totals)."""
    node, coordinator = keys["node"], keys["coordinator"]
    session = session or os.urandom(16)
    writer = LedgerWriter(path, coordinator, "coordinator")
    totals = Totals()
    for i in range(receipts):
        receipt = receipt_for(node, *forward(session, request_id=i + 1))
        writer.append("receipt", receipt_body(receipt, node.public_raw))
        totals.add(receipt)
    writer.append("audit", audit_body(node.id, session, 1, True, "layer 1 re-run: equal bits"))
    totals.audit(True)
    settlement = make_settlement(coordinator, session, node.id, MODEL, 1, totals)
    writer.append("settlement", settlement_body(settlement), sync=True)
    writer.close()
    return receipts + 3, totals


def test_a_ledger_verifies_and_continues_its_chain_when_reopened(tmp_path, keys):
    path = tmp_path / "sub" / "dir" / "ledger.jsonl"
    n, _ = small_ledger(path, keys)
    report = verify(path)
    assert report.ok and report.entries == n, report.describe()
    assert report.owner == keys["coordinator"].id and report.role == "coordinator"
    assert report.kinds == {"open": 1, "receipt": 3, "audit": 1, "settlement": 1}
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    again = LedgerWriter(path, keys["coordinator"], "coordinator")
    assert again.append("audit", audit_body(keys["node"].id, bytes(16), 2, False, "")) == n
    again.close()
    assert verify(path).entries == n + 1
    with pytest.raises(LedgerError, match="belongs to another key"):
        LedgerWriter(path, keys["other"], "coordinator")
    # two writers with the same key (two daemons serving one directory) share one chain
    a = LedgerWriter(path, keys["coordinator"], "coordinator")
    b = LedgerWriter(path, keys["coordinator"], "coordinator")
    for i in range(4):
        (a if i % 2 else b).append("audit", audit_body(keys["node"].id, bytes(16), i, True, ""))
    a.close()
    b.close()
    assert verify(path).ok and verify(path).entries == n + 5


def test_a_new_ledger_is_made_on_first_append_in_the_default_place(tmp_path, keys, monkeypatch):
    monkeypatch.setenv("MOESHARD_HOME", str(tmp_path / "home"))
    path = default_path(keys["node"].id, "node")
    assert path == tmp_path / "home" / "ledger" / f"node-{keys['node'].id[:8]}.jsonl"
    writer = LedgerWriter(path, keys["node"], "node")
    writer.close()
    assert not path.exists()  # nothing recorded, no file
    writer = LedgerWriter(path, keys["node"], "node")
    writer.append("audit", audit_body(keys["node"].id, bytes(16), 1, True, ""))
    writer.close()
    report = verify(path)
    assert report.ok and report.entries == 2 and report.role == "node"


def bad_line_of(data: bytes, offset: int) -> int:
    """The 1-based line holding byte `offset`."""
    return data.count(b"\n", 0, offset) + 1


def test_flipping_any_byte_of_a_ledger_fails_verify_at_that_entry(tmp_path, keys):
    """Every byte of a ledger with one entry of each kind, each with its lowest bit flipped
    and with one more change, taking turns: another single bit (a changed digit, letter case,
    base64 character, quote, comma, newline...) or every bit inverted."""
    path = tmp_path / "ledger.jsonl"
    small_ledger(path, keys, receipts=1)
    data = path.read_bytes()
    more = (0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xFF)
    failures = []
    for offset in range(len(data)):
        for mask in (0x01, more[offset % len(more)]):
            flipped = data[:offset] + bytes([data[offset] ^ mask]) + data[offset + 1 :]
            report = verify(io.BytesIO(flipped))  # the file's bytes without a file system
            if report.ok or report.line != bad_line_of(data, offset):
                failures.append((offset, mask, report.describe()))
    assert verify(io.BytesIO(data)).ok and verify(path).ok
    assert not failures, f"{len(failures)} undetected or misplaced, e.g. {failures[:5]}"


def test_removed_swapped_or_torn_entries_fail_verify(tmp_path, keys):
    path = tmp_path / "ledger.jsonl"
    small_ledger(path, keys)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2] + lines[3:]))  # entry 2 removed
    report = verify(path)
    assert not report.ok and report.line == 3 and "seq 3, expected 2" in report.why
    path.write_bytes(b"".join(lines[:2] + [lines[3], lines[2]] + lines[4:]))  # swapped
    assert verify(path).line == 3
    path.write_bytes(b"".join(lines[1:]))  # the open entry removed
    assert verify(path).line == 1
    path.write_bytes(b"")
    assert "empty" in verify(path).why
    # a crash mid-write leaves a last line without its newline: reported, and not appended to
    whole = b"".join(lines[:-1])
    path.write_bytes(whole + lines[-1][:40])
    report = verify(path)
    assert not report.ok and report.line == len(lines) and "incomplete last entry" in report.why
    assert report.entries == len(lines) - 1
    # a writer (a node restarted after SIGKILL) sets the torn bytes aside and goes on
    writer = LedgerWriter(path, keys["coordinator"], "coordinator")
    assert path.read_bytes() == whole
    assert (tmp_path / "ledger.jsonl.torn").read_bytes() == lines[-1][:40] + b"\n"
    writer.append("audit", audit_body(keys["node"].id, bytes(16), 1, True, ""))
    writer.close()
    assert verify(path).ok and verify(path).entries == len(lines)
    # an altered tail is refused at open too
    flip_byte(path, path.stat().st_size - 20)
    with pytest.raises(LedgerError, match="verifies at its head and tail"):
        LedgerWriter(path, keys["coordinator"], "coordinator")


def test_summary_counts_work_and_flags_a_settlement_that_disagrees(tmp_path, keys):
    path = tmp_path / "ledger.jsonl"
    session = os.urandom(16)
    _, totals = small_ledger(path, keys, session)
    node = keys["node"].id
    work = summary(path).nodes[node]
    assert (work.calls, work.rows, work.expert_bytes) == (3, 9, 9 * RECORD)
    assert (work.audits_passed, work.audits_failed, work.agrees) == (1, 0, True)
    # a later settlement of the same session that under-states the calls
    writer = LedgerWriter(path, keys["coordinator"], "coordinator")
    short = Totals(**{**vars(totals), "calls": 2})
    writer.append(
        "settlement",
        settlement_body(make_settlement(keys["coordinator"], session, node, MODEL, 2, short)),
    )
    writer.close()
    work = summary(path).nodes[node]
    assert work.agrees is False and "calls settled 2, ledger 3" in work.disagreements[0]


def test_accounts_check_receipts_off_the_hot_path_and_settle(tmp_path, keys):
    node, other = keys["node"], keys["other"]
    path = tmp_path / "moeshard.coordinator.jsonl"
    accounts = Accounts(keys["coordinator"], MODEL, path, record_nbytes=RECORD)
    accounts.learn(node.id, node.public_raw)
    for i in range(1, 4):
        request, out = forward(accounts.session, request_id=i)
        reply = pb.ForwardReply(out=pb.Tensor(data=out), request_id=i)
        reply.receipt.CopyFrom(receipt_for(node, request, out))
        accounts.record(node.id, request, reply)
    request, out = forward(accounts.session, request_id=9)
    accounts.record(other.id, request, pb.ForwardReply(out=pb.Tensor(data=out)), other.public_raw)
    lying = pb.ForwardReply(out=pb.Tensor(data=out))
    lying.receipt.CopyFrom(receipt_for(other, request, bytes(len(out))))  # not what it sent
    accounts.record(other.id, request, lying, other.public_raw)
    accounts.audit(node.id, False, "layer 1: differs from its replica")
    results = accounts.settle({node.id: None})
    assert results == {node.id: "node not reachable"}
    stats = accounts.stats()
    assert (stats["receipts"], stats["missing"], stats["bad"]) == (3, 1, 1)
    assert accounts.invalid == {other.id}
    accounts.close()
    assert verify(path).ok, verify(path).describe()
    work = summary(path).nodes[node.id]
    assert (work.calls, work.audits_failed, work.agrees) == (3, 1, True)


# -- the command line -------------------------------------------------------------------------


def test_ledger_verify_exit_codes(tmp_path, keys):
    path = tmp_path / "ledger.jsonl"
    n, _ = small_ledger(path, keys)
    ok = moeshard_run("ledger", "verify", path, home=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"{path}: OK, {n} entries") and len(ok.stdout.splitlines()) == 1
    data = path.read_bytes()
    flip_byte(path, len(data) // 2)
    bad = moeshard_run("ledger", "verify", path, home=tmp_path)
    line = bad_line_of(data, len(data) // 2)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == f"{path}: entry {line - 1} (line {line}): {verify(path).why}\n"


def test_ledger_summary_command_and_errors(tmp_path, keys, capsys, monkeypatch):
    from moeshard.cli import main

    monkeypatch.setenv("MOESHARD_HOME", str(tmp_path))
    path = tmp_path / "ledger.jsonl"
    small_ledger(path, keys)
    capsys.readouterr()
    assert main(["ledger", "summary", str(path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(keys["node"].id[:12]))
    assert row.split()[1:7] == ["3", "3", "0", "9", "108.00", "KiB"]
    assert row.split()[-3:] == ["1/0", "1", "yes"]
    assert main(["ledger", "summary", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verified"] and doc["owner"] == keys["coordinator"].id
    assert doc["nodes"][0]["calls"] == 3 and doc["nodes"][0]["settlement_agrees"] is True
    flip_byte(path, path.stat().st_size // 2)
    assert main(["ledger", "summary", str(path)]) == 2
    assert "(line " in capsys.readouterr().err
    assert main(["ledger", "verify", str(tmp_path / "none.jsonl")]) == 2
    assert "cannot read the ledger" in capsys.readouterr().err
    path.write_bytes(b"")
    assert main(["ledger", "verify", str(path)]) == 2
    assert "entry 0 (line 1): empty" in capsys.readouterr().err


# -- a real node on loopback ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ledger_node(converted, tmp_path_factory):
    """A node over mutual TLS with its ledger in a temporary file."""
    d = tmp_path_factory.mktemp("ledger-node")
    model = ModelDir(converted("qwen3_moe"))
    node = node_process(model.path, "--ledger", d / "node.jsonl", "--key", d / "node.pem")
    channel, _ = dial(PeerSpec(node.addr, node.node_id), client_tls(client_key()), 5)
    yield node, pb_grpc.ExpertNodeStub(channel), model, d / "node.jsonl"
    channel.close()
    node.stop()


def test_a_node_signs_receipts_and_keeps_settlements_in_its_ledger(ledger_node, tmp_path):
    node, stub, model, node_ledger = ledger_node
    info = stub.Info(pb.InfoRequest(nonce=os.urandom(16)), timeout=5)
    accounts = Accounts(client_key(), model.model_id, tmp_path / "moeshard.coordinator.jsonl")
    layer, H = model.config.moe_layers[0], model.config.hidden_size
    rng = np.random.default_rng(0)
    requests = [
        pb.ForwardRequest(
            model_id=model.model_id,
            layer=layer,
            request_id=i,
            session=accounts.session,
            hidden=codec.encode(rng.standard_normal((2, H), dtype=np.float32)),
            ids=codec.encode(np.array([[0, 3], [3, -1]]), codec.I32),
            weights=codec.encode(rng.random((2, 2), dtype=np.float32)),
        )
        for i in (1, 2)
    ]
    replies = [
        stub.Forward(requests[0], timeout=10),
        next(stub.ForwardStream(iter(requests[1:]), timeout=10)),
    ]
    for request, reply in zip(requests, replies, strict=True):
        receipt = reply.receipt
        assert check_receipt(receipt, info.public_key, node.node_id, model.model_id) == ""
        assert receipt_mismatch(receipt, request, reply.out.data) == ""
        assert list(receipt.experts) == [0, 3] and receipt.rows == 2
        assert receipt.expert_bytes == 2 * model.shard_set.record_nbytes
        accounts.record(node.node_id, request, reply, info.public_key)
    # no session, no receipt
    plain = pb.ForwardRequest()
    plain.CopyFrom(requests[0])
    plain.session = b""
    assert not stub.Forward(plain, timeout=10).HasField("receipt")
    # forged settlements are refused, the session left open: the caller's key in another's
    # name, one altered after signing
    accounts.ledger.flush()  # (the receipts are counted on the ledger's thread)
    totals = accounts.totals[node.node_id]
    other = generate(tmp_path / "other.pem")
    forged = make_settlement(other, accounts.session, node.node_id, model.model_id, 5, totals)
    assert "sent by" in stub.Settle(forged, timeout=5).reason
    forged.coordinator_id = client_key().id
    assert "not its key's" in stub.Settle(forged, timeout=5).reason
    altered = make_settlement(
        client_key(), accounts.session, node.node_id, model.model_id, 6, totals
    )
    altered.calls += 100
    assert "signature" in stub.Settle(altered, timeout=5).reason
    assert accounts.settle({node.node_id: stub}) == {node.node_id: ""}
    # then any other settlement of the session is refused
    again = make_settlement(client_key(), accounts.session, node.node_id, model.model_id, 1, totals)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Settle(again, timeout=5)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "by another settlement" in caught.value.details()
    accounts.close()
    # both ledgers verify and agree; the node's holds the receipts and the one settlement
    for path in (node_ledger, accounts.path):
        report = verify(path)
        assert report.ok, report.describe()
        work = summary(path).nodes[node.node_id]
        assert (work.calls, work.rows, work.settlements, work.agrees) == (2, 4, 1, True)
    assert verify(node_ledger).kinds == {"open": 1, "receipt": 2, "settlement": 1}
    assert verify(node_ledger).owner == node.node_id
    # and flipping one byte of it fails
    data = node_ledger.read_bytes()
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(data)
    flip_byte(copy, len(data) // 2)
    assert moeshard_run("ledger", "verify", copy, home=tmp_path).returncode == 2


def test_a_node_refuses_to_start_on_a_ledger_it_cannot_continue(converted, tmp_path, keys):
    from moeshard.node.daemon import Node, NodeConfig

    path = tmp_path / "theirs.jsonl"
    small_ledger(path, keys, receipts=1)  # the coordinator's, not this node's
    config = NodeConfig(
        path=str(converted("qwen3_moe")),
        advertise=False,
        insecure=True,
        key=str(tmp_path / "node.pem"),
        ledger=str(path),
    )
    with pytest.raises(LedgerError, match="belongs to another key"):
        Node(config)


def test_a_bad_session_is_refused(ledger_node):
    node, stub, model, _ = ledger_node
    request = pb.ForwardRequest(
        model_id=model.model_id,
        layer=model.config.moe_layers[0],
        session=b"short",
        hidden=codec.encode(np.ones((1, model.config.hidden_size), dtype=np.float32)),
        ids=codec.encode(np.array([[0]]), codec.I32),
        weights=codec.encode(np.ones((1, 1), dtype=np.float32)),
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.Forward(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "session of 5 bytes" in caught.value.details()
