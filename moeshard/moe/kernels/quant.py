"""matmul and the expert FFN on packed bytes (the layout: `moeshard.moe.kernels.layout`), the
gated unit, the kernels' threads, the activations' mode, and float64 numpy twins of the
kernels for tests.

The layout's public names (`pack`, `quantize`, `dequantize`, `packed_nbytes`, ...) are
imported here too: `quant` is where the rest of the code meets the kernels.
"""

import functools
import os
import threading
import time
from typing import NamedTuple

import numba
import numpy as np

from moeshard.moe.kernels import activations, dots, entry, fixedmath
from moeshard.moe.kernels.layout import (  # noqa: F401  (pack, dequantize, ...: re-exported)  # noqa: F401  (re-exported)
    _FMT_CODE,
    ALIGN,
    ALL_FORMATS,
    BLOCK_FORMATS,
    FORMATS,
    GGML_FORMATS,
    QK,
    QK_K,
    ROW_GROUP,
    _check_buffer,
    _check_matrix,
    _check_x,
    _matrix_layout,
    _readonly,
    dequantize,
    dequantize_rows,
    float_rows_at,
    float_rows_view,
    ggml_block_size,
    nonfinite_scales,
    pack,
    pack_ggml,
    packed_nbytes,
    quantize,
    unpack_to_ggml,
)


class Glu(NamedTuple):
    """An expert's gated unit between its up and down halves: kind 0 is SwiGLU,
    silu(gate) * up (most families); kind 1 is K3's SiTU-GLU,
    [beta tanh(gate / beta) sigmoid(gate)] * [linear_beta tanh(up / linear_beta)]; kind 2
    is gpt-oss's clamped SwiGLU with beta = alpha and linear_beta = limit:
    g = min(gate, limit), (clip(up, -limit, limit) + 1) * g sigmoid(alpha g)."""

    kind: int
    beta: float = 0.0
    linear_beta: float = 0.0


SWIGLU = Glu(0)


def situ(beta: float, linear_beta: float) -> Glu:
    """Kimi K3's SiTU-GLU with the config's activation_situ_beta and _linear_beta."""
    if not (beta > 0 and linear_beta > 0):
        raise ValueError(f"SiTU betas must be positive, not {beta} and {linear_beta}")
    return Glu(1, float(beta), float(linear_beta))


def clamped_swiglu(alpha: float, limit: float) -> Glu:
    """gpt-oss's clamped SwiGLU with the config's swiglu_alpha and swiglu_limit."""
    if not (alpha > 0 and limit > 0):
        raise ValueError(f"clamped SwiGLU alpha and limit must be positive, not {alpha}, {limit}")
    return Glu(2, float(alpha), float(limit))


def _glu(glu: Glu) -> tuple[int, float, float]:
    return int(glu.kind), float(glu.beta), float(glu.linear_beta)


def glu_reference(g: np.ndarray, u: np.ndarray, glu: Glu = SWIGLU) -> np.ndarray:
    """The gated unit in float64 (numpy), as the kernels compute it before rounding: the same
    operations as `entry._glu_mul`, with `fixedmath`'s exp and tanh, so the same bits."""
    g, u = np.asarray(g, dtype=np.float64), np.asarray(u, dtype=np.float64)
    exp, tanh = fixedmath.exp_array, fixedmath.tanh_array
    if glu.kind == 1:
        b, lb = glu.beta, glu.linear_beta
        return b * tanh(g / b) / (1.0 + exp(-g)) * (lb * tanh(u / lb))
    if glu.kind == 2:
        alpha, limit = glu.beta, glu.linear_beta
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
        return (u + 1.0) * (g / (1.0 + exp(-(alpha * g))))
    return g / (1.0 + exp(-g)) * u


def gated_unit(g: np.ndarray, u: np.ndarray, glu: Glu = SWIGLU) -> np.ndarray:
    """The gated unit of gate and up float32 [..., n] -> float32 [..., n], computed by the
    expert kernels' code (`entry._glu_mul`): the bits of `glu_reference(g, u, glu)` rounded to
    float32, for the trunk's FFNs (K3's shared expert).  [1, 2048] and [16, 2048] SiTU: 12 and
    140 us, against 136 and 4325 us for the twin (about 60 array operations) and 20 and 231 us
    for the same formula with numpy's libm-like exp and tanh, as the trunk computed it before."""
    g, u = (np.ascontiguousarray(a, dtype=np.float32) for a in (g, u))
    if g.shape != u.shape or g.ndim == 0:
        raise ValueError(f"gate {g.shape} and up {u.shape} must have one shape, not a scalar's")
    g, u = (a if a.flags.writeable else a.copy() for a in (g, u))  # one compiled signature
    flat = (-1, g.shape[-1])
    return entry._glu_mul(g.reshape(flat), u.reshape(flat), _glu(glu)).reshape(g.shape)


