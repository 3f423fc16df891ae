"""Fraud proofs: a node's signed reply, and what the model's own weights give instead.

When a coordinator's recomputation of an audited call differs from the node's reply
(coordinator/remote/audit.py), it writes a `FraudProof` (proto/moeshard.proto): the request
as sent, the reply tensor as received, the node's signed receipt for both, the node's key, one
row whose bytes differ and the expert records that row routes to. `check` verifies it with
nothing but a model directory (the coordinator directory `moeshard shard` writes will do: its
config, manifest and merkle.bin) and trusts nobody:

1. the receipt is signed by `node_key`, whose id is the receipt's node, for this model;
2. the receipt describes exactly this request (the input hash covers the model id, layer,
   reply dtype and every tensor's dtype, shape and data) and this reply (its sha256), and
   names the arithmetic this moeshard computes (`moeshard.moe.kernels.build.ARITHMETIC`);
3. every record the row routes to is there, and its Merkle root is the one merkle.bin holds;
4. the row recomputed from those records (`moeshard.moe.experts.compute.recompute_partial_sum`, the
   node's own definition of its reply) and encoded in the reply's dtype differs from the
   signed bytes of that row.

All four hold: the node signed a result its model does not give (proven). Any one fails: the
file proves nothing, and `check` says which, in one line. A row's bits do not depend on the
other rows of a call (docs/kernels.md), so one row and its records are enough.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeshard.moe.errors import MoeshardError
from moeshard.moe.experts.compute import recompute_partial_sum
from moeshard.moe.identity.keys import key_id
from moeshard.moe.identity.receipts import check_receipt, receipt_mismatch
from moeshard.moe.kernels.build import ARITHMETIC
from moeshard.moe.storage import merkle
from moeshard.moe.storage.io import align_up, aligned_buffer, write_file
from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb

VERSION = 1
MAX_FILE_BYTES = 1 << 30  # larger files are refused unread (K3: at most 16 records of 17.5 MB)
REQUEST_BYTES = 128 << 20  # what a proof's request, reply and receipt may take beside records
SUFFIX = ".fraud"


class FraudError(MoeshardError):
    """The file is not a fraud proof, or does not prove what it claims (one line: why)."""


@dataclass
class Verdict:
    node_id: str
    layer: int
    row: int
    differing: int  # values of the row whose bits differ
    width: int  # values in the row
    signed: float  # the first differing value, as the node signed it
    recomputed: float  # ... and as the model's records give it

    def describe(self) -> str:
        return (
            f"proven: node {self.node_id} signed a reply to layer {self.layer} whose row "
            f"{self.row} the model's experts do not give ({self.differing} of {self.width} "
            f"values differ; the first: signed {self.signed!r}, recomputed {self.recomputed!r})"
        )


def make_proof(
    model_id: str,
    node_key: bytes,
    request: pb.ForwardRequest,
    reply: pb.ForwardReply,
    row: int,
    records: list[tuple[int, int, np.ndarray]],
    recomputed: np.ndarray,
    accuser_id: str = "",
) -> pb.FraudProof:
    """The proof of one wrong reply: `records` (layer, expert, uint8 bytes) are those row
    `row` routes to; `recomputed` the row as the model gives it, float64 [1, H]."""
    return pb.FraudProof(
        version=VERSION,
        model_id=model_id,
        node_key=node_key,
        request=request,
        reply=reply.out,
        receipt=reply.receipt,
        row=row,
        records=[pb.ExpertRecord(layer=la, expert=e, data=d.tobytes()) for la, e, d in records],
        recomputed=codec.encode(recomputed, codec.F64),
        accuser_id=accuser_id,
        unix_ms=int(time.time() * 1000),
    )


def write_proof(directory: Path, proof: pb.FraudProof) -> Path:
    """Write `proof` under `directory` (temporary name, then rename); its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(proof.unix_ms / 1000))
    name = f"{proof.receipt.node_id[:16]}-{stamp}-{proof.request.request_id}{SUFFIX}"
    tmp = directory / (name + ".tmp")
    write_file(tmp, proof.SerializeToString(deterministic=True))
    os.replace(tmp, directory / name)
    return directory / name


