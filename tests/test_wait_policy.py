"""`quant.spin_while_waiting` (what `moeshard generate --wait spin` does): it takes effect only
in a fresh process, before the pool starts, and never over the user's own setting; and a
decode gives the same tokens and logits bits either way (only the thread split changes)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from helpers import moeshard_run

PROBE = """
import os
from moeshard.moe.kernels import quant
first = quant.spin_while_waiting(200e-6)
count = os.environ.get("GOMP_SPINCOUNT")
import numpy as np
w = quant.pack(np.ones((256, 256), np.float32), "bf16")
quant.matmul(w, "bf16", 256, 256, np.ones((4, 256), np.float32))
found = quant.calibrate_matmul() if first else 0
print(first, count, quant.wait_policy(), quant.PARALLEL_MIN_WEIGHTS, quant.spin_while_waiting(),
      found, quant.MATMUL_PARALLEL_FACTOR)
"""


def _probe(**env) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    r = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_spinning_is_set_before_the_pool_starts_and_only_once():
    first, count, policy, min_weights, again, found, factor = _probe()
    assert first == "True" and policy == "spin" and again == "False"
    assert 1000 <= int(count) <= 3_000_000  # 200 us over this CPU's measured pause
    assert int(min_weights) < 1 << 19  # smaller products go parallel than with sleeping threads
    # the size from which a product's two threads beat one was measured here (one of the
    # sizes tried, or past the largest), and the products' threshold follows it
    assert int(found) in {r * 256 for r in (128, 256, 512, 1024, 2048, 4096)}
    assert int(factor) == max(1, int(found) // int(min_weights))


def test_the_users_own_wait_policy_wins():
    for env in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "5"}):
        first, count, policy, *_ = _probe(**env)
        assert first == "False" and policy == "passive"
        assert count == env.get("GOMP_SPINCOUNT", "None")


def test_decode_is_the_same_bits_spinning_or_sleeping(demo, tmp_path):
    logits = {}
    for wait in ("spin", "passive"):
        out = tmp_path / f"{wait}.npy"
        r = moeshard_run(
            "generate", demo, "--prompt", "The file", "--max-tokens", "12",
            "--wait", wait, "--dump-logits", out, home=tmp_path,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        logits[wait] = np.load(out)
    assert logits["spin"].tobytes() == logits["passive"].tobytes()
