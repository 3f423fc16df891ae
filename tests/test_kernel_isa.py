"""The kernels give the same bits whatever CPU level they are compiled for.

A coordinator recomputes a node's expert output with its own kernels and requires equal bits,
so nothing in an expert's arithmetic may depend on the CPU (docs/kernels.md, "Across CPUs").
This process compiles for this machine (native: AVX2 or AVX-512, with FMA); child processes,
each with its own empty numba cache (numba's cache is keyed by CPU, but not by
MOESHARD_KERNEL_ISA), compile for

* ``generic``: LLVM's generic x86-64 CPU;
* ``sse2``: baseline x86-64 with SSE and SSE2 only (no FMA, no AVX);
* ``portable-int``: this CPU, with `moeshard.moe.kernels.idots`' portable integer step
  (MOESHARD_KERNEL_ISA=generic) instead of AVX2's vpmaddubsw/vpmaddwd (the other two children
  use the portable form as well: their CPUs have no AVX2);
* ``avx2-int`` (on a CPU with AVX-VNNI or AVX512-VNNI, whose native step is vpdpbusd): this
  CPU with AVX2's step (MOESHARD_KERNEL_ISA=avx2).

Each child computes every case below and must give this process's bits: `idots.int_rows` for
every format, batch size, odd block counts, a partial row group and a non-finite activation;
the expert FFN (`expert_ffn`, `experts_ffn_b1`, `experts_ffn_b1_sum`, `experts_ffn_rows`) of
every weight format with SwiGLU and with Kimi K3's SiTU; and the gated unit's exp and tanh
(`moeshard.moe.kernels.fixedmath`) on values over their whole range.  Each child also reads the
machine code it compiled for `entry._glu_mul`: no FMA instruction, no call to libm's exp or tanh (or
to SVML).  The children run at the same time; compiling the kernels is most of their time.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from test_fixedmath import numba_exp, numba_tanh, values

from moeshard.moe.kernels import activations, entry, idots, layout, quant
from moeshard.moe.kernels.entry import _matrix_views

SHAPES = [(5, 96), (9, 2080), (13, 256)]  # (rows, cols): odd and even block counts
BATCHES = (1, 2, 3)
FFN_SHAPES = [(96, 160), (64, 32)]  # (hidden, inter)
GLUS = {"swiglu": quant.SWIGLU, "situ": quant.situ(4.0, 25.0)}
LEVELS = {
    "generic": ({"NUMBA_CPU_NAME": "generic"}, "generic"),
    "sse2": ({"NUMBA_CPU_NAME": "x86-64", "NUMBA_CPU_FEATURES": "+sse,+sse2"}, "generic"),
    "portable-int": ({"MOESHARD_KERNEL_ISA": "generic"}, "generic"),
}
if idots.ISA == "vnni":  # this process has vpdpbusd: a child compiles AVX2's form on this CPU
    LEVELS["avx2-int"] = ({"MOESHARD_KERNEL_ISA": "avx2"}, "avx2")

CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {tests!r})
from moeshard.moe.kernels import idots
from test_kernel_isa import all_outputs, glu_machine_code_problems
assert idots.ISA == {isa!r}, idots.ISA
np.savez({out!r}, **all_outputs())
json.dump(glu_machine_code_problems(), sys.stdout)
"""


def int_rows_all() -> dict[str, np.ndarray]:
    """`idots.int_rows` on fixed weights and activations, for every format, shape and batch."""
    results = {}
    for fmt in quant.BLOCK_FORMATS:
        for rows, cols in SHAPES:
            rng = np.random.default_rng(rows * cols)
            w = rng.standard_normal((rows, cols)).astype(np.float32)  # [rows, cols]
            data = layout._readonly(quant.pack(w, fmt))
            _, row_bytes, scale_off = layout._matrix_layout(fmt, rows, cols)
            wq, ws = _matrix_views(quant._FMT_CODE[fmt], data, rows, cols, row_bytes, scale_off)
            for b in BATCHES:
                x = rng.standard_normal((b, cols)).astype(np.float32) * 3  # [b, cols]
                if b == 3:
                    x[1, 40] = np.inf
                xq, xd, xc = activations.activation_buffers(b, cols)
                activations.quantize_activations(x, xq, xd, xc)
                out = np.empty((b, rows), dtype=np.float32)  # [b, rows]
                idots.int_rows(quant._FMT_CODE[fmt], wq, ws, xq, xd, xc, out, 0, rows)
                results[f"int_rows {fmt} {rows}x{cols} b{b}"] = out
    return results | every_scale() | k_quants()


