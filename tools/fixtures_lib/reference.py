"""The reference model: config and random init, then the float32 reference run, with the
routing and greedy-logit margins a fixture's seed must clear."""

from __future__ import annotations

import math

import numpy as np
import torch
import transformers

from .tokenizer import VOCAB

N_GREEDY = 24


# ------------------------------------------------------------------------------------------------
# model construction


def make_config(spec, eos_id: int):
    cls = transformers.CONFIG_MAPPING[spec["model_type"]]
    kw = dict(spec["cfg"])
    kw.update(vocab_size=VOCAB, bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=False)
    kw["rope_parameters"] = dict(kw["rope_parameters"])
    if "vision_cfg" in spec:  # a vision-language wrapper: the text model under text_config
        kw = dict(
            text_config=kw,
            vision_config=dict(spec["vision_cfg"]),
            tie_word_embeddings=False,
        )
    cfg = cls(**kw)
    cfg.architectures = [spec["arch"]]
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def randomize(model, seed: int, offset_norms: bool = False):
    """Re-init all params (+ e_score_correction_bias) with fan-in scaled normals: wide logits.

    offset_norms: the model's RMSNorms multiply by 1 + w (Qwen3-Next), so their w is drawn
    around 0 (the Gated DeltaNet's own norm multiplies by w: around 1); its A_log gives decay
    rates in [0.02, 0.5], so the recurrent state remembers over the whole sequence."""
    g = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    for n, b in model.named_buffers():
        if n.endswith("e_score_correction_bias"):
            tensors[n] = b
    for name in sorted(tensors):
        t = tensors[name]
        if name.endswith("e_score_correction_bias"):
            v = torch.randn(t.shape, generator=g) * 0.1
        elif name.endswith("A_log") and offset_norms:
            v = torch.empty(t.shape).uniform_(0.02, 0.5, generator=g).log()
        elif t.ndim == 1 and "norm" in name:
            centre = 0.0 if offset_norms and not name.endswith("linear_attn.norm.weight") else 1.0
            v = centre + 0.2 * torch.randn(t.shape, generator=g)
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


@torch.no_grad()
def cached_greedy(model, prompt_ids: list[int], steps: int):
    """(prefill logits [T, V] from one forward, the greedy ids [steps], the logits each was
    chosen from [steps, V]) of a token-by-token loop with transformers' DynamicCache."""
    ids = torch.tensor([prompt_ids])
    prefill = model(ids).logits[0]  # [T, V]
    cache = transformers.DynamicCache(config=model.config)
    out = model(ids, cache=cache, use_cache=True)
    logits, greedy, rows = out.logits[0, -1], [], []
    for _ in range(steps):
        rows.append(logits)
        token = int(torch.argmax(logits))
        greedy.append(token)
        out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
        logits = out.logits[0, -1]
    return prefill, greedy, torch.stack(rows)
