"""The coordinator's directory (`moeshard shard ... --out OUT` writes OUT/coordinator): the trunk,
configs, tokenizer, chat template and Merkle roots of the model, no expert records, the same
model id. Generating from it through real node processes gives the full model's tokens on one
machine; `cluster` and `audit` work from it; every use that would compute the experts here is
refused in one line (exit 2), and so is a damaged one."""

from __future__ import annotations

import filecmp
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import PROMPT, ROOT, TOKENS, client_key, node_process, remote_runtime

from moeshard.cli import main
from moeshard.coordinator.chat import chat_prompt
from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.remote.config import RemoteConfig
from moeshard.coordinator.runtime import open_local, open_remote
from moeshard.coordinator.tokenizer import load as load_tokenizer
from moeshard.moe.convert.placement import directory_bytes, shard_model
from moeshard.moe.errors import StoreError
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.storage import merkle
from moeshard.moe.storage.manifest import MANIFEST, write_manifest

DEMO = ROOT / "models" / "demo-hf"
NO_RECORDS = "holds no expert records (a coordinator directory made by `moeshard shard`)"
COORDINATOR_FILES = [
    "config.json",
    "generation_config.json",
    "merkle.bin",
    "moeshard.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "trunk.gguf",
]


@pytest.fixture(scope="module")
def full(demo) -> Path:
    """The embedded model converted as `make demo` does (q4_0 experts, bf16 trunk)."""
    return demo


@pytest.fixture(scope="module")
def plan(full, tmp_path_factory) -> dict:
    return shard_model(full, 3, 2, tmp_path_factory.mktemp("shards") / "set")


@pytest.fixture(scope="module")
def coord(plan) -> Path:
    return Path(plan["coordinator"]["dir"])


@pytest.fixture(scope="module")
def nodes(plan):
    """A `moeshard node` process on each node directory (mutual TLS, the tests' client)."""
    procs = []
    try:
        for node in plan["nodes"]:
            procs.append(node_process(node["dir"]))
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def reference(full):
    """PROMPT continued for TOKENS greedy tokens by the full directory, in this process."""
    rt = open_local(full)
    try:
        return generate(
            rt.transformer, PROMPT, SamplingOptions(max_tokens=TOKENS, keep_logits=True)
        )
    finally:
        rt.close()


def peers(nodes) -> str:
    return ",".join(f"{n.node_id}@{n.addr}" for n in nodes)


