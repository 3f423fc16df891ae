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
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from fixtures_lib.checkpoint import (  # noqa: E402
    FP8_BLOCK,
    add_mtp_layer,
    add_qwen_mtp,
    dump_json,
    fp8_dequantize,
    fp8_quantize,
    is_fp8_target,
    old_dialect,
    state_dict_published,
    to_stacked,
    write_safetensors,
)
from fixtures_lib.reference import (  # noqa: E402
    RouterProbe,
    logit_gaps,
    make_config,
    randomize,
    reference,
)
from fixtures_lib.specs import ORDER, SPECS  # noqa: E402
from fixtures_lib.tokenizer import EOS_TOKEN, build_tokenizer  # noqa: E402
from fixtures_lib.verify import verify_dialects, verify_fp8_native  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
)

PROMPT_LEN = 7
MARGIN = 1e-3


def build_fixture(
    name: str, out_root: str, tok, prompt_ids: list[int], eos_id: int, max_tries: int = 50
):
    spec = SPECS[name]
    seed = spec["seed"]
    for attempt in range(max_tries):
        s = seed + attempt
        torch.manual_seed(s)
        cfg = make_config(spec, eos_id)
        if "vision_cfg" in spec:  # the published vision-language class, not the text model
            model = getattr(transformers, spec["arch"])._from_config(
                cfg, attn_implementation="eager", dtype=torch.float32
            )
        else:
            model = AutoModelForCausalLM.from_config(
                cfg, attn_implementation="eager", dtype=torch.float32
            )
        randomize(model, s, spec.get("offset_norms", False))
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
        probe = RouterProbe(model, getattr(cfg, "text_config", cfg))
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
    elif spec["layout"] in ("per_expert_mtp", "stacked_mtp"):
        text = getattr(cfg, "text_config", cfg)
        sd = dict(sd_pub)
        if spec["layout"] == "stacked_mtp":  # (published Qwen3.5: stacked experts)
            sd = to_stacked(sd, text, "model.language_model." if text is not cfg else "model.")
        added = add_qwen_mtp(sd, text.hidden_size, s)
        notes.append(f"MTP head (skip at inference): {len(added)} tensors under mtp.")
        nfiles = write_safetensors(sd, outdir, 1)
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
    if "vision_cfg" in spec:
        # published: the wrapper as save_pretrained writes it (its text_config already in the
        # rope_parameters dialect); the other dialect: the text-only model's own config
        new_cfg["text_config"].update(spec.get("text_extra", {}))
        dump_json(new_cfg, os.path.join(outdir, "config.json"))
        text_cfg = cfg.text_config
        text_cfg.architectures = [spec["text_arch"]]
        with tempfile.TemporaryDirectory() as td:
            text_cfg.save_pretrained(td)
            with open(os.path.join(td, "config.json")) as fh:
                text_only = json.load(fh)
        dump_json(text_only, os.path.join(outdir, "config.rope_parameters.json"))
    else:
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
            "model_max_length": getattr(cfg, "text_config", cfg).max_position_embeddings,
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
    print(f"vocab {tok.get_vocab_size()}, eos {eos_id}, prompt {enc} = {tok.decode(enc)!r}")

    names = [n for n in ORDER if not args.only or n in args.only.split(",")]
    for n in names:
        length = SPECS[n].get("prompt_len", PROMPT_LEN)  # (recurrent layers: a longer prompt)
        assert len(enc) >= length, (n, enc)
        build_fixture(n, args.out, tok, enc[:length], eos_id)


if __name__ == "__main__":
    main()
