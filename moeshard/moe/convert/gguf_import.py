"""`moeshard convert FILE.gguf OUT`: a llama.cpp GGUF file as a checkpoint (issue 39).

llama.cpp's converter renames every tensor (`blk.N.attn_q.weight`), stacks the experts of a
layer into one 3-D tensor per projection (`blk.N.ffn_gate_exps.weight` [experts, out, in]),
and moves the config into metadata keys under the architecture's name (`qwen3moe.block_count`).
This module undoes that: `GgufCheckpoint` offers the file's tensors under the Hugging Face
names with the `Checkpoint` interface the converter reads (each expert a slice of its stack,
read and dequantized alone), and `hf_config` writes the config.json transformers would have.
Values are decoded by the `gguf` package's own dequantizers (`gguf.quants.dequantize`), so any
type it knows imports, as float32, into the formats the user picks.

Keys llama.cpp does not store because its graph hard-codes them are set as its graph sets
them, each with the llama.cpp source line that does so.

A split model (`NAME-00001-of-00003.gguf`) is read from all its parts; the metadata is that of
the first (llama.cpp's gguf-split writes it there).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeshard.moe.errors import CheckpointError

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$")


def gguf_parts(path: Path) -> list[Path]:
    """The files of the model `path` names: itself, or every part of a split model (any
    part may be given)."""
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    total = int(m["total"])
    parts = [
        path.with_name(f"{m['stem']}-{i:05d}-of-{total:05d}.gguf") for i in range(1, total + 1)
    ]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise CheckpointError(f"{path}: part of a {total}-file split model; missing {missing[0]}")
    return parts


# ---------------------------------------------------------------------------------------------
# per architecture: tensor names and config keys


@dataclass(frozen=True)
class Arch:
    model_type: str  # the Hugging Face model_type written to config.json
    architecture: str  # its "architectures" entry
    layer_tensors: dict[str, str]  # GGUF name after "blk.N." -> HF name after "model.layers.N."
    expert_stacks: dict[str, str]  # stacked GGUF expert tensor -> HF projection name
    # llama.cpp's converter reorders a `llama` model's q/k rows for its interleaved RoPE
    # (conversion/llama.py: LlamaModel.permute); they are put back (`unpermute_rows`)
    permuted_qk: bool = False


_QWEN_ATTENTION = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
_STACKS = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}

_QK_NORMS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_QKV_BIASES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_SHARED_EXPERT = {
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}

ARCHS = {
    "qwen3moe": Arch("qwen3_moe", "Qwen3MoeForCausalLM", _QWEN_ATTENTION | _QK_NORMS, _STACKS),
    "qwen2moe": Arch(
        "qwen2_moe", "Qwen2MoeForCausalLM", _QWEN_ATTENTION | _QKV_BIASES | _SHARED_EXPERT, _STACKS
    ),
    # (OLMoE's q/k norms span the whole projection, [hidden]: the same names)
    "olmoe": Arch("olmoe", "OlmoeForCausalLM", _QWEN_ATTENTION | _QK_NORMS, _STACKS),
    # DeepSeek-V3 and Kimi-K2; its attn_k_b / attn_v_b are put back together into kv_b_proj
    "deepseek2": Arch(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        {
            "attn_norm.weight": "input_layernorm.weight",
            "ffn_norm.weight": "post_attention_layernorm.weight",
            "attn_q.weight": "self_attn.q_proj.weight",
            "attn_q_a.weight": "self_attn.q_a_proj.weight",
            "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
            "attn_q_b.weight": "self_attn.q_b_proj.weight",
            "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
            "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
            "attn_output.weight": "self_attn.o_proj.weight",
            "ffn_gate.weight": "mlp.gate_proj.weight",
            "ffn_up.weight": "mlp.up_proj.weight",
            "ffn_down.weight": "mlp.down_proj.weight",
            "ffn_gate_inp.weight": "mlp.gate.weight",
            "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
            "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
            "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
            "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
        },
        _STACKS,
    ),
    # Mixtral: llama.cpp's `llama` architecture with experts (a dense llama is refused)
    "llama": Arch("mixtral", "MixtralForCausalLM", _QWEN_ATTENTION, _STACKS, permuted_qk=True),
}


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` of a q or k projection [heads * D, cols]: per
    head it had taken rows (0, D/2, 1, D/2 + 1, ...), the rotary pairs interleaved; back to
    the halves transformers' rotate_half expects."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _arch_of(fields: dict, source: Path) -> tuple[str, Arch]:
    name = _text(fields, "general.architecture", source)
    if name not in ARCHS:
        raise CheckpointError(
            f"{source}: GGUF architecture '{name}' cannot be imported yet "
            f"(supported: {', '.join(sorted(ARCHS))})"
        )
    return name, ARCHS[name]


def _value(fields: dict, key: str, source: Path, default=None):
    field = fields.get(key)
    if field is None:
        if default is not None:
            return default
        raise CheckpointError(f"{source}: GGUF metadata key '{key}' is missing")
    return field.contents()


def _text(fields: dict, key: str, source: Path) -> str:
    value = _value(fields, key, source)
    if not isinstance(value, str):
        raise CheckpointError(f"{source}: GGUF metadata key '{key}' is not a string")
    return value


def _int(fields: dict, key: str, source: Path, default=None) -> int:
    value = _value(fields, key, source, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise CheckpointError(f"{source}: GGUF metadata key '{key}' is not an integer")
    return int(value)


def _float(fields: dict, key: str, source: Path, default=None) -> float:
    """A float32 key as the decimal it was written from (1e-06, not 9.999999974752427e-07)."""
    value = _value(fields, key, source, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise CheckpointError(f"{source}: GGUF metadata key '{key}' is not a number")
    return float(str(np.float32(value)))


def hf_config(fields: dict, tensor_names: set[str], vocab_size: int, source: Path) -> dict:
    """The config.json transformers would have written for the model these GGUF metadata
    `fields` describe."""
    name, arch = _arch_of(fields, source)
    k = f"{name}."
    heads = _int(fields, k + "attention.head_count", source)
    hidden = _int(fields, k + "embedding_length", source)
    config = {
        "architectures": [arch.architecture],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": _int(fields, k + "block_count", source),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(fields, k + "attention.head_count_kv", source),
        "intermediate_size": _int(fields, k + "feed_forward_length", source),
        "num_experts_per_tok": _int(fields, k + "expert_used_count", source),
        "max_position_embeddings": _int(fields, k + "context_length", source),
        "rms_norm_eps": _float(fields, k + "attention.layer_norm_rms_epsilon", source),
        "rope_theta": _float(fields, k + "rope.freq_base", source),
        "rope_scaling": _rope_scaling(fields, k, source),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": _int(fields, "tokenizer.ggml.bos_token_id", source, -1),
        "eos_token_id": _int(fields, "tokenizer.ggml.eos_token_id", source, -1),
    }
    if name != "deepseek2":  # (whose key and value lengths are those of its MQA form)
        config["head_dim"] = _int(fields, k + "attention.key_length", source, hidden // heads)
        value_length = _int(fields, k + "attention.value_length", source, config["head_dim"])
        if value_length != config["head_dim"]:
            raise CheckpointError(
                f"{source}: value length {value_length} differs from key length "
                f"{config['head_dim']}"
            )
    config |= _ARCH_CONFIG[name](fields, k, source)
    for key in ("bos_token_id", "eos_token_id"):
        if config[key] < 0:
            config[key] = None
    return config


def _qwen3moe(fields: dict, k: str, source: Path) -> dict:
    # llama.cpp's graph renormalises the top-k weights of every qwen3moe model
    # (src/models/qwen3moe.cpp: build_moe_ffn(..., LLM_FFN_SILU, true, ...)) and makes every
    # layer a MoE layer (its hparams have no mlp_only_layers / decoder_sparse_step)
    return {
        "num_experts": _int(fields, k + "expert_count", source),
        "moe_intermediate_size": _int(fields, k + "expert_feed_forward_length", source),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _qwen2moe(fields: dict, k: str, source: Path) -> dict:
    # llama.cpp never renormalises qwen2moe's top-k weights (src/models/qwen2moe.cpp:
    # build_moe_ffn(..., LLM_FFN_SILU, false, ...)); every layer is a MoE layer there too
    return {
        "num_experts": _int(fields, k + "expert_count", source),
        "moe_intermediate_size": _int(fields, k + "expert_feed_forward_length", source),
        "shared_expert_intermediate_size": _int(
            fields, k + "expert_shared_feed_forward_length", source
        ),
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _llama(fields: dict, k: str, source: Path) -> dict:
    if _int(fields, k + "expert_count", source, 0) == 0:
        raise CheckpointError(f"{source}: a dense llama model, not a mixture of experts")
    # Mixtral's experts are intermediate_size wide (llama.cpp: feed_forward_length); its
    # graph renormalises the top-k weights (src/models/llama.cpp: build_moe_ffn(...,
    # LLM_FFN_SILU, true, ...)), as transformers' Mixtral always does
    return {"num_local_experts": _int(fields, k + "expert_count", source), "sliding_window": None}


def _olmoe(fields: dict, k: str, source: Path) -> dict:
    # OLMoE's experts are intermediate_size wide (llama.cpp: feed_forward_length); its top-k
    # weights are not renormalised (src/models/olmoe.cpp: build_moe_ffn(..., false, ...)), and
    # llama.cpp has no clip_qkv for it
    return {
        "num_experts": _int(fields, k + "expert_count", source),
        "norm_topk_prob": False,
        "clip_qkv": None,
        "attention_bias": False,
    }


def _deepseek2(fields: dict, k: str, source: Path) -> dict:
    """DeepSeek-V3 / Kimi-K2 from llama.cpp's deepseek2 keys (conversion/deepseek.py writes
    them): MLA sizes from the *_mla lengths, the router from the expert_* keys."""
    gating = _int(fields, k + "expert_gating_func", source, 1)
    if gating != 2:  # llama.cpp: 1 softmax (DeepSeek-V2), 2 sigmoid (V3)
        raise CheckpointError(
            f"{source}: deepseek2 with softmax routing (DeepSeek-V2) cannot be imported yet"
        )
    rope = _int(fields, k + "rope.dimension_count", source)
    q_lora = _int(fields, k + "attention.q_lora_rank", source, 0)
    config = {
        "num_key_value_heads": _int(fields, k + "attention.head_count", source),  # MHA, not MQA
        "first_k_dense_replace": _int(fields, k + "leading_dense_block_count", source, 0),
        "moe_intermediate_size": _int(fields, k + "expert_feed_forward_length", source),
        "n_routed_experts": _int(fields, k + "expert_count", source),
        "n_shared_experts": _int(fields, k + "expert_shared_count", source, 0),
        "n_group": _int(fields, k + "expert_group_count", source, 1),
        "topk_group": _int(fields, k + "expert_group_used_count", source, 1),
        "norm_topk_prob": bool(_value(fields, k + "expert_weights_norm", source, False)),
        "routed_scaling_factor": _float(fields, k + "expert_weights_scale", source, 1.0),
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "q_lora_rank": q_lora or None,
        "kv_lora_rank": _int(fields, k + "attention.kv_lora_rank", source),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": _int(fields, k + "attention.key_length_mla", source) - rope,
        "v_head_dim": _int(fields, k + "attention.value_length_mla", source),
        # llama.cpp's deepseek2 graph rotates interleaved pairs, as transformers does with
        # rope_interleave (its default for deepseek_v3)
        "rope_interleave": True,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
        "attention_bias": False,
    }
    scaling = _rope_scaling(fields, k, source)
    if scaling is not None:
        # llama.cpp keeps YaRN's mscale_all_dim only, as yarn_log_multiplier = 0.1 x it
        # (conversion/deepseek.py), and its graph takes mscale to be the same
        # (src/models/deepseek2.cpp: mscale and kq_scale both from rope_yarn_log_mul)
        log_mul = _float(fields, k + "rope.scaling.yarn_log_multiplier", source, 0.0)
        mscale = float(str(np.float32(log_mul) / np.float32(0.1)))
        scaling |= {
            "beta_fast": _float(fields, k + "rope.scaling.yarn_beta_fast", source, 32.0),
            "beta_slow": _float(fields, k + "rope.scaling.yarn_beta_slow", source, 1.0),
            "mscale": mscale,
            "mscale_all_dim": mscale,
        }
        config["rope_scaling"] = scaling
    return config


_ARCH_CONFIG = {
    "qwen3moe": _qwen3moe,
    "qwen2moe": _qwen2moe,
    "olmoe": _olmoe,
    "llama": _llama,
    "deepseek2": _deepseek2,
}


def _rope_scaling(fields: dict, k: str, source: Path) -> dict | None:
    kind = fields.get(k + "rope.scaling.type")
    if kind is None or kind.contents() in ("none", ""):
        return None
    kind = kind.contents()
    if kind != "yarn":
        raise CheckpointError(f"{source}: rope scaling '{kind}' cannot be imported yet")
    return {
        "rope_type": "yarn",
        "factor": _float(fields, k + "rope.scaling.factor", source),
        "original_max_position_embeddings": _int(
            fields, k + "rope.scaling.original_context_length", source
        ),
    }


# ---------------------------------------------------------------------------------------------
# the tensors


def _decoded(data: np.ndarray, qtype, what: str) -> np.ndarray:
    """ggml data (the reader's typed array, or raw bytes) -> float32 values, by gguf's own
    dequantizers; a type gguf cannot decode is refused naming `what`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = np.asarray(data)
    try:
        if qtype == GGMLQuantizationType.F32:
            return data.view(np.float32) if data.dtype == np.uint8 else data.astype(np.float32)
        return dequantize(data, qtype).astype(np.float32, copy=False)
    except NotImplementedError:
        raise CheckpointError(f"{what}: GGUF type {qtype.name} cannot be decoded") from None


# GGUF types whose bytes moeshard's formats hold as they are (`quant.pack_ggml` reorders them)
KEPT_TYPES = {
    "F32": "f32",
    "BF16": "bf16",
    "Q8_0": "q8_0",
    "Q4_0": "q4_0",
    "MXFP4": "mxfp4",
    "Q4_K": "q4_K",
    "Q5_K": "q5_K",
    "Q6_K": "q6_K",
    "IQ4_NL": "iq4_nl",
    "IQ4_XS": "iq4_xs",
    "Q4_1": "q4_1",
    "Q5_0": "q5_0",
    "Q5_1": "q5_1",
}


@dataclass(frozen=True)
class GgmlMatrix:
    """One matrix [rows, cols] as ggml stores it (`KEPT_TYPES`): its bytes go into a record
    as they are, reordered (`converter._expert_record`), or are decoded (`float32`)."""

    blocks: np.ndarray  # uint8 [rows, row bytes]
    fmt: str | None  # moeshard's name of the format, None where moeshard has no such format
    qtype: object  # gguf.GGMLQuantizationType
    shape: tuple[int, int]

    @property
    def type_name(self) -> str:
        """The GGUF type's name (Q4_K, ...): what the converter reports re-quantizing."""
        return self.qtype.name

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def ggml_blocks(self) -> np.ndarray:
        return self.blocks

    def float32(self) -> np.ndarray:
        return _decoded(self.blocks, self.qtype, f"a {self.qtype.name} matrix")


@dataclass(frozen=True)
class _Source:
    tensor: object  # gguf.ReaderTensor
    expert: int | None  # the slice of a stacked expert tensor, or the whole tensor
    shape: tuple[int, ...]  # row-major, as the HF tensor
    heads: int = 0  # a permuted q/k projection: its heads (`unpermute_rows`), else 0
    v_b: object = None  # deepseek2's kv_b_proj: `tensor` is attn_k_b, this attn_v_b


class GgufCheckpoint:
    """The tensors of GGUF files under their Hugging Face names, with the interface of
    `moeshard.moe.convert.checkpoint.Checkpoint` that the converter reads."""

    def __init__(self, paths: list[Path]):
        from gguf import GGUFReader  # (imported here: it is only needed to import GGUF files)

        self.directory = paths[0]  # (named in the converter's messages)
        self.readers = []
        for p in paths:
            try:
                self.readers.append(GGUFReader(p))
            except (OSError, ValueError, KeyError, IndexError, EOFError) as exc:
                what = f"not a readable GGUF file, truncated or malformed ({exc})"
                raise CheckpointError(f"{p}: {what}") from None
        self.fields = self.readers[0].fields
        self.arch_name, self.arch = _arch_of(self.fields, paths[0])
        self.sources: dict[str, _Source] = {}
        self._kv_b: dict[str, dict[str, object]] = {}  # layer -> {"attn_k_b": t, "attn_v_b": t}
        for reader in self.readers:
            for t in reader.tensors:
                self._add(t)
        for layer, parts in sorted(self._kv_b.items()):
            if set(parts) != {"attn_k_b.weight", "attn_v_b.weight"}:
                raise CheckpointError(f"{paths[0]}: layer {layer} has only {sorted(parts)}")
            k_b, v_b = parts["attn_k_b.weight"], parts["attn_v_b.weight"]
            heads, lora, nope = (int(d) for d in reversed(k_b.shape))  # [heads, lora, nope]
            v_head = int(v_b.shape[1])  # [heads, v_head, lora]
            shape = (heads * (nope + v_head), lora)
            self.sources[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = _Source(
                k_b, None, shape, v_b=v_b
            )

    def _add(self, t) -> None:
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml's ne is innermost first
        name = t.name
        if name in _GLOBAL_TENSORS:
            self.sources[_GLOBAL_TENSORS[name]] = _Source(t, None, shape)
            return
        m = re.match(r"^blk\.(\d+)\.(.+)$", name)
        if m is not None and m[2] in ("attn_k_b.weight", "attn_v_b.weight"):
            self._kv_b.setdefault(m[1], {})[m[2]] = t  # (assembled once both are read)
            return
        if m is not None and m[2] in self.arch.expert_stacks:
            proj = self.arch.expert_stacks[m[2]]
            for e in range(shape[0]):
                hf = f"model.layers.{m[1]}.mlp.experts.{e}.{proj}.weight"
                self.sources[hf] = _Source(t, e, shape[1:])
            return
        if m is not None and m[2] in self.arch.layer_tensors:
            heads = 0
            if self.arch.permuted_qk and m[2] in ("attn_q.weight", "attn_k.weight"):
                key = "head_count" if m[2] == "attn_q.weight" else "head_count_kv"
                heads = _int(self.fields, f"{self.arch_name}.attention.{key}", self.directory)
            hf = f"model.layers.{m[1]}.{self.arch.layer_tensors[m[2]]}"
            self.sources[hf] = _Source(t, None, shape, heads)
            return
        self.sources[name] = _Source(t, None, shape)  # (listed as skipped by the converter)

    @property
    def vocab_size(self) -> int:
        return self.sources["model.embed_tokens.weight"].shape[0]

    def names(self) -> list[str]:
        return list(self.sources)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.sources[name].shape

    def dtype(self, name: str) -> str:
        return self.sources[name].tensor.tensor_type.name

    def describe(self, name: str) -> str:
        s = self.sources[name]
        where = s.tensor.name + (f"[{s.expert}]" if s.expert is not None else "")
        return f"{self.directory.name}:{where}"

    def float32(self, name: str, block=None) -> np.ndarray:
        """Tensor `name` as float32, decoded by `gguf.quants.dequantize` (an expert: its
        slice of the stack alone)."""
        s = self.sources[name]
        if s.v_b is not None:
            return self._kv_b_proj(name, s)
        data = s.tensor.data if s.expert is None else s.tensor.data[s.expert]
        value = _decoded(data, s.tensor.tensor_type, self.describe(name))
        if value.shape != s.shape:
            raise CheckpointError(
                f"{self.describe(name)}: decoded to {list(value.shape)}, expected {list(s.shape)}"
            )
        return unpermute_rows(value, s.heads) if s.heads else value

    def _kv_b_proj(self, name: str, s: _Source) -> np.ndarray:
        """kv_b_proj [heads * (nope + v_head), lora] from llama.cpp's split: attn_k_b
        [heads, lora, nope] (k_b transposed) and attn_v_b [heads, v_head, lora]
        (conversion/deepseek.py: kv_b viewed per head, split, k_b transposed)."""
        k_b = self._decode(s.tensor)  # [heads, lora, nope]
        v_b = self._decode(s.v_b)  # [heads, v_head, lora]
        if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[1] != v_b.shape[2]:
            raise CheckpointError(f"{self.describe(name)}: attn_k_b and attn_v_b do not match")
        per_head = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [heads, nope+v, lora]
        return np.ascontiguousarray(per_head.reshape(s.shape))

    def _decode(self, tensor) -> np.ndarray:
        """A whole tensor as float32, in its row-major shape."""
        value = _decoded(tensor.data, tensor.tensor_type, f"{self.directory.name}:{tensor.name}")
        return value.reshape(tuple(int(d) for d in reversed(tensor.shape)))

    def matrix(self, name: str):
        """A 2-D tensor (an expert's matrix, a trunk matrix) for the converter, as the file
        holds it (`GgmlMatrix`): its bytes are kept where moeshard has its type and the user
        picks it, else decoded."""
        s = self.sources[name]
        if len(s.shape) != 2 or s.v_b is not None:
            return self.float32(name)
        data = s.tensor.data if s.expert is None else s.tensor.data[s.expert]
        blocks = np.ascontiguousarray(data).view(np.uint8).reshape(s.shape[0], -1)
        if s.heads:  # (a row permutation: the rows' blocks move whole, undecoded)
            blocks = np.ascontiguousarray(unpermute_rows(blocks, s.heads))
        kind = s.tensor.tensor_type.name
        return GgmlMatrix(blocks, KEPT_TYPES.get(kind), s.tensor.tensor_type, s.shape)

    def trunk_format(self) -> str | None:
        """The trunk format that keeps the file's trunk matrices' bits: their one type where
        moeshard's trunk has it (f32, bf16, q8_0), else None (the default, bf16)."""
        stacks = self.arch.expert_stacks
        types = {
            t.tensor_type.name
            for r in self.readers
            for t in r.tensors
            if len(t.shape) == 2
            and t.name.split(".", 2)[-1] not in stacks
            and "ffn_gate_inp" not in t.name  # (routers stay f32 whatever the file holds)
        }
        kept = {"F32": "f32", "BF16": "bf16", "Q8_0": "q8_0"}
        return kept.get(next(iter(types))) if len(types) == 1 else None

    def kept_expert_format(self, fallback: str | None = None) -> str | None:
        """The experts' format spec that keeps every expert block of the file as it is
        (`quant.record_format`): their one type, "gate-up/down" types where the down
        projections differ, or one entry per layer where layers differ (llama-quantize's
        Q4_K_M gives some layers' down projections Q6_K); where a type is not one moeshard
        has (or a layer's gate and up differ), None, or with a fallback format that format
        for those matrices (`quality --gguf`: f32, an exact decode)."""
        stacks, layers = self.arch.expert_stacks, {}
        blocks = _int(self.fields, f"{self.arch_name}.block_count", self.directory)
        for r in self.readers:
            for t in r.tensors:
                m = re.match(r"^blk\.(\d{1,9})\.(.+)$", t.name)
                if m is None or m[2] not in stacks:
                    continue
                if int(m[1]) >= blocks:
                    raise CheckpointError(
                        f"{self.directory}: {t.name}: the file has {blocks} blocks "
                        f"({self.arch_name}.block_count)"
                    )
                layers.setdefault(int(m[1]), {})[stacks[m[2]]] = t.tensor_type.name
        per_layer = ["-"] * blocks
        for layer, types in layers.items():
            kept = {proj: KEPT_TYPES.get(kind) for proj, kind in types.items()}
            gate, up, down = (kept.get(p) for p in ("gate_proj", "up_proj", "down_proj"))
            if gate != up:
                gate = up = None
            if fallback is None and None in (gate, down):
                return None
            gate, down = gate or fallback, down or fallback
            per_layer[layer] = gate if down == gate else f"{gate}/{down}"
        used = {f for f in per_layer if f != "-"}
        if not used:
            return None
        return next(iter(used)) if len(used) == 1 else ",".join(per_layer)

    def expert_types(self) -> set[str]:
        """The GGUF types of the routed experts' tensors."""
        stacks = self.arch.expert_stacks
        return {
            t.tensor_type.name
            for r in self.readers
            for t in r.tensors
            if t.name.split(".", 2)[-1] in stacks
        }

    def close(self) -> None:
        for reader in self.readers:
            mm = getattr(reader, "data", None)
            if hasattr(mm, "_mmap") and mm._mmap is not None:
                mm._mmap.close()


# ---------------------------------------------------------------------------------------------
# the conversion


def _check_tokenizer(path: Path) -> None:
    """Refused here, not at the model's first request."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as exc:  # (tokenizers raises plain Exception subclasses)
        raise CheckpointError(f"--tokenizer {path}: not a tokenizer.json ({exc})") from None


def _write_json(path: Path, value) -> None:
    """(Into the staging directory, which convert reads and then removes: no rename needed.)"""
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts as a GGUF file does."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def convert_gguf(
    path,
    out,
    expert_format: str | None = None,
    trunk_fmt: str | None = None,
    force: bool = False,
    progress=True,
    tokenizer: Path | None = None,
):
    """`moeshard.moe.convert.converter.convert` of a GGUF file (or split model): its config,
    tokenizer and generation config are written into a staging directory beside OUT as
    transformers would have written them, and the tensors read from the file itself.
    tokenizer: a tokenizer.json to use instead of rebuilding the file's (its
    tokenizer_config.json beside it is taken too, where there is one)."""
    import shutil
    import tempfile

    from moeshard.moe.convert.converter import DEFAULT_TRUNK_FORMAT, convert
    from moeshard.moe.convert.gguf_tokenizer import tokenizer_config, tokenizer_json

    path, out = Path(path), Path(out)
    ckpt = GgufCheckpoint(gguf_parts(path))
    try:
        tensor_names = {t.name for r in ckpt.readers for t in r.tensors}
        config = hf_config(ckpt.fields, tensor_names, ckpt.vocab_size, path)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.gguf-", dir=out.parent))
    except BaseException:
        ckpt.close()
        raise
    try:
        _write_json(staging / "config.json", config)
        ids = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
        _write_json(staging / "generation_config.json", ids)
        if tokenizer is not None:
            tokenizer = Path(tokenizer)
            if not tokenizer.is_file():
                raise CheckpointError(f"--tokenizer {tokenizer}: no such file")
            _check_tokenizer(tokenizer)
            shutil.copyfile(tokenizer, staging / "tokenizer.json")
            beside = tokenizer.with_name("tokenizer_config.json")
            if beside.is_file():
                shutil.copyfile(beside, staging / "tokenizer_config.json")
            else:
                _write_json(staging / "tokenizer_config.json", tokenizer_config(ckpt.fields, path))
        else:
            (staging / "tokenizer.json").write_text(tokenizer_json(ckpt.fields, path))
            _write_json(staging / "tokenizer_config.json", tokenizer_config(ckpt.fields, path))
        trunk = trunk_fmt or ckpt.trunk_format() or DEFAULT_TRUNK_FORMAT
        if expert_format is None:  # the experts' own formats where they can be kept
            expert_format = ckpt.kept_expert_format()
        return convert(staging, out, expert_format, trunk, force, progress, ckpt, path)
    except BaseException:
        ckpt.close()  # (convert closes it itself once it has it; closing twice is harmless)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
