#!/usr/bin/env python3
"""Train a small Qwen3-MoE demo checkpoint for moeshard (offline, CPU).

Training-only tool: needs the reference venv (torch, transformers, tokenizers,
safetensors, matplotlib).  torch/transformers are NOT runtime dependencies.

Corpus: the Python 3.11 documentation shipped by Debian (`python3.11-doc`,
PSF License), HTML converted to plain text.  Install it with
    apt-get update && apt-get install -y python3.11-doc

Output (written to a temp dir, renamed to --out at the very end):
    config.json, model.safetensors (bf16), generation_config.json,
    tokenizer.json, tokenizer_config.json, loss.png, train_log.json

Usage:
    .venv-ref/bin/python tools/train_demo.py --seed 1234 --steps 2000
    .venv-ref/bin/python tools/train_demo.py --probe 20      # timing probe only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_demo_lib.corpus import corpus_meta, find_corpus, load_docs, split_docs  # noqa: E402
from train_demo_lib.plot import plot_losses  # noqa: E402
from train_demo_lib.tokenizer import EOT, add_bos_post_processor, encode_stream, train_tokenizer  # noqa: E402

# `moeshard serve` / `generate --chat`: the model saw documentation text, never chat turns, so
# a conversation is its messages as paragraphs
DEMO_CHAT_TEMPLATE = (
    "{# the demo model was trained on plain documentation text, never on chat turns: "
    "a conversation is its messages as paragraphs #}"
    "{% for m in messages %}{{ m['content'] }}{{ '\\n' if loop.last else '\\n\\n' }}{% endfor %}"
)
from train_demo_lib.training import build_model, evaluate, get_batch, lr_at, skew_summary  # noqa: E402


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--moe-inter", type=int, default=64)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--no-tie", dest="tie", action="store_false")
    ap.add_argument("--val-frac", type=float, default=0.03)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--doc-root", default=None)
    ap.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models", "demo-hf"),
    )
    ap.add_argument("--max-bytes", type=int, default=25_000_000)
    ap.add_argument("--probe", type=int, default=0, help="only time N training steps, save nothing")
    ap.add_argument("--prompt", default="The function returns")
    ap.add_argument(
        "--stop-file",
        default="/tmp/train_demo.STOP",
        help="emergency brake: if this file appears, stop early and save (recorded in the log)",
    )
    args = ap.parse_args()

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    import transformers
    from transformers import Qwen3MoeForCausalLM

    transformers.logging.set_verbosity_warning()

    # ---- corpus ------------------------------------------------------------------------
    root = find_corpus(args.doc_root)
    meta = corpus_meta(root)
    docs = load_docs(root)
    train_docs, val_docs = split_docs(docs, args.val_frac, args.seed)
    n_chars = sum(len(t) for _, t in docs)
    n_val_chars = sum(len(t) for _, t in val_docs)
    print(
        f"corpus {meta.get('source')} at {root}: {len(docs)} docs, {n_chars / 1e6:.2f} M chars; "
        f"val {len(val_docs)} docs {n_val_chars / 1e6:.3f} M chars ({100 * n_val_chars / n_chars:.1f}%)",
        flush=True,
    )

    # ---- tokenizer ---------------------------------------------------------------------
    tok = train_tokenizer([t for _, t in train_docs], args.vocab)
    eot_id = tok.token_to_id(EOT)
    sample = val_docs[0][1][:2000]
    assert tok.decode(tok.encode(sample).ids) == sample, "ByteLevel round-trip failed"
    train_ids = encode_stream(tok, train_docs, eot_id)
    val_ids = encode_stream(tok, val_docs, eot_id)
    vocab_size = tok.get_vocab_size()
    print(
        f"tokenizer vocab {vocab_size} eot={eot_id}; train {len(train_ids) / 1e6:.3f} M tokens, "
        f"val {len(val_ids) / 1e3:.1f} K tokens ({n_chars / (len(train_ids) + len(val_ids)):.2f} chars/token)",
        flush=True,
    )

    # ---- model -------------------------------------------------------------------------
    model = build_model(args, vocab_size, eot_id)
    n_params = sum(p.numel() for p in model.parameters())
    n_active = n_params - sum(
        l.mlp.experts.gate_up_proj.numel() + l.mlp.experts.down_proj.numel()
        for l in model.model.layers
    ) * (1 - args.topk / args.experts)
    print(
        f"params {n_params:,} (~{2 * n_params / 1e6:.2f} MB bf16), active/token ~{int(n_active):,}",
        flush=True,
    )
    if 2 * n_params > args.max_bytes:
        sys.exit(f"model too large: {2 * n_params} bytes bf16 > {args.max_bytes}")

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    n_steps = args.probe if args.probe else args.steps
    train_steps, train_ce, train_aux, evals = [], [], [], []
    model.train()
    t_train = time.time()
    tokens_seen = 0
    stopped_early = None
    for step in range(n_steps):
        if args.stop_file and os.path.exists(args.stop_file):
            # manual emergency brake only (never triggered in a normal run): finish with what we have
            stopped_early = step
            print(f"STOP file {args.stop_file} found: stopping after {step} steps", flush=True)
            break
        lr = lr_at(step, args)
        for gp in opt.param_groups:
            gp["lr"] = lr
        x = get_batch(train_ids, step, args)
        out = model(input_ids=x, labels=x, output_router_logits=True, use_cache=False)
        loss = out.loss  # = CE + router_aux_loss_coef * aux_loss (HF qwen3_moe)
        aux = out.aux_loss.item()
        ce = loss.item() - args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip).item()
        opt.step()
        tokens_seen += x.numel()
        train_steps.append(step + 1)
        train_ce.append(round(ce, 5))
        train_aux.append(round(aux, 5))
        if (step + 1) % 10 == 0 or step == 0:
            el = time.time() - t_train
            print(
                f"step {step + 1}/{n_steps} ce {ce:.4f} aux {aux:.4f} gnorm {gn:.2f} lr {lr:.2e} "
                f"{el / (step + 1):.2f}s/step {tokens_seen / el:.0f} tok/s elapsed {el / 60:.1f}m",
                flush=True,
            )
        if not args.probe and ((step + 1) % args.eval_every == 0 or step + 1 == n_steps):
            te = time.time()
            vl, vn, _ = evaluate(model, val_ids, args)
            k = min(args.eval_every, len(train_ce))
            evals.append(
                {
                    "step": step + 1,
                    "val_loss": round(vl, 5),
                    "val_ppl": round(math.exp(vl), 3),
                    "train_ce_mean_since_last_eval": round(sum(train_ce[-k:]) / k, 5),
                    "elapsed_s": round(time.time() - t_start, 1),
                }
            )
            print(
                f"EVAL step {step + 1}: val_loss {vl:.4f} ppl {math.exp(vl):.2f} over {vn} tokens "
                f"({time.time() - te:.1f}s)",
                flush=True,
            )
    train_time = time.time() - t_train
    steps_done = len(train_steps)
    if not args.probe and (not evals or evals[-1]["step"] != steps_done) and steps_done:
        vl, vn, _ = evaluate(model, val_ids, args)
        evals.append(
            {
                "step": steps_done,
                "val_loss": round(vl, 5),
                "val_ppl": round(math.exp(vl), 3),
                "train_ce_mean_since_last_eval": None,
                "elapsed_s": round(time.time() - t_start, 1),
            }
        )
    if args.probe:
        print(
            f"PROBE {n_steps} steps: {train_time / n_steps:.3f} s/step, {tokens_seen / train_time:.0f} tok/s, "
            f"batch {args.batch}x{args.seq_len}",
            flush=True,
        )
        return

    # ---- final eval with expert usage --------------------------------------------------
    vl, vn, counts = evaluate(model, val_ids, args, count_experts=True)
    skew = skew_summary(counts)
    print(
        f"final val loss {vl:.4f} ppl {math.exp(vl):.3f}; skew mean top10% share "
        f"{skew['mean_top10pct_share']} (uniform {skew['uniform_top10pct_share']}), "
        f"mean norm entropy {skew['mean_normalized_entropy']}",
        flush=True,
    )

    # ---- save (temp dir, atomic rename at the end) -------------------------------------
    from transformers import GenerationConfig

    out_dir = os.path.realpath(args.out)
    tmp_dir = out_dir + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    model.config.use_cache = True
    model.config.output_router_logits = False  # aux loss only needed for training
    model.generation_config = GenerationConfig(
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        do_sample=False,
        max_new_tokens=64,
    )
    model.to(torch.bfloat16).save_pretrained(tmp_dir, safe_serialization=True)
    add_bos_post_processor(tok, eot_id)  # after training: the training stream adds its own
    tok.save(os.path.join(tmp_dir, "tokenizer.json"))
    with open(os.path.join(tmp_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": EOT,
                "eos_token": EOT,
                "pad_token": EOT,
                "unk_token": None,
                "model_max_length": args.seq_len,
                "add_prefix_space": False,
                "clean_up_tokenization_spaces": False,
                "chat_template": DEMO_CHAT_TEMPLATE,
            },
            f,
            indent=2,
        )
    plot_losses(os.path.join(tmp_dir, "loss.png"), train_steps, train_ce, evals)
    st_bytes = os.path.getsize(os.path.join(tmp_dir, "model.safetensors"))
    assert st_bytes <= args.max_bytes, f"model.safetensors {st_bytes} > {args.max_bytes}"

    # ---- reload check + greedy sample --------------------------------------------------
    import logging

    msgs: list[str] = []

    class _Cap(logging.Handler):
        def emit(self, rec):
            msgs.append(rec.getMessage())

    cap = _Cap(level=logging.WARNING)
    tlog = transformers.logging.get_logger("transformers")
    tlog.addHandler(cap)
    # float32 compute: the sample is then a reference that moeshard's f32 path must reproduce
    m2, info = Qwen3MoeForCausalLM.from_pretrained(
        tmp_dir, output_loading_info=True, dtype=torch.float32
    )
    tlog.removeHandler(cap)
    load_ok = not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    m2.eval()
    from tokenizers import Tokenizer

    tok2 = Tokenizer.from_file(os.path.join(tmp_dir, "tokenizer.json"))
    prompt_ids = tok2.encode(args.prompt).ids  # starts with <|endoftext|> (post-processor)
    with torch.no_grad():
        gen = m2.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=40,
            do_sample=False,
            min_new_tokens=40,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
    new_ids = gen[0, len(prompt_ids) :].tolist()
    sample_text = args.prompt + tok2.decode(new_ids, skip_special_tokens=False)
    print("SAMPLE:", repr(sample_text), flush=True)

    from safetensors import safe_open

    with safe_open(os.path.join(tmp_dir, "model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
        expert_keys = [k for k in keys if ".mlp.experts." in k]
        tensor_examples = {
            k: list(f.get_slice(k).get_shape())
            for k in keys
            if k.startswith("model.layers.0.")
            and (".experts.0." in k or ".experts.1." in k or "experts" not in k)
        }
        st_dtypes = sorted({str(f.get_slice(k).get_dtype()) for k in keys})

    wall = time.time() - t_start
    log = {
        "tool": "tools/train_demo.py",
        "command": " ".join(
            [".venv-ref/bin/python"] + [os.path.relpath(sys.argv[0])] + sys.argv[1:]
        ),
        "seed": args.seed,
        "hyperparameters": {
            k: v for k, v in vars(args).items() if k not in ("out", "prompt", "probe", "doc_root")
        },
        "optimizer": "AdamW betas=(0.9,0.95) eps=1e-8, wd on >=2D non-embedding params; linear warmup + cosine "
        "decay to min_lr_frac*lr; grad clip by global norm",
        "loss": "HF Qwen3MoeForCausalLM loss = CE + router_aux_loss_coef * load_balancing_loss (output_router_logits=True)",
        "tie_word_embeddings": args.tie,
        "corpus": {
            **meta,
            "name": "Python 3.11 documentation (HTML -> plain text, main body only)",
            "documents": len(docs),
            "chars": n_chars,
            "train_docs": len(train_docs),
            "val_docs": len(val_docs),
            "val_chars": n_val_chars,
            "val_doc_paths": [r for r, _ in val_docs],
            "split": "document-level: docs ordered by sha1(f'{seed}:{path}'), first docs up to val_frac of chars",
        },
        "tokenizer": {
            "type": "byte-level BPE (tokenizers), ByteLevel pre-tokenizer + decoder, trained on train split",
            "vocab_size": vocab_size,
            "special_tokens": {EOT: eot_id},
            "bos_token_id": eot_id,
            "eos_token_id": eot_id,
            "train_tokens": len(train_ids),
            "val_tokens": len(val_ids),
        },
        "model": {
            "model_type": "qwen3_moe",
            "params": n_params,
            "active_params_per_token": int(n_active),
            "safetensors_bytes": st_bytes,
            "safetensors_dtypes": st_dtypes,
            "num_tensors": len(keys),
            "num_expert_tensors": len(expert_keys),
            "expert_tensor_naming": "model.layers.{L}.mlp.experts.{E}.{gate_proj,up_proj,down_proj}.weight",
            "example_tensors_layer0": tensor_examples,
        },
        "training": {
            "steps": args.steps,
            "steps_done": steps_done,
            "stopped_early_at": stopped_early,
            "tokens_seen": tokens_seen,
            "train_time_s": round(train_time, 1),
            "s_per_step": round(train_time / max(1, steps_done), 3),
            "train_ce": train_ce,
            "train_aux": train_aux,
        },
        "evals": evals,
        "final": {
            "val_loss": round(vl, 5),
            "val_ppl": round(math.exp(vl), 4),
            "val_tokens_scored": vn,
        },
        "expert_usage_val": {"counts_per_layer": counts.tolist(), **skew},
        "reload_check": {
            "ok": load_ok,
            "missing_keys": list(info.get("missing_keys", [])),
            "unexpected_keys": list(info.get("unexpected_keys", [])),
            "mismatched_keys": [str(x) for x in info.get("mismatched_keys", [])],
            "warnings": msgs,
        },
        "sample": {
            "prompt": args.prompt,
            "greedy_new_tokens": 40,
            "dtype": "float32",
            "text": sample_text,
        },
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
        "wall_time_s": round(wall, 1),
    }
    with open(os.path.join(tmp_dir, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)

    if os.path.exists(out_dir):
        old = out_dir + f".old-{os.getpid()}"
        os.rename(out_dir, old)
        os.rename(tmp_dir, out_dir)
        shutil.rmtree(old)
    else:
        os.rename(tmp_dir, out_dir)
    print(
        f"saved {out_dir} ({st_bytes / 1e6:.2f} MB safetensors), wall {wall / 60:.1f} min, reload_ok={load_ok}",
        flush=True,
    )


if __name__ == "__main__":
    main()
