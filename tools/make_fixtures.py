#!/usr/bin/env python
"""Build tiny random MoE checkpoints + reference outputs with Hugging Face transformers.

Run with the reference venv (torch + transformers), never at runtime:

    .venv-ref/bin/python tools/make_fixtures.py --out tests/fixtures [--only qwen3_moe,mixtral]

Every fixture directory looks like a genuine HF checkpoint:

    config.json                  old dialect (rope_theta + rope_scaling, torch_dtype), as published
    config.rope_parameters.json  same model, transformers-5 dialect (what save_pretrained writes)
    model.safetensors | model-0000X-of-00002.safetensors + model.safetensors.index.json
    generation_config.json, tokenizer.json, tokenizer_config.json
    reference.npz                prompt_ids [T] i64, prefill_logits [T,V] f32,
                                 greedy_ids [24] i64, greedy_logits [24,V] f32
                                 (greedy_logits[i] = the logits greedy_ids[i] was argmax'ed from)
    meta.json                    seed, routing / logit margins, dialect check, notes

Deterministic given the per-fixture seed. References: float32, eval mode, eager attention.
For every routing decision (prompt + greedy run) the gap between the k-th and (k+1)-th selection
score (and, for grouped routing, between the topk_group-th and next group score) and the top1-top2
logit gap at each greedy step must exceed MARGIN; otherwise the next seed is tried.

FP8 (deepseek_v3_fp8) block quantisation, block size B (= weight_block_size, 32), W [out, in]:

    scale_inv[i, j] = max(|W[iB:(i+1)B, jB:(j+1)B]|) / 448     f32 [ceil(out/B), ceil(in/B)]
    W_fp8           = (W / scale_inv expanded per block).to(torch.float8_e4m3fn)
    dequant         = W_fp8.float()
                      * scale_inv.repeat_interleave(B, 0).repeat_interleave(B, 1)[:out, :in]

i.e. dequant[r, c] = float(W_fp8[r, c]) * scale_inv[r // B, c // B] (one f32 multiply).
Partial edge blocks (dims not a multiple of B) get a scale over the partial block only.
The reference model for that fixture holds exactly `dequant` (float32); fp8 is what is stored.
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import os
import shutil
import sys
import tempfile

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
)

VOCAB = 384
PROMPT_LEN = 7
N_GREEDY = 24
MARGIN = 1e-3
FP8_BLOCK = 32
FP8_MAX = 448.0
EOS_TOKEN = "<|endoftext|>"

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still learn a few words.
Once upon a time there was a little town by the sea. Every morning the fishermen went out
in their boats, and every evening they came back with the catch of the day. The children
ran along the beach and the old men sat on the wall and talked about the weather.
The function returns the value of the key when the key is found in the table, and it
returns nothing when the key is missing. The server sends the request to the worker and
the worker sends the answer back to the server. Mixture of experts models route each
token to a few experts, and the router decides which experts see which tokens.
It was a bright cold day in April, and the clocks were striking thirteen. The river ran
under the bridge and the birds sang in the trees. She opened the window and looked out at
the garden, where the flowers were red and yellow and white.
"""


def corpus_lines() -> list[str]:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401

    zen = codecs.decode(sys.modules["this"].s, "rot13")
    return [ln for ln in (CORPUS + zen).splitlines() if ln.strip()]


# ------------------------------------------------------------------------------------------------
# tokenizer


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    return tok


# ------------------------------------------------------------------------------------------------
# fixture specs

# DeepSeek-V3 style (published: factor 40, original 4096, beta_fast 32, beta_slow 1, mscale 1/1)
YARN_DS = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)
# Kimi-K2 style (published: theta 50000, factor 32, original 4096, beta_fast 1, beta_slow 1)
YARN_KIMI = dict(
    rope_type="yarn",
    rope_theta=50000.0,
    factor=32.0,
    original_max_position_embeddings=16,
    beta_fast=1.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)

