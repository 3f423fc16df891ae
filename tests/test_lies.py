"""Nodes that lie (issue 15), made to with failpoints (node/failpoints.py): NaN and duplicate
replies are caught by every reply's validation; zeros, scaled or noisy values and the wrong
expert by spot checks (coordinator/remote/audit.py). Either way the liar is disqualified and
the tokens are those of an honest run."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import PROMPT, TOKENS, NodeProcess, remote_runtime

from coordinator.generate import SamplingOptions, generate
from node import failpoints


def _run_with_liar(model, cluster, lie: str, **config):
    """Generate with the cluster plus a node that lies (MOESHARD_FAILPOINTS); returns
    (result, remote stats, the liar's Peer, the honest Peers)."""
    liar = NodeProcess(model, advertise=False, env={failpoints.ENV: f"lie={lie}"})
    liar.wait_ready()
    try:
        specs = [n.spec for n in cluster] + [liar.spec]
        transformer, remote = remote_runtime(model, specs, backoff_s=60.0, **config)
        try:
            opts = SamplingOptions(max_tokens=TOKENS, keep_logits=True)
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
    "lie", ["zero", "scale:1.01", "noise:0.001", "wrong_expert", "scale:1.01:0.3"]
)
@pytest.mark.parametrize("referee", [True, False], ids=["referee", "third-holder"])
def test_audits_catch_a_plausible_liar_and_the_tokens_are_an_honest_runs(
    cluster_model, cluster, cluster_reference, lie, referee
):
    """Replies that pass validation but are wrong are caught by spot checks: the liar is
    disqualified, the steps that used its unaudited work are recomputed, and the tokens and
    logits are one machine's bit for bit. Settled by the coordinator's own experts, or (no
    copy here) by a third holder."""
    result, stats, bad, honest = _run_with_liar(
        cluster_model, cluster, lie, referee=referee, audit=0.5, audit_new=4
    )
    audit = stats["audit"]
    assert bad.disqualified, f"the liar was not caught: {audit}"
    assert audit["convicted"] == [bad.node_id], audit
    assert all(p.up and not p.disqualified for p in honest), "an honest node was banned"
    assert _same_as_one_machine(result, cluster_reference)
    print(lie, "referee" if referee else "third holder", "rollbacks", result.rollbacks, audit)


def test_honest_nodes_pass_every_audit(cluster_model, cluster, cluster_reference):
    """Audit rate 1 on an honest cluster: every re-run gives the same bits, nobody is
    suspected, nothing is rolled back."""
    transformer, remote = remote_runtime(cluster_model, [n.spec for n in cluster], audit=1.0)
    try:
        opts = SamplingOptions(max_tokens=TOKENS, keep_logits=True)
        result = generate(transformer, PROMPT, opts, verifier=remote.verifier)
        audit = remote.stats()["audit"]
    finally:
        remote.close()
    assert _same_as_one_machine(result, cluster_reference)
    assert result.rollbacks == 0 and not audit["convicted"] and audit["mismatches"] == 0
    assert audit["audits"] > 0 and audit["passed"] + audit["unauditable"] == audit["audits"]


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
    testbed finds its caught liars by that line."""
    import logging
    import threading
    import types

    from coordinator.remote.peers import Peer, PeerSet
    from coordinator.remote.transport import PeerSpec

    peers = types.SimpleNamespace(lock=threading.Lock(), disqualified={})  # PeerSet's state
    peer = Peer(PeerSpec("127.0.0.1:1"), node_id="ab" * 32, name="tb-liar")
    assert not peer.up
    with caplog.at_level(logging.WARNING, logger="coordinator.remote.peers"):
        PeerSet.disqualify(peers, peer, "1 reply(ies) to no request (a duplicate?)")
        PeerSet.disqualify(peers, peer, "caught again")
    named = [r.getMessage() for r in caplog.records if "disqualified" in r.getMessage()]
    assert len(named) == 1 and peer.label in named[0] and "down" in named[0], named
    assert peer.disqualified and peer.node_id in peers.disqualified


def test_the_audit_line_adds_up_to_the_calls_picked(capsys):
    """`generate`'s audit summary names the picked calls that were neither passed nor
    mismatched (an auditor that did not answer, no other holder), so its figures add up."""
    from coordinator.commands.generate import _report_remote

    audit = {"audits": 228, "passed": 226, "mismatches": 0, "unresolved": 0, "convicted": []}
    summary = {"nodes": [], "retries": 0, "bytes_sent": 0, "bytes_received": 0,
               "accounts": None, "dropped_per_layer": {}}  # fmt: skip
    _report_remote(summary | {"audit": audit | {"inconclusive": 1, "unauditable": 1}}, 10)
    err = capsys.readouterr().err
    assert "[audits: 228 calls re-run, 226 passed, 0 mismatched, 0 unresolved, 1 inconc" in err
    assert ", 1 unauditable (no other holder)]" in err
    _report_remote(summary | {"audit": audit | {"passed": 228, "inconclusive": 0}}, 10)
    assert "228 passed, 0 mismatched, 0 unresolved]" in capsys.readouterr().err
