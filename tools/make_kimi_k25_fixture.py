#!/usr/bin/env python
"""A tiny Kimi K2.5 checkpoint in the released layout: INT4 experts as compressed-tensors packs
them, its reference outputs from transformers, and what compressed-tensors decodes them to.

    .venv-ref/bin/python tools/make_kimi_k25_fixture.py --out tests/fixtures/kimi_k25

(needs the `compressed-tensors` package in .venv-ref, which the fixture script alone uses).

The model is transformers 5.25's `Kimi_K25ForConditionalGeneration` (float32, eager
attention): a DeepSeek-V3 language model as Kimi K2's (q LoRA, YaRN as Kimi publishes it, one
group, sigmoid router with a correction bias, a shared expert) with 3 layers (layer 0 a dense
MLP), 8 experts of 32, top-2, and a vision tower of one block, never run.  Weights are the
other fixtures' fan-in-scaled normals (`fixtures_lib.reference.randomize`), rounded to bf16 as
the release stores them, and each routed expert matrix is then quantised exactly as
compressed-tensors does it for the released scheme (`QuantizationArgs`: 4-bit int,
symmetric, group 32; scales from `calculate_qparams` on the bf16 weights, bf16;
`PackedQuantizationCompressor.compress` packs the codes into int32 `weight_packed` beside
`weight_scale` and `weight_shape`).  The model that computes the reference holds what
`PackedQuantizationCompressor.decompress` gives back with the scales in float32 (the exact
products scale * q: with bf16 scales the package rounds each product to bf16).

Written files: model.safetensors in the released names (``language_model.model.layers.N.``,
``language_model.lm_head``, ``vision_tower.``, ``mm_projector.``; experts as INT4, the rest
bf16, the router's correction bias f32); config.json in the released dialect (model_type
kimi_k25, text_config model_type kimi_k2 with quantization_config); config.rope_parameters.json
as transformers' `save_pretrained` writes the config (text_config deepseek_v3 with
rope_parameters, quantization_config at the top); reference.npz as tools/make_fixtures.py
writes it; int4_decoded.npz: what compressed-tensors decodes the matrices of experts 0 and 1
of layer 1 to, with float32 scales (`<name>`, float32) and as it ships (bf16 scales:
`<name>:bf16`, the bf16 bits as uint16); meta.json: seed, margins, and the names
`save_pretrained` writes where they are not the released ones.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from fixtures_lib.checkpoint import (  # noqa: E402
    dump_json,
    old_dialect,
    state_dict_published,
    write_safetensors,
)
from fixtures_lib.reference import RouterProbe, logit_gaps, randomize, reference  # noqa: E402
from fixtures_lib.specs import SPECS  # noqa: E402
from fixtures_lib.tokenizer import EOS_TOKEN, VOCAB, build_tokenizer  # noqa: E402
from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration  # noqa: E402

PROMPT_LEN = 7
MARGIN = 1e-3
SEED = 9000
# Kimi K2's fixture (deepseek_v3_fp8: q_proj without LoRA, YaRN as Kimi publishes it), with
# K2.5's q LoRA and whole 32-weight groups for the INT4 experts
TEXT = dict(
    SPECS["deepseek_v3_fp8"]["cfg"],
    model_type="deepseek_v3",
    q_lora_rank=32,
    intermediate_size=96,
    moe_intermediate_size=32,
    tie_word_embeddings=False,
)
EXPERTS, LAYERS = TEXT["n_routed_experts"], TEXT["num_hidden_layers"]
VISION = dict(
    patch_size=4, num_attention_heads=2, num_hidden_layers=1, hidden_size=16,
    intermediate_size=32, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2,
)  # fmt: skip
ARGS = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
SCHEME = QuantizationScheme(targets=["Linear"], weights=ARGS)
# as Kimi K2 Thinking / K2.5 publish it: only the routed experts are quantised
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
          r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*vision_tower.*",
          "re:.*mm_projector.*"]  # fmt: skip
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
# transformers' save_pretrained -> released names (its kimi_k25 renames, undone on every name)
SAVED_TO_RELEASED = ((r"^language_model\.model\.blocks\.", "language_model.model.layers."),
                     (r"^model\.mm_projector\.", "mm_projector."))  # fmt: skip
DECODED = [f"language_model.model.layers.1.mlp.experts.{e}.{p}_proj" for e in (0, 1)
           for p in ("gate", "up", "down")]  # fmt: skip


def make_model(seed: int, eos_id: int):
    text = dict(TEXT, vocab_size=VOCAB, bos_token_id=eos_id, eos_token_id=eos_id)
    text["rope_parameters"] = dict(text["rope_parameters"])
    cfg = Kimi_K25Config(
        text_config=text, vision_config=VISION, projection_hidden_size=16,
        tie_word_embeddings=False, eos_token_id=eos_id, bos_token_id=eos_id,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    model = Kimi_K25ForConditionalGeneration(cfg).eval().float()
    randomize(model, seed)
    with torch.no_grad():
        for p in model.parameters():  # the release stores everything but the experts in bf16
            p.copy_(p.bfloat16().float())
    return cfg, model


def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One expert matrix [out, in] (bf16 values) as compressed-tensors compresses it."""
    w = w.bfloat16()
    groups = w.reshape(w.shape[0], -1, ARGS.group_size)  # [out, in / 32, 32]
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), ARGS)  # bf16 [out, nb]
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero}
    return PackedQuantizationCompressor.compress(state, SCHEME)


def decompress(packed: dict[str, torch.Tensor], scale_dtype=torch.float32) -> torch.Tensor:
    state = dict(packed, weight_scale=packed["weight_scale"].to(scale_dtype))
    return PackedQuantizationCompressor.decompress(state, SCHEME)["weight"]