SPECS: dict[str, dict] = {
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        arch="Qwen3MoeForCausalLM",
        seed=1000,
        layout="stacked",
        cfg=dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,  # != hidden/heads on purpose (like Qwen3-30B-A3B)
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            use_sliding_window=False,
            sliding_window=None,
        ),
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        arch="DeepseekV3ForCausalLM",
        seed=2000,
        layout="sharded_mtp",
        cfg=dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            first_k_dense_replace=1,
            rope_interleave=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,  # = factor * original_max_position_embeddings
            rope_parameters=YARN_DS,
            num_nextn_predict_layers=1,
        ),
        old_extra=dict(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1),
    ),
    "deepseek_v3_fp8": dict(
        model_type="deepseek_v3",
        arch="DeepseekV3ForCausalLM",
        seed=3000,
        layout="sharded_fp8",
        cfg=dict(
            hidden_size=64,
            intermediate_size=80,  # 2.5 blocks of 32 -> partial edge block
            moe_intermediate_size=48,  # 1.5 blocks -> partial edge block
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,  # Kimi-K2: q_proj directly
            kv_lora_rank=32,  # kv_a_proj_with_mqa out = 32 + 8 = 40 -> partial block
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.827,
            n_shared_experts=1,
            first_k_dense_replace=1,
            rope_interleave=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=512,  # = factor * original_max_position_embeddings
            rope_parameters=YARN_KIMI,
            num_nextn_predict_layers=0,
        ),
        old_extra=dict(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1),
        # Kimi-K2's published config.json has no rope_interleave key (transformers default: True)
        old_drop=("rope_interleave",),
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        arch="Qwen2MoeForCausalLM",
        seed=4000,
        layout="per_expert",
        cfg=dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            qkv_bias=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=3,
        ),
        # published Qwen1.5/Qwen2-MoE configs have no qkv_bias key (transformers default: True)
        old_drop=("qkv_bias",),
    ),
    "mixtral": dict(
        model_type="mixtral",
        arch="MixtralForCausalLM",
        seed=5000,
        layout="per_expert",
        cfg=dict(
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            sliding_window=None,
        ),
    ),
    "olmoe": dict(
        model_type="olmoe",
        arch="OlmoeForCausalLM",
        seed=6000,
        layout="per_expert",
        cfg=dict(
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            clip_qkv=None,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            pad_token_id=None,
        ),
    ),
    "qwen3_moe_yarn": dict(
        model_type="qwen3_moe",
        arch="Qwen3MoeForCausalLM",
        seed=7000,
        layout="per_expert",
        cfg=dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            # Qwen3 cards: {"rope_type": "yarn", "factor": 4.0,
            #               "original_max_position_embeddings": 32768}
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1000000.0,
                factor=4.0,
                original_max_position_embeddings=16,
            ),
            use_sliding_window=False,
            sliding_window=None,
        ),
    ),
}
ORDER = [
    "qwen3_moe",
    "deepseek_v3",
    "deepseek_v3_fp8",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "qwen3_moe_yarn",
]


# ------------------------------------------------------------------------------------------------
# model construction


def make_config(spec, eos_id: int):
    cls = transformers.CONFIG_MAPPING[spec["model_type"]]
    kw = dict(spec["cfg"])
    kw.update(vocab_size=VOCAB, bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=False)
    kw["rope_parameters"] = dict(kw["rope_parameters"])
    cfg = cls(**kw)
    cfg.architectures = [spec["arch"]]
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def randomize(model, seed: int):
    """Re-init all params (+ e_score_correction_bias) with fan-in scaled normals: wide logits."""
    g = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    for n, b in model.named_buffers():
        if n.endswith("e_score_correction_bias"):
            tensors[n] = b
    for name in sorted(tensors):
        t = tensors[name]
        if name.endswith("e_score_correction_bias"):
            v = torch.randn(t.shape, generator=g) * 0.1
        elif t.ndim == 1 and "norm" in name:
            v = 1.0 + 0.2 * torch.randn(t.shape, generator=g)
        elif t.ndim == 1:  # biases
            v = 0.3 * torch.randn(t.shape, generator=g)
        elif name.endswith("embed_tokens.weight"):
            v = torch.randn(t.shape, generator=g)
        else:
            gain = 1.0
            if name == "lm_head.weight":
                gain = 3.0
            elif name.endswith("mlp.gate.weight"):  # routers
                gain = 2.0
            v = torch.randn(t.shape, generator=g) * (gain / math.sqrt(t.shape[-1]))
        t.copy_(v.to(t.dtype))


