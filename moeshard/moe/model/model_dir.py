"""ModelDir: a converted model directory opened and checked (manifest, config, trunk, shards).

The experts' part is a `moeshard.moe.storage.shards.ShardSet` (`shard_set`), which is all an experts
backend needs; the trunk is read with `load_trunk` (into RAM) or streamed through
`moeshard.moe.model.streaming_trunk`.

Three kinds open here (the manifest's "role", `moeshard.moe.storage.manifest`): a full model
directory, a node's shard directory (no trunk) and a coordinator directory (no expert records). The
last one's ShardSet is empty but still knows the experts' geometry (format, widths, GLU, record
bytes), and its merkle.bin is checked on opening, since it is the only thing there that speaks for
the records: covered by the model id, one root per record of the model, of the record size the
format and geometry give. Commands that need the records call `require_experts`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

from moeshard.moe.errors import StoreError
from moeshard.moe.kernels import quant
from moeshard.moe.model.config import read_json
from moeshard.moe.model.families import family_for, load_config
from moeshard.moe.model.trunk import Trunk
from moeshard.moe.storage import merkle
from moeshard.moe.storage.manifest import (
    MANIFEST,
    ROLE_COORDINATOR,
    ROLE_MODEL,
    TRUNK_FILE,
    check_config,
    read_manifest,
)
from moeshard.moe.storage.shards import Key, ShardSet
from moeshard.moe.storage.trunk_file import TrunkLayout, read_trunk_tensors

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
        self._check_expert_format()
        self.role: str = self.manifest.get("role", ROLE_MODEL)
        if self.role == ROLE_COORDINATOR and self.manifest["expert_files"]:
            raise StoreError(
                f"{self.path / MANIFEST}: a coordinator directory that lists expert files"
            )
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
        if self.role == ROLE_COORDINATOR:
            self._check_coordinator()

    def _check_coordinator(self) -> None:
        """A coordinator directory has its trunk, and its roots file is the one the model id
        covers, with a root for every record of the model and the record size its format and
        geometry give. StoreError (one line) otherwise."""
        if not self.has_trunk:
            raise StoreError(
                f"{self.path}: a coordinator directory without {TRUNK_FILE}: run "
                "`moeshard shard` again"
            )
        if not self.manifest.get("merkle"):
            raise StoreError(
                f"{self.path / MANIFEST}: a coordinator directory without possession roots"
            )
        roots = self.possession_roots()
        if roots.keys() != self.expert_keys():
            raise StoreError(
                f"{self.path / merkle.ROOTS_FILE}: {len(roots.keys())} roots, not one for each "
                f"of the model's {len(self.expert_keys())} expert records"
            )

    @property
    def has_trunk(self) -> bool:
        return (self.path / TRUNK_FILE).exists()

    def require_trunk(self) -> None:
        if not self.has_trunk:
            raise StoreError(f"{self.path}: has no {TRUNK_FILE} (a node shard directory?)")

    @property
    def has_experts(self) -> bool:
        """Whether this directory holds expert records (a coordinator directory holds none)."""
        return bool(self.locations)

    def require_experts(
        self, remedy: str = "generate with --peers or --discover, or use the full model directory"
    ) -> None:
        """StoreError (one line, exit 2) naming the directory and `remedy` (what to do
        instead) unless it holds expert records: for every use that reads or computes them
        here rather than on nodes."""
        if self.has_experts:
            return
        if self.role == ROLE_COORDINATOR:
            what = "a coordinator directory made by `moeshard shard`"
        else:
            what = "its manifest lists no expert files"
        raise StoreError(f"{self.path} holds no expert records ({what}): {remedy}")

    def expert_keys(self) -> set[Key]:
        """Every (layer, expert) record of the model, whatever this directory holds of them."""
        c = self.config
        return {(layer, e) for layer in c.moe_layers for e in range(c.n_experts)}

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
                roots = merkle.load_covered(self.path, entry, self.model_id)
                self._check_record_size(roots)
                self._roots = roots
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

    def _check_expert_format(self) -> None:
        """Every MoE layer has a record format (`quant.record_format`), and a spec with one
        per layer has one for every layer: refused here, not by a kernel call mid-run."""
        spec, c = self.expert_format, self.config
        try:
            if not isinstance(spec, str):
                raise ValueError(f"expert format {spec!r} is not a string")
            entries = quant.expert_format_entries(spec)
            if len(entries) > 1 and len(entries) != c.num_hidden_layers:
                raise ValueError(
                    f"expert format {spec!r} has {len(entries)} layers, the model "
                    f"{c.num_hidden_layers}"
                )
            for layer in c.moe_layers:
                if quant.has_bias(quant.record_format(spec, layer)) != c.expert_biases:
                    raise ValueError(
                        f"expert format {spec!r}: the {c.model_type} experts "
                        f"{'have' if c.expert_biases else 'have no'} biases, so every record "
                        f"format {'ends' if c.expert_biases else 'does not end'} in {quant.BIAS}"
                    )
        except ValueError as exc:
            raise StoreError(f"{self.path / MANIFEST}: {exc}") from None

    def _check_record_size(self, roots: merkle.Roots) -> None:
        """The roots file's record size must be the one the experts' format and geometry
        give (`quant.expert_record_nbytes`): every proof's block count depends on it."""
        if roots.record_nbytes != self.shard_set.record_nbytes:
            raise StoreError(
                f"{self.path / merkle.ROOTS_FILE}: records of {roots.record_nbytes} bytes; "
                f"the model's {self.expert_format} experts have {self.shard_set.record_nbytes}"
            )

    def generation_config(self) -> dict:
        path = self.path / "generation_config.json"
        return read_json(path) if path.exists() else {}

    def close(self) -> None:
        self.shard_set.close()
