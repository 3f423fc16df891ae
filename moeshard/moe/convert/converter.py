"""Hugging Face checkpoint directory -> moeshard model directory, streaming tensor by tensor.

Memory stays bounded by the largest single tensor (plus one expert): safetensors files are
memory-mapped, each tensor is converted, packed, checksummed and written before the next.
Everything is written into a temporary directory beside OUT and renamed into place at the end,
so a failure leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import logging
import re
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from moeshard.moe.convert import int4, mxfp4
from moeshard.moe.convert.checkpoint import Checkpoint
from moeshard.moe.convert.outdir import check_output, staged
from moeshard.moe.errors import CheckpointError, ConfigError
from moeshard.moe.kernels import quant
from moeshard.moe.model.config import read_json
from moeshard.moe.model.families import family_for, load_config
from moeshard.moe.storage import merkle
from moeshard.moe.storage.io import copy_file
from moeshard.moe.storage.manifest import (
    FORMAT_VERSION,
    SHARD_MAX_BYTES,
    TRUNK_FILE,
    config_digest,
    content_id,
    covers_entry,
    write_manifest,
)
from moeshard.moe.storage.shards import ShardWriter
from moeshard.moe.storage.trunk_file import TrunkWriter, as_matrix

log = logging.getLogger(__name__)

EXPERT_FORMATS = ("f32", "bf16", "q8_0", "q4_0", "mxfp4")
KEPT_ONLY_FORMATS = quant.GGML_FORMATS  # only as a GGUF file's experts bring them (no quantiser)
TRUNK_FORMATS = ("f32", "bf16", "q8_0")
DEFAULT_EXPERT_FORMAT = "q4_0"
DEFAULT_TRUNK_FORMAT = "bf16"
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",  # (where transformers now saves a chat template: gpt-oss's)
    "tiktoken.model",  # Kimi's tokenizer (`moeshard.coordinator.tokenizer`)
)

_PER_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight(?:_packed)?$"
)
_STACKED = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\."
    r"(gate_up_proj|gate_proj|up_proj|down_proj)(_blocks|_bias)?(?:\.weight)?$"
)  # (gpt-oss: `*_blocks` with `*_scales` beside them are MXFP4, `*_bias` the biases)
_BLOCKS, _SCALES = "_blocks", "_scales"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_ALWAYS_F32 = (
    "norm.weight",
    "layernorm.weight",
    ".bias",
    "mlp.gate.weight",
    "block_sparse_moe.gate.weight",  # Kimi Linear's router
    "_res_proj.weight",  # Kimi K3's attention-residual scores ([1, H])
    "shared_expert_gate",
)


@dataclass
class Plan:
    """What the converter found in the checkpoint, before writing anything."""

    trunk: dict[str, str] = field(default_factory=dict)  # canonical name -> checkpoint name
    fp8_block: tuple[int, int] = (128, 128)  # quantization_config.weight_block_size
    per_expert: dict[tuple[int, int, str], str] = field(default_factory=dict)  # (L, E, proj)
    stacked: dict[tuple[int, str], str] = field(default_factory=dict)  # (L, proj) -> name
    skipped: dict[str, str] = field(default_factory=dict)  # name -> reason
    mxfp4_experts: bool = False  # experts published as compressed-tensors MXFP4 (`mxfp4`)
    mxfp4_blocks: bool = False  # experts published as gpt-oss's MXFP4 (`*_blocks`, `*_scales`)
    int4_experts: bool = False  # experts published as compressed-tensors INT4 (`int4`: q4_0)


def quantization_config(raw: dict) -> dict:
    """config.json's quantization_config: top level, or (Kimi K3) in its text_config."""
    text = raw.get("text_config")
    nested = text.get("quantization_config") if isinstance(text, dict) else None
    return raw.get("quantization_config") or nested or {}


PACKED_SCHEMES = {mxfp4.FORMAT: "mxfp4", int4.FORMAT: "int4"}  # compressed-tensors' formats


def packed_scheme(quantization: dict, where: str) -> str:
    """Which compressed-tensors scheme a checkpoint's `*.weight_packed` experts use ("mxfp4"
    or "int4", checked): others (NVFP4, asymmetric INT4, ...) pack other codes the same way."""
    formats = {quantization.get("format")}
    for group in (quantization.get("config_groups") or {}).values():
        if isinstance(group, dict):
            formats.add(group.get("format"))
    formats.discard(None)
    if len(formats) != 1 or next(iter(formats)) not in PACKED_SCHEMES:
        got = ", ".join(sorted(map(str, formats))) or "none"
        raise CheckpointError(
            f"{where}: *{mxfp4.PACKED} tensors with quantization_config format {got}; only "
            f"compressed-tensors {' and '.join(map(repr, PACKED_SCHEMES))} are supported"
        )
    scheme = PACKED_SCHEMES[formats.pop()]
    if scheme == "int4":
        int4.check_scheme(quantization, where)
    return scheme


