"""What a node may be asked to compute or prove: one check for Forward and Challenge."""

from __future__ import annotations

import grpc

from moeshard.moe.wire import moeshard_pb2 as pb


def unavailable(layer: int, expert: int, held: set, bad: set) -> tuple[grpc.StatusCode, str] | None:
    """(status, why) if record (layer, expert) cannot be served here, else None: it failed its
    checksum (DATA_LOSS) or this node does not hold it (NOT_FOUND). Call under the lock that
    guards `held` and `bad`."""
    key = (layer, expert)
    if key in bad:
        return (
            grpc.StatusCode.DATA_LOSS,
            f"expert {expert} of layer {layer} failed its checksum on this node",
        )
    if key not in held:
        return (
            grpc.StatusCode.NOT_FOUND,
            f"this node does not hold expert {expert} of layer {layer}",
        )
    return None


def layer_experts(keys) -> list[pb.LayerExperts]:
    """(layer, expert) keys as the wire lists them: per layer, its experts ascending."""
    by_layer: dict[int, list[int]] = {}
    for layer, expert in keys:
        by_layer.setdefault(layer, []).append(expert)
    return [pb.LayerExperts(layer=lay, experts=sorted(ex)) for lay, ex in sorted(by_layer.items())]
