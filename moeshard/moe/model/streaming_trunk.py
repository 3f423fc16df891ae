"""A trunk that lives partly on disk: a resident prefix of layers plus a ring of layer slots.

Used by single-node streaming when the RAM budget cannot hold the whole trunk. Tensors outside
the decoder layers (embeddings, final norm, head) and every layer's router are always
resident: the router of layer L+1 is applied during layer L for next-layer prefetch, before
layer L+1 is in the ring. Layers 0..prefix-1 are resident; the others are read, one O_DIRECT
read per layer (a layer's tensors are contiguous in trunk.gguf because the writer sorts names),
into a ring of preallocated slots. `enter_layer(i)` (called by the forward pass before layer i)
waits for layer i and starts reading the next streamed layers into the other slots, so reads
overlap the current layer's compute.

With prefix = all layers this is also the O_DIRECT loader for a fully resident trunk (no page
cache copy, no mmap pages counted in RSS).

Checksums: resident tensors and each streamed layer are verified the first time they are read.
"""

from __future__ import annotations

import logging
import time

from moeshard.moe.errors import StoreError
from moeshard.moe.model.trunk import Trunk
from moeshard.moe.storage.io import ReaderPool, ReadRequest, aligned_buffer, crc32
from moeshard.moe.storage.trunk_file import LAYER_NAME, TrunkLayout, TrunkTensor

log = logging.getLogger(__name__)


class StreamingTrunk(Trunk):
    """`moeshard.moe.model.trunk.Trunk` with layers >= `prefix` streamed through `ring` slots."""

    def __init__(self, layout: TrunkLayout, prefix: int, ring: int = 2, depth: int = 2):
        self.layout = layout
        self.reader = ReaderPool(depth)
        self.streamed = [i for i in range(layout.n_layers) if i >= prefix and i in layout.layers]
        if self.streamed and ring < 2:
            raise StoreError("a streamed trunk needs a ring of at least 2 layer slots")
        self.bytes_read = 0
        self.stall_s = 0.0
        tensors: dict[str, TrunkTensor] = {}
        fixed = set(layout.fixed)
        resident = [n for n in layout.entries if n in fixed or self._layer_of(n) < prefix]
        for name in resident:  # one buffer per tensor; verified once
            e = layout.entries[name]
            buf = aligned_buffer(e.nbytes)
            self.reader.read([ReadRequest(layout.path, e.offset, e.nbytes, buf, name, e.crc)])
            tensors[name] = TrunkTensor(e.fmt, e.shape, buf[: e.nbytes])
            self.bytes_read += e.nbytes
        super().__init__(tensors)
        n_slots = min(ring, len(self.streamed))
        slot_bytes = max((layout.span(i)[1] for i in self.streamed), default=0)
        self.ring = [aligned_buffer(slot_bytes) for _ in range(n_slots)]  # uint8 [slot_bytes]
        self.slot_layer: list[int | None] = [None] * n_slots
        self.futures: list = [None] * n_slots
        self.verified: set[int] = set()
        self.installed: set[int] = set()  # streamed layers whose tensors are in self.tensors

    @staticmethod
    def _layer_of(name: str) -> int:
        m = LAYER_NAME.match(name)
        return int(m.group(1)) if m else -1

    def resident_bytes(self) -> int:
        ring = sum(b.nbytes for b in self.ring)
        return sum(t.data.nbytes for t in self.tensors.values()) + ring

    def _start(self, slot: int, layer: int) -> None:
        old = self.futures[slot]
        if old is not None:
            old.result()
        if self.slot_layer[slot] is not None:
            self._uninstall(self.slot_layer[slot])
        start, length = self.layout.span(layer)
        req = ReadRequest(self.layout.path, start, length, self.ring[slot], ("trunk", layer))
        self.slot_layer[slot] = layer
        self.futures[slot] = self.reader.submit([req])[0]
        self.bytes_read += length

    def _uninstall(self, layer: int) -> None:
        self.installed.discard(layer)
        prefix = f"model.layers.{layer}."
        fixed = set(self.layout.fixed)
        for name in self.layout.layers[layer]:
            if name not in fixed:
                self.tensors.pop(name, None)
        for key in [
            k for k in self._cache if k.startswith(prefix) and k.split("#")[0] not in fixed
        ]:
            del self._cache[key]

    def _install(self, slot: int, layer: int) -> None:
        start, _ = self.layout.span(layer)
        buf = self.ring[slot]
        fixed = set(self.layout.fixed)
        for name in self.layout.layers[layer]:
            if name in fixed:
                continue
            e = self.layout.entries[name]
            data = buf[e.offset - start : e.offset - start + e.nbytes]  # uint8 [nbytes]
            if layer not in self.verified and crc32(data) != e.crc:
                raise StoreError(f"{self.layout.path}: checksum mismatch in trunk tensor '{name}'")
            self.tensors[name] = TrunkTensor(e.fmt, e.shape, data)
        self.verified.add(layer)

    def enter_layer(self, layer: int) -> None:
        if not self.streamed:
            return
        if layer in self.streamed:
            if layer in self.slot_layer:
                slot = self.slot_layer.index(layer)
            else:
                slot = next(
                    (s for s, ly in enumerate(self.slot_layer) if ly is None), 0
                )  # a miss: nothing read ahead (first token)
                self._start(slot, layer)
            if self.futures[slot] is not None:
                t0 = time.perf_counter()
                self.futures[slot].result()
                self.stall_s += time.perf_counter() - t0
                self.futures[slot] = None
            if layer not in self.installed:
                self._install(slot, layer)
                self.installed.add(layer)
            busy = {slot}
            pos = self.streamed.index(layer)
        else:
            busy = set()
            later = [j for j, ly in enumerate(self.streamed) if ly > layer]
            pos = (later[0] if later else 0) - 1
        # read ahead the next streamed layers (cyclically: the next token starts again)
        for d in range(1, len(self.ring) + 1 - len(busy)):
            nxt = self.streamed[(pos + d) % len(self.streamed)]
            if nxt in self.slot_layer:
                busy.add(self.slot_layer.index(nxt))
                continue
            free = [s for s in range(len(self.ring)) if s not in busy]
            if not free:
                break
            self._start(free[0], nxt)
            busy.add(free[0])

    def close(self) -> None:
        self.reader.close()
