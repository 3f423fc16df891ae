"""ModelDir: a converted model directory opened and checked (manifest, config, trunk, shards).

The experts' part is a `moe.storage.shards.ShardSet` (`shard_set`), which is all an experts
backend needs; the trunk is read with `load_trunk` (into RAM) or streamed through
`moe.model.streaming_trunk`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

from moe.errors import StoreError
from moe.model.config import read_json
from moe.model.families import family_for, load_config
from moe.model.trunk import Trunk
from moe.storage import merkle
from moe.storage.manifest import TRUNK_FILE, check_config, read_manifest
from moe.storage.shards import ShardSet
from moe.storage.trunk_file import TrunkLayout, read_trunk_tensors

log = logging.getLogger(__name__)


class ModelDir:
    """A validated model directory. Shards are opened (headers checked) on construction."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise StoreError(f"{self.path}: no such model directory")
        self.manifest = read_manifest(self.path)
        self.model_id: str = self.manifest["model_id"]
        # the config must be the one the model id covers (an edited top-k changes the text)
        check_config(self.path, self.manifest, read_json(self.path / "config.json"))
        self.config = load_config(self.path)
        self.family: ModuleType = family_for(self.config.model_type, str(self.path))
        self.expert_format: str = self.manifest["expert_format"]
        self.shard_set = ShardSet(
            [self.path / name for name in self.manifest["expert_files"]],
            self.model_id,
            self.expert_format,
            self.config.expert_hidden,
            self.config.expert_intermediate,
            self.config.expert_glu,
        )
        self.shards = self.shard_set.files
        self.locations = self.shard_set.locations
        self._roots: merkle.Roots | None = None

    @property
    def has_trunk(self) -> bool:
        return (self.path / TRUNK_FILE).exists()

    def require_trunk(self) -> None:
        if not self.has_trunk:
            raise StoreError(f"{self.path}: has no {TRUNK_FILE} (a node shard directory?)")

    def trunk_layout(self) -> TrunkLayout:
        return TrunkLayout(self.path / TRUNK_FILE, self.model_id)

    def load_trunk(self, verify: bool = True) -> Trunk:
        """The whole trunk in RAM, every tensor checksum-verified."""
        return Trunk(read_trunk_tensors(self.trunk_layout(), verify))

    def possession_roots(self) -> merkle.Roots:
        """The per-record Merkle roots possession challenges are checked against: the roots
        file the manifest lists, refused unless the model id covers it; for a directory
        converted before roots files existed, computed from this directory's own records
        (checksum-verified) on first use of each and kept. StoreError if neither is possible."""
        if self._roots is None:
            entry = self.manifest.get("merkle")
            if entry:
                self._roots = merkle.load_covered(self.path, entry, self.model_id)
            elif self.locations:
                log.warning(
                    "%s: no possession roots file; computing roots from the records "
                    "(reconvert to have them covered by the model id)",
                    self.path,
                )
                self._roots = merkle.ComputedRoots(self.shard_set)
            else:
                raise StoreError(f"{self.path}: no possession roots and no records: reconvert")
        return self._roots

    def generation_config(self) -> dict:
        path = self.path / "generation_config.json"
        return read_json(path) if path.exists() else {}

    def close(self) -> None:
        self.shard_set.close()
