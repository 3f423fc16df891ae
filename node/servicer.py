"""The node's gRPC servicers: thin layers that validate, call the experts backend, and reply.

`ExpertNodeServicer` implements moeshard.v1.ExpertNode (proto/moeshard.proto) on top of any
`moe.experts.backend.ExpertsBackend` (LocalExperts, or the ExpertStore under `--ram`). Every
request is checked before the backend sees it; a bad request gets a status code and a message
and the node keeps serving. A Prefetch hint starts its reads at once. `HealthServicer` is the
standard grpc.health.v1 service.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np

from moe.errors import StoreError
from moe.experts.backend import ExpertsBackend
from moe.identity.keys import Identity
from moe.identity.signed import sign_info
from moe.wire import codec, health_pb2, health_pb2_grpc
from moe.wire import moeshard_pb2 as pb
from moe.wire import moeshard_pb2_grpc as pb_grpc
from moe.wire.constants import MAX_ROWS, MAX_SLOTS, WIRE_VERSION
from node.access import AccessDenied, AccessPolicy

log = logging.getLogger(__name__)


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
    hidden_size: int  # H: width of every hidden row
    n_experts: int  # routed experts per MoE layer in the model
    moe_layers: tuple[int, ...]  # the model's MoE layer indices
    ram_budget: int  # bytes the expert cache may use (0 = unbounded)


def _holdings(keys) -> list[pb.LayerExperts]:
    by_layer: dict[int, list[int]] = {}
    for layer, expert in keys:
        by_layer.setdefault(layer, []).append(expert)
    return [pb.LayerExperts(layer=lay, experts=sorted(ex)) for lay, ex in sorted(by_layer.items())]


class ExpertNodeServicer(pb_grpc.ExpertNodeServicer):
    """Validate -> experts backend -> reply. Thread-safe; compute is serialised by a lock."""

    def __init__(
        self,
        identity: NodeIdentity,
        held: set[tuple[int, int]],
        backend: ExpertsBackend,
        access: AccessPolicy | None = None,
        key: Identity | None = None,  # signs Info replies
    ):
        self.access = access or AccessPolicy(tls=False)
        self.key = key
        self.identity = identity
        self.held = set(held)  # (layer, expert) records this node can compute
        self.bad: set[tuple[int, int]] = set()  # records that failed their checksum
        self.backend = backend
        self.compute_lock = threading.Lock()
        self.state_lock = threading.Lock()
        self.inflight = 0
        self.served = 0

    # -- RPCs ------------------------------------------------------------------------------

    def _authorize(self, context) -> str:
        """The caller's client id; aborts the call if it may not call this node."""
        try:
            return self.access.caller(context)
        except AccessDenied as exc:
            context.abort(exc.code, str(exc))

    def Info(self, request, context):
        self._authorize(context)
        ident = self.identity
        with self.state_lock:
            good, bad = self.held - self.bad, set(self.bad)
            inflight, served = self.inflight, self.served
        with self.compute_lock:  # the backend's counters change under this lock
            stats = {k: float(v) for k, v in self.backend.stats().items() if _is_number(v)}
        info = pb.NodeInfo(
            node_id=ident.node_id,
            model_id=ident.model_id,
            format_version=ident.format_version,
            model_type=ident.model_type,
            expert_format=ident.expert_format,
            hidden_size=ident.hidden_size,
            holdings=_holdings(good),
            bad=_holdings(bad),
            ram_budget=ident.ram_budget,
            inflight=inflight,
            served=served,
            wire_version=WIRE_VERSION,
            stats=stats,
            name=ident.name,
        )
        if self.key is not None:
            sign_info(self.key, info, request.nonce)
        return info

    def Forward(self, request, context):
        self._authorize(context)
        try:
            return self._forward(request)
        except RequestError as exc:
            context.abort(exc.code, str(exc))

    def ForwardStream(self, request_iterator, context):
        self._authorize(context)
        for request in request_iterator:
            try:
                yield self._forward(request)
            except RequestError as exc:
                context.abort(exc.code, str(exc))

    def Prefetch(self, request, context):
        self._authorize(context)
        try:
            self._check_model(request.model_id)
        except RequestError as exc:
            context.abort(exc.code, str(exc))
        with self.state_lock:
            wanted = [e for e in request.experts if (request.layer, e) in self.held - self.bad]
        if wanted:
            try:
                with self.compute_lock:  # the backend is not thread-safe; starting reads is cheap
                    self.backend.prefetch(int(request.layer), np.asarray(wanted, dtype=np.int64))
            except StoreError as exc:  # a hint must never fail the caller
                log.warning("prefetch of layer %d failed: %s", request.layer, exc)
        return pb.PrefetchReply(accepted=len(wanted))

    # -- validation and compute ------------------------------------------------------------

    def _check_model(self, model_id: str) -> None:
        if model_id != self.identity.model_id:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model id {model_id[:16] or '(empty)'} does not match this node's "
                f"{self.identity.model_id[:16]}",
            )

    def _parse(self, request) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, int]:
        """Check every field; returns layer, hidden [T, H], ids [T, k], weights [T, k], dtype."""
        ident = self.identity
        self._check_model(request.model_id)
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
        if not 1 <= rows <= MAX_ROWS or not 1 <= ids.shape[1] <= MAX_SLOTS:
            raise RequestError(
                bad_arg, f"{rows} rows x {ids.shape[1]} slots: need 1..{MAX_ROWS} x 1..{MAX_SLOTS}"
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
        with self.state_lock:
            for expert in np.unique(ids[ids >= 0]):
                key = (layer, int(expert))
                if key in self.bad:
                    raise RequestError(
                        grpc.StatusCode.DATA_LOSS,
                        f"expert {expert} of layer {layer} failed its checksum on this node",
                    )
                if key not in self.held:
                    raise RequestError(
                        grpc.StatusCode.NOT_FOUND,
                        f"this node does not hold expert {expert} of layer {layer}",
                    )
        return layer, hidden, ids, weights, out_dtype

    def _forward(self, request) -> pb.ForwardReply:
        layer, hidden, ids, weights, out_dtype = self._parse(request)
        # Empty slots (-1) become a copy of the row's first expert with weight 0: adding +-0.0
        # leaves the sum bit-identical and the backend never sees an invalid id.
        empty = ids < 0  # [T, k]
        if empty.any():
            first = np.where(empty.all(axis=1), -1, ids.max(axis=1))  # [T]
            ids = np.where(empty, first[:, None], ids)  # [T, k]
            weights = np.where(empty, np.float32(0), weights).astype(np.float32)  # [T, k]
        live = (ids >= 0).any(axis=1)  # [T]
        out = np.zeros(hidden.shape, dtype=np.float64)  # [T, H], the unrounded partial sum
        t0 = time.perf_counter()
        with self.state_lock:
            self.inflight += 1
        try:
            if live.any():
                out[live] = self._compute(layer, hidden[live], ids[live], weights[live])
        finally:
            with self.state_lock:
                self.inflight -= 1
                self.served += 1
        compute_ms = (time.perf_counter() - t0) * 1e3
        return pb.ForwardReply(
            out=codec.encode(out, out_dtype),
            experts_computed=int(np.unique(ids[ids >= 0]).size),
            compute_ms=compute_ms,
        )

    def _compute(self, layer, hidden, ids, weights) -> np.ndarray:
        try:
            with self.compute_lock:
                return self.backend(layer, hidden, ids, weights, dtype=np.float64)  # [T, H]
        except StoreError as exc:
            bad = self._find_bad(layer, hidden, np.unique(ids))
            with self.state_lock:
                self.bad.update((layer, e) for e in bad)
            log.error("layer %d: marked experts %s bad: %s", layer, bad, exc)
            raise RequestError(grpc.StatusCode.DATA_LOSS, str(exc)) from None

    def _find_bad(self, layer: int, hidden: np.ndarray, experts: np.ndarray) -> list[int]:
        """Which of `experts` fail to load: run each alone on one row."""
        bad = []
        one = np.ones((1, 1), dtype=np.float32)  # [1, 1]
        for expert in experts:
            try:
                with self.compute_lock:
                    self.backend(layer, hidden[:1], np.full((1, 1), expert), one)
            except StoreError:
                bad.append(int(expert))
        return bad


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: one status for the whole server (service "" and "moeshard.v1.ExpertNode")."""

    SERVICES = ("", "moeshard.v1.ExpertNode")

    def __init__(self):
        self.status = health_pb2.HealthCheckResponse.NOT_SERVING
        self.changed = threading.Condition()

    def set_serving(self, serving: bool) -> None:
        with self.changed:
            self.status = (
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            self.changed.notify_all()

    def Check(self, request, context):
        if request.service not in self.SERVICES:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service '{request.service}'")
        return health_pb2.HealthCheckResponse(status=self.status)

    def Watch(self, request, context):
        if request.service not in self.SERVICES:
            yield health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            )
            return
        last = None
        while context.is_active():
            with self.changed:
                if self.status == last:
                    self.changed.wait(timeout=1.0)
                    continue
                last = self.status
            yield health_pb2.HealthCheckResponse(status=last)
