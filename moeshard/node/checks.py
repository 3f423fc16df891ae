"""What a node checks of a Forward request before its experts backend sees it, and of the
result before it is sent: every field decoded and bounded, the model, the layer, the experts
(held and healthy), no expert twice in a row, no NaN in or out. A request that fails is a
`RequestError` with its gRPC status and a message, and the node keeps serving."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc
import numpy as np

from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire.constants import MAX_ACTIVATION, MAX_SLOTS
from moeshard.node.holdings import unavailable
from moeshard.node.limits import Refused


class RequestError(Exception):
    """A request the node refuses: carries the gRPC status code and the message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class NodeIdentity:
    node_id: str  # the id of the node's key (moe.identity.keys.key_id)
    name: str  # a display name (zeroconf instance name, logs)
    model_id: str  # sha256 hex of the model the records belong to
    format_version: int  # moe.storage.manifest.FORMAT_VERSION of the shard files
    model_type: str  # HF model_type of the model
    expert_format: str  # f32, bf16, q8_0, q4_0
    hidden_size: int  # H: width of the rows the experts take (Kimi K3: its latent width)
    n_experts: int  # routed experts per MoE layer in the model
    moe_layers: tuple[int, ...]  # the model's MoE layer indices
    ram_budget: int  # bytes the expert cache may use (0 = unbounded)


def claimed_rows(request, max_rows: int) -> int:
    """The rows a request claims (the first dimension of its hidden state; 0 for Info and
    Prefetch), refused over --max-rows before anything else is done with it."""
    if not isinstance(request, pb.ForwardRequest) or not request.hidden.shape:
        return 0
    rows = int(request.hidden.shape[0])
    if rows > codec.MAX_DIM:  # not a shape at all: decoding refuses it (INVALID_ARGUMENT)
        return 0
    if rows > max_rows:
        raise Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{rows} rows: this node takes at most {max_rows} per request (--max-rows)",
        )
    return max(rows, 0)


def check_model(model_id: str, identity: NodeIdentity) -> None:
    if model_id != identity.model_id:
        raise RequestError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"model id {model_id[:16] or '(empty)'} does not match this node's "
            f"{identity.model_id[:16]}",
        )


def parse_forward(
    request, identity: NodeIdentity, max_rows: int, held, bad, state_lock: threading.Lock
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, int]:
    """Check every field; returns layer, hidden [T, H], ids [T, k], weights [T, k], dtype. `held`
    and `bad` (the records this node can compute, those that failed) are read under
    `state_lock`."""
    ident = identity
    check_model(request.model_id, identity)
    layer = int(request.layer)
    if layer not in ident.moe_layers:
        raise RequestError(
            grpc.StatusCode.NOT_FOUND,
            f"layer {layer} is not a MoE layer of this model "
            f"(MoE layers {ident.moe_layers[0]}..{ident.moe_layers[-1]})",
        )
    bad_arg = grpc.StatusCode.INVALID_ARGUMENT
    try:
        hidden = codec.decode(
            request.hidden, "hidden", (codec.F32, codec.BF16), (None, ident.hidden_size)
        )  # [T, H]
        rows = hidden.shape[0]
        ids = codec.decode(request.ids, "ids", (codec.I32,), (rows, None))  # [T, k]
        weights = codec.decode(
            request.weights, "weights", (codec.F32,), (rows, ids.shape[1])
        )  # [T, k]
    except codec.CodecError as exc:
        raise RequestError(bad_arg, str(exc)) from None
    if not 1 <= rows <= max_rows or not 1 <= ids.shape[1] <= MAX_SLOTS:
        raise RequestError(
            bad_arg, f"{rows} rows x {ids.shape[1]} slots: need 1..{max_rows} x 1..{MAX_SLOTS}"
        )
    out_dtype = request.out_dtype or request.hidden.dtype
    if out_dtype not in (codec.F64, codec.F32, codec.BF16):
        raise RequestError(
            bad_arg, f"out_dtype {codec.dtype_name(out_dtype)}: need f64, f32 or bf16"
        )
    if not np.isfinite(hidden).all() or not np.isfinite(weights).all():
        raise RequestError(bad_arg, "hidden or weights contain NaN or infinity")
    out_of_range = ids[(ids < -1) | (ids >= ident.n_experts)]
    if out_of_range.size:
        raise RequestError(
            bad_arg,
            f"expert id {int(out_of_range[0])} out of range (0..{ident.n_experts - 1}, "
            f"-1 = empty slot)",
        )
    ordered = np.sort(ids, axis=1)  # [T, k]
    twice = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)  # [T, k - 1]
    if twice.any():  # top-k never routes a row to one expert twice; each would compute
        row = int(np.nonzero(twice.any(axis=1))[0][0])
        raise RequestError(bad_arg, f"row {row} names an expert in two slots")
    with state_lock:
        for expert in np.unique(ids[ids >= 0]):
            refused = unavailable(layer, int(expert), held, bad)
            if refused:
                raise RequestError(*refused)
    return layer, hidden, ids, weights, out_dtype


def check_result(layer: int, hidden: np.ndarray, out: np.ndarray) -> None:
    """Never send a non-finite or absurd partial sum as a result. MAX_ACTIVATION (1e30) is
    far above any real activation and far enough below float32's 3.4e38 that the
    coordinator's sum of up to 256 of them (and the residual) stays finite in float32."""
    if not np.abs(out).max() <= MAX_ACTIVATION:  # NaN fails the comparison too
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"layer {layer}: result not finite (or beyond {MAX_ACTIVATION:g}): input too "
            f"large (|hidden| up to {float(np.abs(hidden).max()):.3g})",
        )
