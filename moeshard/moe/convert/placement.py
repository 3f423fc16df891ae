"""`moeshard shard`: split a model's experts into per-node shard directories.

Every (layer, expert) record goes to R distinct nodes. Experts are placed heaviest first, each
on the R nodes with the least expected load so far (load = activation count from a trace when
given, else 1 per expert), ties broken by fewest bytes then node index. Each node directory is
a valid model directory without trunk: config.json (and the tokenizer/generation files), a
manifest with the SAME model id, and shard files whose records are copied byte for byte (each
record's checksum is verified on read and must come out equal on write).

Beside them, OUT/coordinator is what the coordinator needs when every expert is on the nodes:
a valid model directory with the same model id and no expert records (manifest role
"coordinator", `moeshard.moe.storage.manifest`): the trunk, config.json, generation_config.json, the
tokenizer and chat template files, and merkle.bin, the roots it checks the nodes' records
against. The experts, nearly all of a large model's bytes, stay on the nodes only.

Trace format (JSON): {"layer:expert": count, ...}; experts not listed count 0, and every
expert gets a floor of 1e-3 of the mean so unseen experts are still spread.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

from moeshard.moe.analysis.placement import plan_placement, survives_any_domain
from moeshard.moe.convert.converter import COPIED_FILES as MODEL_FILES
from moeshard.moe.convert.outdir import PLAN_FILE, check_output, staged
from moeshard.moe.errors import MoeshardError, StoreError
from moeshard.moe.experts.usage import read_usage
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.storage.io import copy_file, write_file
from moeshard.moe.storage.manifest import (
    FORMAT_VERSION,
    ROLE_COORDINATOR,
    ROLE_NODE,
    SHARD_MAX_BYTES,
    TRUNK_FILE,
    write_manifest,
)
from moeshard.moe.storage.merkle import ROOTS_FILE
from moeshard.moe.storage.shards import ShardWriter

COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# the coordinator's directory: the trunk, every file convert carries over from the checkpoint
# (configs, tokenizer, the chat template in tokenizer_config.json) and the roots
COORDINATOR_DIR = "coordinator"
COORDINATOR_FILES = (TRUNK_FILE, *MODEL_FILES, ROOTS_FILE)


def read_trace(path: str | Path, keys, model_id: str | None = None) -> dict[tuple[int, int], float]:
    """Load per known (layer, expert) from any usage source
    (`moeshard.moe.experts.usage.read_usage`:
    a routing trace, a usage profile or a plain {"layer:expert": count} object)."""
    return _smoothed(read_usage(path, model_id), keys, path)


def _smoothed(counts, keys, path) -> dict[tuple[int, int], float]:
    """Every known expert gets a small floor load, so unseen experts still spread evenly."""
    unknown = [k for k in counts if k not in keys]
    if unknown:
        raise MoeshardError(f"{path}: expert {unknown[0][1]} of layer {unknown[0][0]} not in model")
    mean = sum(counts.values()) / max(len(keys), 1) or 1.0
    return {k: counts.get(k, 0.0) + 1e-3 * mean for k in keys}


def _write_node_dir(model: ModelDir, keys, out: Path) -> int:
    """One node directory holding `keys`; returns bytes of records written."""
    out.mkdir(parents=True)
    with ExitStack() as closing:  # a failure closes the shard files it leaves unfinished
        return _write_node_files(model, keys, out, closing)


def _write_node_files(model: ModelDir, keys, out: Path, closing: ExitStack) -> int:
    for name in (*COPIED_FILES, ROOTS_FILE):  # the roots: the manifest copy names them
        if (model.path / name).exists():
            copy_file(model.path / name, out / name)
    c = model.config
    files: list[str] = []
    writers: list[tuple[ShardWriter, list[tuple[int, int]]]] = []
    written = 0
    for key in keys:
        nbytes = model.locations[key][1].nbytes
        if not writers or (len(writers[-1][1]) + 1) * nbytes > SHARD_MAX_BYTES:
            files.append(f"experts-{len(files):05d}.gguf")
            writers.append(
                (
                    ShardWriter(
                        out / files[-1],
                        model.expert_format,
                        c.expert_hidden,
                        c.expert_intermediate,
                        c.model_type,
                    ),
                    [],
                )
            )
            closing.callback(writers[-1][0].close)
        writers[-1][0].declare(*key, model.locations[key][1].nbytes)
        writers[-1][1].append(key)
    for writer, mine in writers:
        writer.begin()
        for layer, expert in mine:
            shard, loc = model.locations[(layer, expert)]
            crc = writer.write(shard.read(layer, expert))  # verified against loc.crc32
            if crc != loc.crc32:
                raise StoreError(f"{out}: expert {expert} of layer {layer} changed on copy")
            written += loc.nbytes
        writer.finish(model.model_id)
    manifest = dict(model.manifest)
    manifest.update(
        format_version=FORMAT_VERSION,
        role=ROLE_NODE,
        expert_files=files,
        trunk_file=None,
        shard_of=str(model.path),
        shard_experts=len(keys),
    )
    write_manifest(out, manifest)
    return written


def _write_coordinator_dir(model: ModelDir, out: Path) -> int:
    """The coordinator's directory (see the module docstring); returns its size in bytes.
    It is opened once written, so a directory that would be refused is never put in place."""
    out.mkdir(parents=True)
    for name in COORDINATOR_FILES:
        if (model.path / name).exists():
            copy_file(model.path / name, out / name)
    manifest = dict(model.manifest)
    for key in ("shard_experts", "layout"):  # what a node's or a packed directory's says
        manifest.pop(key, None)
    manifest.update(
        format_version=FORMAT_VERSION,
        role=ROLE_COORDINATOR,
        expert_files=[],
        trunk_file=TRUNK_FILE,
        shard_of=str(model.path),
    )
    write_manifest(out, manifest)
    ModelDir(out).close()
    return directory_bytes(out)


def directory_bytes(path: Path) -> int:
    """Bytes of the files directly in `path` (model directories have no subdirectories)."""
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def shard_model(
    model_path: str | Path,
    nodes: int,
    replicas: int,
    out: str | Path,
    trace: str | Path | None = None,
    force: bool = False,
    capacity: list[float] | None = None,
    domains: list[str] | None = None,
) -> dict:
    """Write OUT/node-00 ... node-(N-1), OUT/coordinator and OUT/plan.json; returns the plan.
    `capacity`: a relative weight per node; `domains`: a failure domain per node
    (`plan_placement`)."""
    out = check_output(out, [model_path], force, "shards")
    model = ModelDir(model_path)
    try:
        _check_source(model)
        _check_shard_set_size(model, nodes)
        with staged(out, out.with_name(out.name + ".partial")) as tmp:
            return _write_shard_set(model, nodes, replicas, out, tmp, trace, capacity, domains)
    finally:
        model.close()


def _check_source(model: ModelDir) -> None:
    """Only a full model directory can be split: the nodes need its records, the coordinator
    its trunk and the roots the model id covers."""
    remedy = "shard the full model directory (from `moeshard convert`)"
    model.require_experts(remedy)
    if not model.has_trunk:
        raise MoeshardError(f"{model.path}: has no {TRUNK_FILE} (a node directory?): {remedy}")
    if not model.manifest.get("merkle"):
        raise MoeshardError(
            f"{model.path}: no {ROOTS_FILE} (converted before possession roots): convert the "
            "checkpoint again to shard it"
        )


def _check_shard_set_size(model: ModelDir, nodes: int) -> None:
    """Refuse, before writing, nodes that would hold nothing (each would still get a copy of
    the trunk: `--nodes 1000000` would fill the disk). A disk that fills anyway is one line
    (`staged`)."""
    records = model.config.n_experts * len(model.config.moe_layers)
    if nodes > records:
        raise MoeshardError(f"--nodes {nodes}: more than the model's {records} expert records")


def _write_shard_set(
    model: ModelDir, nodes, replicas, out: Path, tmp: Path, trace, capacity=None, domains=None
) -> dict:
    """The shard set for `out`, written into `tmp`; returns the plan."""
    keys = sorted(model.locations)
    if trace:
        loads = read_trace(trace, set(keys), model.model_id)
    else:
        loads = dict.fromkeys(keys, 1.0)
    record_bytes = max(loc.nbytes for _, loc in model.locations.values())
    placed = plan_placement(loads, record_bytes, nodes, replicas, capacity, domains)
    node_plans = []
    for n, mine in enumerate(placed):
        name = f"node-{n:02d}"
        written = _write_node_dir(model, mine, tmp / name)
        node_plans.append(
            {
                "dir": str(out / name),
                "experts": [[a, b] for a, b in mine],
                "load": sum(loads[k] for k in mine),
                "bytes": written,
            }
        )
    coordinator = {
        "dir": str(out / COORDINATOR_DIR),
        "bytes": _write_coordinator_dir(model, tmp / COORDINATOR_DIR),
        "source_bytes": directory_bytes(model.path),
    }
    holders: dict[str, list[int]] = {}
    for n, mine in enumerate(placed):
        for a, b in mine:
            holders.setdefault(f"{a}:{b}", []).append(n)
    plan = {
        "model_id": model.model_id,
        "source": str(model.path),
        "nodes": node_plans,
        "coordinator": coordinator,
        "replicas": replicas,
        "balanced_by": "trace" if trace else "count",
        "trace": str(trace) if trace else None,
        "holders": holders,
        "domains": domains,
        "survives_any_domain": survives_any_domain(placed, domains) if domains else None,
        "plan_file": str(out / PLAN_FILE),
    }
    write_file(tmp / PLAN_FILE, (json.dumps(plan, indent=1) + "\n").encode())
    return plan
