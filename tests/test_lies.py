"""Nodes that lie (issue 15), made to with failpoints (node/failpoints.py): NaN and duplicate
replies are caught by every reply's validation; zeros, scaled or noisy values and the wrong
expert by spot checks (coordinator/remote/audit.py). Either way the liar is disqualified and
the tokens are those of an honest run."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import PROMPT, TOKENS, NodeProcess, remote_runtime

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local
from moeshard.node import failpoints

LONG = 40  # tokens: enough calls for a part-time liar's first lie (its 4th call) to come


@pytest.fixture(scope="module")
def long_reference(cluster_model):
    """PROMPT continued for LONG tokens on one machine, logits kept."""
    rt = open_local(cluster_model)
    return generate(rt.transformer, PROMPT, SamplingOptions(max_tokens=LONG, keep_logits=True))


def _run_with_liar(model, cluster, lie: str, tokens: int = TOKENS, **config):
    """Generate with the cluster plus a node that lies (MOESHARD_FAILPOINTS); returns
    (result, remote stats, the liar's Peer, the honest Peers)."""
    liar = NodeProcess(model, advertise=False, env={failpoints.ENV: f"lie={lie}"})
    liar.wait_ready()
    try:
        specs = [n.spec for n in cluster] + [liar.spec]
        transformer, remote = remote_runtime(model, specs, backoff_s=60.0, **config)
        try:
            opts = SamplingOptions(max_tokens=tokens, keep_logits=True)
            result = generate(transformer, PROMPT, opts, verifier=remote.verifier)
        finally:
            remote.close()  # reads every stream to its end: a late duplicate is seen here
        bad = next(p for p in remote.peers.peers if p.node_id == liar.node_id)
        honest = [p for p in remote.peers.peers if p.node_id != liar.node_id]
        return result, remote.stats(), bad, honest
    finally:
        liar.stop()


def _same_as_one_machine(result, reference) -> bool:
    return result.tokens == reference.tokens and all(
        np.array_equal(a, b) for a, b in zip(result.logits, reference.logits, strict=True)
    )


@pytest.mark.parametrize("lie", ["nan", "duplicate"])
def test_a_reply_no_honest_node_sends_disqualifies_its_sender(
    cluster_model, cluster, cluster_reference, lie
):
    """Caught by every reply's validation: the sender (not the node that gets its work next)
    is disqualified and the layer retried on a replica; the tokens are one machine's."""
    result, _, bad, honest = _run_with_liar(cluster_model, cluster, lie, audit=0.0)
    assert _same_as_one_machine(result, cluster_reference)
    assert bad.disqualified and not bad.up, "the liar was not banned"
    assert all(p.up and not p.disqualified for p in honest), "an honest node was banned"


def test_a_duplicate_after_a_nodes_last_call_is_caught_at_close(cluster_model):
    """A node that sends its last reply twice and gets no more work: the extra reply is
    only seen when its stream is read to the end, which closing does."""
    liar = NodeProcess(cluster_model, advertise=False, env={failpoints.ENV: "lie=duplicate"})
    liar.wait_ready()
    try:
        _, remote = remote_runtime(cluster_model, [liar.spec])
        try:
            rng = np.random.default_rng(0)
            hidden = rng.standard_normal((2, remote.hidden_size), dtype=np.float32)  # [2, H]
            out = remote(0, hidden, np.array([[0, 1], [1, 2]]), np.full((2, 2), 0.5))  # [2, H]
            assert np.isfinite(out).all()
            peer = remote.peers.peers[0]
            assert not peer.disqualified, "convicted before the duplicate could be seen"
        finally:
            remote.close()
        assert peer.disqualified and "duplicate" in peer.disqualified, peer.disqualified
        assert remote.stats()["audit"]["convicted"] == [liar.node_id]
    finally:
        liar.stop()


@pytest.mark.parametrize(
    "lie",
    [
        "zero",
        "scale:1.01",
        "noise:0.001",
        "wrong_expert",
        "scale:1.01:0.3",
        "ulp",
        "scale:1.000005",
    ],
)
def test_audits_catch_a_plausible_liar_and_the_tokens_are_an_honest_runs(
    cluster_model, cluster, long_reference, lie
):
    """Replies that pass validation but are wrong, down to one unit in the last place of one
    value, are caught by the coordinator's own recomputation (bit for bit): the liar is
    disqualified, the steps that used its unverified work are recomputed, and the tokens and
    logits are one machine's bit for bit; no honest node is touched."""
    result, stats, bad, honest = _run_with_liar(
        cluster_model, cluster, lie, LONG, audit=0.5, audit_new=4
    )
    audit = stats["audit"]
    assert bad.disqualified, f"the liar was not caught in {bad.calls} calls: {audit}"
    assert audit["convicted"] == [bad.node_id], audit
    assert all(p.up and not p.disqualified for p in honest), "an honest node was banned"
    assert _same_as_one_machine(result, long_reference)
    print(lie, "liar calls", bad.calls, "rollbacks", result.rollbacks, audit)


def test_honest_nodes_pass_every_audit(cluster_model, cluster, cluster_reference):
    """Audit rate 1 on an honest cluster: every recomputation gives the same bits, nobody is
    convicted, nothing is rolled back."""
    transformer, remote = remote_runtime(cluster_model, [n.spec for n in cluster], audit=1.0)
    try:
        opts = SamplingOptions(max_tokens=TOKENS, keep_logits=True)
        result = generate(transformer, PROMPT, opts, verifier=remote.verifier)
        audit = remote.stats()["audit"]
    finally:
        remote.close()
    assert _same_as_one_machine(result, cluster_reference)
    assert result.rollbacks == 0 and not audit["convicted"] and audit["failed"] == 0
    assert audit["picked"] > 0 and audit["passed"] == audit["picked"], audit
    assert audit["records"]["local"] > 0 and audit["records"]["fetched"] == 0, audit


def test_failpoint_specs_parse_and_bad_ones_are_refused():
    assert failpoints.parse("lie=scale:1.01:0.2") == failpoints.Lie("scale", 1.01, 0.2)
    assert failpoints.parse("lie=nan") == failpoints.Lie("nan", 0.0, 1.0)
    assert failpoints.parse("lie=zero:0.5") == failpoints.Lie("zero", 0.0, 0.5)
    assert failpoints.parse("") is None
    for bad in ("lie=lots", "fib=nan", "lie=scale"):
        with pytest.raises(ValueError):
            failpoints.parse(bad)


def test_a_liar_caught_while_banned_is_still_named(caplog):
    """A node convicted while it is banned (down: say its stream is read at close after a
    failed call) is named as disqualified in the log, once, as one caught while up is: the
    testbed finds its caught liars by that line. Its key pinned at another address goes with
    it."""
    import logging
    import threading
    import types

    from moeshard.coordinator.remote.peers import Peer, PeerSet
    from moeshard.coordinator.remote.transport import PeerSpec

    peer = Peer(PeerSpec("127.0.0.1:1"), node_id="ab" * 32, name="tb-liar")
    twin = Peer(PeerSpec("127.0.0.1:2"), node_id="ab" * 32, name="tb-liar", up=True)
    other = Peer(PeerSpec("127.0.0.1:3"), node_id="cd" * 32, name="honest", up=True)
    peers = types.SimpleNamespace(  # PeerSet's state
        lock=threading.Lock(), disqualified={}, peers=[peer, twin, other]
    )
    assert not peer.up
    with caplog.at_level(logging.WARNING, logger="moeshard.coordinator.remote.peers"):
        PeerSet.disqualify(peers, peer, "1 reply(ies) to no request (a duplicate?)")
        PeerSet.disqualify(peers, peer, "caught again")
    named = [r.getMessage() for r in caplog.records if "disqualified" in r.getMessage()]
    assert len(named) == 1 and peer.label in named[0] and "down" in named[0], named
    assert peer.disqualified and peer.node_id in peers.disqualified
    # the same key at another address is the same liar; another key is not touched
    assert twin.disqualified and not twin.up and other.up and not other.disqualified


def test_the_audit_line_says_what_was_recomputed_and_where_the_records_came_from():
    from moeshard.commands.generate import format_audits

    audit = {
        "picked": 228, "passed": 227, "failed": 1, "withheld": 0, "pending": 0,
        "convicted": ["abc"], "proofs": ["/tmp/x.fraud"], "cpu_s": 0.25,
        "records": {"local": 0, "fetched": 12, "fetched_bytes": 3_500_000, "hits": 300},
    }  # fmt: skip
    line = format_audits(audit)
    assert line.startswith("[audits: 228 calls recomputed here, 227 equal, 1 differed;")
    assert "records: 0 local, 12 fetched (3.5 MB), 300 cached; 250 ms CPU" in line
    assert "caught lying: abc; fraud proofs: /tmp/x.fraud]" in line


def _altered(proof, where: str):
    """A copy of `proof` with one byte of `where` changed (its first byte's bits inverted)."""
    from moeshard.moe.wire import moeshard_pb2 as pb

    copy = pb.FraudProof()
    copy.CopyFrom(proof)
    holder, name = {
        "reply": (copy.reply, "data"),
        "request": (copy.request.hidden, "data"),
        "record": (copy.records[0], "data"),
        "signature": (copy.receipt, "signature"),
    }[where]
    data = bytearray(getattr(holder, name))
    data[len(data) // 2] ^= 0xFF
    setattr(holder, name, bytes(data))
    return copy


def test_a_conviction_leaves_a_fraud_proof_anyone_can_check(cluster_model, cluster, tmp_path):
    """The liar's fraud proof passes `ledger check-fraud` against the model directory alone;
    one byte changed in the reply, the request, a record or the receipt's signature, and it
    fails, with one line saying what does not hold."""
    import subprocess
    import sys

    from moeshard.moe.ledger import fraud

    evidence = tmp_path / "evidence"
    result, stats, bad, _ = _run_with_liar(
        cluster_model, cluster, "scale:1.01", audit=1.0, evidence=str(evidence)
    )
    proofs = stats["audit"]["proofs"]
    assert bad.disqualified and len(proofs) == 1, stats["audit"]
    cli = [sys.executable, "-m", "moeshard", "ledger", "check-fraud"]
    run = subprocess.run([*cli, proofs[0], str(cluster_model)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"proven: node {bad.node_id} signed a reply to layer "), run.stdout
    proof = fraud.read_proof(proofs[0])
    assert proof.receipt.node_id == bad.node_id and len(proof.records) >= 1
    for where, says in [
        ("reply", "output hash"),
        ("request", "input hash"),
        ("record", "Merkle root"),
        ("signature", "signature does not verify"),
    ]:
        path = tmp_path / f"{where}.fraud"
        path.write_bytes(_altered(proof, where).SerializeToString())
        run = subprocess.run([*cli, str(path), str(cluster_model)], capture_output=True, text=True)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1 and says in lines[0], (where, run.stderr)
