"""Random Kimi K3 models at any scale, in K3's real layout (`moeshard synth --preset k3`).

Two outputs from one description (`K3Preset`, scaled with --layers, --experts, widths):

* a **checkpoint in the released layout** (`--checkpoint`): config.json with the language
  model under `text_config` (model_type kimi_linear) beside a `vision_config` and the
  compressed-tensors `quantization_config`; tensors named ``language_model.model...``; routed
  experts as MXFP4 `weight_packed` + `weight_scale`; the other matrices bf16, the small KDA
  tensors F32 (A_log padded to head_dim, as published); layer 0's unused attention-residual
  tensors and a few vision-tower tensors, as the release has them; a byte-level
  `tiktoken.model` with Kimi's special tokens.  `moeshard convert` loads it like the real one.
* a **model directory** (the default), written straight into the shard format as `synth` does
  for its other presets (no float32 experts are ever made), for streaming benchmarks at
  sizes where a checkpoint plus its conversion would need twice the disk.

Both draw the same random values for the same seed and preset, so converting the checkpoint
gives the model directory's trunk and records (tests/test_kimi_k3.py checks this).

The layer map is K3's: MLA where i % 4 == 3 and at the last layer, KDA elsewhere; layer 0
has the dense MLP, the others LatentMoE.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from moeshard.moe.convert import mxfp4
from moeshard.moe.convert.checkpoint import write_safetensors
from moeshard.moe.errors import MoeshardError
from moeshard.moe.kernels import quant
from moeshard.moe.storage.io import write_file

E2M1_RMS = float(np.sqrt(np.mean(mxfp4.E2M1**2)))  # the codes' spread, uniform codes
BYTE_TOKENS = 256  # the tokenizer: one rank per byte, then Kimi's 256 reserved special ids
SPECIAL = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>"}
SPECIAL |= {5: "<|sep|>", 255: "[PAD]"}  # offsets after the ranks (K3's own order)
EOS_OFFSET = 2  # <|end_of_msg|>: K3's eos_token_id
CHECKPOINT_FILE_BYTES = 2 << 30  # a new safetensors file past this


@dataclass(frozen=True)
class K3Preset:
    hidden: int
    latent: int  # routed_expert_hidden_size
    inter: int  # expert (and per shared expert) intermediate size
    dense_inter: int  # layer 0's MLP
    n_experts: int
    top_k: int
    layers: int
    mla_heads: int
    kda_heads: int
    kda_head_dim: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v_head: int
    vocab: int = BYTE_TOKENS + 256
    shared: int = 2
    block: int = 12  # attn_res_block_size
    trunk_fmt: str = "bf16"
    router_skew: float = 0.6  # sigma of the log-normal per-expert router gain

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.layers) if not (i % 4 == 3 or i == self.layers - 1)]


K3_PRESETS = {
    # Kimi K3 itself (torchtitan's Kimi-K3 config at 9f8bcf0c): for the arithmetic only.
    "k3-full": K3Preset(7168, 3584, 3072, 33792, 896, 16, 93, 96, 96, 128, 1536, 512, 128, 64, 128,
                        vocab=163840),
    # A small K3: 896 experts per layer, 16 active, 3 LatentMoE layers of 2.5 MB records.
    "k3-mini": K3Preset(4096, 2048, 768, 8192, 896, 16, 4, 16, 16, 128, 512, 256, 64, 32, 64,
                        vocab=8192, block=2, trunk_fmt="q8_0"),
    # Tiny, for tests and one-liners: every K3 part, 5 layers (3 KDA, 2 MLA), blocks of 2.
    "k3": K3Preset(128, 64, 64, 256, 16, 4, 5, 4, 4, 32, 64, 32, 16, 16, 16, block=2),
}  # fmt: skip
SCALABLE = ("layers", "n_experts", "top_k", "hidden", "latent", "inter")


def preset(name: str, **overrides: int | None) -> K3Preset:
    """A K3 preset with some of its sizes (`SCALABLE`) replaced; checked."""
    p = replace(K3_PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
    if p.layers < 2 or p.top_k > p.n_experts or p.top_k < 1:
        raise MoeshardError("a K3 needs at least 2 layers and 1 <= top-k <= experts")
    for what, size in (("latent", p.latent), ("inter", p.inter)):
        if size % 32:
            raise MoeshardError(f"--{what} {size}: MXFP4 experts need a multiple of 32")
    if p.vocab < BYTE_TOKENS + len(SPECIAL):
        raise MoeshardError(f"vocab {p.vocab} is too small for the byte tokenizer")
    return p


def released_config(p: K3Preset) -> dict:
    """config.json as Kimi K3 publishes it (the fields moeshard reads, and a few others)."""
    kda = p.kda_layers
    eos = BYTE_TOKENS + EOS_OFFSET
    text = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": p.vocab,
        "hidden_size": p.hidden,
        "intermediate_size": p.dense_inter,
        "num_hidden_layers": p.layers,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "num_attention_heads": p.mla_heads,
        "num_key_value_heads": p.mla_heads,
        "q_lora_rank": p.q_lora,
        "kv_lora_rank": p.kv_lora,
        "qk_nope_head_dim": p.nope,
        "qk_rope_head_dim": p.rope,
        "v_head_dim": p.v_head,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": p.n_experts,
        "num_experts_per_token": p.top_k,
        "num_shared_experts": p.shared,
        "moe_intermediate_size": p.inter,
        "routed_expert_hidden_size": p.latent,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0,
        "attn_res_block_size": p.block,
        "linear_attn_config": {
            "full_attn_layers": [i + 1 for i in range(p.layers) if i not in kda],
            "kda_layers": [i + 1 for i in kda],
            "num_heads": p.kda_heads,
            "head_dim": p.kda_head_dim,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "tie_word_embeddings": False,
        "max_position_embeddings": 1 << 20,
        "bos_token_id": BYTE_TOKENS,
        "eos_token_id": eos,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": mxfp4.FORMAT,
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "format": mxfp4.FORMAT,
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "float",
                        "group_size": 32,
                        "strategy": "group",
                        "symmetric": True,
                        "scale_dtype": "torch.uint8",
                    },
                }
            },
            "ignore": [
                "re:.*self_attn.*",
                "re:.*shared_experts.*",
                "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                "re:.*lm_head.*",
                "re:.*vision_tower.*",
                "re:.*mm_projector.*",
            ],
        },  # fmt: skip
        "dtype": "bfloat16",
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "vision_config": {"model_type": "moonvit", "patch_size": 14, "vt_hidden_size": 32},
        "bos_token_id": BYTE_TOKENS,
        "eos_token_id": eos,
        "pad_token_id": BYTE_TOKENS + 255,
        "tie_word_embeddings": False,
        "moeshard_synthetic": True,
    }


def trunk_value(name: str, shape: tuple[int, ...], p: K3Preset, rng) -> np.ndarray:
    """Random float32 values for one trunk tensor (canonical name): norms 1, K3's decay rates
    log(1..16) as torchtitan initialises them (A_log padded with zeros), a skewed router,
    and small matrices so the residual stream changes slowly.  What the release stores in
    bf16 is rounded to it, so the model directory holds the checkpoint's values."""
    value = _random_value(name, shape, p, rng)
    return _bf16_values(value) if _published_bf16(name, value) else value