# Below this many weights a matrix is computed on one thread: waking the pool costs more.
PARALLEL_MIN_WEIGHTS = 1 << 19
# A product with the packed matrices of `PackedMatrix` (the trunk's linears) waits for this
# many times more work (rows x cols x batch): split in 16-row items it gains less from a
# second thread than experts do, each a whole item.  Measured on this project's 2-core
# machine (OpenMP's passive wait: ~20 us to wake the pool), a 256x256 bf16 product of 16
# rows took 37-40 us on one thread and 48-56 us on two; the 4096x256 LM head of one row 89
# against 126 us; the embedded model's decode step went from 1.27 to 0.91 ms at one row and
# 5.0 to 4.3 ms at 16 (medians of six alternations).
MATMUL_PARALLEL_FACTOR = 8

# How q4_0/q8_0 kernels take their activations: "q8", quantised to 8 bits per 32-column block
# with integer dot products (`moeshard.moe.kernels.idots`, as llama.cpp does; the default), or
# "f32", exact float32 activations (`moeshard.moe.kernels.dots`, 2-3x slower).  Process-wide: every
# node and auditor of a network must use the same one for their replies to agree bit for bit.
ACTIVATIONS = ("q8", "f32")
_activations = {"mode": "q8"}


def use_activations(mode: str) -> None:
    """Choose how q4_0/q8_0 kernels take activations, for this process (see ACTIVATIONS)."""
    if mode not in ACTIVATIONS:
        raise ValueError(f"unknown activation mode {mode!r}; expected one of {ACTIVATIONS}")
    _activations["mode"] = mode


def activation_mode() -> str:
    return _activations["mode"]


def _int8() -> bool:
    return _activations["mode"] == "q8"


_threads = {"n": 0}  # numba threads for big matrices; 0: all of numba's (every core)


def set_threads(n: int) -> None:
    """Use n threads for the kernels of big matrices, process-wide (0: all cores).  numba's
    thread count is per calling thread, so `_run` applies this on whichever thread calls (a
    node serves from gRPC worker threads)."""
    most = numba.config.NUMBA_NUM_THREADS
    if not 0 <= n <= most:
        raise ValueError(
            f"threads must be 0 (all) to {most} (numba's pool: this machine's cores, or "
            f"NUMBA_NUM_THREADS), got {n}"
        )
    _threads["n"] = n


def threads() -> int:
    """The threads big matrices use (`set_threads`)."""
    return _threads["n"] or numba.config.NUMBA_NUM_THREADS


# With spinning pool threads (`spin_while_waiting`) a region costs a few microseconds, not a
# futex wake, and a batch-1 product split in two reads weights at twice one core's rate (a
# VM core here: 9 GB/s from DRAM alone, 16-19 GB/s with two).  Measured on a 2-core Intel
# Xeon (AVX-512), 128 greedy tokens, medians of 3: the 706 MB Qwen3-MoE test model 96 tok/s
# passive, 131 with spinning at the old threshold's 1/4, 148 at 1/64; the embedded demo
# model 1149 -> 1190.  Smaller work items than this still run on the calling thread.
SPINNING_MIN_WEIGHTS = 1 << 13
# and `run_parallel` (attention) from this many multiply-adds: a decode step's attention over
# 32+ positions of the big model's 8 heads of 128 (42 us a layer on one thread at 64)
SPINNING_MIN_WORK = 1 << 16

_wait = {"spinning": False}


def spin_while_waiting(spin_s: float = 300e-6) -> bool:
    """For a process whose one user waits for every kernel (`moeshard generate`, the
    benchmark's own decode): the pool's threads spin about `spin_s` after each parallel
    region before they sleep, so the next region, a few microseconds of Python later, finds
    them awake, and products from 64 K weights up go parallel.  Servers and nodes keep the
    passive wait (docs/kernels.md: spinning took the cores their HTTP and gRPC threads need).
    Works only before the first parallel kernel starts libgomp (which reads GOMP_SPINCOUNT
    once) and not over an explicit OMP_WAIT_POLICY=... or GOMP_SPINCOUNT=... of the user's;
    returns whether it took effect.  The count is `spin_s` over this CPU's measured `pause`
    (libgomp spins by repeating it), so the time, not the count, is the same everywhere."""
    global PARALLEL_MIN_WEIGHTS, PARALLEL_MIN_WORK
    if not dots.OMP_WAIT_POLICY_DEFAULTED or "GOMP_SPINCOUNT" in os.environ:
        return False
    try:
        numba.threading_layer()
        return False  # the pool already runs with the passive wait
    except ValueError:
        pass
    count = int(min(max(spin_s / dots.pause_seconds(), 1000), 3_000_000))
    os.environ["GOMP_SPINCOUNT"] = str(count)
    PARALLEL_MIN_WEIGHTS, PARALLEL_MIN_WORK = SPINNING_MIN_WEIGHTS, SPINNING_MIN_WORK
    _wait["spinning"] = True
    return True


def wait_policy() -> str:
    """'spin' or 'passive' (for the benches' headers)."""
    return "spin" if _wait["spinning"] else "passive"


def _threads_for(n_weights: int) -> int:
    """The threads a kernel over `n_weights` weights runs on: all of `threads()`, or the
    calling thread alone below PARALLEL_MIN_WEIGHTS."""
    return threads() if n_weights >= PARALLEL_MIN_WEIGHTS else 1