def one_line(capsys, argv: list, *parts: str) -> str:
    """`main(argv)` in this process: exit 2, one stderr line naming every part, no traceback."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit {code}\n{out}\n{err}"
    assert "Traceback" not in err + out
    assert len(lines) == 1 and lines[0].startswith("moeshard: error: "), err
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


# -- what shard writes ------------------------------------------------------------------------


def test_the_coordinator_directory_has_the_trunk_and_roots_and_no_records(full, plan, coord):
    assert sorted(p.name for p in coord.iterdir()) == COORDINATOR_FILES
    assert not list(coord.glob("experts-*.gguf"))
    for name in COORDINATOR_FILES:
        if name != MANIFEST:  # copied byte for byte
            assert filecmp.cmp(full / name, coord / name, shallow=False), name
    source, here = ModelDir(full), ModelDir(coord)
    try:
        assert here.model_id == source.model_id
        assert here.role == "coordinator" and here.manifest["expert_files"] == []
        assert here.has_trunk and not here.has_experts and not here.locations
        assert source.has_experts and source.role == "model"
        # the empty shard set still knows the experts' geometry
        geometry = ("fmt", "hidden", "inter", "glu", "record_nbytes")
        assert [getattr(here.shard_set, g) for g in geometry] == [
            getattr(source.shard_set, g) for g in geometry
        ]
        assert here.expert_keys() == set(source.locations)
        assert here.possession_roots().roots == source.possession_roots().roots
    finally:
        source.close()
        here.close()
    # what the coordinator reads besides the trunk: tokenizer, chat template
    text = "The function returns"
    assert load_tokenizer(coord).encode(text) == load_tokenizer(full).encode(text)
    chat = [{"role": "user", "content": "Hi?"}]
    assert chat_prompt(coord, "qwen3_moe", chat) == chat_prompt(full, "qwen3_moe", chat)


def test_the_coordinator_directory_is_the_full_one_without_its_experts(full, plan, coord):
    """Smaller than the full directory by the expert files, as the plan says."""
    expert_bytes = sum(p.stat().st_size for p in full.glob("experts-*.gguf"))
    assert expert_bytes > 0
    size = directory_bytes(coord)
    assert size < directory_bytes(full) - expert_bytes + 4096  # (the manifests differ a little)
    recorded = json.loads(Path(plan["plan_file"]).read_text())["coordinator"]
    assert recorded == {"dir": str(coord), "bytes": size, "source_bytes": directory_bytes(full)}


def test_shard_prints_the_coordinator_directory_and_replaces_it_with_force(full, tmp_path, capsys):
    out = tmp_path / "set"
    assert main(["shard", str(full), "--nodes", "2", "--replicas", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    coord = out / "coordinator"
    line = next(x for x in printed.splitlines() if x.startswith(f"{coord}: "))
    assert f"{directory_bytes(coord) / 1e6:.1f} MB" in line and "no expert records" in line
    before = ModelDir(coord).model_id
    (coord / "stale").write_text("from an earlier run")
    argv = ["shard", str(full), "--nodes", "3", "--out", str(out), "--force"]
    assert main(argv) == 0
    capsys.readouterr()
    assert sorted(p.name for p in coord.iterdir()) == COORDINATOR_FILES  # a new one
    assert ModelDir(coord).model_id == before
    assert sorted(p.name for p in out.iterdir()) == [
        "coordinator",
        "node-00",
        "node-01",
        "node-02",
        "plan.json",
    ]


# -- generating from it through nodes -----------------------------------------------------------


def test_generation_from_the_coordinator_directory_equals_the_full_model(coord, nodes, reference):
    transformer, remote = remote_runtime(coord, [n.spec for n in nodes], audit=0.0)
    try:
        result = generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS, keep_logits=True))
        assert result.tokens == reference.tokens
        assert all(
            np.array_equal(a, b) for a, b in zip(result.logits, reference.logits, strict=True)
        )
        assert sum(n["calls"] > 0 for n in remote.stats()["nodes"]) >= 2
    finally:
        remote.close()


def test_open_remote_on_the_coordinator_directory_audits_from_fetched_records(
    coord, nodes, reference
):
    """The runtime `generate --peers` opens: no local records, so every audit fetches the
    records it recomputes with from the nodes, checked against merkle.bin's roots."""
    config = RemoteConfig(identity=client_key(), audit=1.0)
    rt = open_remote(coord, peers(nodes), remote_config=config)
    try:
        trust = rt.experts.trust
        assert trust.roots.keys() == rt.model.expert_keys()
        result = generate(rt.transformer, PROMPT, SamplingOptions(max_tokens=TOKENS))
        rt.verifier.drain()
        audit = rt.experts.stats()["audit"]
        assert result.tokens == reference.tokens
        assert audit["picked"] > 0 and audit["passed"] == audit["picked"], audit
        assert audit["records"]["local"] == 0 and audit["records"]["fetched"] > 0, audit
    finally:
        rt.close()


def test_generate_cli_from_the_coordinator_directory(coord, nodes, reference):
    cmd = [sys.executable, "-m", "moeshard", "generate", str(coord)]
    cmd += ["--peers", peers(nodes), "--key", str(client_key().path), "--audit", "0"]
    cmd += ["--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", str(TOKENS), "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tokens"] == reference.tokens


def test_cluster_and_audit_from_the_coordinator_directory(coord, nodes, capsys):
    key = ["--key", str(client_key().path)]
    assert main(["cluster", str(coord), "--peers", peers(nodes), *key, "--json"]) == 0
    coverage = json.loads(capsys.readouterr().out)["coverage"]
    assert coverage == {"experts": 192, "0": 0, "1": 0, ">=2": 192}
    # coverage counts the model's records, not the (no) records of the directory
    assert main(["cluster", str(coord), "--peers", peers(nodes[:1]), *key, "--json"]) == 3
    coverage = json.loads(capsys.readouterr().out)["coverage"]
    assert coverage["experts"] == 192 and coverage["0"] > 0
    assert main(["audit", str(coord), "--peers", peers(nodes), *key, "--rounds", "1"]) == 0
    capsys.readouterr()


# -- refused uses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "remedy"),
    [
        (["generate", "@", "--prompt-ids", "1,2"], "generate with --peers or --discover"),
        (["generate", "@", "--prompt", "Hi", "--ram", "60M"], "generate with --peers"),
        (["generate", "@", "--prompt-ids", "1", "--trace", "@t.npz"], "or use the full model"),
        (["serve", "@"], "serve with --peers or --discover"),
        (["quality", "@", "--prompt-ids", "1,2"], "quality reads a Hugging Face checkpoint"),
        (["perplexity", "@", "--text", DEMO / "val.txt"], f"checkpoint: give {DEMO}"),
        (["shard", "@", "--nodes", "2", "--out", "@s"], "shard the full model directory"),
        (["bench", "stream", "@", "--ram", "60M"], "use the full model directory"),
        (["bench", "rpc", "@"], "use the full model directory"),
        (["bench", "serve", "@"], "bench serve with --peers or --discover"),
    ],
)
def test_local_use_of_the_coordinator_directory_is_one_line(coord, tmp_path, capsys, argv, remedy):
    argv = [str(coord) if a == "@" else a for a in argv]
    argv = [str(tmp_path / a[1:]) if str(a).startswith("@") else a for a in argv]
    one_line(capsys, argv, f"{coord} {NO_RECORDS}", remedy)
    assert sorted(p.name for p in coord.iterdir()) == COORDINATOR_FILES
    assert not list(tmp_path.iterdir())  # nothing written: no trace, no shard set


