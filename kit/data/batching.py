"""The epoch's batch plan: length filter → chunking → greedy batching, from lengths alone.

The plan is computed in the main process from the order and the cheap per-sequence
lengths, before any data is loaded. Workers only load and collate plan entries, so
with any number of workers every sequence is seen exactly once per epoch, and the
batches are the same, in the same order, as without workers.

An entry is ``(seq_idx, spans)``: ``spans`` is None for the whole sequence, else a
tuple of ``(key, start, end)`` for the chunked keys (other keys come whole, as in
RETURNN).
"""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np

from kit.errors import ConfigError, DataError

Span = tuple[str, int, int]
Entry = tuple[int, "tuple[Span, ...] | None"]


def per_key(value: int | Mapping[str, int] | None, keys: Sequence[str], name: str) -> dict[str, int]:
    """An int for all keys or a dict per key → dict for the listed keys (missing keys: no limit)."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(keys))
        if unknown:
            raise ConfigError(f"{name}: data keys {unknown} have no time axis here (time keys: {list(keys)})")
        return {k: int(v) for k, v in value.items()}
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"{name}: got {value!r}, expected an int or a dict data key -> int")
    return {k: int(value) for k in keys}


def length_filter(
    order: Sequence[int] | np.ndarray,
    lengths: Mapping[str, np.ndarray],
    min_seq_length: Any = None,
    max_seq_length: Any = None,
) -> np.ndarray:
    """The int64 order without the sequences outside ``[min, max]`` for some limited key (RETURNN's LenFilter)."""
    keys = list(lengths)
    lo, hi = per_key(min_seq_length, keys, "min_seq_length"), per_key(max_seq_length, keys, "max_seq_length")
    idx = np.asarray(order, dtype=np.int64)
    if not lo and not hi:
        return idx
    keep = np.ones(len(idx), dtype=bool)
    for k, v in lo.items():
        keep &= lengths[k][idx] >= v
    for k, v in hi.items():
        keep &= lengths[k][idx] <= v
    return idx[keep]


def parse_chunking(chunking: Any, time_keys: Sequence[str]) -> tuple[dict[str, int], dict[str, int]]:
    """``chunking`` → (size per key, step per key); empty dicts for no chunking."""
    if chunking in (None, 0, False):
        return {}, {}
    if isinstance(chunking, str):
        m = re.fullmatch(r"(\d+)(?::(\d+))?", chunking.strip())
        if not m:
            raise ConfigError(f"chunking: got {chunking!r}, expected 'size' or 'size:step'")
        chunking = (int(m[1]), int(m[2]) if m[2] else None)
    if isinstance(chunking, (tuple, list)):
        if len(chunking) != 2:
            raise ConfigError(f"chunking: got {chunking!r}, expected (size, step)")
        size, step = chunking
    else:
        size, step = chunking, None
    sizes = per_key(size, time_keys, "chunking size")
    steps = sizes if step in (None, 0) else per_key(step, time_keys, "chunking step")
    if sorted(sizes) != sorted(steps):
        raise ConfigError(f"chunking: size keys {sorted(sizes)} and step keys {sorted(steps)} differ")
    bad = [k for k in sizes if sizes[k] < 1 or steps[k] < 1]
    if bad:
        raise ConfigError(f"chunking: size and step must be >= 1 (keys {bad})")
    return sizes, steps


def chunk_entries(
    order: Sequence[int],
    lengths: Mapping[str, np.ndarray],
    sizes: Mapping[str, int],
    steps: Mapping[str, int],
    min_chunk_size: Any = None,
    tag_of: Any = None,
) -> list[Entry]:
    """Entries for ``order``: whole sequences, or RETURNN's chunks (see :func:`chunk_arrays`)."""
    seq_idx, spans = chunk_arrays(np.asarray(order, dtype=np.int64), lengths, sizes, steps, min_chunk_size, tag_of)
    return entries_of(seq_idx, spans)


def chunk_arrays(
    order: np.ndarray,
    lengths: Mapping[str, np.ndarray],
    sizes: Mapping[str, int],
    steps: Mapping[str, int],
    min_chunk_size: Any = None,
    tag_of: Any = None,
) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The entries of ``order`` as arrays: (sequence index per entry, chunked key → (start, end) per entry).

    For each chunked key the chunks start at ``0, step, 2 step, ...`` below the length
    and are ``size`` long (the last ones shorter); chunks shorter than
    ``min_chunk_size`` are dropped. All chunked keys must give the same number of chunks.
    Without chunking the entries are the order itself and the spans are empty.
    """
    order = order.astype(np.int64, copy=False)
    if not sizes:
        return order, {}
    mins = per_key(min_chunk_size, list(sizes), "min_chunk_size") if min_chunk_size else {}
    counts = {k: _chunk_counts(lengths[k][order], sizes[k], steps[k], mins.get(k, 0)) for k in sizes}
    first = next(iter(counts.values()))
    bad = np.flatnonzero(np.any([c != first for c in counts.values()], axis=0))
    if len(bad):
        i = int(order[bad[0]])
        tag = tag_of(i) if tag_of else f"seq-{i}"
        raise DataError(
            f"chunking of sequence {tag!r}: the keys give different numbers of chunks "
            f"{ {k: int(c[bad[0]]) for k, c in counts.items()} }; adjust the per-key sizes/steps"
        )
    seq_idx = np.repeat(order, first)
    firsts = np.cumsum(first) - first  # each sequence's first entry
    chunk = np.arange(len(seq_idx), dtype=np.int64) - np.repeat(firsts, first)  # chunk number in its sequence
    spans = {}
    for k in sizes:
        start = chunk * steps[k]
        spans[k] = (start, np.minimum(start + sizes[k], lengths[k][seq_idx]))
    return seq_idx, spans


def _chunk_counts(n: np.ndarray, size: int, step: int, min_size: int) -> np.ndarray:
    """Chunks per sequence of length ``n``: the starts ``s < n`` (multiples of ``step``) whose chunk
    ``min(s + size, n) - s`` is at least ``min_size`` long, i.e. ``s <= n - max(min_size, 1)``."""
    if size < min_size:
        return np.zeros(len(n), dtype=np.int64)
    last = n.astype(np.int64) - max(min_size, 1)
    return np.where(last >= 0, last // step + 1, 0)


def entries_of(seq_idx: np.ndarray, spans: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> list[Entry]:
    """The arrays of :func:`chunk_arrays` as ``(seq_idx, spans)`` tuples."""
    ints = seq_idx.tolist()
    if not spans:
        return list(zip(ints, itertools.repeat(None)))
    per_key = [
        [(k, s, e) for s, e in zip(start.tolist(), end.tolist())] for k, (start, end) in spans.items()
    ]
    return list(zip(ints, zip(*per_key)))


def has_spans(entries: Sequence[Entry]) -> bool:
    """Whether any entry is a chunk (C-level scan: this runs per batch)."""
    return list(map(itemgetter(1), entries)).count(None) != len(entries)


def span_lengths(
    seq_idx: np.ndarray, spans: Mapping[str, tuple[np.ndarray, np.ndarray]], lengths: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Per-key time length of each entry of :func:`chunk_arrays` (chunk lengths for chunked keys)."""
    out = {k: v[seq_idx] for k, v in lengths.items()}
    for k, (start, end) in spans.items():
        out[k] = end - start
    return out


class PlannedBatch(NamedTuple):
    """What loading one planned batch needs (a worker gets only this): its sequences and chunk spans."""

    idx: np.ndarray  # int64 [B]: the entries' sequence indices
    spans: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]  # chunked key -> (rows, start, end)

    @classmethod
    def from_entries(cls, entries: Sequence[Entry]) -> PlannedBatch:
        idx = np.fromiter(map(itemgetter(0), entries), dtype=np.int64, count=len(entries))
        if not has_spans(entries):
            return cls(idx, {})
        per_key: dict[str, tuple[list[int], list[int], list[int]]] = {}
        for row, (_, spans) in enumerate(entries):
            for key, start, end in spans or ():
                rows, starts, ends = per_key.setdefault(key, ([], [], []))
                rows.append(row)
                starts.append(start)
                ends.append(end)
        as_arrays = {k: tuple(np.array(x, dtype=np.int64) for x in v) for k, v in per_key.items()}
        return cls(idx, as_arrays)  # type: ignore[arg-type]  # tuples of three arrays