def fp8_quantize(w: torch.Tensor, block: int = FP8_BLOCK):
    out, inn = w.shape
    nb_o, nb_i = math.ceil(out / block), math.ceil(inn / block)
    pad = torch.zeros(nb_o * block, nb_i * block, dtype=torch.float32)
    pad[:out, :inn] = w.float()
    blocks = pad.view(nb_o, block, nb_i, block).abs().amax(dim=(1, 3))
    scale_inv = (blocks / FP8_MAX).clamp(min=1e-12).float()
    expanded = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out, :inn]
    q = (w.float() / expanded).to(torch.float8_e4m3fn)
    return q, scale_inv


def fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK):
    out, inn = q.shape
    return q.float() * scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out, :inn]


FP8_SUFFIXES = (
    "q_proj.weight",
    "q_a_proj.weight",
    "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight",
    "kv_b_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


def is_fp8_target(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(FP8_SUFFIXES)


# ------------------------------------------------------------------------------------------------
# reference run + margins


class RouterProbe:
    """Captures router inputs (hidden states entering `mlp.gate`), recomputes selection margins."""

    def __init__(self, model, cfg):
        self.cfg = cfg
        self.gaps: list[float] = []
        self.handles = []
        self.selections = []
        for mod in model.modules():
            if type(mod).__name__.lower().endswith("topkrouter"):
                self.handles.append(mod.register_forward_hook(self._hook))

    def _hook(self, mod, args, out):
        x = args[0].detach().reshape(-1, mod.weight.shape[1]).double()
        logits = x @ mod.weight.detach().double().T
        k = mod.top_k
        if hasattr(mod, "e_score_correction_bias"):
            s = logits.sigmoid() + mod.e_score_correction_bias.double()
            ng, tg = mod.num_group, mod.topk_group
            ne = s.shape[1]
            if ng > 1 and tg < ng:
                gs = s.view(-1, ng, ne // ng).topk(2, dim=-1)[0].sum(-1)
                srt = gs.sort(dim=-1, descending=True)[0]
                self.gaps += (srt[:, tg - 1] - srt[:, tg]).tolist()
                gidx = gs.topk(tg, dim=-1)[1]
                gmask = torch.zeros_like(gs).scatter_(1, gidx, 1.0)
                emask = gmask.unsqueeze(-1).expand(-1, ng, ne // ng).reshape(-1, ne).bool()
                s = s.masked_fill(~emask, float("-inf"))
            srt = s.sort(dim=-1, descending=True)[0]
            self.gaps += (srt[:, k - 1] - srt[:, k]).tolist()
            sel = s.topk(k, dim=-1)[1]
        else:
            p = logits.softmax(-1)
            srt = p.sort(dim=-1, descending=True)[0]
            self.gaps += (srt[:, k - 1] - srt[:, k]).tolist()
            sel = p.topk(k, dim=-1)[1]
        # cross-check our recomputation against what transformers actually selected
        tsel = out[2].reshape(-1, k)
        same = torch.equal(sel.sort(-1)[0], tsel.sort(-1)[0].to(sel.device))
        assert same, "router recompute mismatch"

    def close(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def reference(model, prompt_ids: list[int]):
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    prefill = model(input_ids=ids, use_cache=False).logits[0].float()
    # greedy with KV cache
    out = model(input_ids=ids, use_cache=True)
    cache = out.cache
    step_logits = out.logits[0, -1].float()
    greedy, glogits = [], []
    for _ in range(N_GREEDY):
        nxt = int(step_logits.argmax())
        greedy.append(nxt)
        glogits.append(step_logits.clone())
        out = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache = out.cache
        step_logits = out.logits[0, -1].float()
    # cross-check the manual cache loop against transformers' own greedy generate()
    gen = model.generate(ids, max_new_tokens=N_GREEDY, do_sample=False, use_cache=True)
    # generate() stops at EOS: compare the common prefix
    gen_new = gen[0, len(prompt_ids) :].tolist()
    assert gen_new == greedy[: len(gen_new)], (gen_new, greedy)
    return prefill.numpy(), np.array(greedy, dtype=np.int64), torch.stack(glogits).numpy()


def logit_gaps(glogits: np.ndarray) -> np.ndarray:
    s = np.sort(glogits.astype(np.float64), axis=-1)
    return s[:, -1] - s[:, -2]


# ------------------------------------------------------------------------------------------------
# checkpoint layout


def state_dict_published(model) -> dict[str, torch.Tensor]:
    """What transformers writes: save_pretrained reverts its weight conversions (= published)."""
    with tempfile.TemporaryDirectory() as td:
        model.save_pretrained(td)
        files = sorted(f for f in os.listdir(td) if f.endswith(".safetensors"))
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(os.path.join(td, f)))
        with open(os.path.join(td, "config.json")) as fh:
            new_cfg = json.load(fh)
    return sd, new_cfg


def to_stacked(sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Per-expert -> transformers' internal stacked form.

    experts.gate_up_proj [E, 2I, H] (rows :I = gate, I: = up), experts.down_proj [E, H, I].
    """
    out = {}
    E = cfg.num_experts
    for k, v in sd.items():
        if ".mlp.experts." in k:
            continue
        out[k] = v
    for L in range(cfg.num_hidden_layers):
        p = f"model.layers.{L}.mlp.experts"
        if f"{p}.0.gate_proj.weight" not in sd:
            continue
        gate = torch.stack([sd[f"{p}.{e}.gate_proj.weight"] for e in range(E)])
        up = torch.stack([sd[f"{p}.{e}.up_proj.weight"] for e in range(E)])
        down = torch.stack([sd[f"{p}.{e}.down_proj.weight"] for e in range(E)])
        out[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
        out[f"{p}.down_proj"] = down.contiguous()
    return out


def add_mtp_layer(sd: dict[str, torch.Tensor], cfg, seed: int) -> list[str]:
    """DeepSeek-V3 style MTP layer at index num_hidden_layers (V3: 61). Inference must skip it."""
    g = torch.Generator().manual_seed(seed + 777)
    n = cfg.num_hidden_layers
    H = cfg.hidden_size
    src = f"model.layers.{n - 1}."
    dst = f"model.layers.{n}."
    added = []
    for k in list(sd):
        if k.startswith(src):
            nk = dst + k[len(src) :]
            sd[nk] = (sd[k] + 0.01 * torch.randn(sd[k].shape, generator=g)).to(sd[k].dtype)
            added.append(nk)
    extra = {
        "embed_tokens.weight": torch.randn(cfg.vocab_size, H, generator=g),
        "enorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "eh_proj.weight": torch.randn(H, 2 * H, generator=g) / math.sqrt(2 * H),
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "shared_head.head.weight": torch.randn(cfg.vocab_size, H, generator=g) / math.sqrt(H),
    }
    for k, v in extra.items():
        sd[dst + k] = v.float()
        added.append(dst + k)
    return added


def layer_key(name: str) -> tuple:
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        return (1, int(parts[2]), name)
    return (0 if "embed" in name else 2, 0, name)


def write_safetensors(sd: dict[str, torch.Tensor], outdir: str, shards: int):
    names = sorted(sd, key=layer_key)
    meta = {"format": "pt"}
    if shards == 1:
        save_file(
            {k: sd[k].contiguous() for k in names},
            os.path.join(outdir, "model.safetensors"),
            metadata=meta,
        )
        os.chmod(os.path.join(outdir, "model.safetensors"), 0o644)
        return ["model.safetensors"]
    # split roughly in half by bytes, keeping each layer's tensors together where possible
    total = sum(sd[k].numel() * sd[k].element_size() for k in names)
    files, weight_map, acc, cur = [], {}, 0, []
    groups: list[list[str]] = [[], []]
    for k in names:
        groups[0 if acc < total / 2 else 1].append(k)
        acc += sd[k].numel() * sd[k].element_size()
    for i, grp in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k].contiguous() for k in grp}, os.path.join(outdir, fn), metadata=meta)
        os.chmod(os.path.join(outdir, fn), 0o644)
        files.append(fn)
        for k in grp:
            weight_map[k] = fn
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(outdir, "model.safetensors.index.json"), "w") as fh:
        json.dump(index, fh, indent=2)
        fh.write("\n")
    del cur
    return files


# ------------------------------------------------------------------------------------------------
# config dialects


def old_dialect(new: dict, spec) -> dict:
    d = {k: v for k, v in new.items() if k not in ("transformers_version",)}
    rp = dict(d.pop("rope_parameters"))
    d["rope_theta"] = rp.pop("rope_theta")
    rtype = rp.pop("rope_type")
    if rtype == "default":
        d["rope_scaling"] = None
    elif spec["model_type"] == "deepseek_v3":
        # published DeepSeek-V3 / Kimi-K2 form
        d["rope_scaling"] = {"type": rtype, **dict(sorted(rp.items()))}
    else:
        d["rope_scaling"] = {"rope_type": rtype, **dict(sorted(rp.items()))}  # published Qwen3 form
    d["torch_dtype"] = d.pop("dtype", "float32")
    if spec["model_type"] in ("qwen3_moe", "qwen2_moe", "olmoe") and "num_local_experts" in d:
        d["num_experts"] = d.pop("num_local_experts")
    if spec["model_type"] == "deepseek_v3":
        # derived in transformers, absent in published configs
        for k in ("head_dim", "qk_head_dim"):
            d.pop(k, None)
    if d.get("head_dim", 0) is None:  # e.g. Mixtral: published configs have no head_dim key
        d.pop("head_dim")
    d.pop("layer_types", None)  # transformers-5 addition; published configs predate it
    for k in spec.get("old_drop", ()):
        d.pop(k, None)
    d.update(spec.get("old_extra", {}))
    d["transformers_version"] = "4.46.3"
    return dict(sorted(d.items()))


def dump_json(obj, path):
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=False)
        fh.write("\n")


# ------------------------------------------------------------------------------------------------
# verification: both dialects load (from_pretrained) to the same model and reproduce the reference


def dequantize_checkpoint(ckpt: str) -> dict[str, torch.Tensor]:
    """Read all shards; X.weight with a sibling X.weight_scale_inv -> f32 via fp8_dequantize."""
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(ckpt, f)))
    out = {}
    for k, v in sd.items():
        if k.endswith("_scale_inv"):
            continue
        if k + "_scale_inv" in sd:
            assert v.dtype == torch.float8_e4m3fn, (k, v.dtype)
            out[k] = fp8_dequantize(v, sd[k + "_scale_inv"])
        else:
            out[k] = v.float()
    return out


@torch.no_grad()
def verify_dialects(outdir: str, ref_prefill: np.ndarray, prompt_ids, spec, ref_model=None) -> dict:
    report = {}
    files = [f for f in os.listdir(outdir) if f.startswith("model") or f.startswith("tokenizer")]
    ids = torch.tensor([prompt_ids])
    results = {}
    for dialect, cfgname in (("old", "config.json"), ("new", "config.rope_parameters.json")):
        with tempfile.TemporaryDirectory() as td:
            for f in files:
                shutil.copy(os.path.join(outdir, f), td)
            shutil.copy(os.path.join(outdir, cfgname), os.path.join(td, "config.json"))
            if spec["layout"] == "sharded_fp8":
                # fp8: dequantise the WRITTEN shards (documented formula) into a plain f32
                # checkpoint, drop quantization_config, let transformers load it with this config.
                deq = dequantize_checkpoint(outdir)
                for f in os.listdir(td):
                    if f.startswith("model"):
                        os.remove(os.path.join(td, f))
                save_file(deq, os.path.join(td, "model.safetensors"))
                with open(os.path.join(td, "config.json")) as fh:
                    c = json.load(fh)
                c.pop("quantization_config")
                dump_json(c, os.path.join(td, "config.json"))
            m = AutoModelForCausalLM.from_pretrained(
                td, attn_implementation="eager", dtype=torch.float32
            )
            m.eval()
            logits = m(input_ids=ids, use_cache=False).logits[0].float().numpy()
            results[dialect] = logits
            rp = m.config.rope_parameters
            report[dialect] = dict(
                rope_parameters=dict(rp),
                max_abs_diff_vs_reference=float(np.abs(logits - ref_prefill).max()),
            )
    report["old_vs_new_identical"] = bool(np.array_equal(results["old"], results["new"]))
    assert report["old_vs_new_identical"], report
    # old dialect keeps the legacy "type" alias next to the standardised "rope_type"
    rp_old = {k: v for k, v in report["old"]["rope_parameters"].items() if k != "type"}
    assert rp_old == report["new"]["rope_parameters"], report
    for dialect in ("old", "new"):
        assert report[dialect]["max_abs_diff_vs_reference"] < 1e-4, report
    return report


@torch.no_grad()
def verify_fp8_native(outdir: str, ref_prefill: np.ndarray, prompt_ids) -> str:
    """Best effort: does transformers itself load the fp8 checkpoint on CPU (dequantize=True)?"""
    try:
        from transformers import FineGrainedFP8Config

        m = AutoModelForCausalLM.from_pretrained(
            outdir,
            attn_implementation="eager",
            dtype=torch.float32,
            quantization_config=FineGrainedFP8Config(dequantize=True),
        )
        m.eval()
        logits = m(input_ids=torch.tensor([prompt_ids]), use_cache=False).logits[0].float().numpy()
        diff = float(np.abs(logits - ref_prefill).max())
        return f"transformers FineGrainedFP8Config(dequantize=True): max|diff| vs ref = {diff:.3e}"
    except Exception as e:  # noqa: BLE001
        return f"transformers native fp8 load not verified: {type(e).__name__}: {str(e)[:200]}"


# ------------------------------------------------------------------------------------------------


def build_fixture(
    name: str, out_root: str, tok, prompt_ids: list[int], eos_id: int, max_tries: int = 50
):
    spec = SPECS[name]
    seed = spec["seed"]
    for attempt in range(max_tries):
        s = seed + attempt
        torch.manual_seed(s)
        cfg = make_config(spec, eos_id)
        model = AutoModelForCausalLM.from_config(
            cfg, attn_implementation="eager", dtype=torch.float32
        )
        randomize(model, s)
        model.eval().float()
        sd_pub, new_cfg = state_dict_published(model)
        fp8_store = {}
        if spec["layout"] == "sharded_fp8":
            for k in list(sd_pub):
                if is_fp8_target(k):
                    q, si = fp8_quantize(sd_pub[k])
                    fp8_store[k] = (q, si)
                    sd_pub[k] = fp8_dequantize(q, si)
            # reload the dequantised weights into the reference model (via transformers' own loader)
            with tempfile.TemporaryDirectory() as td:
                save_file(
                    {k: v.contiguous() for k, v in sd_pub.items()},
                    os.path.join(td, "model.safetensors"),
                )
                cfg.save_pretrained(td)
                model = AutoModelForCausalLM.from_pretrained(
                    td, attn_implementation="eager", dtype=torch.float32
                )
                model.eval()
        probe = RouterProbe(model, cfg)
        prefill, greedy, glogits = reference(model, prompt_ids)
        probe.close()
        rgap = float(min(probe.gaps)) if probe.gaps else float("inf")
        lgap = float(logit_gaps(glogits).min())
        eos_in = eos_id in greedy.tolist()
        ok = rgap > MARGIN and lgap > MARGIN and not eos_in
        print(
            f"[{name}] seed {s}: min router gap {rgap:.3e} ({len(probe.gaps)} decisions), "
            f"min greedy logit gap {lgap:.3e}, eos in greedy: {eos_in} -> "
            f"{'OK' if ok else 'retry'}",
            flush=True,
        )
        if ok:
            break
    else:
        raise RuntimeError(f"{name}: no seed with sufficient margins")

    outdir = os.path.join(out_root, name)
    if os.path.exists(outdir):
        shutil.rmtree(outdir)
    os.makedirs(outdir)

    # --- weights
    notes = []
    if spec["layout"] == "stacked":
        sd = to_stacked(sd_pub, cfg)
        nfiles = write_safetensors(sd, outdir, 1)
    elif spec["layout"] == "sharded_mtp":
        sd = dict(sd_pub)
        added = add_mtp_layer(sd, cfg, s)
        n = cfg.num_hidden_layers
        notes.append(f"MTP layer (skip at inference): {len(added)} tensors under model.layers.{n}.")
        nfiles = write_safetensors(sd, outdir, 2)
    elif spec["layout"] == "sharded_fp8":
        sd = {}
        for k, v in sd_pub.items():
            if k in fp8_store:
                q, si = fp8_store[k]
                sd[k] = q
                sd[k + "_scale_inv"] = si
            else:
                sd[k] = v
        nfiles = write_safetensors(sd, outdir, 2)
    else:
        sd = sd_pub
        nfiles = write_safetensors(sd, outdir, 1)

    # --- configs
    new_cfg = dict(new_cfg)
    new_cfg["architectures"] = [spec["arch"]]
    if spec["layout"] == "sharded_fp8":
        new_cfg["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
    dump_json(new_cfg, os.path.join(outdir, "config.rope_parameters.json"))
    dump_json(old_dialect(new_cfg, spec), os.path.join(outdir, "config.json"))
    dump_json(
        {
            "_from_model_config": True,
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "do_sample": False,
        },
        os.path.join(outdir, "generation_config.json"),
    )
    tok.save(os.path.join(outdir, "tokenizer.json"))
    dump_json(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": EOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "add_bos_token": False,
            "model_max_length": cfg.max_position_embeddings,
        },
        os.path.join(outdir, "tokenizer_config.json"),
    )

    # --- reference
    np.savez(
        os.path.join(outdir, "reference.npz"),
        prompt_ids=np.array(prompt_ids, dtype=np.int64),
        prefill_logits=prefill.astype(np.float32),
        greedy_ids=greedy.astype(np.int64),
        greedy_logits=glogits.astype(np.float32),
    )

    report = verify_dialects(outdir, prefill, prompt_ids, spec, ref_model=model)
    if spec["layout"] == "sharded_fp8":
        notes.append(verify_fp8_native(outdir, prefill, prompt_ids))
    meta = dict(
        fixture=name,
        seed=s,
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
        weight_files=nfiles,
        min_router_gap=rgap,
        router_decisions=len(probe.gaps),
        min_greedy_logit_gap=lgap,
        eos_token_id=eos_id,
        eos_note="eos = <|endoftext|> (special token, id 0); it does not occur in greedy_ids",
        dialect_check=report,
        notes=notes,
    )
    dump_json(meta, os.path.join(outdir, "meta.json"))
    print(f"[{name}] wrote {outdir}: {nfiles}; {notes}", flush=True)
    return meta


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--only", default="", help="comma-separated fixture names")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.makedirs(args.out, exist_ok=True)

    tok = build_tokenizer()
    eos_id = tok.token_to_id(EOS_TOKEN)
    enc = tok.encode("The quick brown fox jumps over the lazy dog and the river").ids
    assert len(enc) >= PROMPT_LEN, enc
    prompt_ids = enc[:PROMPT_LEN]
    print(
        f"vocab {tok.get_vocab_size()}, eos {eos_id}, "
        f"prompt {prompt_ids} = {tok.decode(prompt_ids)!r}"
    )

    names = [n for n in ORDER if not args.only or n in args.only.split(",")]
    for n in names:
        build_fixture(n, args.out, tok, prompt_ids, eos_id)


if __name__ == "__main__":
    main()