def _published_bf16(name: str, value: np.ndarray) -> bool:
    """Matrices are bf16 in the release; KDA's small tensors, the norms and (here) the
    attention-residual score vectors F32."""
    return value.ndim == 2 and not name.endswith("_res_proj.weight")


def _random_value(name: str, shape: tuple[int, ...], p: K3Preset, rng) -> np.ndarray:
    if name.endswith("A_log"):
        rates = np.zeros(shape, np.float32)  # [head_dim]: the heads' rates, then padding
        rates[: p.kda_heads] = np.log(rng.uniform(1.0, 16.0, p.kda_heads))
        return rates
    if name.endswith(("dt_bias", "e_score_correction_bias")):
        return np.zeros(shape, np.float32)
    if name.endswith("conv1d.weight"):
        return rng.normal(0.0, 0.5, shape).astype(np.float32)  # [C, 1, kernel]
    if len(shape) == 1:
        return np.ones(shape, np.float32)  # norms
    if name.endswith("block_sparse_moe.gate.weight"):  # router: directions x log-normal gains
        gains = np.exp(rng.normal(0.0, p.router_skew, shape[0])).astype(np.float32)  # [E]
        dirs = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])  # [E, H]
        return dirs * gains[:, None] * np.float32(4.0)  # [E, H]
    if name.endswith("_res_proj.weight"):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(2.0 / np.sqrt(shape[1]))
    scale = 0.2 if "embed_tokens" not in name else 1.0  # residual updates ~0.2 of the stream
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale / np.sqrt(shape[1]))


def _bf16_values(value: np.ndarray) -> np.ndarray:
    """float32 rounded to the nearest bfloat16 (ties to even), as float32."""
    bits = np.ascontiguousarray(value, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32).reshape(value.shape)