def test_the_runtime_refuses_local_experts_from_the_coordinator_directory(coord):
    with pytest.raises(StoreError, match=f"{coord} holds no expert records"):
        open_local(coord)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "@", "--prompt", "Hi"],
        ["node", "@", "--insecure", "--no-advertise", "--port", "0"],
    ],
)
def test_a_process_on_the_coordinator_directory_exits_2_with_one_line(coord, argv):
    cmd = [sys.executable, "-m", "moeshard", *(str(coord) if a == "@" else a for a in argv)]
    # (a node that would serve it never exits: 60 s is a failure, not a hang)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"moeshard: error: {coord} {NO_RECORDS}: ")
    if argv[0] == "node":
        assert "serve a node directory" in done.stderr
    assert not (coord / "node-key.pem").exists()  # the node stopped before making its key


def test_inspect_shows_a_coordinator_directory(coord, capsys):
    assert main(["inspect", str(coord), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "directory  coordinator (made by `moeshard shard`)" in out
    assert "no expert records" in out and "192 Merkle roots" in out
    assert "file       trunk.gguf" in out and "checksums ok" in out
    assert "experts-" not in out


# -- a damaged coordinator directory ----------------------------------------------------------


def _manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def _forge_roots(path: Path, change) -> None:
    """Rewrite merkle.bin with `change(roots)` applied, and the manifest to match (roots sha256
    and the model id they make): a damage only the roots' own checks can see."""
    roots, _ = merkle.read_roots(path / merkle.ROOTS_FILE)
    change(roots)
    sha = merkle.write_roots(path, roots)
    manifest = _manifest(path)
    manifest["merkle"]["sha256"] = sha
    manifest["model_id"] = merkle.covered_id(manifest["merkle"]["content_id"], sha)
    write_manifest(path, manifest)


def _edit_manifest(**fields):
    def damage(path: Path) -> None:
        write_manifest(path, _manifest(path) | fields)

    return damage


def _flip_root_byte(path: Path) -> None:
    data = bytearray((path / merkle.ROOTS_FILE).read_bytes())
    data[-1] ^= 0xFF
    (path / merkle.ROOTS_FILE).write_bytes(bytes(data))


DAMAGES = {
    "a root changed": (_flip_root_byte, "merkle.bin: these roots are not the ones model id"),
    "roots file gone": (
        lambda p: (p / merkle.ROOTS_FILE).unlink(),
        "merkle.bin: missing (the manifest lists it)",
    ),
    "roots file cut": (
        lambda p: (p / merkle.ROOTS_FILE).write_bytes(b"MSMERKL1"),
        "merkle.bin: truncated roots file",
    ),
    "another model id": (
        _edit_manifest(model_id="ab" * 32),
        "merkle.bin: these roots are not the ones model id abababababababab",
    ),
    "expert files listed": (
        _edit_manifest(expert_files=["experts-00000.gguf"]),
        "moeshard.json: a coordinator directory that lists expert files",
    ),
    "unknown role": (_edit_manifest(role="referee"), "moeshard.json: role 'referee' is not one"),
    "manifest not JSON": (
        lambda p: (p / MANIFEST).write_text('{"format_version": 2, "model_id'),
        "moeshard.json: unreadable manifest",
    ),
    "trunk gone": (
        lambda p: (p / "trunk.gguf").unlink(),
        "a coordinator directory without trunk.gguf",
    ),
    "roots of another record size": (
        lambda p: _forge_roots(p, lambda r: setattr(r, "record_nbytes", r.record_nbytes + 32)),
        "merkle.bin: records of 27680 bytes; the model's q4_0 experts have 27648",
    ),
    "a root missing": (
        lambda p: _forge_roots(p, lambda r: r.roots.pop(max(r.roots))),
        "merkle.bin: 191 roots, not one for each of the model's 192 expert records",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_coordinator_directory_is_refused(coord, tmp_path, capsys, damage):
    bad = tmp_path / "coordinator"
    shutil.copytree(coord, bad)
    do, message = DAMAGES[damage]
    do(bad)
    with pytest.raises(StoreError, match="^" + re.escape(str(bad))):
        ModelDir(bad)
    argv = ["generate", bad, "--peers", f"{'a' * 26}@127.0.0.1:1", "--prompt-ids", "1"]
    one_line(capsys, argv, message)
