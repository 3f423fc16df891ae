"""Disk and RAM a published MoE checkpoint needs with moeshard, computed from its config.

The geometry below is copied from each checkpoint's published config.json; the totals it
gives are checked against the parameter counts the model cards publish (printed beside them).
Converted size: routed experts in q4_0 (18 bytes per 32 weights) plus the trunk in bf16
(`moeshard convert`'s defaults); the trunk is what `generate --ram` keeps resident when the
budget allows (below that it streams too). Used for the README's table:

    python3 tools/model_sizes.py
"""

from __future__ import annotations

Q4_0_BYTES = 18 / 32  # bytes per weight: 16 nibbles + one f16 scale per 32 weights
BF16_BYTES = 2

MODELS = {  # hub repo: geometry (GQA attention unless mla)
    "allenai/OLMoE-1B-7B-0924": dict(
        layers=16, hidden=2048, moe=1024, experts=64, vocab=50304, heads=16, kv=16, pub="6.9B"
    ),
    "Qwen/Qwen3-30B-A3B": dict(
        layers=48, hidden=2048, moe=768, experts=128, vocab=151936, heads=32, kv=4, pub="30.5B"
    ),
    "mistralai/Mixtral-8x7B-v0.1": dict(
        layers=32, hidden=4096, moe=14336, experts=8, vocab=32000, heads=32, kv=8, pub="46.7B"
    ),
    "Qwen/Qwen3-235B-A22B": dict(
        layers=94, hidden=4096, moe=1536, experts=128, vocab=151936, heads=64, kv=4, pub="235B"
    ),
    "deepseek-ai/DeepSeek-V3": dict(
        layers=61,
        dense=3,
        hidden=7168,
        moe=2048,
        experts=256,
        vocab=129280,
        heads=128,
        mla=True,
        pub="671B",
    ),
    "moonshotai/Kimi-K2-Instruct": dict(
        layers=61,
        dense=1,
        hidden=7168,
        moe=2048,
        experts=384,
        vocab=163840,
        heads=64,
        mla=True,
        pub="1.03T",
    ),
}
HEAD_DIM = 128
MLA_Q_RANK, MLA_KV_RANK, MLA_ROPE, MLA_NOPE, MLA_V = 1536, 512, 64, 128, 128
DEEPSEEK_DENSE_INTER = 18432


def attention_params(c: dict) -> int:
    h = c["hidden"]
    if c.get("mla"):
        heads = c["heads"]
        q = h * MLA_Q_RANK + MLA_Q_RANK * heads * (MLA_NOPE + MLA_ROPE)
        kv = h * (MLA_KV_RANK + MLA_ROPE) + MLA_KV_RANK * heads * (MLA_NOPE + MLA_V)
        return q + kv + heads * MLA_V * h
    return 2 * h * c["heads"] * HEAD_DIM + 2 * h * c["kv"] * HEAD_DIM


def sizes(c: dict) -> tuple[int, int]:
    """(routed expert parameters, trunk parameters)."""
    h, dense = c["hidden"], c.get("dense", 0)
    moe_layers = c["layers"] - dense
    expert = 3 * h * c["moe"]  # gate, up, down
    routed = moe_layers * c["experts"] * expert
    shared = moe_layers * expert if c.get("mla") else 0  # DeepSeek's one shared expert
    dense_mlp = dense * 3 * h * DEEPSEEK_DENSE_INTER
    routers = moe_layers * h * c["experts"]
    embeddings = 2 * c["vocab"] * h  # input and output (untied in all of these)
    trunk = c["layers"] * attention_params(c) + shared + dense_mlp + routers + embeddings
    return routed, trunk


def main() -> None:
    print("| checkpoint | parameters | converted (q4_0 experts) | trunk in RAM (bf16) |")
    print("|---|---|---|---|")
    for repo, c in MODELS.items():
        routed, trunk = sizes(c)
        total = (routed + trunk) / 1e9
        disk = (routed * Q4_0_BYTES + trunk * BF16_BYTES) / 1e9
        print(
            f"| `{repo}` | {total:,.1f} B (card: {c['pub']}) | {disk:,.1f} GB "
            f"| {trunk * BF16_BYTES / 1e9:,.1f} GB |"
        )


if __name__ == "__main__":
    main()
