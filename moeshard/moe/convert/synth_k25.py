"""Kimi K2.5 presets for `moeshard synth`: the released wrapper config (model_type kimi_k25, the
DeepSeek-V3 language model under `text_config` as Kimi K2's) with random q4_0 experts, the
format K2.5's INT4 experts convert to without change (`moeshard.moe.convert.int4`), so the
records have the size a converted K2.5's have.  The vision tower is not written (convert
skips it).
"""

from __future__ import annotations

from moeshard.moe.model.kimi_k25 import PUBLISHED, K25Shape, released_config

__all__ = ["K25_PRESETS", "released_config"]


K25_PRESETS = {
    # Kimi K2.5 / K2.6's language model as published (Kimi K2's shape): 61 layers, layer 0
    # dense, 384 experts of 2048, 8 active; 571 GB of q4_0 records, for the arithmetic.
    "kimi-k2.5": PUBLISHED,
    # K2.5's router (384 experts, top-8) on a small trunk: 3 MoE layers of 216 KiB records.
    "kimi-k2.5-mini": K25Shape(512, 256, 1024, 384, 8, 4, 8, 128, 64, 32, 16, 32, 8192),
    # Tiny, for tests.
    "kimi-k2.5-tiny": K25Shape(64, 64, 128, 16, 4, 3, 4, 32, 32, 16, 8, 16, 256, "f32"),
}
