"""What quantisation costs: next-token agreement, KL divergence and perplexity against f32.

`moeshard quality SRC` converts the checkpoint once per format combination into a temporary
directory, greedy-decodes with f32 experts and trunk (the reference), then runs every other
combination teacher-forced on the same token sequence and compares next-token distributions
position by position: top-1 agreement (same argmax) and KL(f32 || quantised).

`--gguf FILE` adds the same model as a llama.cpp GGUF file holds it (a Q4_K_M, IQ4_XS or Q4_0
mix from llama-quantize), compared with the same reference.

`moeshard perplexity SRC --text FILE` reports perplexity of a text under each expert format.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local
from moeshard.moe.convert.converter import convert
from moeshard.moe.errors import MoeshardError
from moeshard.moe.kernels import quant

QUANTISED = quant.BLOCK_FORMATS  # the formats whose kernels take 8-bit or float32 activations


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)  # [..., V]
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@dataclass
class Comparison:
    experts: str
    trunk: str
    activations: str  # how q4_0/q8_0 kernels took activations ("-" when neither is used)
    positions: int
    top1_agreement: float  # share of positions with the same argmax as f32
    mean_kl: float  # mean KL(f32 || this) in nats
    max_kl: float


def sequence_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    """Logits [len(ids), V] of one forward pass over the whole sequence."""
    rt = open_local(model_dir)
    try:
        return rt.transformer.forward(np.asarray(ids), rt.transformer.new_cache(len(ids)))
    finally:
        rt.model.close()


def compare_formats(
    src: str | Path,
    prompts: list[list[int]],
    tokens: int,
    expert_formats: list[str],
    trunk_formats: list[str],
    activations: tuple[str, ...] = ("q8",),
    ggufs: tuple[Path, ...] = (),
) -> list[Comparison]:
    """One row per (trunk, experts) format pair, and per activation mode (`quant.ACTIVATIONS`)
    for pairs with q4_0/q8_0 weights; the f32 reference uses no quantised kernel.  Then one
    row per GGUF file of the same model (`gguf_rows`)."""
    with tempfile.TemporaryDirectory(prefix="moeshard-quality-") as tmp:
        root = Path(tmp)
        reference = root / "f32-f32"
        convert(src, reference, "f32", "f32", progress=False)
        rt = open_local(reference)
        sequences = []  # (full ids, index of the first generated position's predictor)
        for prompt in prompts:
            result = generate(rt.transformer, prompt, SamplingOptions(max_tokens=tokens))
            sequences.append((prompt + result.tokens[:-1], len(prompt) - 1))
        rt.model.close()
        ref_logp = [log_softmax(sequence_logits(reference, s)[start:]) for s, start in sequences]
        out = []
        for trunk in trunk_formats:
            for experts in expert_formats:
                target = root / f"{experts}-{trunk}"
                if not target.exists():  # f32-f32 is the reference itself
                    convert(src, target, experts, trunk, progress=False)
                quantised = experts in QUANTISED or trunk in QUANTISED
                for mode in activations if quantised else ("-",):
                    out.append(_compare(target, sequences, ref_logp, experts, trunk, mode))
        for i, path in enumerate(ggufs):
            out += gguf_rows(Path(path), root / f"gguf-{i}", sequences, ref_logp, activations)
        return out


def gguf_rows(path: Path, target: Path, sequences, ref_logp, activations) -> list[Comparison]:
    """The model as a GGUF file holds it (llama.cpp's quantization mixes, `llama-quantize`):
    experts whose type moeshard has are kept (their kernels run), any other type is decoded
    exactly to f32, as is the trunk; so the row measures the file's weights.  The experts
    column names the file's expert types and the format they ran in."""
    from moeshard.moe.convert.gguf_import import GgufCheckpoint, convert_gguf, gguf_parts

    ckpt = GgufCheckpoint(gguf_parts(path))
    try:
        types = sorted(ckpt.expert_types())
        fmt = ckpt.kept_expert_format(fallback="f32")
    finally:
        ckpt.close()
    convert_gguf(path, target, fmt, "f32", progress=False)
    used = sorted(quant.matrix_formats(fmt))
    label = f"{'/'.join(types)}>{'/'.join(used)}"
    trunk = f"gguf:{path.name}"
    # a row per activation mode where the file's formats have both kinds of kernels; one
    # where one of them has integer kernels only (a GGUF-only format: it takes 8-bit
    # activations in either mode); none where all are float formats
    if set(used) & set(quant.GGML_FORMATS):
        modes = ("q8",)
    else:
        modes = activations if set(used) & set(QUANTISED) else ("-",)
    return [_compare(target, sequences, ref_logp, label, trunk, mode) for mode in modes]


def _compare(target: Path, sequences, ref_logp, experts: str, trunk: str, mode: str):
    """Teacher-forced next-token distributions of `target` against the reference's."""
    previous = quant.activation_mode()
    if mode != "-":
        quant.use_activations(mode)
    try:
        agree, kls = [], []
        for (seq, start), ref in zip(sequences, ref_logp, strict=True):
            logp = log_softmax(sequence_logits(target, seq)[start:])  # [N, V]
            agree.extend(np.argmax(logp, -1) == np.argmax(ref, -1))
            kls.extend((np.exp(ref) * (ref - logp)).sum(-1))
    finally:
        quant.use_activations(previous)
    n = len(agree)
    return Comparison(
        experts, trunk, mode, n, float(np.mean(agree)), float(np.mean(kls)), float(np.max(kls))
    )


def eval_windows(n: int, window: int) -> list[tuple[int, int]]:
    """(start, first scored index) of each forward pass over a stream of n tokens.

    Windows of `window` tokens overlap by one, so every token after the first is predicted
    exactly once; the last, partial window is right-aligned and scores only its new tokens
    (the scheme of tools/train_demo.py's evaluation, so the two perplexities compare).
    """
    windows, start, covered = [], 0, 0
    while start + window <= n:
        windows.append((start, 0))
        covered = start + window - 1
        start += window - 1
    if covered < n - 1:
        start = max(0, n - window)
        windows.append((start, covered - start))
    return windows


def perplexity(model_dir: Path, ids: list[int], window: int) -> float:
    """exp(mean negative log-likelihood) of every token after the first."""
    nll, count = 0.0, 0
    rt = open_local(model_dir)
    for start, first in eval_windows(len(ids), window):
        chunk = np.asarray(ids[start : start + window])  # [L]
        logits = rt.transformer.forward(chunk, rt.transformer.new_cache(len(chunk)))  # [L, V]
        logp = log_softmax(logits[:-1])  # [L-1, V]: position i predicts token i + 1
        token_nll = -logp[np.arange(len(chunk) - 1), chunk[1:]]  # [L-1]
        nll += float(token_nll[first:].sum())
        count += len(token_nll) - first
    rt.model.close()
    return float(np.exp(nll / count))


def perplexity_by_format(
    src: str | Path, text: str, expert_formats: list[str], trunk: str, window: int, max_tokens: int
) -> tuple[int, dict[str, float]]:
    from moeshard.coordinator import tokenizer

    tok = tokenizer.load(Path(src))
    if tok is None:
        raise MoeshardError(f"{src}: no {tokenizer.TOKENIZER_FILES} to tokenize the text with")
    ids = tok.encode(text)[: max_tokens or None]
    if len(ids) < 2:
        raise MoeshardError("the text has fewer than two tokens")
    results = {}
    with tempfile.TemporaryDirectory(prefix="moeshard-ppl-") as tmp:
        for fmt in expert_formats:
            target = Path(tmp) / fmt
            convert(src, target, fmt, trunk, progress=False)
            results[fmt] = perplexity(target, ids, window)
    return len(ids), results
