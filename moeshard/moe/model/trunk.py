"""The dense trunk's weights in memory: linear layers on packed bytes, vectors in float32."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from moeshard.moe.kernels import quant
from moeshard.moe.storage.trunk_file import TrunkTensor


class Linear:
    """y = x @ W.T (+ b) with W [rows=out, cols=in] kept in its stored format."""

    def __init__(self, weight: TrunkTensor, bias: np.ndarray | None = None):
        self.rows, self.cols = weight.shape
        self.fmt = weight.fmt
        self.bias = bias
        # every format, f32 included, through our kernels: a row's result is then the same
        # bits whatever other rows are in the call (numpy's BLAS blocks a batch differently
        # from one row), which batched serving needs; packed formats are never dequantized
        self.data = weight.data
        self.packed = quant.PackedMatrix(weight.data, weight.fmt, self.rows, self.cols)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = self.packed(x)  # [T, rows]
        if self.bias is not None:
            y = y + self.bias
        return y.astype(np.float32, copy=False)


class LinearGroup:
    """Linear layers that take the same input (a layer's q, k and v projections) in one kernel
    call when they share a format and width (`quant.PackedGroup`), else one call each; the
    outputs have the bits each layer gives alone."""

    def __init__(self, layers: list[Linear]):
        self.layers = layers
        same = len({(ly.fmt, ly.cols) for ly in layers}) == 1
        self.packed = quant.PackedGroup([ly.packed for ly in layers]) if same else None

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        if self.packed is None:  # (untimed: a profile clocks this whole call)
            return [_UNTIMED_CALL(ly, x) for ly in self.layers]
        outs = self.packed(x)  # [T, rows_m] each
        return [
            y if ly.bias is None else (y + ly.bias).astype(np.float32, copy=False)
            for y, ly in zip(outs, self.layers, strict=True)
        ]


_UNTIMED_CALL = Linear.__call__
_UNTIMED_GROUP_CALL = LinearGroup.__call__


def time_linear(clock: Callable[[int], None] | None) -> None:
    """Profiling (`generate --profile`): while `clock` is set, every Linear call reports its
    duration in nanoseconds to it; None restores the untimed call. Process-wide (it swaps
    Linear.__call__), so an untimed generation pays nothing for it."""
    if clock is None:
        Linear.__call__ = _UNTIMED_CALL
        LinearGroup.__call__ = _UNTIMED_GROUP_CALL
        return

    def timed_call(self: Linear, x: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter_ns()
        try:
            return _UNTIMED_CALL(self, x)
        finally:
            clock(time.perf_counter_ns() - t0)

    def timed_group_call(self: LinearGroup, x: np.ndarray) -> list[np.ndarray]:
        t0 = time.perf_counter_ns()
        try:
            return _UNTIMED_GROUP_CALL(self, x)
        finally:
            clock(time.perf_counter_ns() - t0)

    Linear.__call__ = timed_call
    LinearGroup.__call__ = timed_group_call


class Trunk:
    """Named access to trunk weights. Names are the checkpoint's HF names (see each family)."""

    def __init__(self, tensors: dict[str, TrunkTensor]):
        self.tensors = tensors
        self._cache: dict[str, object] = {}
        self._row_views: dict[str, tuple] = {}  # name -> (tensor, its rows' view): `embed`

    def enter_layer(self, layer: int) -> None:
        """Called before layer `layer` runs; a fully resident trunk has nothing to do."""

    def close(self) -> None:
        """Stop any reader threads (a streamed trunk); a resident trunk holds none."""

    def has(self, name: str) -> bool:
        return name in self.tensors

    def vector(self, name: str) -> np.ndarray:
        """A small tensor (norm weight, bias, router) as float32."""
        if name not in self._cache:
            self._cache[name] = np.ascontiguousarray(self.tensors[name].to_f32())
        return self._cache[name]

    def linear(self, prefix: str) -> Linear:
        """The linear layer `prefix`.weight (+ `prefix`.bias when the checkpoint has one)."""
        key = prefix + "#linear"
        if key not in self._cache:
            bias_name = prefix + ".bias"
            bias = self.vector(bias_name) if bias_name in self.tensors else None
            self._cache[key] = Linear(self.tensors[prefix + ".weight"], bias)
        return self._cache[key]

    def embed(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of an embedding table, dequantized: ids [T] -> [T, H].  Only those rows
        are decoded, never the whole table (a float32 copy of a bf16 table is twice its
        bytes, outside any RAM budget)."""
        table = self.tensors[name]
        rows, cols = table.shape
        if table.fmt not in ("f32", "bf16"):
            return quant.dequantize_rows(table.data, table.fmt, rows, cols, ids)  # [T, H]
        # float rows: `dequantize_rows`' kernel (`float_rows_at`) on a view of the table kept
        # here, without its per-call view and checks (a decode step's embedding runs cold
        # after a big model's layers streamed through the caches: a row of the 706 MB
        # model's table 68 -> 48 us with one kernel call instead of a dozen numpy ones, 7.5
        # -> 1.4 us in cache)
        held = self._row_views.get(name)
        if held is None or held[0] is not table:  # (a view of its bytes, not a float32 copy)
            held = self._row_views[name] = (
                table, quant.float_rows_view(table.data, table.fmt, rows, cols)
            )  # fmt: skip
        if not (isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.ndim == 1):
            ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # [T]
        return quant.float_rows_at(held[1], rows, cols, ids)  # [T, H]

    def nbytes(self) -> int:
        return sum(t.data.nbytes for t in self.tensors.values())
