"""A disk model for the simulator: bandwidth by read size and queue depth.

A profile is {"points": [[read bytes, depth, GB/s], ...]}: a named one below, or one measured
on this machine by `moeshard bench disk --profile-out FILE` (`write_disk_profile`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeshard.moe.errors import MoeshardError

# Disk profiles: GB/s by (read size, queue depth). "this-machine" is fio on this project's dev
# machine (O_DIRECT random reads); "pcie4-nvme" is a typical PCIe Gen4 x4 NVMe SSD's datasheet
# class (7 GB/s sequential at depth, ~20k IOPS at 4 KiB QD1, ~3 GB/s at 1 MiB QD1).
DISK_PROFILES = {
    "this-machine": {
        "points": [
            [4096, 1, 0.061],
            [65536, 1, 0.67],
            [1 << 20, 1, 1.12],
            [1 << 20, 8, 1.85],
            [8 << 20, 4, 2.2],
        ]
    },
    "pcie4-nvme": {
        "points": [
            [4096, 1, 0.08],
            [65536, 1, 1.2],
            [1 << 20, 1, 3.0],
            [1 << 20, 8, 6.5],
            [8 << 20, 4, 7.0],
        ]
    },
}


SPLIT_BYTES = 1 << 20  # large reads reach the device as requests of about this size


def _valid_points(points) -> bool:
    """A non-empty list of [read bytes > 0, depth >= 1, GB/s > 0]."""
    if not isinstance(points, list) or not points:
        return False
    for p in points:
        if not (isinstance(p, list) and len(p) == 3):
            return False
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in p):
            return False
        if not (p[0] > 0 and p[1] >= 1 and p[2] > 0 and math.isfinite(p[2])):
            return False
    return True


@dataclass
class Disk:
    points: list  # [read bytes, depth, GB/s]

    @classmethod
    def load(cls, spec: str) -> Disk:
        if spec in DISK_PROFILES:
            return cls(DISK_PROFILES[spec]["points"])
        try:
            data = json.loads(Path(spec).read_text())
        except (OSError, ValueError) as exc:
            raise MoeshardError(
                f"{spec}: not a disk profile name ({', '.join(DISK_PROFILES)}) or JSON file ({exc})"
            ) from None
        points = data.get("points") if isinstance(data, dict) else None
        if not _valid_points(points):
            raise MoeshardError(
                f'{spec}: a disk profile is {{"points": [[read bytes, depth, GB/s], ...]}} with '
                "positive numbers (`moeshard bench disk --profile-out FILE` writes one)"
            )
        return cls(points)

    def scaled(self, factor: float) -> Disk:
        """The same curve shape, every bandwidth times `factor`."""
        return Disk([[size, depth, gbps * factor] for size, depth, gbps in self.points])

    def curve(self, depth: int) -> tuple[list[float], list[float]]:
        """(log2 read size, GB/s) at the deepest measured depth <= `depth`. A depth measured at
        fewer than two sizes borrows the shallowest depth's curve, scaled to its own point."""
        depths = sorted({p[1] for p in self.points})
        chosen = max([d for d in depths if d <= depth] or depths[:1])
        points = sorted((math.log2(p[0]), p[2]) for p in self.points if p[1] == chosen)
        if len(points) >= 2:
            return [x for x, _ in points], [g for _, g in points]
        xs, gs = self.curve(depths[0]) if chosen != depths[0] else ([points[0][0]], [1.0])
        scale = points[0][1] / float(np.interp(points[0][0], xs, gs))
        return xs, [g * scale for g in gs]

    def gbps(self, read_bytes: float, depth: int) -> float:
        """Bandwidth for reads of this size at this depth (interpolated in log read size)."""
        xs, gs = self.curve(depth)
        return float(np.interp(math.log2(max(read_bytes, 1)), xs, gs))

    def read_seconds(self, sizes: list[int], depth: int) -> float:
        """Time to read these runs, `depth` of them in flight. The kernel splits a read larger
        than SPLIT_BYTES into SPLIT_BYTES requests that are all in flight at once, so a few big
        merged reads keep the device as busy as many record-sized ones."""
        if not sizes:
            return 0.0
        total = float(sum(sizes))
        mean = total / len(sizes)
        if mean <= SPLIT_BYTES:
            return total / (self.gbps(mean, min(depth, len(sizes))) * 1e9)
        pieces = sum(math.ceil(s / SPLIT_BYTES) for s in sizes)
        deepest = max(p[1] for p in self.points)
        return total / (self.gbps(SPLIT_BYTES, min(max(depth, deepest), pieces)) * 1e9)


def write_disk_profile(path: Path, points: list) -> None:
    """The measured (read bytes, depth, GB/s) points as JSON, written to a temporary name and
    renamed, so a failed run never leaves half a profile behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps({"points": points}, indent=1) + "\n")
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise MoeshardError(f"{path}: cannot write the disk profile ({exc.strerror})") from None