def quantize_experts(model) -> dict[str, dict[str, torch.Tensor]]:
    """Every routed expert matrix replaced in the model by its INT4 decoding; returns the
    compressed tensors by released name (without .weight)."""
    packed = {}
    with torch.no_grad():
        for layer in range(1, LAYERS):
            experts = model.model.language_model.layers[layer].mlp.experts
            inter = TEXT["moe_intermediate_size"]
            for e in range(EXPERTS):
                gate_up = experts.gate_up_proj[e]  # [2I, H]: gate rows, then up rows
                mats = {
                    "gate": gate_up[:inter],
                    "up": gate_up[inter:],
                    "down": experts.down_proj[e],
                }
                for proj, w in mats.items():
                    name = f"language_model.model.layers.{layer}.mlp.experts.{e}.{proj}_proj"
                    packed[name] = quantize(w)
                    w.copy_(decompress(packed[name]))
    return packed


def released_names(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """save_pretrained's state dict under the released names, and {released: saved} where
    they differ."""
    out, renamed = {}, {}
    for saved, value in sd.items():
        name = saved
        for pattern, released in SAVED_TO_RELEASED:
            name = re.sub(pattern, released, name)
        out[name] = value
        if name != saved:
            renamed[name] = saved
    return out, renamed


def checkpoint(sd, packed) -> dict[str, torch.Tensor]:
    """The released tensors: INT4 experts, the correction bias f32, everything else bf16."""
    out = {}
    for name, value in sd.items():
        if EXPERT.search(name):
            base = name[: -len(".weight")]
            for part, tensor in packed[base].items():
                out[f"{base}.{part}"] = tensor.contiguous()
        elif name.endswith("e_score_correction_bias"):
            out[name] = value.float()
        else:
            out[name] = value.bfloat16()
    return out


def quantization_config() -> dict:
    qc = QuantizationConfig(
        config_groups={"group_0": SCHEME}, format="pack-quantized",
        quantization_status="compressed", ignore=IGNORE,
    )  # fmt: skip
    return qc.model_dump()


def configs(saved: dict, eos_id: int) -> tuple[dict, dict]:
    """(released config.json, transformers' config.json) from what save_pretrained wrote."""
    text = old_dialect(dict(saved["text_config"]), {
        "model_type": "deepseek_v3", "old_drop": ("rope_interleave",),
        "old_extra": dict(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1),
    })  # fmt: skip
    text |= {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
             "torch_dtype": "bfloat16", "quantization_config": quantization_config()}  # fmt: skip
    released = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "media_placeholder_token_id": saved["image_token_id"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "text_config": dict(sorted(text.items())),
        "vision_config": saved["vision_config"],
    }
    hf = dict(saved, quantization_config=quantization_config())
    return released, hf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/kimi_k25")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tok = build_tokenizer()
    eos_id = tok.token_to_id(EOS_TOKEN)
    prompt = tok.encode("The quick brown fox jumps over the lazy dog and the river").ids[
        :PROMPT_LEN
    ]
    for seed in range(SEED, SEED + 50):
        torch.manual_seed(seed)
        cfg, model = make_model(seed, eos_id)
        packed = quantize_experts(model)
        probe = RouterProbe(model, cfg.text_config)
        prefill, greedy, glogits = reference(model, prompt)
        probe.close()
        rgap, lgap = float(min(probe.gaps)), float(logit_gaps(glogits).min())
        ok = rgap > MARGIN and lgap > MARGIN and eos_id not in greedy.tolist()
        print(f"seed {seed}: router gap {rgap:.3e}, logit gap {lgap:.3e} -> {ok}", flush=True)
        if ok:
            break
    else:
        raise RuntimeError("no seed with sufficient margins")

    out = args.out
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    saved_sd, saved_cfg = state_dict_published(model)
    sd, renamed = released_names(saved_sd)
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight" in sd
    files = write_safetensors(checkpoint(sd, packed), out, 1)
    released, hf = configs(saved_cfg, eos_id)
    dump_json(released, os.path.join(out, "config.json"))
    dump_json(hf, os.path.join(out, "config.rope_parameters.json"))
    dump_json({"_from_model_config": True, "bos_token_id": eos_id, "eos_token_id": eos_id,
               "do_sample": False}, os.path.join(out, "generation_config.json"))  # fmt: skip
    tok.save(os.path.join(out, "tokenizer.json"))
    dump_json({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS_TOKEN,
               "eos_token": EOS_TOKEN, "add_bos_token": False},
              os.path.join(out, "tokenizer_config.json"))  # fmt: skip
    np.savez(
        os.path.join(out, "reference.npz"),
        prompt_ids=np.array(prompt, dtype=np.int64),
        prefill_logits=prefill.astype(np.float32),
        greedy_ids=greedy.astype(np.int64),
        greedy_logits=glogits.astype(np.float32),
    )
    decoded = {}
    for name in DECODED:
        decoded[name] = decompress(packed[name]).numpy()
        decoded[name + ":bf16"] = decompress(packed[name], torch.bfloat16).view(torch.int16).numpy()
    np.savez_compressed(os.path.join(out, "int4_decoded.npz"), **decoded)
    meta = dict(
        fixture="kimi_k25", seed=seed, transformers_version=transformers.__version__,
        torch_version=torch.__version__, weight_files=files, min_router_gap=rgap,
        router_decisions=len(probe.gaps), min_greedy_logit_gap=lgap,
        save_pretrained_names=dict(sorted(renamed.items())),
    )  # fmt: skip
    dump_json(meta, os.path.join(out, "meta.json"))
    print(f"wrote {out}: {files}; {len(renamed)} names save_pretrained writes otherwise")


if __name__ == "__main__":
    main()
