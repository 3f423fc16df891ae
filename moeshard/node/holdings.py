"""What a node may be asked to compute or prove: one check for Forward and Challenge."""

from __future__ import annotations

import grpc


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
