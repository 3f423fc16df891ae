"""Strangers who know the protocol (issue 33): colluding holders, a liar that alone holds what
it lies about, nodes that will not hand over records, a node that claims another CPU, and a
served request through a liar. The coordinator recomputes audited calls itself, from records
checked against merkle.bin, and compares bits: nobody votes, so no coalition of nodes can
convict an honest one or clear a liar, and the text is an honest run's.

Each test runs real node processes (failpoints make the liars: node/failpoints.py) against a
coordinator whose directory holds no expert records unless the test says otherwise."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from helpers import PROMPT, TOKENS, NodeProcess, client_key, remote_runtime

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.remote.config import UncoveredError
from moeshard.coordinator.runtime import open_local
from moeshard.coordinator.serve.engine import Engine
from moeshard.moe.convert.placement import _write_node_dir
from moeshard.moe.model.model_dir import ModelDir
from moeshard.node import failpoints

LONG = 24  # tokens


@pytest.fixture(scope="module")
def coordinator_dir(cluster_plan):
    """The cluster's coordinator directory: trunk, config and roots, no records."""
    return cluster_plan["coordinator"]["dir"]


@pytest.fixture(scope="module")
def honest_run(cluster_model):
    """PROMPT continued for LONG tokens on one machine, logits kept."""
    rt = open_local(cluster_model)
    return generate(rt.transformer, PROMPT, SamplingOptions(max_tokens=LONG, keep_logits=True))


def _node(path, lie: str | None = None) -> NodeProcess:
    """A node on `path` with a key of its own (nodes on one directory would share its key:
    one identity), lying as `lie` says."""
    env = {failpoints.ENV: f"lie={lie}"} if lie else None
    key = ("--key", str(Path(tempfile.mkdtemp(prefix="moeshard-node-key-")) / "key.pem"))
    return NodeProcess(path, advertise=False, env=env, flags=key).wait_ready()


def _generate(model, specs, tokens: int = LONG, **config):
    """(result, audit stats, peers by node id) of a generation through `specs`."""
    transformer, remote = remote_runtime(model, specs, backoff_s=60.0, **config)
    try:
        opts = SamplingOptions(max_tokens=tokens, keep_logits=True)
        result = generate(transformer, PROMPT, opts, verifier=remote.verifier, keep_partial=True)
        remote.verifier.drain()
        audit = remote.stats()["audit"]
    finally:
        remote.close()
    return result, audit, {p.node_id: p for p in remote.peers.peers}


def _honest(result, reference) -> bool:
    """The same tokens and logits, bit for bit, as the run on one machine."""
    return result.tokens == reference.tokens and all(
        np.array_equal(a, b) for a, b in zip(result.logits, reference.logits, strict=True)
    )


def test_two_colluding_holders_cannot_outvote_the_coordinator(
    cluster_model, coordinator_dir, cluster, honest_run
):
    """Two full copies return the same wrong reply (x1.5). Today's majority would side with
    them; the coordinator's own recomputation convicts exactly the two, never an honest node,
    and the text is the honest run's. The coordinator holds no records: it fetches them."""
    liars = [_node(cluster_model, "scale:1.5"), _node(cluster_model, "scale:1.5")]
    try:
        specs = [n.spec for n in cluster] + [n.spec for n in liars]
        result, audit, peers = _generate(cluster_model, specs, trust_dir=coordinator_dir)
    finally:
        for n in liars:
            n.stop()
    liar_ids = {n.node_id for n in liars}
    assert len(liar_ids) == 2, "the liars share a key: one identity"
    used = {i for i in liar_ids if peers[i].calls}
    assert used, "neither liar got work: the test proves nothing"
    assert set(audit["convicted"]) == used, audit  # every liar that answered, and only they
    assert not any(peers[n.node_id].disqualified for n in cluster), "an honest node convicted"
    assert audit["records"]["local"] == 0 and audit["records"]["fetched"] > 0, audit
    assert _honest(result, honest_run), (result.tokens, honest_run.tokens)