@dataclass(frozen=True)
class EpochEntries:
    """One epoch's entries as arrays; the batches are ``[start, end)`` ranges over them."""

    seq_idx: np.ndarray  # int64 [E]: the sequence of each entry
    spans: dict[str, tuple[np.ndarray, np.ndarray]]  # chunked key -> (start, end) [E]; empty: whole sequences

    def __len__(self) -> int:
        return len(self.seq_idx)

    def batch(self, start: int, end: int) -> PlannedBatch:
        """The entries ``[start, end)`` as one batch to load."""
        if not self.spans:
            return PlannedBatch(self.seq_idx[start:end], {})
        rows = np.arange(end - start, dtype=np.int64)
        cut = {k: (rows, s[start:end], e[start:end]) for k, (s, e) in self.spans.items()}
        return PlannedBatch(self.seq_idx[start:end], cut)

    def entries(self, ranges: Sequence[tuple[int, int]]) -> list[list[Entry]]:
        """The batches ``ranges`` as lists of ``(seq_idx, spans)`` entries."""
        flat = entries_of(self.seq_idx, self.spans)
        return [flat[a:b] for a, b in ranges]


def shuffle_in_blocks(ranges: list[tuple[int, int]], buffer_size: int, seed: int) -> list[tuple[int, int]]:
    """RETURNN's ``online_shuffle_batches``: the batches shuffled within consecutive blocks of
    ``buffer_size`` (its shuffle buffer fills with the next ``buffer_size`` batches, then empties).

    kit's seed is ``seed`` (the pipeline's random seed and the epoch), so a resumed epoch plans the
    same order; RETURNN draws its seed from torch's RNG when a DataLoader iterator starts.
    """
    rng = np.random.RandomState(seed % 2**32)
    out = list(ranges)
    for start in range(0, len(out), buffer_size):
        block = out[start : start + buffer_size]
        rng.shuffle(block)
        out[start : start + buffer_size] = block
    return out


