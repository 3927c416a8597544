"""Per-epoch sequence orders (RETURNN's ``seq_ordering``) and ``partition_epoch``.

| ordering | meaning |
|---|---|
| ``default`` | dataset order |
| ``reverse`` | dataset order reversed |
| ``sorted`` / ``sorted_reverse`` | by length, shortest / longest first (ties: dataset order) |
| ``random[:k]`` | shuffled; ``k`` is an extra seed |
| ``laplace:B[:k]`` / ``laplace:.S[:k]`` | shuffled, cut into ``B`` bins (or bins of about ``S`` seqs), each bin sorted by length, alternating ascending/descending: lengths zig-zag, so neighbours have similar lengths (little padding) while the order stays random |
| ``sort_bin_shuffle[_x2]:B[:k]`` / ``:.S`` | sorted by length, cut into bins, the bins shuffled (``_x2``: the seqs inside each bin too) |

As in RETURNN, ``B`` is the number of bins and ``.S`` the approximate bin size.
Laplace keeps padding low only when one bin holds many batches: on skewed lengths a bin
of about 15 batches or more gives >= 0.9 padding efficiency (``benchmarks/pipeline.py``:
``laplace:.100`` 0.93 at 6 seqs per batch, 0.85 at 12), so scale ``S`` with the batch.
Random orders are deterministic functions of ``(random_seed, k, full epoch)``: the
same in every process and after a restart, and different from one epoch to the next.

``partition_epoch=P`` computes the order of a full pass and hands out part
``(epoch - 1) % P`` of the full epoch ``(epoch - 1) // P + 1``; the P parts tile the
full order exactly and share its random seed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kit.errors import ConfigError

_PATTERN = re.compile(
    r"(?P<name>default|reverse|sorted|sorted_reverse|random|laplace|sort_bin_shuffle|sort_bin_shuffle_x2)"
    r"(?::(?P<bins>\.?\d+))?(?::(?P<k>\d+))?"
)
_NEEDS_BINS = ("laplace", "sort_bin_shuffle", "sort_bin_shuffle_x2")


@dataclass(frozen=True)
class Ordering:
    name: str
    bins: int | None = None  # number of bins
    bin_size: int | None = None  # or approximate seqs per bin (".S")
    k: int = 0  # extra seed

    def num_bins(self, num_seqs: int) -> int:
        if self.bin_size is not None:
            return max(num_seqs // self.bin_size, 1)
        return max(self.bins or 1, 1)


def parse(method: str) -> Ordering:
    """Parse a ``seq_ordering`` string; ConfigError with the accepted forms if it is wrong."""
    m = _PATTERN.fullmatch(method) if isinstance(method, str) else None
    ok = m is not None and (
        (m["name"] in _NEEDS_BINS) == (m["bins"] is not None)
        or (m["name"] == "random" and m["k"] is None and not m["bins"].startswith("."))
    )
    if not ok:
        raise ConfigError(
            f"seq_ordering: got {method!r}, expected one of default, reverse, sorted, sorted_reverse, "
            "random[:k], laplace:B[:k], laplace:.S[:k], sort_bin_shuffle[_x2]:B[:k] (B bins, .S seqs per bin)"
        )
    if m["name"] == "random" and m["bins"] is not None:  # "random:k": the only number is the seed
        return Ordering("random", k=int(m["bins"]))
    bins = m["bins"]
    k = int(m["k"] or 0)
    if bins is None:
        return Ordering(m["name"], k=k)
    if bins.startswith("."):
        size = int(bins[1:])
        if size < 1:
            raise ConfigError(f"seq_ordering {method!r}: the bin size after '.' must be >= 1")
        return Ordering(m["name"], bin_size=size, k=k)
    if int(bins) < 1:
        raise ConfigError(f"seq_ordering {method!r}: the number of bins must be >= 1")
    return Ordering(m["name"], bins=int(bins), k=k)


def _rng(random_seed: int, k: int, full_epoch: int) -> np.random.Generator:
    return np.random.default_rng([int(random_seed), int(k), int(full_epoch)])


def _sort(idx: np.ndarray, lens: np.ndarray, reverse: bool = False) -> np.ndarray:
    keys = -lens[idx] if reverse else lens[idx]
    return idx[np.argsort(keys, kind="stable")]


def full_order(
    method: str | Ordering,
    num_seqs: int,
    full_epoch: int,
    seq_len: Callable[[], np.ndarray],
    random_seed: int,
) -> np.ndarray:
    """The order of one full pass over the data (before ``partition_epoch``)."""
    o = parse(method) if isinstance(method, str) else method
    idx = np.arange(num_seqs, dtype=np.int64)
    if o.name == "default":
        return idx
    if o.name == "reverse":
        return idx[::-1].copy()
    if o.name in ("sorted", "sorted_reverse"):
        return _sort(idx, np.asarray(seq_len()), reverse=o.name == "sorted_reverse")
    rng = _rng(random_seed, o.k, full_epoch)
    perm = rng.permutation(num_seqs)
    if o.name == "random":
        return perm
    lens = np.asarray(seq_len())
    bins = o.num_bins(num_seqs)
    if o.name == "laplace":
        bounds = [i * num_seqs // bins for i in range(bins + 1)]
        parts = [
            _sort(perm[a:b], lens, reverse=i % 2 == 1) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
        ]
        return np.concatenate(parts) if parts else idx
    # sort_bin_shuffle[_x2]: shuffled before the stable sort, so equal lengths come in random order
    parts = np.array_split(_sort(perm, lens), bins)
    parts = [parts[i] for i in rng.permutation(len(parts))]
    if o.name == "sort_bin_shuffle_x2":
        parts = [p[rng.permutation(len(p))] for p in parts]
    return np.concatenate(parts) if parts else idx


def partition_bounds(num_seqs: int, partition_epoch: int, part: int) -> tuple[int, int]:
    """``[start, end)`` of part ``part`` (0-based): sizes differ by at most one, the first parts larger."""
    base, extra = divmod(num_seqs, partition_epoch)
    start = part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)


def seq_order(
    method: str,
    *,
    num_seqs: int,
    epoch: int,
    seq_len: Callable[[], np.ndarray],
    random_seed: int = 0,
    partition_epoch: int = 1,
) -> list[int]:
    """Dataset indices for (sub-)epoch ``epoch`` (1-based).

    ``seq_len`` returns the per-sequence lengths used for sorting; it is only called by
    the orderings that need it.
    """
    if epoch < 1:
        raise ValueError(f"epochs count from 1, got epoch={epoch}")
    full_epoch, part = (epoch - 1) // partition_epoch + 1, (epoch - 1) % partition_epoch
    order = full_order(method, num_seqs, full_epoch, seq_len, random_seed)
    start, end = partition_bounds(num_seqs, partition_epoch, part)
    return order[start:end].tolist()