@pytest.fixture(scope="module")
def sole_holder_dirs(cluster_model, tmp_path_factory):
    """Layer 0's experts 0 and 1 on one node only (the liar's), everything else on two honest
    nodes: (honest directories, the liar's directory)."""
    model = ModelDir(cluster_model)
    alone = {(0, 0), (0, 1)}
    rest = sorted(set(model.locations) - alone)
    out = tmp_path_factory.mktemp("sole")
    honest = []
    for i in range(2):
        _write_node_dir(model, rest, out / f"honest-{i}")
        honest.append(out / f"honest-{i}")
    _write_node_dir(model, sorted(alone), out / "liar")
    return honest, out / "liar"


def test_a_liar_that_alone_holds_an_expert_is_caught(
    cluster_model, coordinator_dir, sole_holder_dirs, honest_run
):
    """It lies on every call, all of which name an expert nobody else holds. Its records are
    fetched from it (after its reply is in), its lie is recomputed and it is convicted; with
    nobody else holding those experts, the generation stops (exit 3) rather than print a
    word of the lie: the tokens kept are a prefix of the honest run's."""
    honest_dirs, liar_dir = sole_holder_dirs
    nodes = [_node(d) for d in honest_dirs] + [_node(liar_dir, "scale:1.5")]
    try:
        result, audit, peers = _generate(
            cluster_model, [n.spec for n in nodes], trust_dir=coordinator_dir
        )
    finally:
        for n in nodes:
            n.stop()
    liar = nodes[-1].node_id
    assert audit["convicted"] == [liar], audit
    assert audit["records"]["fetched"] > 0, audit
    assert isinstance(result.error, UncoveredError), result.error
    assert result.tokens == honest_run.tokens[: len(result.tokens)]
    assert not any(peers[n.node_id].disqualified for n in nodes[:-1])


def test_a_sole_holder_liar_is_caught_and_the_coordinator_computes_its_experts(
    cluster_model, sole_holder_dirs, honest_run
):
    """The same liar against a coordinator on the full model directory with --own-experts:
    caught, and the experts nobody else holds are computed here, so the text is the honest
    run's bit for bit."""
    honest_dirs, liar_dir = sole_holder_dirs
    nodes = [_node(d) for d in honest_dirs] + [_node(liar_dir, "scale:1.5")]
    try:
        result, audit, _ = _generate(cluster_model, [n.spec for n in nodes], own_experts=True)
    finally:
        for n in nodes:
            n.stop()
    assert audit["convicted"] == [nodes[-1].node_id], audit
    assert result.error is None and _honest(result, honest_run)


def test_a_holder_that_forges_records_cannot_shield_a_liar(
    cluster_model, coordinator_dir, cluster, honest_run
):
    """A liar's colluder hands over forged records when the coordinator fetches from it: the
    bytes fail the Merkle root, the colluder is disqualified, the record comes from another
    holder, and the liar is convicted all the same. Refusing or forging records changes
    nothing about the verdict."""
    liar = _node(cluster_model, "scale:1.5")
    forger = _node(cluster_model, "forged_record")
    try:  # two honest shard nodes (every expert is on two of the three): the liar and the
        # forger, full copies, get a good share of the work
        specs = [cluster[0].spec, cluster[1].spec, liar.spec, forger.spec]
        result, audit, peers = _generate(cluster_model, specs, trust_dir=coordinator_dir)
    finally:
        liar.stop()
        forger.stop()
    assert peers[liar.node_id].calls, "the liar got no work: the test proves nothing"
    assert liar.node_id in audit["convicted"], audit
    assert not any(peers[n.node_id].disqualified for n in cluster[:2]), "an honest one convicted"
    assert _honest(result, honest_run)
    if peers[forger.node_id].disqualified:  # it was asked for a record, and forged it
        assert "not as the model has it" in peers[forger.node_id].disqualified