def k_quants() -> dict[str, np.ndarray]:
    """`idots.int_rows` on random valid blocks of the formats kept from GGUF files (q4_K,
    q5_K, q6_K, iq4_nl, iq4_xs, q4_1, q5_0, q5_1): random code and scale bytes, float16 d
    (and dmin or m) over four decades."""
    results = {}
    for fmt, per, block, d_at in (
        ("q4_K", 256, 144, (0, 4)),
        ("q5_K", 256, 176, (0, 4)),
        ("q6_K", 256, 210, (208, 210)),
        ("iq4_nl", 32, 18, (0, 2)),
        ("iq4_xs", 256, 136, (0, 2)),
        ("q4_1", 32, 20, (0, 4)),
        ("q5_0", 32, 22, (0, 2)),
        ("q5_1", 32, 24, (0, 4)),
    ):
        rows, cols = 13, 512
        rng = np.random.default_rng(block)
        raw = rng.integers(0, 256, (rows, cols // per, block), dtype=np.uint8)
        n = (d_at[1] - d_at[0]) // 2
        d = (10.0 ** rng.uniform(-4, 0, (rows, cols // per, n))).astype(np.float16)
        raw[:, :, d_at[0] : d_at[1]] = d.view(np.uint8).reshape(rows, cols // per, 2 * n)
        data = layout._readonly(quant.pack_ggml(raw.reshape(rows, -1), fmt, rows, cols))
        _, row_bytes, scale_off = layout._matrix_layout(fmt, rows, cols)
        wq, ws = _matrix_views(quant._FMT_CODE[fmt], data, rows, cols, row_bytes, scale_off)
        for b in BATCHES + (4, 5):
            x = rng.standard_normal((b, cols)).astype(np.float32) * 3  # [b, cols]
            if b == 3:
                x[1, 40] = np.inf
            xq, xd, xc = activations.activation_buffers(b, cols)
            activations.quantize_activations(x, xq, xd, xc)
            out = np.empty((b, rows), dtype=np.float32)  # [b, rows]
            idots.int_rows(quant._FMT_CODE[fmt], wq, ws, xq, xd, xc, out, 0, rows)
            results[f"int_rows {fmt} {rows}x{cols} b{b}"] = out
    return results


def every_scale() -> dict[str, np.ndarray]:
    """One block per row, a row for every possible block scale: all 65536 float16 values
    (q8_0; widened by vcvtph2ps, or by integer operations on a CPU without F16C, nan payloads
    included) and all 256 E8M0 bytes (mxfp4)."""
    results = {}
    rng = np.random.default_rng(3)
    for fmt, n_scales, scale_bytes, code_bytes in (("q8_0", 65536, 2, 32), ("mxfp4", 256, 1, 16)):
        raw = rng.integers(0, 256, (n_scales, scale_bytes + code_bytes), dtype=np.uint8)
        scales = np.arange(n_scales, dtype=np.uint16 if scale_bytes == 2 else np.uint8)
        raw[:, :scale_bytes] = scales.view(np.uint8).reshape(n_scales, scale_bytes)
        data = layout._readonly(quant.pack_ggml(raw, fmt, n_scales, 32))
        _, row_bytes, scale_off = layout._matrix_layout(fmt, n_scales, 32)
        wq, ws = _matrix_views(quant._FMT_CODE[fmt], data, n_scales, 32, row_bytes, scale_off)
        x = rng.standard_normal((2, 32)).astype(np.float32)  # [2, 32]
        xq, xd, xc = activations.activation_buffers(2, 32)
        activations.quantize_activations(x, xq, xd, xc)
        out = np.empty((2, n_scales), dtype=np.float32)  # [2, n_scales]
        idots.int_rows(quant._FMT_CODE[fmt], wq, ws, xq, xd, xc, out, 0, n_scales)
        results[f"int_rows {fmt} every scale"] = out
    return results


def expert_records(fmt: str, hidden: int, inter: int, seed: int, n: int) -> list[np.ndarray]:
    """n expert records whose gate and up rows are scaled over 3.5 decades, so the gated unit
    sees gates from about 0.1 to several hundred (exp's overflow, tanh's saturation)."""
    rng = np.random.default_rng(seed)
    recs = []
    for _ in range(n):
        gate, up = (
            rng.standard_normal((inter, hidden)).astype(np.float32)
            * (10.0 ** rng.uniform(-2, 1.5, (inter, 1))).astype(np.float32)
            for _ in range(2)
        )  # [inter, hidden] each
        down = rng.standard_normal((hidden, inter)).astype(np.float32) * np.float32(0.05)
        recs.append(quant.pack_expert(gate, up, down, fmt))
    return recs


def expert_all() -> dict[str, np.ndarray]:
    """The expert FFN kernels on fixed records and rows, every format and gated unit."""
    results = {}
    for fmt in quant.FORMATS:
        for hidden, inter in FFN_SHAPES:
            recs = expert_records(fmt, hidden, inter, seed=hidden + inter, n=3)
            arena, offsets = np.concatenate(recs), np.arange(3) * recs[0].size
            rng = np.random.default_rng(hidden)
            x = rng.standard_normal((5, hidden)).astype(np.float32) * 2  # [5, hidden]
            x[4, 7] = np.inf  # a non-finite row
            w = np.array([0.5, 0.3, 0.2], dtype=np.float32)  # [3]
            for name, glu in GLUS.items():
                key = f"{fmt} {hidden}x{inter} {name}"
                results[f"ffn {key} b1"] = quant.expert_ffn(recs[0], fmt, hidden, inter, x[:1], glu)
                results[f"ffn {key} b5"] = quant.expert_ffn(recs[1], fmt, hidden, inter, x, glu)
                b1 = quant.experts_ffn_b1(arena, offsets, fmt, hidden, inter, x[:3], glu)
                total = quant.experts_ffn_b1_sum(arena, offsets, fmt, hidden, inter, x[:1], w, glu)
                rows = quant.experts_ffn_rows(
                    arena, offsets, fmt, hidden, inter, x, [0, 2, 2, 5], glu
                )
                results[f"b1 {key}"], results[f"b1_sum {key}"] = b1, total  # total: float64
                results[f"rows {key}"] = rows
    return results


def elementary_all() -> dict[str, np.ndarray]:
    """`fixedmath.exp`/`tanh` compiled into numba loops, and the gated unit itself."""
    x = values(20_000, seed=11)  # float64 [~100k]
    rng = np.random.default_rng(12)
    g = (rng.standard_normal((16, 4096)) * 10.0 ** rng.uniform(-1, 2.5, (16, 1))).astype(np.float32)
    u = (rng.standard_normal((16, 4096)) * 10.0 ** rng.uniform(-1, 2.5, (16, 1))).astype(np.float32)
    results = {"exp": numba_exp(x), "tanh": numba_tanh(x)}
    for name, glu in GLUS.items():
        results[f"glu {name}"] = entry._glu_mul(g, u, quant._glu(glu))  # [16, 4096]
    return results


def float_products_all() -> dict[str, np.ndarray]:
    """`quant.matmul` and `quant.PackedGroup` of f32 and bf16 rows (sixteen AVX-512 lanes
    where numba compiles for AVX-512, two sets of eight elsewhere), widths with and without a
    tail past the last 16 columns, batches from 1 to 17 (17: the narrow rows' four-row pass)."""
    results = {}
    for fmt in ("f32", "bf16"):
        for rows, cols in [(5, 96), (13, 2083), (36, 512)]:
            rng = np.random.default_rng(rows + cols)
            w = rng.standard_normal((rows, cols)).astype(np.float32)  # [rows, cols]
            data = quant.pack(w, fmt)
            for b in (1, 2, 17):
                x = rng.standard_normal((b, cols)).astype(np.float32)  # [b, cols]
                results[f"matmul {fmt} {rows}x{cols} b{b}"] = quant.matmul(data, fmt, rows, cols, x)
            mats = [quant.PackedMatrix(data, fmt, rows, cols)] * 2
            x = rng.standard_normal((3, cols)).astype(np.float32)  # [3, cols]
            for i, y in enumerate(quant.PackedGroup(mats)(x)):
                results[f"group {fmt} {rows}x{cols} part {i}"] = y
    return results


def all_outputs() -> dict[str, np.ndarray]:
    return int_rows_all() | float_products_all() | expert_all() | elementary_all()


FMA = re.compile(r"\bv?f(n?m(add|sub)|maddsub|msubadd)\w*", re.IGNORECASE)
LIBM = re.compile(r"\b(exp|expf|tanh|tanhf|__\w*exp\w*|__\w*tanh\w*|__svml\w*)\b")


def glu_machine_code_problems() -> list[str]:
    """What `entry._glu_mul`'s compiled code should not hold: FMA instructions, calls to
    libm's or SVML's exp and tanh, LLVM's exp/fma intrinsics and fast-math flags.  Only in a
    process that compiled it (numba does not keep the code of what it loads from its cache)."""
    g = np.ones((2, 40), dtype=np.float32)
    entry._glu_mul(g, g, quant._glu(quant.SWIGLU))
    problems = []
    ir_bad = r"@llvm\.(exp|tanh|fma|fmuladd)\.|@(exp|tanh)\(|\b(fast|contract|reassoc|afn)\b"
    for sig in entry._glu_mul.signatures:
        asm, ir = entry._glu_mul.inspect_asm(sig), entry._glu_mul.inspect_llvm(sig)
        if not re.search(r"div[sp]d", asm):
            problems.append("no machine code to inspect")
        problems += [f"instruction {m.group(0)}" for m in FMA.finditer(asm)]
        problems += [f"calls {m.group(0)}" for m in LIBM.finditer(asm)]
        problems += [f"IR {m.group(0)}" for m in re.finditer(ir_bad, ir)]
    return problems


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """{level: (outputs, machine-code problems)} from one child per level, run concurrently."""
    tests = os.path.dirname(os.path.abspath(__file__))
    running = {}
    for level, (env, isa) in LEVELS.items():
        root = tmp_path_factory.mktemp(level)
        out = str(root / "out.npz")
        child_env = dict(os.environ, NUMBA_CACHE_DIR=str(root / "numba"), **env)
        for key in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "MOESHARD_KERNEL_ISA"):
            if key not in env:
                child_env.pop(key, None)
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD.format(tests=tests, out=out, isa=isa)],
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        running[level] = (proc, out)
    done = {}
    for level, (proc, out) in running.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{level}: {stderr}"
        with np.load(out) as saved:
            done[level] = ({key: saved[key] for key in saved.files}, json.loads(stdout))
    return done


@pytest.fixture(scope="module")
def here():
    return all_outputs()


@pytest.mark.parametrize("level", LEVELS)
def test_every_case_gives_equal_bits_on_another_cpu_level(level, children, here):
    there, _ = children[level]
    assert sorted(there) == sorted(here)
    differ = [key for key, y in here.items() if not same_bits(there[key], y)]
    assert not differ, f"{level}: {len(differ)} of {len(here)} differ: {differ[:8]}"


@pytest.mark.parametrize("level", LEVELS)
def test_gated_unit_compiles_without_fma_or_libm(level, children):
    _, problems = children[level]
    assert not problems, f"{level}: {problems[:8]}"


def test_forced_isa_must_be_known(tmp_path):
    env = dict(os.environ, MOESHARD_KERNEL_ISA="avx9", NUMBA_CACHE_DIR=str(tmp_path))
    child = subprocess.run(
        [sys.executable, "-c", "import moeshard.moe.kernels.idots"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode != 0 and "MOESHARD_KERNEL_ISA='avx9'" in child.stderr