def plan_conversion(config, family, ckpt: Checkpoint, quantization: dict) -> Plan:
    """Sort every checkpoint tensor into trunk / expert / skipped; check nothing is missing."""
    skip_reason = getattr(family, "skip_reason", lambda name: None)
    block = quantization.get("weight_block_size") or (128, 128)
    plan = Plan(fp8_block=(int(block[0]), int(block[1])))
    wanted = config.trunk_shapes()
    moe_layers = set(config.moe_layers)
    names = set(ckpt.names())
    packed = False  # *.weight_packed experts: which scheme, the config says (below)
    for name in ckpt.names():
        if name.endswith("_scale_inv"):
            continue  # fp8 scales travel with their weight
        if name.endswith((int4.SCALE, int4.SHAPE)) and _packed_name(name) in names:
            continue  # MXFP4 and INT4 scales (and INT4 shapes) travel with their codes
        if name.endswith(_SCALES) and name[: -len(_SCALES)] + _BLOCKS in names:
            continue  # (gpt-oss's MXFP4 likewise)
        canonical = family.canonical_name(name)
        m = _LAYER.match(canonical)
        if m and int(m.group(1)) >= config.num_hidden_layers:
            plan.skipped[name] = "layer beyond num_hidden_layers (e.g. multi-token prediction)"
            continue
        if (m := _PER_EXPERT.match(canonical)) is not None:
            layer, expert, proj = int(m.group(1)), int(m.group(2)), _PROJ.get(m[3], m[3])
            plan.per_expert[(layer, expert, proj)] = name
            packed |= name.endswith(mxfp4.PACKED)
            continue
        if (m := _STACKED.match(canonical)) is not None:
            plan.stacked[(int(m.group(1)), m.group(2) + (m.group(3) or ""))] = name
            plan.mxfp4_blocks |= m.group(3) == _BLOCKS
            continue
        if canonical in wanted:
            plan.trunk[canonical] = name
        elif canonical == "lm_head.weight" and config.tie_word_embeddings:
            plan.skipped[name] = "tied to the embeddings"
        else:
            plan.skipped[name] = skip_reason(name) or "not used by inference"
    source = ckpt.directory
    if packed:
        scheme = packed_scheme(quantization, f"{source / 'config.json'}")
        plan.mxfp4_experts, plan.int4_experts = scheme == "mxfp4", scheme == "int4"
    if plan.mxfp4_blocks and quantization.get("quant_method") != "mxfp4":
        raise CheckpointError(
            f"{source / 'config.json'}: *{_BLOCKS} expert tensors but quantization_config "
            f"quant_method {quantization.get('quant_method')!r}, not 'mxfp4'"
        )
    for canonical, shape in wanted.items():
        if canonical not in plan.trunk:
            raise CheckpointError(f"{source}: missing tensor '{canonical}'")
        got = ckpt.shape(plan.trunk[canonical])
        if tuple(got) != tuple(shape):
            raise CheckpointError(
                f"{ckpt.describe(plan.trunk[canonical])}: shape {list(got)}, expected {list(shape)}"
            )
    for layer in moe_layers:
        for expert in range(config.n_experts):
            expert_shapes(config, plan, ckpt, layer, expert, check_only=True)
            expert_biases(config, plan, ckpt, layer, expert)
    return plan


def expert_shapes(config, plan: Plan, ckpt: Checkpoint, layer, expert, check_only=False):
    """Check (or load) expert `expert` of `layer`: returns gate, up [I, H], down [H, I], each
    float32, or a `mxfp4.PackedMxfp4` where the checkpoint publishes them so."""
    h, inter = config.expert_hidden, config.expert_intermediate
    want = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    out = {}
    for proj, shape in want.items():
        name = plan.per_expert.get((layer, expert, proj))
        if name is not None and name.endswith(mxfp4.PACKED):
            read = _int4_matrix if plan.int4_experts else _mxfp4_matrix
            out[proj] = read(ckpt, name, shape, check_only)
            continue
        if name is not None:
            if tuple(ckpt.shape(name)) != shape:
                raise CheckpointError(
                    f"{ckpt.describe(name)}: shape {list(ckpt.shape(name))}, expected {list(shape)}"
                )
            if check_only:
                out[proj] = None
            elif hasattr(ckpt, "matrix"):  # (a GGUF file: its ggml bytes, to keep)
                out[proj] = ckpt.matrix(name)
            else:
                out[proj] = ckpt.float32(name, plan.fp8_block)
            continue
        out[proj] = _from_stack(config, plan, ckpt, layer, expert, proj, shape, check_only)
    if check_only:
        return None
    return out["gate_proj"], out["up_proj"], out["down_proj"]


