"""Verification: both config dialects load (from_pretrained) to the same model and reproduce
the reference; fp8 checkpoints are dequantised by the documented formula first."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from .checkpoint import dump_json, fp8_dequantize


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
