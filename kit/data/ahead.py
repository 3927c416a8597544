"""Loading the next planned batches ahead, in one go, in the main process.

Between two training steps the model's compute evicts the data path's code and objects
from the CPU caches, so loading one batch per step costs several times what it costs in
a tight loop (measured for 64 length-1 sequences of an ``ArrayDataset``: ~150 µs against
~55 µs). Loading the next batches together, while that code is warm, brings the cost per
batch back near the tight loop's, and gathering them as one block (:mod:`kit.data.block`:
one gather per key for all of them, each batch a view) lowers that further (~30 µs in a
tight loop; inside the training loop ~35 µs per step instead of ~55, measured per phase).

Only for a packed dataset (:mod:`kit.data.gather`) without worker processes: loading it
changes no state (unlike the first sight of a per-sequence dataset's sequences), so a
batch loaded early is exactly the batch loaded on its turn. A batch that fails to load
is not kept: it is loaded again on its turn and raises then, as without loading ahead.
A batch's tensors are its own to change, but a batch that is kept keeps its block's
arrays alive (at most ``MAX_BYTES``); where a block does not apply (chunking, labels that
a batch must check, long rows) each batch is gathered into arrays of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from kit.data.batch import Batch
from kit.data.batching import EpochEntries
from kit.data.collate import BatchLoader

MAX_BATCHES = 64  # loaded together at most (the epoch's end comes first when nearer)
MAX_BYTES = 2 << 20  # ... and until their tensors hold this much: stays in the CPU's caches
PREPARE_MASKS = True  # their fields' masks built then too (a step asks for one; built cold, it costs more)


def batch_bytes(batch: Batch) -> int:
    """The bytes of a batch's tensors and lengths."""
    total = 0
    for f in batch.fields.values():
        total += f.tensor.nbytes + (f.lengths.nbytes if f.lengths is not None else 0)
    return total


class LoadAhead:
    """Batches of one epoch's plan loaded before their turn, by position."""

    def __init__(self) -> None:
        self._ready: dict[int, Batch] = {}
        self._of: Sequence[tuple[int, int]] | None = None  # the plan the ready batches belong to

    def clear(self) -> None:
        """Forget the batches loaded ahead (a new epoch, a new plan, a new dataset state)."""
        self._ready, self._of = {}, None

    def load(
        self, loader: BatchLoader, entries: EpochEntries, ranges: Sequence[tuple[int, int]], b: int
    ) -> Batch:
        """Batch ``b`` of the plan ``ranges``: loaded ahead before, else now with the next ones."""
        if self._of is ranges:
            ready = self._ready.pop(b, None)
            if ready is not None:
                return ready
        block = self._block(loader, entries, ranges, b)  # packed: the next batches in one go, views of a block
        if block is not None:
            self._ready, self._of = dict(enumerate(block[1:], b + 1)), ranges
            return block[0]
        planned = entries.batch(*ranges[b])
        batch = loader.load_planned(planned)
        if b + 1 < len(ranges) and loader.is_packed():
            self._fill(loader, entries, ranges, b + 1, batch_bytes(batch))
        return batch

    @staticmethod
    def _block(
        loader: BatchLoader, entries: EpochEntries, ranges: Sequence[tuple[int, int]], b: int
    ) -> list[Batch] | None:
        try:
            return loader.load_block(entries, ranges, b, MAX_BATCHES, MAX_BYTES)
        except Exception:  # noqa: BLE001 - batch by batch instead: a bad batch raises on its turn, as without this
            return None

    def _fill(
        self, loader: BatchLoader, entries: EpochEntries, ranges: Sequence[tuple[int, int]], start: int, used: int
    ) -> None:
        ready: dict[int, Batch] = {}
        for i in range(start, min(len(ranges), start + MAX_BATCHES - 1)):
            if used >= MAX_BYTES:
                break
            try:
                batch = loader.load_planned(entries.batch(*ranges[i]))
            except Exception:  # noqa: BLE001 - loaded again on its turn, raising there as it would without this
                break
            if PREPARE_MASKS:
                for f in batch.fields.values():
                    f.prepare_mask()
            ready[i] = batch
            used += batch_bytes(batch)
        self._ready, self._of = ready, ranges
