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
import glob
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser

import torch
import torch.nn.functional as F

EOT = "<|endoftext|>"

# --------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------

DOC_GLOBS = ["/usr/share/doc/python3.11/html", "/usr/share/doc/python3.*/html"]
SKIP_RE = re.compile(
    r"^(genindex.*|py-modindex|search|download|contents|index|copyright|license|bugs|about)\.html$"
    r"|^whatsnew/changelog\.html$"
    r"|^_"
)
BLOCK_TAGS = {
    "p",
    "div",
    "section",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "li",
    "ul",
    "ol",
    "dl",
    "dt",
    "dd",
    "table",
    "tr",
    "pre",
    "blockquote",
    "br",
    "hr",
    "figure",
    "caption",
}
SKIP_TAGS = {"script", "style", "head", "title"}


class _MainText(HTMLParser):
    """Collect the text of Sphinx's <div class="body" role="main"> only."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.div_depth = 0  # depth of <div> nesting inside the main body
        self.in_main = False
        self.done = False
        self.skip = 0  # inside script/style/headerlink
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        if self.done:
            return
        a = dict(attrs)
        if not self.in_main:
            if tag == "div" and a.get("role") == "main":
                self.in_main = True
                self.div_depth = 1
            return
        if tag == "div":
            self.div_depth += 1
        if tag in SKIP_TAGS or (tag == "a" and "headerlink" in (a.get("class") or "")):
            self.skip += 1
            self._skip_tag = tag
        if tag == "pre":
            self.pre += 1
        if tag in BLOCK_TAGS:
            self.out.append("\n")

    def handle_endtag(self, tag):
        if self.done or not self.in_main:
            return
        if tag in SKIP_TAGS or (tag == "a" and self.skip):
            if self.skip:
                self.skip -= 1
            return
        if tag == "pre" and self.pre:
            self.pre -= 1
        if tag in BLOCK_TAGS:
            self.out.append("\n")
        if tag == "div":
            self.div_depth -= 1
            if self.div_depth == 0:
                self.in_main = False
                self.done = True

    def handle_data(self, data):
        if self.done or not self.in_main or self.skip:
            return
        if self.pre:
            self.out.append(data)
        else:
            self.out.append(re.sub(r"\s+", " ", data))

    def text(self) -> str:
        t = "".join(self.out).replace("\u00b6", "")
        lines = [ln.rstrip() for ln in t.split("\n")]
        # strip leading single spaces produced by whitespace collapsing (not inside code)
        lines = [ln[1:] if ln.startswith(" ") and not ln.startswith("  ") else ln for ln in lines]
        t = "\n".join(lines)
        t = re.sub(r"\n{3,}", "\n\n", t)
        return t.strip() + "\n"


def html_to_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        raw = f.read()
    p = _MainText()
    p.feed(raw)
    p.close()
    return p.text()


def find_corpus(doc_root: str | None):
    roots = [doc_root] if doc_root else []
    for g in DOC_GLOBS:
        roots += sorted(glob.glob(g))
    for r in roots:
        if r and os.path.isfile(os.path.join(r, "library", "functions.html")):
            return os.path.realpath(r)
    sys.exit(
        "corpus not found: install it with `apt-get update && apt-get install -y python3.11-doc`"
    )


def corpus_meta(root: str) -> dict:
    meta = {
        "path": root,
        "package": None,
        "version": None,
        "licence": "PSF-2.0 (Python Software Foundation License Version 2; redistributable). Code examples in "
        "the docs are dual-licensed PSF-2.0 / 0BSD (Zero-Clause BSD) since Python 3.8.6.",
    }
    try:
        owner = subprocess.run(
            ["dpkg-query", "-S", os.path.join(root, "library", "functions.html")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        pkg = owner.split(":")[0].strip()
        ver = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True, check=True
        ).stdout.strip()
        meta["package"], meta["version"] = pkg, ver
        meta["source"] = f"Debian package {pkg} {ver}"
        cp = f"/usr/share/doc/{pkg}/copyright"
        if os.path.exists(cp):
            txt = open(cp, encoding="utf-8", errors="replace").read()
            meta["copyright_file"] = cp
            meta["licence_check_psf_text_in_copyright"] = (
                "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in txt
            )
    except Exception as e:  # pragma: no cover - non-Debian host
        meta["source"] = f"unknown package ({e})"
    return meta


def load_docs(root: str) -> list[tuple[str, str]]:
    files = []
    for dp, dns, fns in os.walk(root):
        dns.sort()
        for fn in fns:
            if fn.endswith(".html"):
                rel = os.path.relpath(os.path.join(dp, fn), root)
                if not SKIP_RE.search(rel) and not rel.startswith("_"):
                    files.append(rel)
    files.sort()
    docs = []
    for rel in files:
        t = html_to_text(os.path.join(root, rel))
        if len(t) > 200:
            docs.append((rel, t))
    return docs


def split_docs(docs, val_frac: float, seed: int):
    """Deterministic document-level split: order docs by sha1(seed:path), take docs into
    validation until val_frac of total characters is reached."""
    total = sum(len(t) for _, t in docs)
    order = sorted(docs, key=lambda d: hashlib.sha1(f"{seed}:{d[0]}".encode()).hexdigest())
    val, vc = [], 0
    for rel, t in order:
        if vc >= val_frac * total:
            break
        if len(t) > 0.02 * total:  # keep single huge pages out of validation
            continue
        val.append(rel)
        vc += len(t)
    vs = set(val)
    train = [(r, t) for r, t in docs if r not in vs]
    valid = [(r, t) for r, t in docs if r in vs]
    return train, valid


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def add_bos_post_processor(tok, eot_id: int) -> None:
    """Make encode() start every text with <|endoftext|>, the document separator the model saw
    before each document in training, so any consumer of tokenizer.json (transformers, or
    moeshard through the tokenizers library) prompts the model the way it was trained."""
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot_id)]
    )


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, docs, eot_id: int) -> torch.Tensor:
    ids = []
    encs = tok.encode_batch([t for _, t in docs])
    for e in encs:
        ids.append(eot_id)  # <|endoftext|> doubles as BOS/document separator
        ids.extend(e.ids)
    ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------------------
# Model / training helpers
# --------------------------------------------------------------------------------------


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


def plot_losses(path, train_steps, train_losses, evals):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(
        train_steps, train_losses, color="tab:blue", alpha=0.25, lw=0.8, label="train CE (per step)"
    )
    if train_losses:
        ema, sm = 0.0, []
        for i, v in enumerate(train_losses):
            ema = 0.95 * ema + 0.05 * v
            sm.append(ema / (1 - 0.95 ** (i + 1)))  # bias-corrected EMA
        ax.plot(train_steps, sm, color="tab:blue", lw=1.8, label="train CE (EMA 0.95)")
    ax.plot(
        [e["step"] for e in evals],
        [e["val_loss"] for e in evals],
        "o-",
        color="tab:red",
        lw=1.8,
        label="validation CE (full held-out set)",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Qwen3-MoE demo (python3.11-doc corpus)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


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
