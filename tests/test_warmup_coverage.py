"""The kernels' warm-up compiles every signature a generation then calls.

The Docker image compiles the kernels at build time (`quant.warmup()` + `fused.warmup()`, the
Dockerfile's RUN line) so that no container compiles at run time (a cold compile is minutes on
a small box). numba compiles one machine-code version per argument-type signature (dtype, rank,
layout, read-only or not), so a kernel the warm-ups never call, or call with other types than
the model's arrays have, is compiled when a generation first reaches it. `make compose-test`
finds that only after building the image; this test finds it in a child process: warm up,
note every moeshard dispatcher's signatures, generate (alone, then as a coordinator through
three nodes with its audits), and list any signature that was added.
"""

import json
import subprocess
import sys
import textwrap

from helpers import ROOT

CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from numba.core.dispatcher import Dispatcher

    sys.path.insert(0, str(Path(sys.argv[3]) / "tests"))
    from moeshard.moe.kernels import quant
    from moeshard.moe.model import fused

    quant.warmup() + fused.warmup()  # what the Dockerfile runs


    def signatures():
        found = {}
        for name, module in list(sys.modules.items()):
            if name.startswith("moeshard"):
                for obj in list(vars(module).values()):
                    if isinstance(obj, Dispatcher):
                        key = f"{obj.py_func.__module__}.{obj.__name__}"
                        found[key] = {str(s) for s in obj.signatures}
        return found


    before = signatures()
    from moeshard import cli

    code = cli.main(["generate", sys.argv[1], "--prompt", "The function returns",
                     "--max-tokens", "24"])
    assert code == 0, code
    from helpers import PROMPT, generate_on_nodes
    from moeshard.coordinator.sampling import SamplingOptions
    from moeshard.moe.convert.placement import shard_model

    plan = shard_model(Path(sys.argv[1]), 3, 2, Path(sys.argv[2]))
    generate_on_nodes(Path(sys.argv[1]), plan, PROMPT, SamplingOptions(max_tokens=12))
    added = {k: sorted(v - before.get(k, set())) for k, v in signatures().items()}
    print(json.dumps({k: v for k, v in added.items() if v}))
    """
)


def test_the_warmups_compile_what_a_generation_calls(demo, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(demo), str(tmp_path / "shards"), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    added = json.loads(proc.stdout.strip().splitlines()[-1])
    assert added == {}, f"compiled after the warm-ups (a container would compile these): {added}"