def complete_fracs(order: np.ndarray, seq_idx: np.ndarray, ranges: Sequence[tuple[int, int]]) -> list[float]:
    """RETURNN's ``complete_frac`` of each batch: (position of its last sequence in the epoch's order + 1)
    / sequences in the order, as float32 (RETURNN passes it through a float32 array); 1.0 for the last
    batch, also when length filtering removed the order's final sequences (the loop's end marker)."""
    if not ranges:
        return []
    where = np.empty(int(order.max()) + 1, dtype=np.int64)
    where[order] = np.arange(len(order))
    ends = np.fromiter(map(itemgetter(1), ranges), dtype=np.int64, count=len(ranges))
    fracs = ((where[seq_idx[ends - 1]] + 1) / len(order)).astype(np.float32).tolist()
    fracs[-1] = 1.0
    return fracs


def plan_batches(
    lens: Mapping[str, np.ndarray],
    num_entries: int,
    batch_size: int | Mapping[str, int] | None,
    max_seqs: int | None = None,
    packed_batch_size: int | Mapping[str, int] | None = None,
    packed_batch_cost: Mapping[str, Any] | None = None,
) -> list[tuple[int, int]]:
    """Greedy, order-keeping batches as ``[start, end)`` ranges over the entries.

    ``packed_batch_size`` (RETURNN's): also ``sum of lengths including it <= packed_batch_size`` per key
    (no padding counted). ``packed_batch_cost`` (RETURNN's): name -> ``f(lengths)``, a cost per entry
    (``lengths``: the entry's length per key, a dict) whose sum over the batch stays within
    ``packed_batch_size[name]``; names are not data keys.

    An entry joins the current batch while, for every key with a limit,
    ``max length including it × (n + 1) <= batch_size`` (padding counts) and the batch
    has fewer than ``max_seqs`` entries. An entry over the budget on its own forms a
    batch of one: nothing is dropped.
    """
    limits = per_key(batch_size, list(lens), "batch_size")
    max_seqs = sys.maxsize if max_seqs in (None, -1) else int(max_seqs)
    # keys sharing a limit fold into one column (max over them): exact, and one column for an int batch_size
    by_limit: dict[int, list[str]] = {}
    for k, v in limits.items():
        by_limit.setdefault(v, []).append(k)
    cols = [(np.max(np.stack([lens[k] for k in ks]), axis=0).astype(np.int64), lim) for lim, ks in by_limit.items()]
    if num_entries == 0:
        return []
    if packed_batch_size is not None or packed_batch_cost:
        sums = _packed_columns(lens, num_entries, packed_batch_size, packed_batch_cost)
        return _greedy_loop_packed([(col.tolist(), lim) for col, lim in cols], sums, num_entries, max_seqs)
    if all(int(col.max()) * min(max_seqs, num_entries) <= lim for col, lim in cols):
        return _fixed_size(num_entries, max_seqs)  # no frame budget binds
    if len(cols) == 1:  # a plain loop: a few tens of ns per entry, cheaper than numpy calls per batch
        return _greedy_loop_one(cols[0][0].tolist(), cols[0][1], num_entries, max_seqs)
    return _greedy_loop([(col.tolist(), lim) for col, lim in cols], num_entries, max_seqs)