def test_a_sole_holder_that_will_not_hand_over_its_records_is_convicted(
    cluster_model, coordinator_dir, sole_holder_dirs
):
    """Its replies are honest, but when an audit asks for a record only it holds, it forges
    it: a node that will not hand over a record it claims is treated as failing the audit."""
    honest_dirs, liar_dir = sole_holder_dirs
    nodes = [_node(d) for d in honest_dirs] + [_node(liar_dir, "forged_record")]
    try:
        _, audit, _ = _generate(
            cluster_model, [n.spec for n in nodes], TOKENS, trust_dir=coordinator_dir
        )
    finally:
        for n in nodes:
            n.stop()
    assert audit["convicted"] == [nodes[-1].node_id] and audit["withheld"] >= 1, audit


def test_a_node_claiming_another_cpu_gets_no_tolerance(
    cluster_model, coordinator_dir, cluster, honest_run, monkeypatch
):
    """A node that says it runs other kernels on another CPU level used to be compared within
    a tolerance it had chosen, so a x(1 + 5e-6) lie passed every audit. Bits are compared
    whatever a node claims: it is caught."""
    from moeshard.node import servicer
    from moeshard.node.daemon import Node, NodeConfig

    monkeypatch.setenv(failpoints.ENV, "lie=scale:1.000005")
    monkeypatch.setattr(servicer, "cpu_level", lambda: "baseline")
    monkeypatch.setattr(servicer, "kernel_build", lambda: "0123456789abcdef")
    liar = Node(
        NodeConfig(path=str(cluster_model), name="claims", allow=frozenset({client_key().id}))
    )
    port = liar.start()
    try:
        from moeshard.coordinator.remote.transport import PeerSpec

        specs = [n.spec for n in cluster] + [PeerSpec(f"127.0.0.1:{port}", liar.identity.node_id)]
        result, audit, peers = _generate(cluster_model, specs, trust_dir=coordinator_dir)
    finally:
        liar.stop()
    assert peers[liar.identity.node_id].kernels == "0123456789abcdef/baseline"
    assert audit["convicted"] == [liar.identity.node_id], audit
    assert _honest(result, honest_run)


def test_a_served_request_through_a_liar_sends_only_honest_text(
    cluster_model, coordinator_dir, cluster, honest_run
):
    """The serving engine sends a token only once the audits of the calls it rests on are
    done: the client's tokens are the honest run's, and nothing sent is ever taken back
    (the events are the tokens, in order, then the end)."""
    liar = _node(cluster_model, "scale:1.5")
    try:
        specs = [n.spec for n in cluster] + [liar.spec]
        transformer, remote = remote_runtime(
            cluster_model, specs, backoff_s=60.0, trust_dir=coordinator_dir
        )
        engine = Engine(transformer, max_batch=4, verifier=remote.verifier)
        try:
            request = engine.submit(PROMPT, SamplingOptions(max_tokens=LONG))
            events = list(request.stream(timeout=120))
            stats = engine.stats
        finally:
            engine.close()
            remote.close()
    finally:
        liar.stop()
    audit = remote.stats()["audit"]
    assert audit["convicted"] == [liar.node_id], audit
    assert [e.kind for e in events] == ["token"] * LONG + ["end"]
    assert [e.token for e in events[:-1]] == honest_run.tokens
    assert stats.rollbacks >= 1, "the liar's work was never undone: did it get any?"


def test_serving_with_audits_keeps_bounded_records(cluster_model, coordinator_dir, cluster):
    """Request after request, the auditor keeps records of the calls that can still be
    undone only: they stay bounded, not one per call served."""
    transformer, remote = remote_runtime(
        cluster_model, [n.spec for n in cluster], trust_dir=coordinator_dir, audit=0.2
    )
    engine = Engine(transformer, max_batch=4, verifier=remote.verifier)
    auditor = remote.verifier
    sizes = []
    try:
        for round_ in range(6):
            requests = [
                engine.submit([1 + round_, 5, 9 + i], SamplingOptions(max_tokens=12))
                for i in range(4)
            ]
            for r in requests:
                list(r.stream(timeout=120))
            sizes.append((len(auditor.uses), len(auditor.verified)))
    finally:
        engine.close()
        remote.close()
    calls = remote.stats()["layer_calls"]
    assert max(u for u, _ in sizes) < calls / 4, (sizes, calls)
    assert sizes[-1][0] <= sizes[1][0] + 8, sizes  # no growth with the requests served
