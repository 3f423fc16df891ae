"""Model and training helpers: the Qwen3-MoE, the learning-rate schedule, batches, the
full-validation-set evaluation and the expert-usage skew summary."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def build_model(args, vocab_size: int, eot_id: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,  # unused (all layers sparse)
        moe_intermediate_size=args.moe_inter,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=True,
        router_aux_loss_coef=args.aux_coef,
        max_position_embeddings=args.seq_len,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=args.tie,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        use_cache=True,
        initializer_range=0.02,
    )
    cfg._experts_implementation = "eager"
    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(cfg)
    return model


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    prog = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (
        args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog))
    )


def get_batch(data: torch.Tensor, step: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - args.seq_len, (args.batch,), generator=g)
    return torch.stack([data[s : s + args.seq_len] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, val: torch.Tensor, args, count_experts: bool = False):
    """Token-weighted CE over the FULL validation stream (non-overlapping windows; the
    final partial window is right-aligned and only its new tokens are scored)."""
    model.eval()
    L = args.seq_len
    n = len(val)
    windows = []  # (start, index into per-window NLL from which tokens are newly scored)
    st, covered = 0, 0  # covered: last token index already predicted
    while st + L <= n:
        windows.append((st, 0))
        covered = st + L - 1
        st += L - 1  # windows overlap by one token -> every token after the first scored once
    if covered < n - 1:
        start = max(0, n - L)
        windows.append((start, covered - start))
    E = model.config.num_experts
    counts = torch.zeros(model.config.num_hidden_layers, E, dtype=torch.long)
    hooks = []
    if count_experts:
        for li, layer in enumerate(model.model.layers):

            def hook(mod, inp, out, li=li):
                idx = out[2]
                counts[li] += torch.bincount(idx.reshape(-1), minlength=E)

            hooks.append(layer.mlp.gate.register_forward_hook(hook))
    nll, ntok = 0.0, 0
    for b in range(0, len(windows), args.eval_batch):
        chunk = windows[b : b + args.eval_batch]
        x = torch.stack([val[st : st + L] for st, _ in chunk])
        out = model(input_ids=x, output_router_logits=False, use_cache=False)
        logp = F.log_softmax(out.logits[:, :-1].float(), dim=-1)
        tgt = x[:, 1:]
        tok_nll = -logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)  # (B, L-1) predicts pos 1..L-1
        for i, (_start, first) in enumerate(chunk):
            sl = tok_nll[i, first:]
            nll += sl.sum().item()
            ntok += sl.numel()
    for h in hooks:
        h.remove()
    model.train()
    return nll / ntok, ntok, counts


def skew_summary(counts: torch.Tensor) -> dict:
    E = counts.shape[1]
    k = max(1, round(0.1 * E))
    per_layer = []
    for li in range(counts.shape[0]):
        c = counts[li].double()
        p = c / c.sum()
        top = torch.sort(c, descending=True).values[:k].sum() / c.sum()
        ent = -(p[p > 0] * p[p > 0].log()).sum() / math.log(E)
        per_layer.append(
            {
                "layer": li,
                "routed_assignments": int(c.sum().item()),
                "top10pct_share": round(top.item(), 4),
                "normalized_entropy": round(ent.item(), 4),
                "min_count": int(c.min().item()),
                "max_count": int(c.max().item()),
                "unused_experts": int((c == 0).sum().item()),
            }
        )
    return {
        "top_k_experts_for_10pct": k,
        "uniform_top10pct_share": round(k / E, 4),
        "mean_top10pct_share": round(
            sum(d["top10pct_share"] for d in per_layer) / len(per_layer), 4
        ),
        "max_top10pct_share": max(d["top10pct_share"] for d in per_layer),
        "mean_normalized_entropy": round(
            sum(d["normalized_entropy"] for d in per_layer) / len(per_layer), 4
        ),
        "min_normalized_entropy": min(d["normalized_entropy"] for d in per_layer),
        "per_layer": per_layer,
    }