def _packed_columns(
    lens: Mapping[str, np.ndarray], num_entries: int, packed_batch_size: Any, packed_batch_cost: Mapping[str, Any] | None
) -> list[tuple[list[Any], Any]]:
    """(per-entry value, budget) columns of the summed-length limits, then of the ``packed_batch_cost`` costs."""
    costs = dict(packed_batch_cost or {})
    bad = [k for k, f in costs.items() if not callable(f)]
    if bad:
        raise ConfigError(f"packed_batch_cost: {bad} must map to functions f(lengths) -> cost")
    size: Any = packed_batch_size
    if costs:
        missing = [k for k in costs if not isinstance(size, Mapping) or k not in size]
        if missing:
            raise ConfigError(f"packed_batch_cost {missing} needs an explicit packed_batch_size entry of that name "
                              f"(a dict), got packed_batch_size={packed_batch_size!r}")
    if isinstance(size, Mapping):  # RETURNN's: entries that name no time key bound nothing (a cost of the other split)
        size = {k: v for k, v in size.items() if k in lens}
    sums: list[tuple[list[Any], Any]] = [
        (lens[k].astype(np.int64).tolist(), lim) for k, lim in per_key(size, list(lens), "packed_batch_size").items()
    ] if size is not None else []
    if costs:
        cols = {k: v.tolist() for k, v in lens.items()}
        per_entry = [{k: c[j] for k, c in cols.items()} for j in range(num_entries)]
        for name, fn in costs.items():
            sums.append(([fn(seq) for seq in per_entry], packed_batch_size[name]))  # type: ignore[index]
    return sums