def read_proof(path: str | Path, limit: int = MAX_FILE_BYTES) -> pb.FraudProof:
    """The proof in `path`, parsed; FraudError if it is larger than `limit` bytes (refused
    unread), unreadable or not a proof of this version."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > limit:
            raise FraudError(f"{path}: {size} bytes, more than a fraud proof may have")
        data = path.read_bytes()
    except OSError as exc:
        raise FraudError(f"{path}: cannot read ({exc.strerror})") from None
    proof = pb.FraudProof()
    try:
        proof.ParseFromString(data)
    except Exception:  # protobuf raises its DecodeError, or others on garbage
        raise FraudError(f"{path}: not a fraud proof (unparsable)") from None
    if proof.version != VERSION:
        raise FraudError(f"{path}: fraud proof version {proof.version}, this build reads 1")
    return proof


def check(path: str | Path, model) -> Verdict:
    """The verdict of the proof at `path` against `model` (an opened ModelDir: its id, expert
    geometry and Merkle roots); FraudError naming what does not hold."""
    # a row routes to at most top-k records; the request and reply get REQUEST_BYTES
    limit = min(MAX_FILE_BYTES, model.config.top_k * model.shard_set.record_nbytes + REQUEST_BYTES)
    proof = read_proof(path, limit)
    where = f"{path}"
    if proof.model_id != model.model_id:
        raise FraudError(f"{where}: about model {proof.model_id[:16]}, not {model.model_id[:16]}")
    receipt, request = proof.receipt, proof.request
    why = check_receipt(receipt, proof.node_key, model_id=model.model_id) or receipt_mismatch(
        receipt, request, proof.reply.data
    )
    if why:
        raise FraudError(f"{where}: {why}")
    if receipt.arithmetic != ARITHMETIC:
        raise FraudError(
            f"{where}: the node computed with arithmetic {receipt.arithmetic}; this moeshard "
            f"computes {ARITHMETIC}: check it with a version that computes the node's"
        )
    shards = model.shard_set
    out_dtype = request.out_dtype or request.hidden.dtype
    if out_dtype not in (codec.F64, codec.F32, codec.BF16):
        raise FraudError(f"{where}: a reply dtype ({out_dtype}) no node is asked for")
    if len(request.hidden.shape) != 2 or not 0 <= proof.row < request.hidden.shape[0]:
        raise FraudError(f"{where}: row {proof.row} of a request of shape {request.hidden.shape}")
    r = proof.row
    try:  # only row r is decoded: a hostile file cannot make this widen all of its bytes
        hidden = _row(request.hidden, r, (codec.F32, codec.BF16), shards.hidden)  # [1, H]
        ids = _row(request.ids, r, (codec.I32,), None)  # [1, k]
        weights = _row(request.weights, r, (codec.F32,), ids.shape[1])  # [1, k]
        got = _row(proof.reply, r, (out_dtype,), shards.hidden)  # [1, H]
    except codec.CodecError as exc:
        raise FraudError(f"{where}: {exc}") from None
    arena, offsets = _records(proof, model, request.layer, ids[0], where)
    expected = recompute_partial_sum(
        lambda experts: [(arena, {e: offsets[e] for e in experts})],
        shards.record_format(request.layer), shards.hidden, shards.inter, shards.glu, hidden,
        ids, weights,
    )  # fmt: skip  # [1, H] float64
    want = codec.decode(codec.encode(expected, out_dtype), "row", (out_dtype,))  # [1, H]
    differ = np.nonzero(want.view(np.uint8).reshape(-1) != got.view(np.uint8).reshape(-1))[0]
    if not differ.size:
        raise FraudError(f"{where}: row {r} of the signed reply is what the model gives: no fraud")
    col = int(differ[0]) // want.dtype.itemsize
    differing = int(np.count_nonzero(_bits(want) != _bits(got)))
    return Verdict(
        key_id(proof.node_key), int(request.layer), r, differing, int(want.size),
        float(got[0, col]), float(want[0, col]),
    )  # fmt: skip


def _row(tensor: pb.Tensor, r: int, dtypes: tuple, width: int | None) -> np.ndarray:
    """Row r of a 2-D tensor, [1, width], decoded alone after its shape, dtype and length are
    checked (CodecError if they are not those of a [rows, width] tensor of one of `dtypes`)."""
    if len(tensor.shape) != 2 or tensor.dtype not in dtypes or tensor.dtype not in codec.ITEMSIZE:
        raise codec.CodecError(f"a tensor of shape {list(tensor.shape)}, dtype {tensor.dtype}")
    rows, cols = tensor.shape
    size = codec.ITEMSIZE[tensor.dtype]
    if width is not None and cols != width or not 0 <= r < rows or cols < 1:
        raise codec.CodecError(f"shape {list(tensor.shape)}: no row {r} of width {width}")
    if len(tensor.data) != rows * cols * size:
        raise codec.CodecError(f"{len(tensor.data)} bytes for shape {list(tensor.shape)}")
    row = pb.Tensor(data=tensor.data[r * cols * size : (r + 1) * cols * size], shape=[1, cols])
    row.dtype = tensor.dtype
    return codec.decode(row, "row", dtypes, (1, cols))


def _bits(x: np.ndarray) -> np.ndarray:
    """x's values as unsigned integers of their width (equal bits, equal integers)."""
    return x.reshape(-1).view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _records(proof, model, layer: int, row_ids: np.ndarray, where: str):
    """The row's records, each checked against the model's Merkle root, in one arena:
    (uint8 arena, {expert: offset}). FraudError if one is missing, extra or not the model's."""
    roots = model.possession_roots()
    nbytes = model.shard_set.record_nbytes
    wanted = sorted({int(e) for e in row_ids if e >= 0})
    given = {(r.layer, r.expert): r.data for r in proof.records}
    if sorted(given) != [(layer, e) for e in wanted]:
        raise FraudError(
            f"{where}: records {sorted(given)} given; row {proof.row} routes to experts "
            f"{wanted} of layer {layer}"
        )
    slot = align_up(nbytes)  # records at aligned offsets, as every backend keeps them
    arena = aligned_buffer(max(len(wanted), 1) * slot)  # [m * slot bytes]
    offsets = {}
    for i, e in enumerate(wanted):
        data = given[(layer, e)]
        root = roots.root(layer, e)
        if len(data) != nbytes or root is None or merkle.root(data, roots.block_size) != root:
            raise FraudError(
                f"{where}: the record of expert {e} of layer {layer} is not the model's "
                "(its Merkle root differs from merkle.bin's)"
            )
        arena[i * slot : i * slot + nbytes] = np.frombuffer(data, dtype=np.uint8)
        offsets[e] = i * slot
    return arena, offsets
