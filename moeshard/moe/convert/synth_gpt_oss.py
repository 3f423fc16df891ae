"""gpt-oss geometries for `moeshard synth`: OpenAI's published shapes with random weights.

config.json is the published one (`gpt_oss.published_config`); the records are `mxfp4+bias`
as converting the release gives them: random E2M1 codes with one E8M0 scale per matrix (sized
so activations stay O(1)) and zero biases.  `--layers` scales a preset down (the traces
`simulate` replays are short; `simulate --geometry gpt-oss-120b` has the whole model's bytes).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from moeshard.moe.errors import MoeshardError
from moeshard.moe.kernels import layout, quant
from moeshard.moe.model import gpt_oss

RECORD_FORMAT = "mxfp4" + quant.BIAS


@dataclass(frozen=True)
class GptOssPreset:
    name: str  # the published model (`gpt_oss.PUBLISHED`)
    layers: int
    trunk_fmt: str = "bf16"
    router_skew: float = 0.6  # sigma of the log-normal per-expert router gain

    @property
    def config(self) -> dict:
        return {**gpt_oss.published_config(self.name, self.layers), "moeshard_synthetic": True}

    @property
    def width(self) -> int:
        return int(self.config["hidden_size"])  # (the experts' width as well)


GPT_OSS_PRESETS = {name: GptOssPreset(name, shape[0]) for name, shape in gpt_oss.PUBLISHED.items()}
SCALABLE = ("layers",)


def preset(name: str, layers: int | None = None) -> GptOssPreset:
    p = GPT_OSS_PRESETS[name]
    if layers is not None:
        if layers < 1:
            raise MoeshardError("--layers: a gpt-oss needs at least 1 layer")
        p = replace(p, layers=layers)
    return p


def records(p: GptOssPreset, seed: int) -> Iterator[np.ndarray]:
    """Endless random `mxfp4+bias` records: random code bytes, one E8M0 scale per matrix
    (an E2M1 code's rms is about 3, so 2^(s - 127) ~ 1 / (3 sqrt(cols))), zero biases."""
    rng = np.random.default_rng(seed)
    w = p.width
    nbytes = quant.expert_record_nbytes(RECORD_FORMAT, w, w)
    scales, start = [], 0
    for rows, cols in ((w, w), (w, w), (w, w)):  # gate, up, down: all 2880 x 2880
        _, s_off, s_bytes = layout._sections("mxfp4", rows, cols)
        e8m0 = 127 - round(math.log2(3 * math.sqrt(cols)))
        scales.append((start + s_off, s_bytes, e8m0))
        start += quant.packed_nbytes("mxfp4", rows, cols)
    while True:
        record = np.zeros(nbytes, dtype=np.uint8)  # [nbytes]: the biases stay 0
        record[:start] = rng.integers(0, 256, start, dtype=np.uint8)
        for off, size, e8m0 in scales:
            record[off : off + size] = e8m0
        yield record
