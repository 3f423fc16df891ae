"""The model directory's manifest (`moeshard.json`) and the names every directory shares.

A model directory holds:
  moeshard.json          manifest: format version, model id, formats, file list, geometry
  config.json            the Hugging Face config it was converted from (and generation_config.json,
                         tokenizer.json when the checkpoint had them)
  trunk.gguf             every dense tensor (embeddings, attention, norms, routers, shared experts)
  experts-NNNNN.gguf     expert shard files: one record per (layer, expert)
  merkle.bin             per-record Merkle roots, for proofs of possession (moe/storage/merkle.py)

`moeshard shard MODEL --out OUT` writes two more kinds, named by the manifest's "role" field:
  "node"         OUT/node-NN: the same without trunk.gguf, only the records placed on that
                 node ("shard_of": the source directory, "shard_experts": its record count)
  "coordinator"  OUT/coordinator: the same without any experts-*.gguf ("expert_files" is empty):
                 trunk, configs, tokenizer and merkle.bin, all a coordinator whose experts are
                 on nodes needs ("shard_of": the source directory)
A manifest without "role" is a full model directory ("model"; node directories written before
the field existed have "trunk_file": null instead). The model id is the sha256 of a content id
(the sha256 of the config and of every tensor's and record's checksum) and of merkle.bin, so
two directories (a full one, a node's, the coordinator's) agree on it only if they hold the
same model in the same formats with the same roots.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from moeshard.moe.errors import StoreError
from moeshard.moe.storage.io import write_file

# 2: q4_0/q8_0 matrices in interleaved groups of eight rows (`moeshard.moe.kernels.quant`)
# 3: bf16 matrices in groups of four rows interleaved sixteen columns at a time (`layout`)
FORMAT_VERSION = 3
SHARD_MAX_BYTES = 4 << 30  # an expert shard file holds at most about this many record bytes
MANIFEST = "moeshard.json"
TRUNK_FILE = "trunk.gguf"
PLACEHOLDER_ID = "0" * 64  # the model id written first and replaced once the data is hashed
# the manifest's "role": what a directory holds (see the module docstring)
ROLE_MODEL, ROLE_NODE, ROLE_COORDINATOR = "model", "node", "coordinator"
ROLES = (ROLE_MODEL, ROLE_NODE, ROLE_COORDINATOR)


CONTENT_PREFIX = b"moeshard-content-v1\n"


def config_digest(raw: dict) -> str:
    """sha256 of a config as loaded (canonical JSON: sorted keys), what the model id covers."""
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


def content_id(config_sha256: str, data_id: str) -> str:
    """The id of a model's content: its config's digest and the digest of its formats and
    every tensor's and record's checksum (`data_id`)."""
    return hashlib.sha256(CONTENT_PREFIX + f"{config_sha256}\n{data_id}".encode()).hexdigest()


def covers_entry(config_sha256: str, data_id: str) -> dict:
    """The manifest's "covers" field: what the content id is made of, so a loader can check
    the config it reads is the one the model id covers without reading every record."""
    return {"config_sha256": config_sha256, "data_id": data_id}


def check_config(directory: Path, manifest: dict, raw_config: dict) -> None:
    """StoreError (one line naming the file) unless `raw_config` (the directory's config.json
    as loaded) is the one the model id covers. Directories converted before the manifest had
    a "covers" field are not checked."""
    covers = manifest.get("covers")
    if not isinstance(covers, dict):
        return
    path = Path(directory) / "config.json"
    if config_digest(raw_config) != covers.get("config_sha256"):
        raise StoreError(
            f"{path}: changed since conversion (the model id covers another config); "
            "restore it or convert the checkpoint again"
        )
    merkle = manifest.get("merkle") or {}
    made = content_id(str(covers.get("config_sha256")), str(covers.get("data_id")))
    if made != merkle.get("content_id"):
        raise StoreError(
            f"{Path(directory) / MANIFEST}: its config digest is not the one the model id covers"
        )


def write_manifest(directory: Path, manifest: dict) -> None:
    """Write moeshard.json atomically (temporary name, then rename)."""
    tmp = Path(directory) / (MANIFEST + ".tmp")
    write_file(tmp, (json.dumps(manifest, indent=2) + "\n").encode())
    os.replace(tmp, Path(directory) / MANIFEST)


def _hint(directory: Path) -> str:
    """What to do with a directory that is no model directory, when it looks like one thing
    a user may hand over instead."""
    directory = Path(directory)
    if not directory.is_dir():
        return "" if directory.exists() else ": no such directory"
    if (directory / "config.json").exists() and any(directory.glob("*.safetensors")):
        return (
            f": a Hugging Face checkpoint, to convert first: moeshard convert {directory} MODEL_DIR"
        )
    if any(directory.glob("*.gguf")):
        return ": a GGUF file's directory; moeshard reads Hugging Face checkpoints (convert)"
    return ""


def read_manifest(directory: Path) -> dict:
    """The manifest of a model or shard directory, checked for version and required keys."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise StoreError(
            f"{directory}: not a moeshard model directory (no {MANIFEST}){_hint(directory)}"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StoreError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict):
        raise StoreError(f"{path}: unreadable manifest (not a JSON object)")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise StoreError(
            f"{path}: format version {version} not supported (this build reads {FORMAT_VERSION}):"
            " convert the checkpoint again with this build"
        )
    for key in ("model_id", "expert_format", "expert_files"):
        if key not in manifest:
            raise StoreError(f"{path}: manifest lacks '{key}'")
    if not isinstance(manifest["expert_files"], list):
        raise StoreError(f"{path}: 'expert_files' is not a list of file names")
    if manifest.get("role", ROLE_MODEL) not in ROLES:
        raise StoreError(
            f"{path}: role {manifest['role']!r} is not one of {', '.join(ROLES)} "
            "(a manifest from a newer build, or damaged)"
        )
    return manifest