def _mxfp4_matrix(ckpt: Checkpoint, name: str, shape: tuple[int, int], check_only: bool):
    """The published codes and scales of one MXFP4 matrix (`name` its weight_packed), checked;
    None when only checking."""
    scale = name[: -len(mxfp4.PACKED)] + mxfp4.SCALE
    if scale not in ckpt.where:
        raise CheckpointError(f"{ckpt.describe(name)}: no {scale} beside it")
    dtypes = (ckpt.dtype(name), ckpt.dtype(scale))
    mxfp4.check_shapes(ckpt.describe(name), ckpt.shape(name), ckpt.shape(scale), shape, dtypes)
    return None if check_only else mxfp4.PackedMxfp4(ckpt.raw(name), ckpt.raw(scale))


def _packed_name(name: str) -> str:
    """The weight_packed tensor a scale or shape tensor belongs to."""
    return name[: name.rindex(".weight_")] + int4.PACKED


def _int4_matrix(ckpt: Checkpoint, name: str, shape: tuple[int, int], check_only: bool):
    """The published codes and scales of one INT4 matrix (`name` its weight_packed), checked
    against its weight_shape; None when only checking."""
    base = name[: -len(int4.PACKED)]
    parts = {s: base + s for s in (int4.PACKED, int4.SCALE, int4.SHAPE)}
    for part in parts.values():
        if part not in ckpt.where:
            raise CheckpointError(f"{ckpt.describe(name)}: no {part} beside it")
    shapes = {s: ckpt.shape(n) for s, n in parts.items()}
    dtypes = {s: ckpt.dtype(n) for s, n in parts.items()}
    int4.check_shapes(ckpt.describe(name), shapes, dtypes, shape)
    stated = [int(d) for d in ckpt.raw(parts[int4.SHAPE])]
    if stated != list(shape):
        raise CheckpointError(
            f"{ckpt.describe(parts[int4.SHAPE])}: {stated}, expected {list(shape)} ([out, in])"
        )
    if check_only:
        return None
    return int4.PackedInt4(ckpt.raw(name), ckpt.float32(parts[int4.SCALE]))


def _from_stack(config, plan, ckpt, layer, expert, proj, shape, check_only):
    """One expert's matrix from a stacked [experts, out, in] tensor (or fused gate_up)."""
    n = config.n_experts
    fused = proj in ("gate_proj", "up_proj") and (layer, "gate_up_proj") in plan.stacked
    key = (layer, "gate_up_proj") if fused else (layer, proj)
    if _interleaved(config):
        blocks = (layer, ("gate_up_proj" if fused or proj != "down_proj" else proj) + _BLOCKS)
        if blocks in plan.stacked:
            return _mxfp4_stacked(
                config, ckpt, plan.stacked[blocks], expert, proj, shape, check_only
            )
        fused = proj != "down_proj"
        key = (layer, "gate_up_proj" if fused else proj)
    name = plan.stacked.get(key)
    if name is None:
        raise CheckpointError(
            f"{ckpt.directory}: missing tensor for expert {expert} {proj} of layer {layer} "
            f"(neither model.layers.{layer}.mlp.experts.{expert}.{proj}.weight nor a stacked "
            f"experts tensor)"
        )
    rows, cols = (2 * shape[0], shape[1]) if fused else shape
    got = tuple(ckpt.shape(name))
    if got not in ((n, rows, cols), (n, cols, rows)):
        raise CheckpointError(
            f"{ckpt.describe(name)}: shape {list(got)}, expected {[n, rows, cols]} "
            f"([experts, out, in])"
        )
    if check_only:
        return None
    if _interleaved(config) and got != (n, cols, rows):
        raise CheckpointError(
            f"{ckpt.describe(name)}: shape {list(got)}, expected {[n, cols, rows]} "
            f"([experts, in, out], as gpt-oss stores them)"
        )
    matrix = _slice_expert(ckpt, name, expert)  # [out, in] or [in, out]
    if got == (n, cols, rows) and (rows != cols or _interleaved(config)):
        matrix = matrix.T  # stored [experts, in, out]
    if fused:
        matrix = _gate_or_up(config, matrix, proj)
    return np.ascontiguousarray(matrix, dtype=np.float32)


