"""Fetch throughput of rpc Record and the cost of its Merkle check, on this machine.

    python tools/bench_fetch.py MODEL_DIR [--runs 7] [--insecure]

Starts `moeshard node MODEL_DIR` on loopback (mutual TLS as a fresh client key unless
--insecure; its record rate limit lifted so only the transfer is timed), then fetches every
record of the model `--runs` times with `moeshard.coordinator.remote.fetch.fetch_record` and prints
the median of: the whole fetch (stream + checks + Merkle root), the stream alone (chunks copied into
the buffer, no root), and `merkle.root` over a record. The records come from the node's page
cache after the first read: this is the network path, not the disk. A model with K3-sized
records: `moeshard synth DIR --preset k3 --experts 4 --top-k 2 --layers 2 --latent 3072
--inter 3584` (one MoE layer of 4 MXFP4 records of 17.5 MB).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's code, as the node it starts (cwd ROOT) runs

from moeshard.coordinator.remote.fetch import fetch_record  # noqa: E402
from moeshard.coordinator.remote.transport import PeerSpec, dial  # noqa: E402
from moeshard.moe.identity.keys import generate  # noqa: E402
from moeshard.moe.identity.tls import client_tls  # noqa: E402
from moeshard.moe.model.model_dir import ModelDir  # noqa: E402
from moeshard.moe.storage import merkle  # noqa: E402
from moeshard.moe.wire import moeshard_pb2 as pb  # noqa: E402
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc  # noqa: E402

log = logging.getLogger("bench_fetch")


def start_node(model_dir: Path, client_id: str, home: str) -> tuple[subprocess.Popen, PeerSpec]:
    """A node process serving `model_dir`; its peer spec from the line it prints."""
    cmd = [sys.executable, "-m", "moeshard", "node", str(model_dir), "--port", "0"]
    cmd += ["--no-advertise", "--record-rate-mb", "1e6", "--key", f"{home}/node.pem"]
    cmd += ["--insecure"] if not client_id else ["--allow", client_id]
    env = dict(os.environ, MOESHARD_HOME=home)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        if " serving " in line:
            addr = line.split(" on ")[1].split()[0]
            node_id = line.split(" id ")[1].split()[0]
            return proc, PeerSpec(addr, node_id if client_id else "")
    raise SystemExit(f"the node did not start (exit {proc.wait()})")


def stream_only(stub, model_id: str, key, out: np.ndarray) -> None:
    """The chunks copied into `out`, nothing checked: the transfer alone."""
    request = pb.RecordRequest(model_id=model_id, layer=key[0], expert=key[1])
    for chunk in stub.Record(request, timeout=60):
        out[chunk.offset : chunk.offset + len(chunk.data)] = np.frombuffer(chunk.data, np.uint8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--insecure", action="store_true", help="plaintext instead of TLS")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = ModelDir(args.model)
    roots, nbytes = model.possession_roots(), model.shard_set.record_nbytes
    keys = sorted(model.locations)
    with tempfile.TemporaryDirectory(prefix="bench-fetch-") as home:
        key = None if args.insecure else generate(Path(home) / "client.pem")
        proc, spec = start_node(args.model, key.id if key else "", home)
        try:
            channel, _ = dial(spec, client_tls(key) if key else None, 10.0)
            stub = pb_grpc.ExpertNodeStub(channel)
            out = np.empty(nbytes, dtype=np.uint8)  # [nbytes]
            times = {"fetch": [], "stream": [], "root": []}
            for record in keys:  # warm up: the node's page cache, the connection
                fetch_record(stub, model.model_id, *record, roots.root(*record), nbytes, out, 60)
            for _ in range(args.runs):
                for record in keys:
                    t0 = time.perf_counter()
                    root = roots.root(*record)
                    fetch_record(stub, model.model_id, *record, root, nbytes, out, 60)
                    t1 = time.perf_counter()
                    stream_only(stub, model.model_id, record, out)
                    t2 = time.perf_counter()
                    assert merkle.root(out) == root
                    t3 = time.perf_counter()
                    for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                        times[name].append(seconds)
            channel.close()
        finally:
            proc.terminate()
            proc.wait()
    mb = nbytes / 1e6
    median = {name: statistics.median(ts) for name, ts in times.items()}
    how = "plaintext" if args.insecure else "TLS"
    print(f"record {mb:.2f} MB, {len(keys)} records x {args.runs} runs, loopback {how}")
    for name, what in (("fetch", "fetch_record (checked)"), ("stream", "stream alone")):
        print(f"  {what:24s} {median[name] * 1e3:8.1f} ms  {mb / median[name]:7.0f} MB/s")
    root_ms = median["root"] * 1e3
    print(f"  {'merkle.root':24s} {root_ms:8.1f} ms  {root_ms / mb:7.2f} ms/MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
