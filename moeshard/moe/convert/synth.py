"""`moeshard synth OUT --preset NAME`: a large random-weight MoE model written straight into the
shard format, at close to disk speed, for streaming benchmarks on models larger than RAM.

The model is a valid model directory (config.json, trunk.gguf, experts-*.gguf, merkle.bin,
moeshard.json; no tokenizer: use --prompt-ids): qwen3_moe for `PRESETS`, Kimi K3 (MXFP4
experts, `moeshard.moe.convert.synth_k3`, which can also write the released checkpoint layout) for
`synth_k3.K3_PRESETS`, Qwen3.6 / Qwen3-Next at their published shapes for
`moeshard.moe.model.qwen3_next_shapes.QWEN_PRESETS`, Kimi K2.5 (q4_0 experts,
`moeshard.moe.convert.synth_k25`) for `synth_k25.K25_PRESETS`, gpt-oss for
`synth_gpt_oss.GPT_OSS_PRESETS`. Expert records are random quantised
codes with one constant scale per matrix (sized so activations stay O(1)); they are generated as
bytes, never as float32 weights, so writing is bound by the disk, the checksum and the
possession roots (sha256 of every 4 KiB block), not quantisation.

Routing is skewed on purpose, as in trained models: router row e is a random direction times
a per-expert gain drawn log-normally, so experts with a large gain win the top-k more often
and caching has something to exploit. Trunk matrices are small random values, so the residual
stream changes slowly from layer to layer and next-layer prediction is informative.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from moeshard.moe.convert import synth_gpt_oss, synth_k3, synth_k25
from moeshard.moe.convert.converter import trunk_format
from moeshard.moe.convert.outdir import check_output, staged
from moeshard.moe.errors import MoeshardError
from moeshard.moe.kernels import layout, quant
from moeshard.moe.model import qwen3_next_shapes
from moeshard.moe.model.families import family_for, load_config
from moeshard.moe.model.kimi_k25 import K25Shape
from moeshard.moe.storage import merkle
from moeshard.moe.storage.io import write_file
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


@dataclass(frozen=True)
class Preset:
    hidden: int
    inter: int  # expert intermediate size
    n_experts: int
    top_k: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts_fmt: str = "q4_0"
    trunk_fmt: str = "q8_0"
    router_skew: float = 0.6  # sigma of the log-normal per-expert router gain


@dataclass(frozen=True)
class GlmPreset(Preset):
    """GLM-4.5's shape (model_type glm4_moe): `Preset`'s fields and GLM's own. The config is
    GLM-4.6's as published but for the sizes (q/k/v bias, partial RoPE 0.5, one expert group,
    sigmoid router); synth writes no multi-token-prediction layer (inference skips it)."""

    dense_inter: int = 0  # intermediate_size of the first_dense dense layers
    first_dense: int = 1  # first_k_dense_replace
    shared: int = 1  # n_shared_experts
    qk_norm: bool = False  # use_qk_norm
    scaling: float = 1.0  # routed_scaling_factor
    max_positions: int = 131072


PRESETS = {
    # K3's expert geometry on a Qwen3-MoE trunk: 896 experts per layer, 16 active; 2.5 MiB
    # q4_0 records, ~7 GB (this was `k3-mini` before the real K3 family; README figures
    # measured before 2026-12-02 on "k3-mini" are this model).
    "k3-shaped": Preset(2048, 768, 896, 16, 3, 16, 4, 128, 8192),
    # Small enough for tests: 64 experts of 8 KiB per layer.
    "tiny": Preset(64, 64, 64, 4, 3, 4, 2, 16, 256, trunk_fmt="f32"),
    # GLM-4.6 (= GLM-4.7's shape) as published: 92 layers, the first 3 dense, 160 experts of 1536
    # (13.3 MB q4_0 records), 8 active, a 5120-wide trunk with 96 query / 8 kv heads of 128.
    # 353 G parameters (the MTP layer not counted): ~190 GB at q4_0; for `simulate --geometry`.
    "glm-4.6": GlmPreset(5120, 1536, 160, 8, 92, 96, 8, 128, 151552, dense_inter=12288,
                         first_dense=3, qk_norm=True, scaling=2.5, max_positions=202752),
    # GLM-4.5-Air as published: 46 layers, the first dense, 128 experts of 1408, 8 active.
    "glm-4.5-air": GlmPreset(4096, 1408, 128, 8, 46, 96, 8, 128, 151552, dense_inter=10944),
    # GLM-4.6's layers, four of them (one dense, three MoE): 6.4 GB of experts, for traces.
    "glm-4.6-mini": GlmPreset(5120, 1536, 160, 8, 4, 96, 8, 128, 151552, dense_inter=12288,
                              first_dense=1, qk_norm=True, scaling=2.5, max_positions=202752),
    # GLM-4.5's architecture small enough for tests.
    "glm-tiny": GlmPreset(64, 64, 32, 4, 3, 4, 2, 32, 256, trunk_fmt="f32", dense_inter=96,
                          qk_norm=True, scaling=2.5),
}  # fmt: skip


def hf_config(p: Preset) -> dict:
    return glm_config(p) if isinstance(p, GlmPreset) else qwen_config(p)


def glm_config(p: GlmPreset) -> dict:
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "hidden_size": p.hidden,
        "intermediate_size": p.dense_inter,
        "moe_intermediate_size": p.inter,
        "n_routed_experts": p.n_experts,
        "num_experts_per_tok": p.top_k,
        "n_shared_experts": p.shared,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": p.scaling,
        "first_k_dense_replace": p.first_dense,
        "num_hidden_layers": p.layers,
        "num_nextn_predict_layers": 0,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "head_dim": p.head_dim,
        "attention_bias": True,
        "use_qk_norm": p.qk_norm,
        "partial_rotary_factor": 0.5,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "vocab_size": p.vocab,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "max_position_embeddings": p.max_positions,
        "torch_dtype": "float32",
        "moeshard_synthetic": True,
    }


def qwen_config(p: Preset) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": p.hidden,
        "intermediate_size": p.inter * 4,
        "moe_intermediate_size": p.inter,
        "num_experts": p.n_experts,
        "num_experts_per_tok": p.top_k,
        "num_hidden_layers": p.layers,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "head_dim": p.head_dim,
        "vocab_size": p.vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "use_sliding_window": False,
        "torch_dtype": "float32",
        "moeshard_synthetic": True,
    }


def _trunk_tensor(name: str, shape: tuple[int, ...], p: Preset, rng) -> np.ndarray:
    """Random float32 values for one trunk tensor."""
    if len(shape) == 1:  # norms (ones); biases, the routers' selection bias (zeros)
        return (np.zeros if name.endswith("bias") else np.ones)(shape, np.float32)
    if name.endswith("mlp.gate.weight"):  # router: random directions x log-normal gains
        gains = np.exp(rng.normal(0.0, p.router_skew, shape[0])).astype(np.float32)  # [E]
        dirs = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])  # [E, H]
        return dirs * gains[:, None] * np.float32(4.0)  # [E, H]
    if "embed_tokens" in name:
        return rng.standard_normal(shape, dtype=np.float32)  # [V, H]
    scale = 0.2 / np.sqrt(shape[1])  # residual updates ~0.2 of the stream
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)


class RecordMaker:
    """Random expert records in the kernel layout: random codes, one scale per matrix."""

    def __init__(self, p: Preset, seed: int):
        self.fmt, self.rng = p.experts_fmt, np.random.default_rng(seed)
        if self.fmt not in ("q4_0", "q8_0"):
            raise MoeshardError("synth writes q4_0 or q8_0 experts")
        self.nbytes = quant.expert_record_nbytes(self.fmt, p.hidden, p.inter)
        spread = 4.6 if self.fmt == "q4_0" else 73.0  # std of the integer codes
        mats = [(p.inter, p.hidden, 1.0), (p.inter, p.hidden, 1.0), (p.hidden, p.inter, 0.3)]
        self.scales: list[tuple[int, np.ndarray]] = []  # (byte offset, uint8 scale bytes)
        start = 0
        for rows, cols, gain in mats:
            payload, s_off, s_bytes = layout._sections(self.fmt, rows, cols)
            d = np.float16(gain / (spread * np.sqrt(cols)))
            self.scales.append((start + s_off, np.full(s_bytes // 2, d).view(np.uint8)))
            start += quant.packed_nbytes(self.fmt, rows, cols)

    def make(self) -> np.ndarray:
        rec = self.rng.integers(0, 256, self.nbytes, dtype=np.uint8)  # [nbytes]
        for off, scale in self.scales:
            rec[off : off + scale.size] = scale
        return rec


ALL_PRESETS = sorted(
    [
        *PRESETS,
        *synth_k3.K3_PRESETS,
        *synth_gpt_oss.GPT_OSS_PRESETS,
        *qwen3_next_shapes.QWEN_PRESETS,
        *synth_k25.K25_PRESETS,
    ]
)


def preset_sizes(preset: str) -> tuple[dict, str, int]:
    """What a (non-K3) preset would write, without writing it: its config.json, its experts'
    format and the bytes of its trunk file's tensors as `_write` stores them (for `simulate
    --geometry PRESET` at sizes no disk here holds)."""
    if preset not in PRESETS:
        raise MoeshardError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    raw = hf_config(p)
    source = f"preset {preset}"
    config = family_for(raw["model_type"], source).Config.from_hf(raw, source)
    trunk = 0
    for name, shape in config.trunk_shapes().items():
        rows, cols = as_matrix(shape)
        trunk += quant.packed_nbytes(trunk_format(name, shape, p.trunk_fmt), rows, cols)
    return raw, p.experts_fmt, trunk


def synth(
    out: str | Path,
    preset: str,
    force: bool = False,
    seed: int = 0,
    checkpoint: bool = False,
    **sizes: int | None,
) -> dict:
    """Write the model directory (or, for a K3 preset with `checkpoint`, a checkpoint in the
    released layout); returns a summary (bytes, seconds, GB/s, model id or None).  `sizes`
    scale a K3 preset (`synth_k3.SCALABLE`)."""
    if preset not in ALL_PRESETS:
        raise MoeshardError(f"unknown preset {preset!r}; choose one of {ALL_PRESETS}")
    k3, gpt_oss = preset in synth_k3.K3_PRESETS, preset in synth_gpt_oss.GPT_OSS_PRESETS
    given = {k for k, v in sizes.items() if v is not None}
    if gpt_oss and (checkpoint or given - set(synth_gpt_oss.SCALABLE)):
        raise MoeshardError(f"{preset!r} takes --layers only (no --checkpoint, no other size)")
    if not (k3 or gpt_oss) and (checkpoint or given):
        raise MoeshardError(f"--checkpoint and sizes apply to the K3 presets, not {preset!r}")
    what = "checkpoint" if checkpoint else "model"
    out = check_output(out, [], force, what)
    t0 = time.perf_counter()
    model_id = None
    with staged(out, out.with_name(out.name + ".partial")) as tmp, ExitStack() as closing:
        if gpt_oss:
            p = synth_gpt_oss.preset(preset, sizes.get("layers"))
            model_id = _write(tmp, Geometry.of_gpt_oss(p, seed), preset, seed, closing)
        elif preset in synth_k25.K25_PRESETS:
            g = Geometry.of_k25(synth_k25.K25_PRESETS[preset], seed)
            model_id = _write(tmp, g, preset, seed, closing)
        elif preset in qwen3_next_shapes.QWEN_PRESETS:
            g = Geometry.of_qwen3_next(qwen3_next_shapes.preset(preset), seed)
            model_id = _write(tmp, g, preset, seed, closing)
        elif not k3:
            model_id = _write(tmp, Geometry.of(PRESETS[preset], seed), preset, seed, closing)
        elif checkpoint:
            synth_k3.write_checkpoint(tmp, synth_k3.preset(preset, **sizes), seed)
        else:
            p = synth_k3.preset(preset, **sizes)
            model_id = _write(tmp, Geometry.of_k3(p, seed), preset, seed, closing)
    seconds = time.perf_counter() - t0
    total = sum(f.stat().st_size for f in out.iterdir())
    return {"bytes": total, "seconds": seconds, "gb_per_s": total / seconds / 1e9, "id": model_id}


@dataclass
class Geometry:
    """What `_write` makes: config.json, the trunk's values and format, the expert records."""

    raw: dict
    trunk_fmt: str
    trunk_value: Callable  # (canonical name, shape, rng) -> float32
    records: Callable[[], Iterator[np.ndarray]]  # the records in (layer, expert) order
    record_nbytes: int
    experts_fmt: str

    @classmethod
    def of(cls, p: Preset, seed: int) -> Geometry:
        maker = RecordMaker(p, seed + 1)
        return cls(
            raw=hf_config(p),
            trunk_fmt=p.trunk_fmt,
            trunk_value=lambda name, shape, rng: _trunk_tensor(name, shape, p, rng),
            records=lambda: (maker.make() for _ in itertools.count()),
            record_nbytes=maker.nbytes,
            experts_fmt=p.experts_fmt,
        )

    @classmethod
    def of_gpt_oss(cls, p: synth_gpt_oss.GptOssPreset, seed: int) -> Geometry:
        fmt = synth_gpt_oss.RECORD_FORMAT
        return cls(
            raw=p.config,
            trunk_fmt=p.trunk_fmt,
            trunk_value=lambda name, shape, rng: _trunk_tensor(name, shape, p, rng),
            records=lambda: synth_gpt_oss.records(p, seed + 1),
            record_nbytes=quant.expert_record_nbytes(fmt, p.width, p.width),
            experts_fmt=fmt,
        )

    @classmethod
    def of_qwen3_next(cls, q: qwen3_next_shapes.QwenNextPreset, seed: int) -> Geometry:
        """Qwen3.6 / Qwen3-Next at the published shape: its config, `synth`'s trunk values and
        records (for a preset of the same expert and router sizes)."""
        p = Preset(q.hidden, q.inter, q.n_experts, q.top_k, q.layers, q.heads, q.kv_heads,
                   q.head_dim, q.vocab, q.experts_fmt, q.trunk_fmt)  # fmt: skip
        return replace(cls.of(p, seed), raw=qwen3_next_shapes.released_config(q))

    @classmethod
    def of_k25(cls, p: K25Shape, seed: int) -> Geometry:
        """Kimi K2.5's wrapper config; q4_0 records and trunk values as the Qwen presets'."""
        sizes = Preset(p.hidden, p.inter, p.n_experts, p.top_k, p.layers, p.heads, p.heads,
                       p.nope + p.rope, p.vocab, trunk_fmt=p.trunk_fmt)  # fmt: skip
        return replace(cls.of(sizes, seed), raw=synth_k25.released_config(p))

    @classmethod
    def of_k3(cls, p: synth_k3.K3Preset, seed: int) -> Geometry:
        def records() -> Iterator[np.ndarray]:
            rng = np.random.default_rng(seed + 1)  # as `synth_k3.released_tensors`
            while True:
                yield synth_k3.record_bytes(synth_k3.random_expert(p, rng))

        return cls(
            raw=synth_k3.released_config(p),
            trunk_fmt=p.trunk_fmt,
            trunk_value=lambda name, shape, rng: synth_k3.trunk_value(name, shape, p, rng),
            records=records,
            record_nbytes=quant.expert_record_nbytes("mxfp4", p.latent, p.inter),
            experts_fmt="mxfp4",
        )


def _write(tmp: Path, g: Geometry, preset: str, seed: int, closing: ExitStack) -> str:
    """Every file of the model directory into `tmp`; returns the model id. Writers are closed
    by `closing` (a failure leaves none open)."""
    raw = g.raw
    write_file(tmp / "config.json", (json.dumps(raw, indent=2) + "\n").encode())
    config = load_config(tmp)
    rng = np.random.default_rng(seed)
    config_sha = config_digest(raw)
    digest = hashlib.sha256()  # the data id: formats and every checksum
    digest.update(f"experts={g.experts_fmt};v={FORMAT_VERSION}".encode())

    shapes = config.trunk_shapes()
    trunk = TrunkWriter(tmp / TRUNK_FILE, config.model_type)
    closing.callback(trunk.close)
    names = sorted(shapes)
    fmts = {n: trunk_format(n, shapes[n], g.trunk_fmt) for n in names}
    for n in names:
        trunk.declare(n, fmts[n], shapes[n])
    trunk.begin()
    for n in names:
        value = g.trunk_value(n, shapes[n], rng)
        matrix = value.reshape(as_matrix(shapes[n]))  # what the trunk file stores for any shape
        crc = trunk.write(quant.pack(np.ascontiguousarray(matrix), fmts[n]))
        digest.update(f"{n}:{fmts[n]}:{crc};".encode())

    nbytes, n_experts = g.record_nbytes, config.n_experts
    hidden, inter = config.expert_hidden, config.expert_intermediate
    per_layer = n_experts * nbytes
    shards: list[ShardWriter] = []
    files: list[str] = []
    for layer in config.moe_layers:
        if not shards or len(shards[-1].index.layers) * nbytes + per_layer > SHARD_MAX_BYTES:
            files.append(f"experts-{len(shards):05d}.gguf")
            shards.append(
                ShardWriter(tmp / files[-1], g.experts_fmt, hidden, inter, config.model_type)
            )
            closing.callback(shards[-1].close)
        for expert in range(n_experts):
            shards[-1].declare(layer, expert)
    written = 0
    roots: dict[tuple[int, int], bytes] = {}  # possession roots, one per record
    records = g.records()
    for shard in shards:
        shard.begin()
        for layer, expert in zip(shard.index.layers, shard.index.experts, strict=True):
            record = next(records)
            crc = shard.write(record)
            roots[(layer, expert)] = merkle.root(record)
            digest.update(f"{layer}.{expert}:{crc};".encode())
            written += nbytes
        log.info("synth: %s written (%.1f GB so far)", shard.file.path.name, written / 1e9)
    data_id = digest.hexdigest()
    content = content_id(config_sha, data_id)  # a changed config.json changes the id
    roots_sha = merkle.write_roots(tmp, merkle.Roots(merkle.BLOCK_SIZE, nbytes, roots))
    model_id = merkle.covered_id(content, roots_sha)  # a changed roots file changes the id
    trunk.finish(model_id)
    for shard in shards:
        shard.finish(model_id)
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    write_manifest(
        tmp,
        {
            "format_version": FORMAT_VERSION,
            "model_id": model_id,
            "model_type": config.model_type,
            "expert_format": g.experts_fmt,
            "trunk_format": g.trunk_fmt,
            "trunk_file": TRUNK_FILE,
            "expert_files": files,
            "hidden_size": config.hidden_size,
            "expert_hidden": hidden,
            "expert_intermediate": inter,
            "n_experts": n_experts,
            "moe_layers": list(config.moe_layers),
            "params": {
                "trunk": n_params,
                "experts": len(config.moe_layers) * n_experts * 3 * hidden * inter,
            },
            "converted_from": f"synth:{preset}",
            "skipped_tensors": {},
            "merkle": merkle.manifest_entry(content, roots_sha),
            "covers": covers_entry(config_sha, data_id),
        },
    )
    return model_id