def _interleaved(config) -> bool:
    """gpt-oss's layout: stacked [experts, in, out], gate and up interleaved (`gpt_oss`)."""
    return getattr(family_for(config.model_type, ""), "EXPERTS_LAYOUT", None) == "gpt_oss"


def _gate_or_up(config, rows, proj: str):
    """The gate or up rows of a fused gate_up [2 inter, ...]: its halves, or (gpt-oss) its
    even and odd rows."""
    if _interleaved(config):
        return rows[0::2] if proj == "gate_proj" else rows[1::2]
    half = rows.shape[0] // 2
    return rows[:half] if proj == "gate_proj" else rows[half:]


def _mxfp4_stacked(config, ckpt, name: str, expert: int, proj: str, shape, check_only):
    """One expert's matrix from gpt-oss's MXFP4 `*_blocks` [experts, out, in / 32, 16] and
    `*_scales` [experts, out, in / 32] (the codes and scales of `mxfp4.PackedMxfp4`, rows in
    [out, in] order; gate_up's rows interleave gate and up), kept bit for bit."""
    scale = name[: -len(_BLOCKS)] + _SCALES
    if scale not in ckpt.where:
        raise CheckpointError(f"{ckpt.describe(name)}: no {scale} beside it")
    n, (rows, cols) = config.n_experts, shape
    rows = 2 * rows if proj != "down_proj" else rows
    want = (n, rows, cols // mxfp4.QK, mxfp4.QK // 2)
    if tuple(ckpt.shape(name)) != want or tuple(ckpt.shape(scale)) != want[:3]:
        raise CheckpointError(
            f"{ckpt.describe(name)}: shapes {list(ckpt.shape(name))} and "
            f"{list(ckpt.shape(scale))}, expected {list(want)} and {list(want[:3])}"
        )
    if (ckpt.dtype(name), ckpt.dtype(scale)) != ("U8", "U8"):
        raise CheckpointError(f"{ckpt.describe(name)}: MXFP4 blocks and scales must be U8")
    if check_only:
        return None
    packed = ckpt.where[name].raw(name, expert).reshape(rows, cols // 2)  # [out, in / 2]
    scales = ckpt.where[scale].raw(scale, expert)  # [out, in / 32]
    if proj != "down_proj":
        packed, scales = _gate_or_up(config, packed, proj), _gate_or_up(config, scales, proj)
    return mxfp4.PackedMxfp4(np.ascontiguousarray(packed), np.ascontiguousarray(scales))


def expert_biases(config, plan: Plan, ckpt: Checkpoint, layer: int, expert: int):
    """(gate [inter], up [inter], down [hidden]) float32 biases of an expert whose family has
    them (gpt-oss: stacked `gate_up_proj_bias` [experts, 2 inter], `down_proj_bias`
    [experts, hidden]), else None."""
    if not config.expert_biases:
        return None
    n, h, inter = config.n_experts, config.expert_hidden, config.expert_intermediate
    parts = {}
    for proj, width in (("gate_up_proj", 2 * inter), ("down_proj", h)):
        name = plan.stacked.get((layer, proj + "_bias"))
        if name is None:
            raise CheckpointError(
                f"{ckpt.directory}: missing tensor model.layers.{layer}.mlp.experts.{proj}_bias"
            )
        if tuple(ckpt.shape(name)) != (n, width):
            raise CheckpointError(
                f"{ckpt.describe(name)}: shape {list(ckpt.shape(name))}, expected {[n, width]}"
            )
        parts[proj] = ckpt.where[name].float32(name, expert)  # [width]
    gate_up = parts["gate_up_proj"]
    gate, up = _gate_or_up(config, gate_up, "gate_proj"), _gate_or_up(config, gate_up, "up_proj")
    return tuple(np.ascontiguousarray(b, dtype=np.float32) for b in (gate, up, parts["down_proj"]))


def _slice_expert(ckpt: Checkpoint, name: str, expert: int) -> np.ndarray:
    """Expert `expert` of a stacked tensor: only that slice is read and converted."""
    f = ckpt.where[name]
    if f.entries[name].dtype == "F8_E4M3":
        raise CheckpointError(f"{ckpt.describe(name)}: stacked fp8 experts are not supported")
    return f.float32(name, expert)


def trunk_format(name: str, shape: tuple[int, ...], requested: str) -> str:
    """Norms, biases, routers and the small tensors of other shapes (KDA's convolutions and
    decay rates) stay f32 (tiny, and routing decisions are sensitive); matrices whose rows
    are not whole 32-weight blocks fall back to bf16/f32."""
    if len(shape) != 2 or any(name.endswith(s) or s in name for s in _ALWAYS_F32):
        return "f32"
    if requested == "q8_0" and shape[-1] % 32:
        return "bf16"
    return requested


class Progress:
    """Output bytes written against the planned total, with rate and ETA, redrawn in place on
    one line of `stream` (default stderr) - only when that is a terminal (`interactive`
    defaults to stream.isatty()): piped or redirected, it prints nothing.

    `begin(total)` once the output files are declared (their planned sizes), `advance(n)` per
    write with the bytes the files grew by, `close()` draws the final state and ends the line.
    """

    REDRAW_S = 0.1  # at most this often, and always on close

    def __init__(self, label: str, stream: TextIO | None = None, interactive: bool | None = None):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.total = self.done = 0
        self.start = self.drawn = time.perf_counter()

    def begin(self, total: int) -> None:
        self.total, self.done = total, 0
        self.start = time.perf_counter()
        self._draw(self.start)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if now - self.drawn >= self.REDRAW_S:
            self._draw(now)

    def line(self, now: float) -> str:
        """`convert [####      ]  42.0%  4.3/10.3 MB  21.5 MB/s  ETA 0:00`"""
        share = self.done / self.total if self.total else 1.0
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0  # bytes/s
        eta = _clock((self.total - self.done) / rate) if rate > 0 else "?"
        bar = "#" * int(share * 30)
        return (
            f"{self.label} [{bar:<30}] {share:6.1%}  {self.done / 1e6:.1f}/{self.total / 1e6:.1f}"
            f" MB  {rate / 1e6:.1f} MB/s  ETA {eta}"
        )

    def _draw(self, now: float) -> None:
        self.drawn = now
        if self.interactive:
            self.stream.write("\r" + self.line(now) + "\x1b[K")  # [K: clear the rest
            self.stream.flush()

    def close(self) -> None:
        self._draw(time.perf_counter())
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    """h:mm:ss or m:ss."""
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


@dataclass
class ConvertSummary:
    params: int
    trunk_params: int
    expert_params: int
    bytes_written: int
    seconds: float
    skipped: dict[str, str]
    model_id: str
    requantized: list[str] = field(default_factory=list)  # what re-quantizing cost, per type


# experts re-quantized from another format (a GGUF type moeshard has no kernels for): the
# first this many are measured against the decoded values for the summary's error figure
MEASURED_EXPERTS = 16


@dataclass
class Requantized:
    """Experts a file holds in a `source` type, decoded and packed as `target`: the
    relative RMS error that cost, over the first MEASURED_EXPERTS of them."""

    source: str
    target: str
    experts: int = 0
    measured: int = 0
    err2: float = 0.0
    norm2: float = 0.0

    def line(self) -> str:
        rel = (self.err2 / self.norm2) ** 0.5 if self.norm2 else 0.0
        return (
            f"experts stored as {self.source} in the file, decoded and packed as {self.target}: "
            f"relative RMS error of their weights {rel:.4f} ({self.measured} of {self.experts} "
            f"experts measured); pick the format with --experts"
        )


def convert(
    src: str | Path,
    out: str | Path,
    expert_format: str | None = None,
    trunk_fmt: str | None = DEFAULT_TRUNK_FORMAT,
    force: bool = False,
    progress: bool | Progress = True,
    checkpoint=None,
    origin: Path | None = None,
) -> ConvertSummary:
    """Convert checkpoint directory `src` into model directory `out` (see module docstring).

    expert_format None: mxfp4 where the checkpoint publishes its experts so (their bits
    kept), else DEFAULT_EXPERT_FORMAT.  progress: True for a progress bar on stderr (drawn
    only if it is a terminal), False for none, or a `Progress` to draw on.  checkpoint: the
    tensors, where they are not src's safetensors (a GGUF file: `gguf_import`, which writes
    src's config and tokenizer files and passes the file as `origin`); closed here."""
    started = time.perf_counter()
    src, out = Path(src), Path(out)
    origin = Path(origin) if origin is not None else src
    trunk_fmt = trunk_fmt or DEFAULT_TRUNK_FORMAT
    if expert_format is not None and expert_format not in EXPERT_FORMATS:
        # a GGUF file's own formats (`gguf_import`): its K-quants, a mix per layer
        try:
            quant.expert_format_entries(expert_format)
        except ValueError:
            known = EXPERT_FORMATS + KEPT_ONLY_FORMATS
            raise ConfigError(
                f"--experts {expert_format}: choose one of {', '.join(known)}"
            ) from None
        if checkpoint is None:
            raise ConfigError(
                f"--experts {expert_format}: only a GGUF file's experts can be kept as "
                f"{expert_format}; choose one of {', '.join(EXPERT_FORMATS)}"
            )
    if trunk_fmt not in TRUNK_FORMATS:
        raise ConfigError(f"--trunk {trunk_fmt}: choose one of {', '.join(TRUNK_FORMATS)}")
    if not src.is_dir():
        if checkpoint is not None:
            checkpoint.close()
        raise CheckpointError(f"{src}: no such checkpoint directory")
    try:
        check_output(out, [origin], force, "model")
        raw = read_json(src / "config.json")
        config = load_config(src)
        family = family_for(config.model_type, str(src / "config.json"))
    except BaseException:
        if checkpoint is not None:
            checkpoint.close()
        raise
    ckpt = checkpoint if checkpoint is not None else Checkpoint(src)
    bar = progress if isinstance(progress, Progress) else Progress("convert") if progress else None
    try:
        with staged(out, out.parent / f".{out.name}.tmp-convert") as tmp:
            plan = plan_conversion(config, family, ckpt, quantization_config(raw))
            if expert_format is None:
                published = plan.mxfp4_experts or plan.mxfp4_blocks
                expert_format = "mxfp4" if published else DEFAULT_EXPERT_FORMAT
            if config.expert_biases:  # (gpt-oss) each record carries its expert's biases
                expert_format = ",".join(
                    e if e == "-" else e + quant.BIAS for e in expert_format.split(",")
                )
            _check_block_dims(config, expert_format, src)
            summary = _write(config, plan, ckpt, src, tmp, expert_format, trunk_fmt, bar, origin)
            summary.seconds = time.perf_counter() - started
        return summary
    finally:
        ckpt.close()


def _check_block_dims(config, expert_format: str, src: Path) -> None:
    for entry in quant.expert_format_entries(expert_format):
        if entry == "-":
            continue
        gate, _, down = quant.record_matrix_formats(entry)
        # gate and up have expert_hidden columns, down expert_intermediate
        for fmt, dim in ((gate, config.expert_hidden), (down, config.expert_intermediate)):
            if fmt in quant.GGML_FORMATS and dim % quant.ggml_block_size(fmt)[0]:
                raise ConfigError(
                    f"{src / 'config.json'}: expert width {dim} is not a multiple of "
                    f"{quant.ggml_block_size(fmt)[0]}, so experts cannot be {fmt}"
                )
    if expert_format.removesuffix(quant.BIAS) in quant.BLOCK_FORMATS:
        width = "hidden_size" if config.expert_hidden == config.hidden_size else "expert width"
        for dim, what in ((config.expert_hidden, width), (config.expert_intermediate, "moe")):
            if dim % 32:
                raise ConfigError(
                    f"{src / 'config.json'}: {what} {dim} is not a multiple of 32, so experts "
                    f"cannot be {expert_format}; use --experts bf16 or f32"
                )


class _BadScales(CheckpointError):
    """A kept matrix's block scales are not finite (`_write_files` names the record)."""


def _expert_record(
    gate, up, down, fmt: str, requantized: dict | None = None, biases=None
) -> np.ndarray:
    """One expert's record in record format fmt (`quant.record_format`): published MXFP4
    matrices, or a GGUF file's matrices in a format moeshard has (`gguf_import.GgmlMatrix`),
    kept bit for bit where fmt has their format, each other matrix decoded to float32 and
    packed to its format in fmt, then its biases where fmt has them (`quant.BIAS`). A GGUF
    file's matrices of another type are counted (and the first few measured) in
    `requantized` by type."""
    mats = (gate, up, down)
    pairs = list(zip(mats, quant.record_matrix_formats(fmt), strict=True))  # gate, up, down
    parts, made = [], []
    for m, f in pairs:
        if _kept_as(m) == f:
            blocks = m.ggml_blocks()
            if bad := quant.nonfinite_scales(blocks, f, *m.shape):
                raise _BadScales(
                    f"{bad} {f} block(s) of a {m.shape[0]}x{m.shape[1]} expert matrix have a "
                    f"nan or inf scale (a corrupted file?)"
                )
            parts.append(quant.pack_ggml(blocks, f, *m.shape))
            continue
        if f in KEPT_ONLY_FORMATS:
            raise ConfigError(
                f"{f} experts are kept from a GGUF file's {f.upper()} blocks, never made: "
                f"this matrix is {getattr(m, 'type_name', 'float')}; pick --experts q4_0, "
                f"q8_0, bf16 or f32"
            )
        w = m if isinstance(m, np.ndarray) else m.float32()
        parts.append(quant.pack(w, f))
        made.append((m, w, parts[-1], f))
    types = sorted({m.type_name for m, *_ in made if hasattr(m, "type_name")})
    if requantized is not None and any(t.lower() != f for t in types for *_, f in made):
        source = "/".join(types)  # (a layer may mix types: Q4_K_M's down projections)
        target = "/".join(sorted({f for *_, f in made}))
        r = requantized.setdefault(source, Requantized(source, target))
        r.experts += 1
        if r.measured < MEASURED_EXPERTS:
            r.measured += 1
            for _, w, packed, f in made:
                _measure(r, w, packed, f)
    inter, hidden = gate.shape
    return quant.with_biases(np.concatenate(parts), fmt, hidden, inter, biases)


def _measure(r: Requantized, w: np.ndarray, packed: np.ndarray, fmt: str) -> None:
    """Add one packed matrix's squared error against its float32 weights w to r."""
    ggml = quant.unpack_to_ggml(packed, fmt, *w.shape)
    back = quant.dequantize(ggml, fmt, w.shape).astype(np.float64)  # [rows, cols]
    r.err2 += float(np.sum((back - w) ** 2))
    r.norm2 += float(np.sum(w.astype(np.float64) ** 2))


def _kept_trunk_tensor(ckpt, name: str, fmt: str, shape) -> np.ndarray | None:
    """A GGUF file's trunk matrix packed from its own blocks, where its type is the trunk
    format picked for it (the same bits, reordered); None otherwise (decode and pack)."""
    if len(shape) != 2 or not hasattr(ckpt, "matrix"):
        return None
    m = ckpt.matrix(name)
    if _kept_as(m) != fmt or tuple(m.shape) != tuple(shape):
        return None
    return quant.pack_ggml(m.ggml_blocks(), fmt, *m.shape)


def _kept_as(matrix) -> str | None:
    """The format whose bits a matrix brings (MXFP4 as published, INT4 as q4_0, ggml bytes),
    or None."""
    if isinstance(matrix, mxfp4.PackedMxfp4):
        return "mxfp4"
    return getattr(matrix, "fmt", None) if hasattr(matrix, "ggml_blocks") else None


def _write(config, plan, ckpt, src, tmp, expert_format, trunk_fmt, bar, origin) -> ConvertSummary:
    with ExitStack() as closing:  # a failure closes the files it leaves unfinished
        args = (config, plan, ckpt, src, tmp, expert_format, trunk_fmt, bar, closing, origin)
        return _write_files(*args)


def _write_files(
    config, plan, ckpt, src, tmp, expert_format, trunk_fmt, bar, closing, origin
) -> ConvertSummary:
    shapes = config.trunk_shapes()
    trunk = TrunkWriter(tmp / TRUNK_FILE, config.model_type)
    closing.callback(trunk.close)
    trunk_names = sorted(shapes)
    for name in trunk_names:
        trunk.declare(name, trunk_format(name, shapes[name], trunk_fmt), shapes[name])

    record_bytes = quant.expert_record_nbytes(
        expert_format, config.expert_hidden, config.expert_intermediate
    )
    shards: list[ShardWriter] = []
    shard_files: list[str] = []
    layer_records = config.n_experts * record_bytes
    for layer in config.moe_layers:
        if not shards or (len(shards[-1].index.layers) * record_bytes + layer_records) > (
            SHARD_MAX_BYTES
        ):
            shard_files.append(f"experts-{len(shards):05d}.gguf")
            shards.append(
                ShardWriter(
                    tmp / shard_files[-1],
                    expert_format,
                    config.expert_hidden,
                    config.expert_intermediate,
                    config.model_type,
                )
            )
            closing.callback(shards[-1].close)
        stored = quant.expert_record_nbytes(
            quant.record_format(expert_format, layer),
            config.expert_hidden,
            config.expert_intermediate,
        )  # (a layer of a smaller format in a mix: fewer bytes, `ShardSet.read`)
        for expert in range(config.n_experts):
            shards[-1].declare(layer, expert, stored)

    if bar:  # the .gguf files' final sizes: headers, packed tensors, records, padding
        bar.begin(trunk.planned_size() + sum(shard.planned_size() for shard in shards))
        closing.callback(bar.close)
    config_sha = config_digest(read_json(src / "config.json"))
    digest = hashlib.sha256()  # the data id: formats and every checksum
    digest.update(f"experts={expert_format};v={FORMAT_VERSION}".encode())

    trunk.begin()
    if bar:
        bar.advance(trunk.file.bytes_written)
    trunk_params = 0
    for name, (_, fmt, shape) in zip(trunk_names, trunk.entries, strict=True):
        packed = _kept_trunk_tensor(ckpt, plan.trunk[name], fmt, shape)
        if packed is None:
            value = ckpt.float32(plan.trunk[name], plan.fp8_block).reshape(shape)
            matrix = value.reshape(as_matrix(shape))  # what the trunk file stores for any shape
            packed = quant.pack(np.ascontiguousarray(matrix), fmt)
        before = trunk.file.bytes_written
        crc = trunk.write(packed)
        digest.update(f"{name}:{fmt}:{crc};".encode())
        trunk_params += int(np.prod(shape))
        if bar:
            bar.advance(trunk.file.bytes_written - before)
    expert_params = 0
    requantized: dict[str, Requantized] = {}
    roots: dict[tuple[int, int], bytes] = {}  # possession roots, one per record
    for shard in shards:
        shard.begin()
        if bar:
            bar.advance(shard.file.bytes_written)
        for layer, expert in zip(shard.index.layers, shard.index.experts, strict=True):
            gate, up, down = expert_shapes(config, plan, ckpt, layer, expert)
            biases = expert_biases(config, plan, ckpt, layer, expert)
            fmt = quant.record_format(expert_format, layer)
            try:
                record = _expert_record(gate, up, down, fmt, requantized, biases)
            except (_BadScales, int4.InexactScales) as exc:
                raise CheckpointError(
                    f"{origin}: expert {expert} of layer {layer}: {exc}"
                ) from None
            before = shard.file.bytes_written
            crc = shard.write(record)
            if record.size < record_bytes:  # the whole record is zeros after what is stored
                record = np.concatenate([record, np.zeros(record_bytes - record.size, np.uint8)])
            roots[(layer, expert)] = merkle.root(record)
            digest.update(f"{layer}.{expert}:{crc};".encode())
            expert_params += gate.size + up.size + down.size
            if bar:
                bar.advance(shard.file.bytes_written - before)
    data_id = digest.hexdigest()
    content = content_id(config_sha, data_id)  # a changed config.json changes the id
    roots_sha = merkle.write_roots(tmp, merkle.Roots(merkle.BLOCK_SIZE, record_bytes, roots))
    model_id = merkle.covered_id(content, roots_sha)  # a changed roots file changes the id
    trunk.finish(model_id)
    for shard in shards:
        shard.finish(model_id)

    for name in COPIED_FILES:
        if (src / name).exists():
            copy_file(src / name, tmp / name)
    bytes_written = sum(p.stat().st_size for p in tmp.iterdir())
    manifest = {
        "format_version": FORMAT_VERSION,
        "model_id": model_id,
        "model_type": config.model_type,
        "expert_format": expert_format,
        "trunk_format": trunk_fmt,
        "trunk_file": TRUNK_FILE,
        "expert_files": shard_files,
        "hidden_size": config.hidden_size,
        "expert_hidden": config.expert_hidden,
        "expert_intermediate": config.expert_intermediate,
        "n_experts": config.n_experts,
        "moe_layers": list(config.moe_layers),
        "params": {"trunk": trunk_params, "experts": expert_params},
        "converted_from": str(origin),
        "skipped_tensors": plan.skipped,
        "merkle": merkle.manifest_entry(content, roots_sha),
        "covers": covers_entry(config_sha, data_id),
    }
    write_manifest(tmp, manifest)
    return ConvertSummary(
        params=trunk_params + expert_params,
        trunk_params=trunk_params,
        expert_params=expert_params,
        bytes_written=bytes_written,
        seconds=0.0,
        skipped=plan.skipped,
        model_id=model_id,
        requantized=[r.line() for _, r in sorted(requantized.items())],
    )
