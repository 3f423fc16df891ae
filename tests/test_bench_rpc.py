"""`moeshard bench rpc` end to end at a tiny size: one node daemon in plaintext and one with
mutual TLS on loopback, the timed calls, a MoE layer and a short decode through each.
(It once broke unnoticed: its streamed call used a method ForwardStream no longer has.)"""

from __future__ import annotations

import re

from helpers import moeshard_run


def test_round_trips_layers_and_decode_on_one_node(demo, tmp_path):
    r = moeshard_run(
        "bench", "rpc", demo, "--nodes", "1", "--iters", "3", "--tokens", "2", home=tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"^   bidi stream message, same \d+ B Forward +TLS +[\d.]+", r.stdout, re.M)
    assert re.search(r"^     stream +[\d.]+ \(", r.stdout, re.M), r.stdout
    decode = re.findall(
        r"^   RemoteExperts, 1 node\(s\), stream +(plain|TLS) +([\d.]+)", r.stdout, re.M
    )
    assert [wire for wire, _ in decode][-2:] == ["plain", "TLS"], r.stdout
    assert all(float(tok_s) > 0 for _, tok_s in decode)
