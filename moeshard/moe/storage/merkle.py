"""Merkle trees over expert records, and the model directory's roots file (`merkle.bin`).

Proof of possession (docs/security.md): the coordinator holds one 32-byte root per expert
record; it challenges a node for random blocks of records the node claims to hold, and the
node answers with each block and its path of sibling hashes up to the record's root.

The tree of one record:
- blocks: the record split into BLOCK_SIZE bytes; the last block may be short and is never
  padded (a leaf hash covers exactly its bytes, and both sides know the record's length).
  4096 bytes because records start at 4096-byte boundaries of the shard files
  (`gguf_file.ALIGNMENT`): a block is one aligned page, the unit an SSD reads, so challenging
  a block costs a node one page read; smaller blocks only deepen the tree, larger ones only
  make every proof bigger.
- leaf = sha256(0x00 || block), inner node = sha256(0x01 || left || right): the prefixes keep
  a leaf from being passed off as an inner node (RFC 6962).
- a level with an odd number of nodes moves its last node up unchanged (never paired with a
  copy of itself: duplicating it would let two different records share a root, as in
  CVE-2012-2459). The root equals RFC 6962's Merkle tree hash.
- a path is the sibling hashes from the leaf up, skipping the levels where the node moved up
  alone; (index, number of blocks) fix its length, and `verify` refuses any other.

The roots file, little-endian: magic b"MSMERKL1", u32 block size, u32 record count, u64 record
bytes, then per record sorted by (layer, expert): u32 layer, u32 expert, 32-byte root. Binary
rather than JSON: one canonical byte string for the same roots (its sha256 goes into the model
id, see `covered_id`), 40 bytes a record (0.9 MB for 23k records), read in one numpy call.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeshard.moe.errors import StoreError
from moeshard.moe.storage.io import write_file

BLOCK_SIZE = 4096
ROOTS_FILE = "merkle.bin"
MAGIC = b"MSMERKL1"
HEADER = struct.Struct("<8sIIQ")  # magic, block size, records, record bytes
ENTRY = np.dtype([("layer", "<u4"), ("expert", "<u4"), ("root", "V32")])
LEAF, NODE = b"\x00", b"\x01"
MODEL_ID_PREFIX = b"moeshard-model-v1\n"
POSSESSION_PREFIX = b"moeshard-possession-v1"

Key = tuple[int, int]  # (layer, expert)


def n_blocks(nbytes: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks of a record of `nbytes` bytes (at least one)."""
    return max(1, -(-nbytes // block_size))


def block_span(index: int, nbytes: int, block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    """(start, end) byte offsets of block `index` inside a record of `nbytes` bytes."""
    start = index * block_size
    return start, min(start + block_size, nbytes)


def _leaf(block) -> bytes:
    h = hashlib.sha256(LEAF)
    h.update(block)
    return h.digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE + left + right).digest()


class Tree:
    """Every level of one record's tree: levels[0] the leaf hashes, levels[-1] == [root]."""

    def __init__(self, record, block_size: int = BLOCK_SIZE):
        if not isinstance(record, bytes | bytearray | memoryview):
            record = np.ascontiguousarray(record).reshape(-1).view(np.uint8)  # [nbytes]
        view = memoryview(record).cast("B")
        self.nbytes, self.block_size = len(view), block_size
        count = n_blocks(self.nbytes, block_size)
        level = [_leaf(view[i * block_size : (i + 1) * block_size]) for i in range(count)]
        self.levels = [level]
        while len(level) > 1:
            up = [_node(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
            if len(level) % 2:
                up.append(level[-1])  # the odd one out moves up unchanged
            self.levels.append(up)
            level = up

    @property
    def root(self) -> bytes:
        return self.levels[-1][0]

    def path(self, index: int) -> list[bytes]:
        """Sibling hashes of block `index` from the leaf up."""
        if not 0 <= index < len(self.levels[0]):
            raise IndexError(f"block {index} of {len(self.levels[0])}")
        path = []
        for level in self.levels[:-1]:
            sibling = index ^ 1
            if sibling < len(level):
                path.append(level[sibling])
            index //= 2
        return path


def root(record, block_size: int = BLOCK_SIZE) -> bytes:
    """The Merkle root of one record (bytes or a uint8 array)."""
    return Tree(record, block_size).root


def proof(record, index: int, block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The path of block `index` of `record`."""
    return Tree(record, block_size).path(index)


def verify(root_hash: bytes, index: int, count: int, data: bytes, path: list[bytes]) -> bool:
    """Whether `data` is block `index` of a record of `count` blocks whose root is `root_hash`,
    by `path` (exactly the siblings the tree has for that block, leaf first)."""
    if not 0 <= index < count:
        return False
    node, width, used = _leaf(data), count, 0
    while width > 1:
        if index % 2:  # a right child: the sibling is on the left
            if used == len(path):
                return False
            node, used = _node(path[used], node), used + 1
        elif index + 1 < width:  # a left child with a sibling on the right
            if used == len(path):
                return False
            node, used = _node(node, path[used]), used + 1
        index, width = index // 2, (width + 1) // 2
    return used == len(path) and node == root_hash


def covered_id(content_id: str, roots_sha256: str) -> str:
    """The model id of a directory with a roots file: the id of its content (config and every
    checksum) hashed with the roots file's sha256, so a changed roots file changes the id."""
    data = MODEL_ID_PREFIX + content_id.encode() + b"\n" + roots_sha256.encode()
    return hashlib.sha256(data).hexdigest()


def possession_message(nonce: bytes, reply) -> bytes:
    """What a ChallengeReply's signature covers: the domain, the challenge's nonce and the
    reply serialized deterministically with its signature empty."""
    unsigned = type(reply)()
    unsigned.CopyFrom(reply)
    unsigned.signature = b""
    return POSSESSION_PREFIX + nonce + unsigned.SerializeToString(deterministic=True)


# -- the roots of a model ------------------------------------------------------------------


@dataclass
class Roots:
    """Every record's root, with the block size and the (common) record length."""

    block_size: int
    record_nbytes: int
    roots: dict[Key, bytes]

    @property
    def n_blocks(self) -> int:
        return n_blocks(self.record_nbytes, self.block_size)

    def root(self, layer: int, expert: int) -> bytes | None:
        return self.roots.get((layer, expert))

    def keys(self) -> set[Key]:
        """The records these roots can check."""
        return set(self.roots)

    def to_bytes(self) -> bytes:
        keys = sorted(self.roots)
        entries = np.zeros(len(keys), dtype=ENTRY)  # [records]
        entries["layer"] = [k[0] for k in keys]
        entries["expert"] = [k[1] for k in keys]
        entries["root"] = [self.roots[k] for k in keys]
        head = HEADER.pack(MAGIC, self.block_size, len(keys), self.record_nbytes)
        return head + entries.tobytes()


def write_roots(directory: Path, roots: Roots) -> str:
    """Write `directory`/merkle.bin atomically (temporary name, then rename); its sha256."""
    data = roots.to_bytes()
    tmp = Path(directory) / (ROOTS_FILE + ".tmp")
    write_file(tmp, data)
    os.replace(tmp, Path(directory) / ROOTS_FILE)
    return hashlib.sha256(data).hexdigest()


def read_roots(path: Path) -> tuple[Roots, str]:
    """A roots file and its sha256; StoreError naming the file if it is not one."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise StoreError(f"{path}: cannot read the possession roots ({exc.strerror})") from None
    if len(data) < HEADER.size:
        raise StoreError(f"{path}: truncated roots file")
    magic, block_size, count, record_nbytes = HEADER.unpack_from(data)
    if magic != MAGIC or block_size == 0:
        raise StoreError(f"{path}: not a moeshard roots file")
    if block_size != BLOCK_SIZE:
        raise StoreError(f"{path}: blocks of {block_size} bytes; this build proves {BLOCK_SIZE}")
    if len(data) != HEADER.size + count * ENTRY.itemsize:
        raise StoreError(f"{path}: {len(data)} bytes, {count} roots need a different size")
    entries = np.frombuffer(data, dtype=ENTRY, offset=HEADER.size)  # [records]
    roots = {(int(e["layer"]), int(e["expert"])): bytes(e["root"]) for e in entries}
    return Roots(block_size, record_nbytes, roots), hashlib.sha256(data).hexdigest()


def manifest_entry(content_id: str, roots_sha256: str) -> dict:
    """The manifest's "merkle" field: the roots file, its sha256 and the content id that
    `covered_id` combines with it into the model id."""
    return {"file": ROOTS_FILE, "sha256": roots_sha256, "content_id": content_id}


def load_covered(directory: Path, entry: dict, model_id: str) -> Roots:
    """The roots file the manifest's "merkle" field names, checked to be the one the model id
    covers: covered_id(content id, the file's sha256) must be the model id."""
    path = Path(directory) / Path(str(entry.get("file", ROOTS_FILE))).name
    if not path.exists():
        raise StoreError(f"{path}: missing (the manifest lists it): reconvert the model")
    roots, sha = read_roots(path)
    if sha != entry.get("sha256") or covered_id(str(entry.get("content_id")), sha) != model_id:
        raise StoreError(
            f"{path}: these roots are not the ones model id {model_id[:16]} covers "
            f"(the file changed, or comes from another conversion)"
        )
    return roots


class ComputedRoots(Roots):
    """The roots of a directory converted before roots files existed: computed from its own
    records (checksum-verified reads) on first use of each record, then kept."""

    def __init__(self, shard_set, block_size: int = BLOCK_SIZE):
        super().__init__(block_size, shard_set.record_nbytes, {})
        self.shard_set = shard_set

    def root(self, layer: int, expert: int) -> bytes | None:
        key = (layer, expert)
        if key not in self.roots and key in self.shard_set.locations:
            self.roots[key] = root(self.shard_set.read(layer, expert), self.block_size)
        return self.roots.get(key)

    def keys(self) -> set[Key]:
        return set(self.shard_set.locations)
