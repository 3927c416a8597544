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
from operator import itemgetter
from typing import Any

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
    order: Sequence[int],
    lengths: Mapping[str, np.ndarray],
    min_seq_length: Any = None,
    max_seq_length: Any = None,
) -> list[int]:
    """Keep the sequences whose every limited key lies in ``[min, max]`` (RETURNN's LenFilter)."""
    keys = list(lengths)
    lo, hi = per_key(min_seq_length, keys, "min_seq_length"), per_key(max_seq_length, keys, "max_seq_length")
    if not lo and not hi:
        return list(order)
    idx = np.asarray(order, dtype=np.int64)
    keep = np.ones(len(idx), dtype=bool)
    for k, v in lo.items():
        keep &= lengths[k][idx] >= v
    for k, v in hi.items():
        keep &= lengths[k][idx] <= v
    return idx[keep].tolist()


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
    """Entries for ``order``: whole sequences, or RETURNN's chunks.

    For each chunked key the chunks start at ``0, step, 2 step, ...`` below the length
    and are ``size`` long (the last ones shorter); chunks shorter than
    ``min_chunk_size`` are dropped. All chunked keys must give the same number of chunks.
    """
    if not sizes:
        ints = order.tolist() if isinstance(order, np.ndarray) else [int(i) for i in order]
        return list(zip(ints, itertools.repeat(None)))
    mins = per_key(min_chunk_size, list(sizes), "min_chunk_size") if min_chunk_size else {}
    out: list[Entry] = []
    for i in order:
        per_key_spans = []
        for k in sizes:
            n, size, step, lo = int(lengths[k][i]), sizes[k], steps[k], mins.get(k, 0)
            spans = [(k, s, min(s + size, n)) for s in range(0, n, step) if min(s + size, n) - s >= lo]
            per_key_spans.append(spans)
        counts = {len(s) for s in per_key_spans}
        if len(counts) > 1:
            tag = tag_of(i) if tag_of else f"seq-{i}"
            raise DataError(
                f"chunking of sequence {tag!r}: the keys give different numbers of chunks "
                f"{ {k: len(s) for k, s in zip(sizes, per_key_spans)} }; adjust the per-key sizes/steps"
            )
        out.extend((int(i), spans) for spans in zip(*per_key_spans))
    return out


def has_spans(entries: Sequence[Entry]) -> bool:
    """Whether any entry is a chunk (C-level scan: this runs per batch)."""
    return list(map(itemgetter(1), entries)).count(None) != len(entries)


def entry_lengths(entries: Sequence[Entry], lengths: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-key time length of each entry (chunk lengths for chunked keys)."""
    idx = np.fromiter(map(itemgetter(0), entries), dtype=np.int64, count=len(entries))
    out = {k: v[idx] for k, v in lengths.items()}  # fancy indexing: copies
    if not has_spans(entries):
        return out
    for j, (_, spans) in enumerate(entries):
        if spans is not None:
            for k, s, e in spans:
                out[k][j] = e - s
    return out


def plan_batches(
    lens: Mapping[str, np.ndarray],
    num_entries: int,
    batch_size: int | Mapping[str, int] | None,
    max_seqs: int | None = None,
) -> list[tuple[int, int]]:
    """Greedy, order-keeping batches as ``[start, end)`` ranges over the entries.

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
    cols = [(np.max(np.stack([lens[k] for k in ks]), axis=0).tolist(), lim) for lim, ks in by_limit.items()]
    if not cols:
        return _fixed_size(num_entries, max_seqs)
    if len(cols) == 1:
        return _plan_one_limit(cols[0][0], cols[0][1], num_entries, max_seqs)
    ranges, start, maxima = [], 0, [0] * len(cols)
    for j in range(num_entries):
        n = j - start
        if n:
            fits = n < max_seqs and all(
                max(m, col[j]) * (n + 1) <= lim for m, (col, lim) in zip(maxima, cols)
            )
            if not fits:
                ranges.append((start, j))
                start, maxima = j, [0] * len(cols)
        maxima = [max(m, col[j]) for m, (col, _) in zip(maxima, cols)]
    if num_entries > start:
        ranges.append((start, num_entries))
    return ranges


def _fixed_size(num_entries: int, max_seqs: int) -> list[tuple[int, int]]:
    """Batches of ``max_seqs`` entries: the greedy plan when no frame budget binds, without its loop."""
    return [(a, min(a + max_seqs, num_entries)) for a in range(0, num_entries, max_seqs)]


def _plan_one_limit(col: list[int], limit: int, num_entries: int, max_seqs: int) -> list[tuple[int, int]]:
    if num_entries and max(col) * min(max_seqs, num_entries) <= limit:
        return _fixed_size(num_entries, max_seqs)  # the frame budget never binds
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
