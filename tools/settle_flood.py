"""A stranger's flood of `Settle` calls at an `--allow-any` node, and what it costs the node.

    python tools/settle_flood.py MODEL_DIR [--settles 1002] [--sessions 0]

Starts `moeshard node MODEL_DIR --allow-any` on loopback with its ledger in a temporary
directory. A fresh client key first has the node do `--sessions` one-row Forwards, each in a
session of its own (so it holds receipts in them), then sends `--settles` self-signed
settlements as fast as it can: of those sessions in turn when there are any, else of random
sessions. Prints how the node answered (accepted, or each gRPC status), the time taken, and how
much the node's ledger grew; then whether another client's honest settlement is still taken.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's code, as the node it starts (cwd ROOT) runs

from moeshard.coordinator.remote.transport import PeerSpec, dial  # noqa: E402
from moeshard.moe.identity.keys import generate  # noqa: E402
from moeshard.moe.identity.receipts import Totals, make_settlement  # noqa: E402
from moeshard.moe.identity.tls import client_tls  # noqa: E402
from moeshard.moe.model.model_dir import ModelDir  # noqa: E402
from moeshard.moe.wire import codec  # noqa: E402
from moeshard.moe.wire import moeshard_pb2 as pb  # noqa: E402
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc  # noqa: E402


def start_node(model_dir: Path, home: str) -> tuple[subprocess.Popen, PeerSpec]:
    cmd = [sys.executable, "-m", "moeshard", "node", str(model_dir), "--port", "0"]
    cmd += ["--no-advertise", "--allow-any", "--key", f"{home}/node.pem"]
    cmd += ["--ledger", f"{home}/node.jsonl"]
    env = dict(os.environ, MOESHARD_HOME=home)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        if " serving " in line:
            addr = line.split(" on ")[1].split()[0]
            return proc, PeerSpec(addr, line.split(" id ")[1].split()[0])
    raise SystemExit(f"the node did not start (exit {proc.wait()})")


def forward(model: ModelDir, session: bytes) -> pb.ForwardRequest:
    """One row to the model's first held expert of its first MoE layer."""
    layer = model.config.moe_layers[0]
    expert = min(e for lay, e in model.locations if lay == layer)
    return pb.ForwardRequest(
        model_id=model.model_id,
        layer=layer,
        session=session,
        hidden=codec.encode(np.ones((1, model.config.hidden_size), np.float32)),  # [1, H]
        ids=codec.encode(np.array([[expert]]), codec.I32),  # [1, 1]
        weights=codec.encode(np.ones((1, 1), np.float32)),  # [1, 1]
    )


def settle(stub, settlement) -> str:
    try:
        return "accepted" if stub.Settle(settlement, timeout=10).accepted else "refused"
    except grpc.RpcError as exc:
        return exc.code().name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--settles", type=int, default=1002)
    parser.add_argument("--sessions", type=int, default=0, help="sessions with receipts first")
    args = parser.parse_args()
    model = ModelDir(args.model)
    with tempfile.TemporaryDirectory(prefix="settle-flood-") as home:
        proc, spec = start_node(args.model, home)
        ledger = Path(home) / "node.jsonl"
        try:
            key, other = generate(Path(home) / "a.pem"), generate(Path(home) / "b.pem")
            channel, _ = dial(spec, client_tls(key), 10.0)
            stub = pb_grpc.ExpertNodeStub(channel)
            totals: dict[bytes, Totals] = {}
            for _ in range(args.sessions):
                session = os.urandom(16)
                totals[session] = Totals()
                totals[session].add(stub.Forward(forward(model, session), timeout=10).receipt)
            sessions = list(totals)
            time.sleep(1.0)  # the receipts reach the ledger (written queued)
            size = ledger.stat().st_size if ledger.exists() else 0
            answers: Counter = Counter()
            t0 = time.perf_counter()
            for i in range(args.settles):
                session = sessions[i % len(sessions)] if sessions else os.urandom(16)
                tally = totals.get(session, Totals())
                settlement = make_settlement(key, session, spec.node_id, model.model_id, 1, tally)
                answers[settle(stub, settlement)] += 1
            elapsed = time.perf_counter() - t0
            time.sleep(0.5)
            grown = (ledger.stat().st_size if ledger.exists() else 0) - size
            # another client, with work of its own, settles it
            other_channel, _ = dial(spec, client_tls(other), 10.0)
            other_stub, session = pb_grpc.ExpertNodeStub(other_channel), os.urandom(16)
            mine = Totals()
            mine.add(other_stub.Forward(forward(model, session), timeout=10).receipt)
            honest = settle(
                other_stub,
                make_settlement(other, session, spec.node_id, model.model_id, 1, mine),
            )
            channel.close()
            other_channel.close()
        finally:
            proc.terminate()
            proc.wait()
    shown = ", ".join(f"{n} {what}" for what, n in answers.most_common())
    print(
        f"{args.settles} settlements from one key ({args.sessions} sessions with receipts) "
        f"in {elapsed:.2f} s: {shown}"
    )
    print(f"node ledger grew {grown} bytes; another client's settlement: {honest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