def matmul_runs_serial(work: int) -> bool:
    """Whether a packed product of `work` multiply-adds (rows x cols x batch) runs on the
    calling thread (`PackedMatrix` and `PackedGroup` count its weights so)."""
    return _threads_for(work // MATMUL_PARALLEL_FACTOR) == 1


def _run(kernel, n_weights: int, *args, serial=None):
    """Call a parallel kernel on `threads()` threads, or on the calling thread alone for small
    matrices (waking the pool costs more than it saves there): its serial twin when it has
    one (the same bits, without the pool's scheduling)."""
    want = _threads_for(n_weights)
    if want == 1 and serial is not None:
        return serial(*args)
    return _launch(kernel, want, args)


def run_kernel(kernel, n_weights: int, *args, serial=None):
    """`_run` for a parallel kernel outside this module whose size is `n_weights` expert
    weights (`fused_layer.decode_layers`)."""
    return _run(kernel, n_weights, *args, serial=serial)


# Below this many multiply-adds a parallel kernel outside this module (`run_parallel`: the
# attention of several sequences) runs on the calling thread alone.  Waking a sleeping pool
# thread cost ~50 us a region on a 2-core VM; the attention of 16 sequences at 45 positions
# (4 query heads of 64, 0.37 M multiply-adds) took 55 us on one thread and 78 us on two, at
# 100 positions 90 against 97 us, at 190 positions 143-179 against 129-134 us.
PARALLEL_MIN_WORK = 1 << 20


def run_parallel(kernel, items: int, work: int, *args):
    """Call a parallel=True kernel outside this module (e.g. attention over several
    sequences) on as many of `threads()` threads as it has independent items, or on this
    thread alone when its `work` (multiply-adds) is below PARALLEL_MIN_WORK."""
    return run_parallel_on(kernel, parallel_threads(items, work), *args)


def parallel_threads(items: int, work: int) -> int:
    """The threads `run_parallel` runs a kernel of `items` independent items and `work`
    multiply-adds on (for a kernel that must know, e.g. to deal its work out itself)."""
    return max(1, min(threads(), items) if work >= PARALLEL_MIN_WORK else 1)


def run_parallel_on(kernel, n_threads: int, *args):
    """`run_parallel` for a kernel that deals its work out itself: on the `n_threads` that
    `parallel_threads` gave the caller to pass it (not worked out a second time)."""
    return _launch(kernel, n_threads, args)


_pool = {"lock": threading.Lock(), "shared": None}  # shared: may threads launch at once?
_set = threading.local()  # .n: the thread count this thread last gave numba (numba's own
# getter costs 0.6 us, an eighth of a small product's whole call)


def _launch(kernel, want: int, args):
    """Numba's own thread pool ("workqueue", used where neither OpenMP nor TBB is installed)
    is not safe for launches from several threads at once (a node computes from gRPC worker
    threads; audits run beside the decode loop): its results came back wrong in a
    container without libgomp. There, launches take turns; OpenMP and TBB need no lock."""
    if _pool["shared"]:
        if getattr(_set, "n", 0) != want:
            numba.set_num_threads(want)
            _set.n = want
        return kernel(*args)
    with _pool["lock"]:
        if getattr(_set, "n", 0) != want:
            numba.set_num_threads(want)
            _set.n = want
        out = kernel(*args)
        if _pool["shared"] is None:  # known once a kernel has launched
            _pool["shared"] = numba.threading_layer() != "workqueue"
        return out


# ---------------------------------------------------------------------------------------------
# compute


def matmul(data: np.ndarray, fmt: str, rows: int, cols: int, x: np.ndarray) -> np.ndarray:
    """x float32 [b, cols] -> float32 [b, rows] = x @ W.T, computed on the packed bytes.

    q4_0/q8_0: x quantised to 8 bits per block and integer dot products (or float32 x and
    codes converted in registers: `use_activations`); f32/bf16 in float32 FMA lanes
    (`moeshard.moe.kernels.fdots`).
    """
    return PackedMatrix(data, fmt, rows, cols)(x)


class PackedMatrix:
    """A packed matrix checked once, for calling many times (the trunk's linear layers):
    `matmul` without re-validating the buffer on every call, which cost about as much as a
    small model's whole product (14 us against 6-20 us for 256-column matrices)."""

    __slots__ = ("fmt", "rows", "cols", "_args", "_serial")

    def __init__(self, data: np.ndarray, fmt: str, rows: int, cols: int):
        nbytes, row_bytes, s_off = _matrix_layout(fmt, rows, cols)
        _check_buffer(data, nbytes, f"packed {fmt} {rows}x{cols} matrix")
        self.fmt, self.rows, self.cols = fmt, rows, cols
        self._args = (_readonly(data), rows, cols, row_bytes, s_off, dots.F16_LUT)
        self._serial = entry.matmul_serial_kernel

    def fused_args(self) -> tuple:
        """(format code, data, rows, cols, row_bytes, scale_off): the matrix as a kernel that
        calls `entry.matmul_serial_kernel` itself takes it (`model.fused_layer`)."""
        return (_FMT_CODE[self.fmt], *self._args[:5])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x float32 [b, cols] -> float32 [b, rows], the same bits as `matmul`."""
        x = _check_x(x, self.cols)
        code = _FMT_CODE[self.fmt]
        args = (code, _int8(), *self._args, x)
        work = self.rows * self.cols * x.shape[0]  # (a batch of rows is worth the pool sooner)
        weights = work // MATMUL_PARALLEL_FACTOR
        return _run(entry.matmul_kernel, weights, *args, serial=self._serial)


class PackedGroup:
    """Several packed matrices of one format and width that take the same input (a layer's q,
    k and v projections), computed in one kernel call: one dispatch, one preparation of x,
    one wake-up of the pool.  Each product has the bits `PackedMatrix` gives it alone."""

    __slots__ = ("fmt", "rows", "cols", "_args", "_split")

    def __init__(self, matrices: list[PackedMatrix]):
        if len({(m.fmt, m.cols) for m in matrices}) != 1:
            raise ValueError("a matrix group needs one format and one width")
        first = matrices[0]
        self.fmt, self.cols = first.fmt, first.cols
        self.rows = tuple(m.rows for m in matrices)
        datas = tuple(m._args[0] for m in matrices)
        row_bytes = tuple(m._args[3] for m in matrices)
        scale_offs = tuple(m._args[4] for m in matrices)
        self._args = (datas, self.rows, self.cols, row_bytes, scale_offs, dots.F16_LUT)
        self._split = np.cumsum((0,) + self.rows)  # [n + 1]: each block's start, per row of x

    def fused_args(self) -> tuple:
        """(format code, datas, rows, cols, row_bytes, scale_offs), as `PackedMatrix`'s."""
        return (_FMT_CODE[self.fmt], *self._args[:5])

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        """x float32 [b, cols] -> [float32 [b, rows_m] for each matrix m], C-contiguous."""
        x = _check_x(x, self.cols)
        b = x.shape[0]
        args = (_FMT_CODE[self.fmt], _int8(), *self._args, x)
        work = int(self._split[-1]) * self.cols * b
        flat = _run(
            entry.matmul_group_kernel,
            work // MATMUL_PARALLEL_FACTOR,
            *args,
            serial=entry.matmul_group_serial_kernel,
        )  # [b * sum(rows)]
        return [
            flat[b * int(s) : b * int(e)].reshape(b, -1)
            for s, e in zip(self._split[:-1], self._split[1:], strict=True)
        ]


# ---------------------------------------------------------------------------------------------
# expert formats
#
# An expert record's format is one weight format for its three matrices ("q4_0"), or gate and
# up in one and down in another ("q4_K/q6_K": a GGUF file's mix, kept as it is).  A model's
# expert format spec is one record format for every layer, or one per layer of the model,
# comma-separated ("-" for a layer without experts): llama-quantize's Q4_K_M gives some
# layers' down projections Q6_K and others Q4_K.  Every record of a model is one size, the
# largest of its layers' (a smaller layer's records end in zeros), so stores, nodes, audits
# and proofs of possession see one record size as before.


# A record format ending in BIAS ("mxfp4+bias") carries its expert's biases after the down
# matrix (gpt-oss): float32 gate bias [inter], up bias [inter], down bias [hidden], from an
# offset rounded up to BIAS_ALIGN; the kernels add them (`entry._gate_up_bias`).
BIAS = "+bias"
BIAS_ALIGN = 64


def has_bias(fmt: str) -> bool:
    """Whether the records of a record format (or of every layer of a spec) carry biases."""
    return all(e.endswith(BIAS) for e in expert_format_entries(fmt) if e != "-")


@functools.lru_cache(maxsize=256)
def expert_format_entries(spec: str) -> tuple[str, ...]:
    """The record formats of an expert format spec, validated: one, or one per layer."""
    entries = tuple(spec.split(","))
    for one in entries:
        if one == "-" and len(entries) > 1:
            continue
        parts = one.removesuffix(BIAS).split("/")
        if len(parts) > 2 or not all(p in ALL_FORMATS for p in parts):
            raise ValueError(
                f"expert format {spec!r}: {one!r} is not a weight format or a gate-up/down "
                f"pair of them ({', '.join(ALL_FORMATS)})"
            )
    return entries


def record_format(spec: str, layer: int) -> str:
    """Layer `layer`'s record format under an expert format spec."""
    entries = expert_format_entries(spec)
    if len(entries) == 1:
        return entries[0]
    if not 0 <= layer < len(entries) or entries[layer] == "-":
        raise ValueError(f"expert format {spec!r} has no experts for layer {layer}")
    return entries[layer]


def record_matrix_formats(fmt: str) -> tuple[str, str, str]:
    """A record format's (gate, up, down) weight formats (one record format: a spec with
    one per layer is refused, not read as its first layer's)."""
    entries = expert_format_entries(fmt)
    if len(entries) != 1 or entries[0] == "-":
        raise ValueError(f"expert format {fmt!r} is not one record format (record_format)")
    parts = entries[0].removesuffix(BIAS).split("/")
    return parts[0], parts[0], parts[-1]


def matrix_formats(spec: str) -> set[str]:
    """Every weight format an expert format spec uses."""
    entries = expert_format_entries(spec)
    return {f for e in entries if e != "-" for f in e.removesuffix(BIAS).split("/")}


def expert_record_nbytes(fmt: str, hidden: int, inter: int) -> int:
    """Bytes of one packed expert record: gate, up [inter, hidden] then down [hidden, inter]
    (the largest layer's, for a spec with one format per layer)."""
    sizes = [_expert_layout(e, hidden, inter)[0] for e in expert_format_entries(fmt) if e != "-"]
    if not sizes:
        raise ValueError(f"expert format {fmt!r} has no layer with experts")
    return max(sizes)


def pack_expert(
    gate: np.ndarray, up: np.ndarray, down: np.ndarray, fmt: str, biases=None
) -> np.ndarray:
    """gate, up float32 [inter, hidden], down [hidden, inter] -> uint8 [expert_record_nbytes];
    a record format with biases (`BIAS`) takes them as biases = (gate [inter], up [inter],
    down [hidden])."""
    fg, fu, fd = record_matrix_formats(fmt)
    gate, up, down = (_check_matrix(m, f) for m, f in ((gate, fg), (up, fu), (down, fd)))
    inter, hidden = gate.shape
    if up.shape != (inter, hidden) or down.shape != (hidden, inter):
        raise ValueError(
            f"expert shapes disagree: gate {gate.shape}, up {up.shape}, down {down.shape}; "
            f"want gate/up [inter, hidden] and down [hidden, inter]"
        )
    matrices = np.concatenate([pack(gate, fg), pack(up, fu), pack(down, fd)])
    return with_biases(matrices, fmt, hidden, inter, biases)


def with_biases(matrices: np.ndarray, fmt: str, hidden: int, inter: int, biases) -> np.ndarray:
    """A record's packed matrices (uint8) followed by its biases, as record format `fmt` lays
    them out (biases None for a format without them)."""
    nbytes, layout = _expert_layout(fmt, hidden, inter)
    if (biases is not None) != has_bias(fmt):
        raise ValueError(f"expert format {fmt!r} {'needs' if has_bias(fmt) else 'takes no'} biases")
    if biases is None:
        return matrices
    shapes = ((inter,), (inter,), (hidden,))
    parts = [np.asarray(b) for b in biases]
    if [p.shape for p in parts] != list(shapes):
        raise ValueError(f"expert biases {[p.shape for p in parts]}, want {list(shapes)}")
    record = np.zeros(nbytes, dtype=np.uint8)  # [record bytes]
    record[: matrices.size] = matrices
    tail = np.concatenate([p.astype(np.float32) for p in parts]).view(np.uint8)
    record[layout[5] :] = tail
    return record


@functools.lru_cache(maxsize=1024)
def _expert_layout(fmt: str, hidden: int, inter: int) -> tuple[int, tuple[int, ...]]:
    """(record bytes, kernel layout tuple) for one expert of record format fmt, validated:
    layout = (gate/up bytes, their row bytes, their scale offset, down's row bytes, its scale
    offset, the biases' offset or -1)."""
    gu, _, d = record_matrix_formats(fmt)
    n_gu, rb_gu, s_gu = _matrix_layout(gu, inter, hidden)
    n_d, rb_d, s_d = _matrix_layout(d, hidden, inter)
    nbytes = 2 * n_gu + n_d
    if not has_bias(fmt):
        return nbytes, (n_gu, rb_gu, s_gu, rb_d, s_d, -1)
    bias_off = -(-nbytes // BIAS_ALIGN) * BIAS_ALIGN
    return bias_off + 4 * (2 * inter + hidden), (n_gu, rb_gu, s_gu, rb_d, s_d, bias_off)


def _record_code(fmt: str) -> int:
    """The expert kernels' format code of a record format: gate-up's code + 16 x down's."""
    gu, _, d = record_matrix_formats(fmt)
    return _FMT_CODE[gu] + 16 * _FMT_CODE[d]


def expert_ffn(
    record: np.ndarray, fmt: str, hidden: int, inter: int, x: np.ndarray, glu: Glu = SWIGLU
) -> np.ndarray:
    """x float32 [b, hidden] -> [b, hidden] = glu(x@gate.T, x@up.T) @ down.T (`Glu`).

    One kernel call on the packed record; the intermediate [b, inter] stays float32.
    """
    nbytes, layout = _expert_layout(fmt, hidden, inter)
    _check_buffer(record, nbytes, f"{fmt} expert record (hidden={hidden}, inter={inter})")
    x = _check_x(x, hidden)
    args = (_record_code(fmt), _int8(), _readonly(record), hidden, inter, layout, dots.F16_LUT)
    args += (x,)
    return _run(entry.expert_ffn_kernel, inter * hidden, *args, _glu(glu))


def experts_ffn_b1(
    arena: np.ndarray, offsets, fmt: str, hidden: int, inter: int, x: np.ndarray, glu=SWIGLU
) -> np.ndarray:
    """`expert_ffn` for m experts at batch 1 in one kernel call: expert e is the record at
    arena[offsets[e]:][:record bytes], applied to x[e] (float32 [m, hidden]) -> [m, hidden].
    Same results as m calls of `expert_ffn` (bit for bit), faster: see the kernel."""
    nbytes, layout = _expert_layout(fmt, hidden, inter)
    if not isinstance(arena, np.ndarray) or arena.dtype != np.uint8 or arena.ndim != 1:
        raise ValueError("arena must be a 1-D uint8 numpy array")
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)  # [m]
    if offsets.ndim != 1 or ((offsets < 0) | (offsets + nbytes > arena.size)).any():
        raise ValueError(f"expert records must lie inside the arena of {arena.size} bytes")
    x = _check_x(x, hidden)
    if x.shape[0] != offsets.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows for {offsets.shape[0]} experts")
    args = (_record_code(fmt), _int8(), _readonly(arena), _readonly(offsets), nbytes, hidden)
    args += (inter, layout)
    n_weights = offsets.size * inter * hidden
    return _run(entry.experts_b1_kernel, n_weights, *args, dots.F16_LUT, x, _glu(glu))


def experts_ffn_rows(
    arena: np.ndarray, offsets, fmt: str, hidden: int, inter: int, x, starts, glu=SWIGLU
) -> np.ndarray:
    """`expert_ffn` for m experts, each on its own rows, in one kernel call: expert e is the
    record at arena[offsets[e]:][:record bytes], applied to x[starts[e]:starts[e + 1]]
    (float32 [N, hidden]) -> [N, hidden]; each row the same bits as `expert_ffn` gives it."""
    nbytes, layout = _expert_layout(fmt, hidden, inter)
    if not isinstance(arena, np.ndarray) or arena.dtype != np.uint8 or arena.ndim != 1:
        raise ValueError("arena must be a 1-D uint8 numpy array")
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)  # [m]
    starts = np.ascontiguousarray(starts, dtype=np.int64)  # [m + 1]
    if offsets.ndim != 1 or ((offsets < 0) | (offsets + nbytes > arena.size)).any():
        raise ValueError(f"expert records must lie inside the arena of {arena.size} bytes")
    x = _check_x(x, hidden)
    if starts.shape != (offsets.size + 1,) or starts[0] != 0 or starts[-1] != x.shape[0]:
        raise ValueError("starts must run from 0 to the rows of x, one more than the experts")
    if (np.diff(starts) < 0).any():
        raise ValueError("starts must not decrease")
    args = (_record_code(fmt), _int8(), _readonly(arena), _readonly(offsets), nbytes, hidden)
    n_weights = x.shape[0] * inter * hidden
    args += (inter, layout, dots.F16_LUT, x, _readonly(starts), _glu(glu), _threads_for(n_weights))
    return _run(entry.experts_rows_kernel, n_weights, *args)