def random_expert(p: K3Preset, rng) -> tuple[mxfp4.PackedMxfp4, ...]:
    """One routed expert as published: gate and up [inter, latent], down [latent, inter], each
    uniform random E2M1 codes with one power-of-two scale per matrix, sized so outputs are
    O(1) (down 0.3 of that)."""
    mats = []
    for rows, cols, gain in ((p.inter, p.latent, 1.0), (p.inter, p.latent, 1.0),
                             (p.latent, p.inter, 0.3)):  # fmt: skip
        packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)  # [rows, cols / 2]
        exponent = round(np.log2(gain / (E2M1_RMS * np.sqrt(cols))))
        scale = np.full((rows, cols // mxfp4.QK), 127 + exponent, dtype=np.uint8)
        mats.append(mxfp4.PackedMxfp4(packed, scale))
    return tuple(mats)


def record_bytes(expert: tuple[mxfp4.PackedMxfp4, ...]) -> np.ndarray:
    """The expert's mxfp4 record: the published bits, in the kernel layout (as convert)."""
    return np.concatenate([quant.pack_ggml(m.ggml_blocks(), "mxfp4", *m.shape) for m in expert])


def _bf16(value: np.ndarray) -> bytes:
    """float32 -> bfloat16 bytes, rounded to nearest even."""
    return (_bf16_values(value).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _stored(name: str, value: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype, shape, bytes) as the release stores a trunk tensor: matrices bf16, KDA's small
    tensors and the norms F32."""
    if _published_bf16(name, value):
        return "BF16", value.shape, _bf16(value)
    return "F32", value.shape, np.ascontiguousarray(value, dtype=np.float32).tobytes()


def write_tokenizer(out: Path, p: K3Preset) -> None:
    """A byte-level tiktoken.model (one rank per byte) and tokenizer_config.json naming K3's
    special tokens at their offsets after the ranks."""
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(BYTE_TOKENS)]
    write_file(out / "tiktoken.model", ("\n".join(lines) + "\n").encode())
    decoder = {str(BYTE_TOKENS + i): {"content": t, "special": True} for i, t in SPECIAL.items()}
    config = {
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]",
        "eos_token": "<|end_of_msg|>",
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
    }
    write_file(out / "tokenizer_config.json", (json.dumps(config, indent=2) + "\n").encode())


def released_tensors(
    p: K3Preset, config, seed: int
) -> Iterator[tuple[str, tuple[str, tuple[int, ...], bytes]]]:
    """Every tensor of the released checkpoint, by its released name, in file order."""
    rng = np.random.default_rng(seed)
    for name, shape in sorted(config.trunk_shapes().items()):
        yield "language_model." + name, _stored(name, trunk_value(name, shape, p, rng))
    h = p.hidden
    for name in ("self_attention_res_norm.weight", "self_attention_res_proj.weight"):
        shape = (h,) if name.endswith("norm.weight") else (1, h)  # layer 0's: never used
        yield f"language_model.model.layers.0.{name}", _stored(name, np.ones(shape, np.float32))
    for name, shape in (("vision_tower.patch_embed.proj.weight", (32, 3, 14, 14)),
                        ("mm_projector.proj.0.weight", (128, 128))):  # fmt: skip
        yield name, ("BF16", shape, _bf16(rng.standard_normal(shape, dtype=np.float32)))
    experts = np.random.default_rng(seed + 1)
    for layer in config.moe_layers:
        for e in range(config.n_experts):
            gate, up, down = random_expert(p, experts)
            prefix = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}."
            for proj, m in (("w1", gate), ("w3", up), ("w2", down)):
                yield prefix + proj + mxfp4.PACKED, ("U8", m.packed.shape, m.packed.tobytes())
                yield prefix + proj + mxfp4.SCALE, ("U8", m.scale.shape, m.scale.tobytes())


def write_checkpoint(out: Path, p: K3Preset, seed: int) -> int:
    """The released layout into directory `out` (made by the caller); returns its bytes."""
    from moeshard.moe.model.kimi_k3 import Config

    raw = released_config(p)
    config = Config.from_hf(raw, "synth k3")
    write_file(out / "config.json", (json.dumps(raw, indent=2) + "\n").encode())
    generation = {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]}
    write_file(out / "generation_config.json", (json.dumps(generation) + "\n").encode())
    write_tokenizer(out, p)
    weight_map: dict[str, str] = {}
    pending: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    total = pending_bytes = 0
    files = 0
    for name, tensor in released_tensors(p, config, seed):
        if pending and pending_bytes + len(tensor[2]) > CHECKPOINT_FILE_BYTES:
            files += 1
            _write_file(out / f"model-{files:05d}.safetensors", pending, weight_map)
            pending_bytes = 0
        pending[name] = tensor
        pending_bytes += len(tensor[2])
        total += len(tensor[2])
    _write_file(out / f"model-{files + 1:05d}.safetensors", pending, weight_map)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_file(out / "model.safetensors.index.json", (json.dumps(index, indent=1) + "\n").encode())
    return sum(f.stat().st_size for f in out.iterdir())


def _write_file(path: Path, tensors: dict, weight_map: dict[str, str]) -> None:
    """One safetensors file of the checkpoint; its tensors are then forgotten."""
    write_safetensors(path, tensors)
    weight_map.update(dict.fromkeys(tensors, path.name))
    tensors.clear()
