"""Loading the next batches on a background thread while the step runs (``data_prefetch``).

A :class:`Prefetch` thread loads the batches of one epoch's plan in order, from a given
position, at most ``depth`` ahead of the one the training thread takes, through the very
code that loads them without it (the pipeline's loader, and its blocks of packed batches), so
each batch is exactly the batch loaded on its turn. The pipeline's ``position`` counts the
batches taken, never those loaded ahead: a state saved mid-epoch resumes at the next batch
the step would have seen, and a batch loaded ahead and not taken is dropped.

Reading HDF files, gathering and padding mostly run in numpy and h5py code that releases
the GIL, and the model's step mostly in torch code that releases it too, so a thread overlaps
them without the pickling and memory of worker processes (``torch_dataloader_opts``).

Which datasets load on the thread (:func:`loads_off_thread`): those that read files (HDF,
``DistributeFilesDataset``, or a Meta/Concat dataset over them) — in-memory data is gathered faster than
the hand-over costs — and only kit's own classes. A
dataset of the user's (a ``get_seq`` of their own, a torch dataset, a generator) may draw
from Python's, numpy's or torch's global RNG, and those streams are shared by all threads:
its draws would interleave with the training thread's (dropout, say) in an order that
depends on timing. Such datasets are loaded on the training thread, as with
``data_prefetch=0``; worker processes (``num_workers``) have RNGs of their own.

A batch that fails to load on the thread is not handed over: the thread stops, and the
training thread loads that batch itself on its turn and raises there, as without prefetch.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from kit.data.batch import Batch

JOIN_TIMEOUT = 30.0  # seconds close() waits for a load in progress (one batch) to finish

# kit's dataset classes whose loading draws from no global RNG and runs no user code
_OWN = frozenset(
    {
        "kit.data.hdf.HDFDataset",
        "kit.data.dataset.ArrayDataset",
        "kit.data.meta.StaticDataset",
        "kit.data.meta.ConcatDataset",
        "kit.data.meta.MetaDataset",
        "kit.data.distrib_files.DistributeFilesDataset",
        "kit.data.toy.Task12AXDataset",
    }
)


# of those, the ones that read files: the thread pays off only where loading waits for I/O (h5py releases the
# GIL); in-memory data is gathered faster than a hand-over to the training thread costs (end_to_end.py's MLP
# on an ArrayDataset: 1.14x the pre-collated loop on the training thread, 1.32x through the thread)
_READS_FILES = frozenset({"kit.data.hdf.HDFDataset", "kit.data.distrib_files.DistributeFilesDataset"})


def _name(dataset: Any) -> str:
    return f"{type(dataset).__module__}.{type(dataset).__qualname__}"


def _children(dataset: Any) -> list[Any]:
    children = getattr(dataset, "datasets", None)
    if isinstance(children, dict):
        children = list(children.values())
    sub = getattr(dataset, "sub_dataset", None)
    return [*(children or []), *([sub] if sub is not None else [])]


def _safe(dataset: Any) -> bool:
    """A class of kit's own (not a subclass: it may override ``get_seq``), and so are those it reads from."""
    return _name(dataset) in _OWN and all(_safe(c) for c in _children(dataset))


def _reads_files(dataset: Any) -> bool:
    return _name(dataset) in _READS_FILES or any(_reads_files(c) for c in _children(dataset))


def loads_off_thread(dataset: Any) -> bool:
    """Whether ``dataset``'s batches load on a background thread: it is kit's own all the way down (no user
    code, no global RNG draws) and reads files (in-memory data loads faster on the training thread)."""
    return _safe(dataset) and _reads_files(dataset)


_RUNNING: weakref.WeakSet[Prefetch] = weakref.WeakSet()  # closed at interpreter exit: a daemon thread inside
# h5py or numpy while the interpreter finalises crashes the process


@atexit.register
def _close_all() -> None:
    for prefetch in list(_RUNNING):
        prefetch.close()


def _ready(batch: Batch, pin: bool) -> Batch:
    """What the step would do first with a batch, done on the thread: pinned, masks built."""
    if pin:  # the mask is built on the device then
        return batch.pin_memory()
    for f in batch.fields.values():
        f.prepare_mask()
    return batch


class Prefetch:
    """A thread loading batches ``start, start+1, ... end-1`` through ``load``, at most ``depth`` ahead.

    ``take(b)`` returns batch ``b`` (the next one in order), or None when the thread could not
    load it (the caller loads it itself and sees the error). ``close()`` stops and joins the thread.
    """

    def __init__(self, load: Callable[[int], Batch], start: int, end: int, depth: int, *, pin: bool = False):
        self.next = start
        self._queue: queue.Queue[tuple[int, Batch | None]] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(load, start, end, pin), name="kit-data-prefetch", daemon=True
        )
        _RUNNING.add(self)
        self._thread.start()

    def _run(self, load: Callable[[int], Batch], start: int, end: int, pin: bool) -> None:
        for b in range(start, end):
            if self._stop.is_set():
                return
            try:
                batch: Batch | None = _ready(load(b), pin)
            except BaseException:  # noqa: BLE001 - the training thread loads it again and raises there
                batch = None
            if not self._put((b, batch)) or batch is None:
                return

    def _put(self, item: tuple[int, Batch | None]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def take(self, b: int) -> Batch | None:
        """Batch ``b`` once loaded; None: load it on this thread (the thread failed or stopped)."""
        if b != self.next:
            return None
        while True:
            try:
                got, batch = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    return None
        if got != b or batch is None:
            self.close()
            return None
        self.next = b + 1
        return batch

    def close(self) -> None:
        """Stop the thread (a load in progress finishes first) and drop what it loaded ahead."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(JOIN_TIMEOUT)
        _RUNNING.discard(self)
