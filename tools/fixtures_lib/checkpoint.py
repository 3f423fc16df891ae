"""Checkpoint writing: fp8 block quantisation, the published state dict and its layouts
(stacked experts, MTP layer, shards), and the old/new config dialects."""

from __future__ import annotations

import json
import math
import os
import tempfile

import torch
from safetensors.torch import load_file, save_file

FP8_BLOCK = 32
FP8_MAX = 448.0


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


def to_stacked(sd: dict[str, torch.Tensor], cfg, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Per-expert -> transformers' internal stacked form.

    experts.gate_up_proj [E, 2I, H] (rows :I = gate, I: = up), experts.down_proj [E, H, I].
    `prefix`: where the decoder's layers are (a vision-language wrapper: model.language_model.).
    """
    out = {}
    E = cfg.num_experts
    for k, v in sd.items():
        if ".mlp.experts." in k:
            continue
        out[k] = v
    for L in range(cfg.num_hidden_layers):
        p = f"{prefix}layers.{L}.mlp.experts"
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


def add_qwen_mtp(sd: dict[str, torch.Tensor], hidden: int, seed: int) -> list[str]:
    """A Qwen3-Next / Qwen3.5 style multi-token-prediction head (`mtp.*`, as published; a few
    of its tensors): transformers ignores them on load, inference must skip them."""
    g = torch.Generator().manual_seed(seed + 777)
    extra = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=g) / math.sqrt(2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": 0.1 * torch.randn(hidden, generator=g),
        "mtp.pre_fc_norm_hidden.weight": 0.1 * torch.randn(hidden, generator=g),
        "mtp.layers.0.input_layernorm.weight": 0.1 * torch.randn(hidden, generator=g),
        "mtp.norm.weight": 0.1 * torch.randn(hidden, generator=g),
    }
    sd.update(extra)
    return sorted(extra)


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
    if "partial_rotary_factor" in rp:  # GLM, published Qwen3-Next: at top level
        d["partial_rotary_factor"] = rp.pop("partial_rotary_factor")
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