def plan_batches_by_seq(
    lens: Mapping[str, np.ndarray],
    seq_idx: np.ndarray,
    order: np.ndarray,
    epoch: int,
    batch_size: Any,
    max_seqs: Any,
) -> list[tuple[int, int]]:
    """:func:`plan_batches`' greedy rule with limits that a function gives per sequence (RETURNN's callable
    ``batch_size`` / ``max_seqs``), called as RETURNN calls them: ``f(epoch=, epoch_continuous=, seq_idx=)``,
    ``seq_idx`` the sequence's position in the epoch's order, ``epoch_continuous`` ``epoch - 1`` plus the
    float32 fraction of the order done with it."""
    keys = list(lens)
    cols = {k: lens[k].tolist() for k in keys}
    where = np.empty(int(order.max()) + 1 if len(order) else 0, dtype=np.int64)
    where[order] = np.arange(len(order))
    positions = where[seq_idx].tolist()

    def limit(value: Any, pos: int) -> Any:
        if not callable(value):
            return value
        frac = float(np.float32((pos + 1) / len(order)))
        return value(epoch=epoch, epoch_continuous=epoch - 1 + frac, seq_idx=pos)

    ranges, start, maxima = [], 0, dict.fromkeys(keys, 0)
    for j, pos in enumerate(positions):
        sizes = per_key(limit(batch_size, pos), keys, "batch_size")
        seqs = limit(max_seqs, pos)
        seqs = sys.maxsize if seqs in (None, -1) else int(seqs)
        if seqs < 1 or any(v < 1 for v in sizes.values()):
            raise ConfigError(f"batch_size / max_seqs: the function gave {sizes or seqs!r} for seq_idx {pos}; "
                              "expected positive limits")
        n = j - start
        if n and (n >= seqs or any(max(maxima[k], cols[k][j]) * (n + 1) > lim for k, lim in sizes.items())):
            ranges.append((start, j))
            start, maxima = j, dict.fromkeys(keys, 0)
        for k in keys:
            maxima[k] = max(maxima[k], cols[k][j])
    if len(positions) > start:
        ranges.append((start, len(positions)))
    return ranges


def _fixed_size(num_entries: int, max_seqs: int) -> list[tuple[int, int]]:
    """Batches of ``max_seqs`` entries: the greedy plan when no frame budget binds, without its loop."""
    starts = range(0, num_entries, max_seqs)
    return list(zip(starts, [*starts[1:], num_entries]))


def _greedy_loop_one(col: list[int], limit: int, num_entries: int, max_seqs: int) -> list[tuple[int, int]]:
    """The greedy rule for one column (an int ``batch_size``), entry by entry."""
    ranges, start, longest = [], 0, 0
    for j in range(num_entries):
        length = col[j]
        n = j - start
        if n and (n >= max_seqs or max(longest, length) * (n + 1) > limit):
            ranges.append((start, j))
            start, longest = j, 0
        if length > longest:
            longest = length
    if num_entries > start:
        ranges.append((start, num_entries))
    return ranges


def _greedy_loop(cols: list[tuple[list[int], int]], num_entries: int, max_seqs: int) -> list[tuple[int, int]]:
    ranges, start, maxima = [], 0, [0] * len(cols)
    for j in range(num_entries):
        n = j - start
        if n:
            fits = n < max_seqs and all(max(m, col[j]) * (n + 1) <= lim for m, (col, lim) in zip(maxima, cols))
            if not fits:
                ranges.append((start, j))
                start, maxima = j, [0] * len(cols)
        maxima = [max(m, col[j]) for m, (col, _) in zip(maxima, cols)]
    if num_entries > start:
        ranges.append((start, num_entries))
    return ranges


def _greedy_loop_packed(cols: list[tuple[list[int], int]], sums: list[tuple[list[int], int]], num_entries: int,
                        max_seqs: int) -> list[tuple[int, int]]:
    """The greedy rule with RETURNN's ``packed_batch_size`` too: the batch's summed lengths stay in budget."""
    ranges, start, maxima, totals = [], 0, [0] * len(cols), [0] * len(sums)
    for j in range(num_entries):
        n = j - start
        if n:
            fits = (n < max_seqs and all(max(m, col[j]) * (n + 1) <= lim for m, (col, lim) in zip(maxima, cols))
                    and all(t + col[j] <= lim for t, (col, lim) in zip(totals, sums)))
            if not fits:
                ranges.append((start, j))
                start, maxima, totals = j, [0] * len(cols), [0] * len(sums)
        maxima = [max(m, col[j]) for m, (col, _) in zip(maxima, cols)]
        totals = [t + col[j] for t, (col, _) in zip(totals, sums)]
    if num_entries > start:
        ranges.append((start, num_entries))
    return ranges