def group_by_expert(ids: np.ndarray, weights: np.ndarray, hidden: np.ndarray):
    """ids/weights [T, k], hidden [T, H] -> (experts [m], starts [m + 1], rows [P],
    x [P, H], w [P]): the pairs by expert, rows ascending within one (`entry.group_by_expert`)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)  # [T, k]
    weights = np.ascontiguousarray(weights, dtype=np.float32)  # [T, k]
    hidden = np.ascontiguousarray(hidden, dtype=np.float32)  # [T, H]
    if ids.ndim != 2 or weights.shape != ids.shape or hidden.shape[0] != ids.shape[0]:
        raise ValueError(f"ids {ids.shape}, weights {weights.shape}, hidden {hidden.shape}")
    return entry.group_by_expert(ids, weights, hidden)


def accumulate_rows(out: np.ndarray, rows: np.ndarray, y: np.ndarray, w: np.ndarray) -> None:
    """out[rows[j]] += float32(y[j] * w[j]) in float64, j in order (`entry.accumulate_rows`)."""
    entry.accumulate_rows(out, np.ascontiguousarray(rows, dtype=np.int64), y, w)


@functools.lru_cache(maxsize=64)
def experts_args(fmt: str, hidden: int, inter: int, glu: Glu = SWIGLU) -> tuple:
    """(format code, record bytes, layout, glu tuple) of an expert shape: worked out once, not
    on every decode call."""
    nbytes, layout = _expert_layout(fmt, hidden, inter)
    return _record_code(fmt), nbytes, layout, _glu(glu)


def experts_ffn_b1_sum(
    arena: np.ndarray, offsets: np.ndarray, fmt: str, hidden: int, inter: int, x, w, glu=SWIGLU
) -> np.ndarray:
    """sum_e w[e] * expert_e(x) for one row x float32 [1, hidden], expert e the record at
    arena[offsets[e]:] and w float32 [m] -> float64 [hidden]: each weighted output rounded to
    float32, then added in float64 in the given order (what `moeshard.moe.experts.compute.combine`
    does with the parts of `run_experts`, bit for bit), in one kernel call."""
    code, nbytes, layout, glu_args = experts_args(fmt, hidden, inter, glu)
    if not isinstance(arena, np.ndarray) or arena.dtype != np.uint8 or arena.ndim != 1:
        raise ValueError("arena must be a 1-D uint8 numpy array")
    starts = [int(v) for v in offsets]  # a handful: Python ints are cheaper than numpy here
    if starts and (min(starts) < 0 or max(starts) + nbytes > arena.size):
        raise ValueError(f"expert records must lie inside the arena of {arena.size} bytes")
    offsets = np.array(starts, dtype=np.int64)  # [m]
    offsets.flags.writeable = False  # (a fresh array: read-only in place, no view made)
    x = _check_x(x, hidden)
    w = np.array(w, dtype=np.float32)  # [m]
    w.flags.writeable = False
    if x.shape[0] != 1 or w.shape != offsets.shape:
        raise ValueError(f"want one row and one weight per expert, got x {x.shape}, w {w.shape}")
    args = (code, _int8(), _readonly(arena), offsets, nbytes, hidden, inter, layout)
    args += (dots.F16_LUT, x, w, glu_args)
    n_weights = offsets.size * inter * hidden
    return _run(
        entry.experts_b1_sum_kernel, n_weights, *args, serial=entry.experts_b1_sum_serial_kernel
    )


_calibrated = {"done": False, "from_work": 0}  # `calibrate_matmul`'s finding


def calibrate_matmul(cols: int = 256) -> int:
    """With spinning pool threads (`spin_while_waiting`), the batch-1 product size (rows x
    cols) from which two threads beat one, measured here: bf16 matrices of `cols` columns
    and 128..2048 rows, alternating one thread and the pool, medians of 25 calls each; the
    first size at which the pool takes under 85% of one thread's time.  MATMUL_PARALLEL_FACTOR
    is set from it.  Why measured: it moves with the core, the cache and the VM (on a 2-core
    Xeon, 256 columns: 512 rows 7.9 us alone against 8.7 us on two threads, 4096 rows 79
    against 40), and a decode step of a small model is dozens of such products.  Once per
    process, a few milliseconds; returns the size found."""
    global MATMUL_PARALLEL_FACTOR
    if _calibrated["done"]:
        return _calibrated["from_work"]
    code, int8, lut = dots.FMT_BF16, _int8(), dots.F16_LUT
    x = _readonly(np.ones((1, cols), dtype=np.float32))
    found = 2 * 2048 * cols  # (if the pool never wins below that: from there)
    for rows in (128, 256, 512, 1024, 2048):
        nbytes, row_bytes, s_off = _matrix_layout("bf16", rows, cols)
        args = (code, int8, _readonly(np.zeros(nbytes, np.uint8)), rows, cols, row_bytes, s_off)
        args += (lut, x)
        alone, pool = [], []
        for i in range(30):
            t0 = time.perf_counter()
            entry.matmul_serial_kernel(*args)
            t1 = time.perf_counter()
            _launch(entry.matmul_kernel, threads(), args)
            t2 = time.perf_counter()
            if i >= 5:  # (the first calls warm the caches)
                alone.append(t1 - t0)
                pool.append(t2 - t1)
        if threads() > 1 and np.median(pool) < 0.85 * np.median(alone):
            found = rows * cols
            break
    MATMUL_PARALLEL_FACTOR = max(1, found // PARALLEL_MIN_WEIGHTS)
    _calibrated.update(done=True, from_work=found)
    return found


def warmup() -> float:
    """Compile (or load from numba's cache) every kernel for every format; returns seconds.

    Kernels take the format as a runtime int and see only read-only C-contiguous inputs, so
    one call per entry point covers every format and batch size.
    """
    t0 = time.perf_counter()
    dots.pause_seconds()  # (`spin_while_waiting` times the CPU's pause with a kernel too)
    hidden, inter = 64, 96
    nbytes, layout = _expert_layout("q4_0", hidden, inter)
    rec = _readonly(np.zeros(nbytes, dtype=np.uint8))
    x = _readonly(np.zeros((2, hidden), dtype=np.float32))
    n_gu, rb_gu, s_gu = layout[:3]
    code, lut, int8 = dots.FMT_Q4_0, dots.F16_LUT, _int8()
    entry.matmul_kernel(code, int8, rec[:n_gu], inter, hidden, rb_gu, s_gu, lut, x)
    entry.matmul_serial_kernel(code, int8, rec[:n_gu], inter, hidden, rb_gu, s_gu, lut, x)
    three = ((rec[:n_gu],) * 3, (inter,) * 3, hidden, (rb_gu,) * 3, (s_gu,) * 3, lut, x)
    entry.matmul_group_kernel(code, int8, *three)  # (a layer's q, k, v: `PackedGroup`)
    entry.matmul_group_serial_kernel(code, int8, *three)
    glu = _glu(SWIGLU)
    gated_unit(np.zeros((1, 8), dtype=np.float32), np.zeros((1, 8), dtype=np.float32))
    entry.expert_ffn_kernel(code, int8, rec, hidden, inter, layout, lut, x, glu)  # starts the pool
    offsets = _readonly(np.zeros(2, dtype=np.int64))
    entry.experts_b1_kernel(code, int8, rec, offsets, nbytes, hidden, inter, layout, lut, x, glu)
    y = np.zeros((2, hidden), dtype=np.float32)  # writable, as the rows kernel's output is
    entry.accumulate_rows(
        np.zeros((2, hidden)), np.zeros(2, dtype=np.int64), y, np.ones(2, dtype=np.float32)
    )
    ids = np.zeros((2, 2), dtype=np.int64)  # writable, as the router makes them
    group_by_expert(ids, np.ones((2, 2), dtype=np.float32), np.zeros((2, hidden), np.float32))
    starts = _readonly(np.array([0, 1, 2], dtype=np.int64))
    entry.experts_rows_kernel(
        code, int8, rec, offsets, nbytes, hidden, inter, layout, lut, x, starts, glu, 2
    )
    w = _readonly(np.ones(2, dtype=np.float32))
    sum_args = (code, int8, rec, offsets, nbytes, hidden, inter, layout, lut, x[:1], w, glu)
    entry.experts_b1_sum_kernel(*sum_args)
    entry.experts_b1_sum_serial_kernel(*sum_args)
    for fmt in ("bf16", "f32"):  # embedding rows of bf16 and f32 tables, in RAM or mapped
        table = pack(np.zeros((2, hidden), np.float32), fmt)
        for data in (table, _readonly(table)):
            float_rows_at(float_rows_view(data, fmt, 2, hidden), 2, hidden, ids[0])
    if _wait["spinning"]:
        calibrate_matmul()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# numpy twins of the kernels (reference for tests; slow, float64)


def kernel_activations(x: np.ndarray, fmt: str) -> np.ndarray:
    """The activations the kernels of `fmt` multiply, as float64 [b, cols]: x itself, or for
    q4_0/q8_0 with 8-bit activations (`use_activations`) the codes times their block scales
    (q4_K always: it has only the integer kernels)."""
    x = np.ascontiguousarray(x, dtype=np.float32)  # [b, cols]
    if fmt not in GGML_FORMATS and (fmt not in BLOCK_FORMATS or not _int8()):
        return x.astype(np.float64)
    xq, xd, xc = activations.activation_buffers(x.shape[0], x.shape[1])
    activations.quantize_activations(x, xq, xd, xc)
    codes = xq.astype(np.float64).reshape(x.shape[0], -1, QK)  # [b, nb, 32]
    return (codes * xd.astype(np.float64)[..., None]).reshape(x.shape)  # [b, cols]


def matmul_reference(data: np.ndarray, fmt: str, rows: int, cols: int, x: np.ndarray) -> np.ndarray:
    """x @ W.T in float64 with W dequantised by gguf's reference from `unpack_to_ggml(data)`
    and x as the kernels take it (`kernel_activations`)."""
    w = dequantize(unpack_to_ggml(data, fmt, rows, cols), fmt, (rows, cols))  # [rows, cols]
    return kernel_activations(x, fmt) @ w.astype(np.float64).T  # [b, rows]


def expert_ffn_reference(
    record: np.ndarray, fmt: str, hidden: int, inter: int, x: np.ndarray, glu: Glu = SWIGLU
) -> np.ndarray:
    """Float64 twin of `expert_ffn`; the [b, inter] activation is rounded to float32 between
    the two halves exactly like the kernel does."""
    gu, _, d = record_matrix_formats(fmt)
    n_gu, n_d = packed_nbytes(gu, inter, hidden), packed_nbytes(d, hidden, inter)
    g = matmul_reference(record[:n_gu], gu, inter, hidden, x)  # [b, inter]
    u = matmul_reference(record[n_gu : 2 * n_gu], gu, inter, hidden, x)  # [b, inter]
    biases = _reference_biases(record, fmt, hidden, inter)
    if biases is not None:  # added to the float32 products, as the kernel adds them
        g = (g.astype(np.float32) + biases[0]).astype(np.float64)  # [b, inter]
        u = (u.astype(np.float32) + biases[1]).astype(np.float64)  # [b, inter]
    h = glu_reference(g, u, glu).astype(np.float32)  # [b, inter]
    down = record[2 * n_gu : 2 * n_gu + n_d]
    y = matmul_reference(down, d, hidden, inter, h)  # [b, hidden]
    return y if biases is None else (y.astype(np.float32) + biases[2]).astype(np.float64)


def _reference_biases(record: np.ndarray, fmt: str, hidden: int, inter: int):
    """A record's (gate [inter], up [inter], down [hidden]) float32 biases, or None."""
    _, layout = _expert_layout(fmt, hidden, inter)
    if layout[5] < 0:
        return None
    tail = record[layout[5] : layout[5] + 4 * (2 * inter + hidden)].view(np.float32)
    return tail[:inter], tail[inter : 2 * inter], tail[2 * inter :]
