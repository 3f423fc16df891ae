"""Nodes that lie in ways every reply's validation catches (issue 15's first step): a node
that returns NaN, or two replies for one request, is banned (itself, not the node that gets
its work next) and the layer is retried on a replica, so the tokens are one machine's."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import PROMPT, TOKENS, NodeProcess, remote_runtime

from coordinator.generate import SamplingOptions, generate
from node import failpoints


@pytest.mark.parametrize("lie", ["nan", "duplicate"])
def test_a_lying_node_is_banned_and_the_tokens_are_one_machines(
    cluster_model, cluster, cluster_reference, lie
):
    liar = NodeProcess(cluster_model, advertise=False, env={failpoints.ENV: f"lie={lie}"})
    liar.wait_ready()
    try:
        specs = [n.spec for n in cluster] + [liar.spec]
        transformer, remote = remote_runtime(cluster_model, specs, backoff_s=60.0)
        try:
            opts = SamplingOptions(max_tokens=TOKENS, keep_logits=True)
            result = generate(transformer, PROMPT, opts)
            assert result.tokens == cluster_reference.tokens
            assert all(
                np.array_equal(a, b)
                for a, b in zip(result.logits, cluster_reference.logits, strict=True)
            )
            bad = next(p for p in remote.peers.peers if p.node_id == liar.node_id)
            honest = [p for p in remote.peers.peers if p.node_id != liar.node_id]
            assert not bad.up and bad.failures >= 1, "the liar was not banned"
            assert all(p.up and p.failures == 0 for p in honest), "an honest node was banned"
        finally:
            remote.close()
    finally:
        liar.stop()


def test_failpoint_specs_parse_and_bad_ones_are_refused():
    assert failpoints.parse("lie=scale:1.01:0.2") == failpoints.Lie("scale", 1.01, 0.2)
    assert failpoints.parse("lie=nan") == failpoints.Lie("nan", 0.0, 1.0)
    assert failpoints.parse("lie=zero:0.5") == failpoints.Lie("zero", 0.0, 0.5)
    assert failpoints.parse("") is None
    for bad in ("lie=lots", "fib=nan", "lie=scale"):
        with pytest.raises(ValueError):
            failpoints.parse(bad)
