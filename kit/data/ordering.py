"""Per-epoch sequence orders (RETURNN's ``seq_ordering``) and ``partition_epoch``, exactly RETURNN's.

| ordering | meaning |
|---|---|
| ``default`` | dataset order |
| ``reverse`` | dataset order reversed |
| ``sorted`` / ``sorted_reverse`` | by length, shortest / longest first (ties: dataset order) |
| ``random[:n]`` | shuffled; ``n``: the same shuffle for ``n`` consecutive (full) epochs |
| ``random_sample[:n]`` | ``num_seqs`` draws with replacement (sequences repeat or are left out) |
| ``laplace[:B\\|:.S][:n]`` | shuffled, cut into ``B`` bins (or ``num_seqs // S``, at least 2; bare: 2), each bin sorted by length, alternating ascending/descending: neighbours have similar lengths (little padding) while the order stays random |
| ``sort_bin_shuffle[_x2][:B\\|:.S][:n]`` | shuffled, sorted by length, cut into bins, the bins shuffled (``_x2``: the seqs inside each bin too) |
| ``default_every_n:k`` | ``k`` interleaved streams: ``0, m, 2m, .., 1, m+1, ..`` with ``m = num_seqs // k`` (the last ``num_seqs % k`` seqs are left out) |

The random orders use RETURNN's generator and seed, so kit and RETURNN give the same
order for the same dataset and epoch: ``numpy.random.RandomState(seed)`` with ``seed =
fixed_random_seed`` when the dataset sets it, else ``full_epoch`` (``(epoch - 1) //
partition_epoch + 1``; with ``:n`` it is ``(full_epoch - 1) // n + 1``) plus the dataset's
``random_seed_offset`` (default 0). The config's ``random_seed`` does not change the data
order (as in RETURNN). Laplace keeps padding low only when one bin holds many batches (on
skewed lengths, about 15 batches per bin or more give >= 0.9 padding efficiency), so scale
``S`` with the batch.

``partition_epoch=P`` computes the order of a full pass and hands out part
``(epoch - 1) % P`` of it; the P parts tile the full order exactly, the first
``len % P`` parts one sequence longer. A ``seq_ordering`` may also be a callable
``f(epoch=..., **_) -> str`` (RETURNN allows that too).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kit.errors import ConfigError

_PATTERN = re.compile(
    r"(?P<name>default|reverse|sorted|sorted_reverse|random|random_sample|laplace"
    r"|sort_bin_shuffle|sort_bin_shuffle_x2|default_every_n)"
    r"(?::(?P<bins>\.?\d+))?(?::(?P<n>\d+))?"
)
_BINNED = ("laplace", "sort_bin_shuffle", "sort_bin_shuffle_x2")
_FORMS = (
    "default, reverse, sorted, sorted_reverse, random[:n], random_sample[:n], laplace[:B|:.S][:n], "
    "sort_bin_shuffle[_x2][:B|:.S][:n], default_every_n:k (B bins, .S seqs per bin, n epochs per shuffle)"
)


@dataclass(frozen=True)
class Ordering:
    """A parsed ``seq_ordering``: its name, bins (``B`` or ``.S``) and ``n`` (epochs per shuffle)."""

    name: str
    bins: int | None = None  # number of bins, or the k of default_every_n
    bin_size: int | None = None  # or approximate seqs per bin (".S")
    n: int = 1  # keep the random seed for n consecutive full epochs

    def num_bins(self, num_seqs: int) -> int:
        """RETURNN's bin count: ``B``, or ``max(num_seqs // S, 2)``, or 2 when not given."""
        if self.bin_size is not None:
            return max(num_seqs // self.bin_size, 2)
        return self.bins if self.bins is not None else 2

    @property
    def is_random(self) -> bool:
        return self.name not in ("default", "reverse", "sorted", "sorted_reverse", "default_every_n")

    @property
    def needs_lengths(self) -> bool:
        return self.name in ("sorted", "sorted_reverse", *_BINNED)


def _bad(method: Any, why: str = "") -> ConfigError:
    return ConfigError(f"seq_ordering: got {method!r}{why}, expected one of {_FORMS}")


def parse(method: str) -> Ordering:
    """Parse a ``seq_ordering`` string; ConfigError with the accepted forms if it is wrong."""
    m = _PATTERN.fullmatch(method) if isinstance(method, str) else None
    if m is None:
        raise _bad(method)
    name, bins, n = m["name"], m["bins"], m["n"]
    if name in ("random", "random_sample"):  # RETURNN: "random:n", the only number is n
        if n is not None or (bins is not None and bins.startswith(".")):
            raise _bad(method)
        return Ordering(name, n=int(bins or 1))
    if name == "default_every_n":
        if bins is None or n is not None or bins.startswith(".") or int(bins) < 1:
            raise _bad(method, " (default_every_n needs :k with k >= 1)")
        return Ordering(name, bins=int(bins))
    if name not in _BINNED:
        if bins is not None:
            raise _bad(method)
        return Ordering(name)
    if bins is None:
        return Ordering(name)
    if bins.startswith("."):
        if int(bins[1:]) < 1:
            raise ConfigError(f"seq_ordering {method!r}: the bin size after '.' must be >= 1")
        return Ordering(name, bin_size=int(bins[1:]), n=int(n or 1))
    if int(bins) < 1:
        raise ConfigError(f"seq_ordering {method!r}: the number of bins must be >= 1")
    return Ordering(name, bins=int(bins), n=int(n or 1))


def check(method: Any) -> None:
    """Validate a ``seq_ordering`` option: a string of the forms above or a callable."""
    if not callable(method):
        parse(method)


def resolve(method: Any, epoch: int) -> Ordering:
    """The ordering of ``epoch``: a string parsed, a callable ``f(epoch=...)`` called first."""
    if isinstance(method, Ordering):
        return method
    if callable(method):
        value = method(epoch=epoch)
        if not isinstance(value, str):
            raise ConfigError(f"seq_ordering function {method!r} must return a str, got {value!r}")
        method = value
    return parse(method)


def random_seed_for_epoch(
    epoch: int,
    *,
    partition_epoch: int = 1,
    n: int = 1,
    fixed_random_seed: int | None = None,
    random_seed_offset: int = 0,
) -> int:
    """RETURNN's seed of ``epoch``'s RandomState: fixed, or the (full) epoch plus the offset."""
    if fixed_random_seed is not None:
        return int(fixed_random_seed)
    seed = max(int(epoch), 1)
    if partition_epoch > 1:  # one seed for all the parts of a full epoch
        seed = (seed - 1) // partition_epoch + 1
    if n > 1:
        seed = (seed - 1) // n + 1
    return seed + int(random_seed_offset)


def _sort(idx: np.ndarray, lens: np.ndarray, reverse: bool = False) -> np.ndarray:
    keys = -lens[idx] if reverse else lens[idx]
    return idx[np.argsort(keys, kind="stable")]


def _binned(o: Ordering, perm: np.ndarray, lens: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    """laplace and sort_bin_shuffle[_x2] on a shuffled ``perm`` (RETURNN's bin boundaries)."""
    n = len(perm)
    bins = o.num_bins(n)
    if o.name == "laplace":
        parts = [_sort(perm[i * n // bins : (i + 1) * n // bins], lens, reverse=i % 2 == 1) for i in range(bins)]
        return np.concatenate(parts) if parts else perm
    by_len = _sort(perm, lens)  # stable: equal lengths keep their shuffled order
    out = []
    for i in rng.permutation(bins):
        end = n if i == bins - 1 else (i + 1) * n // bins
        part = by_len[i * n // bins : end].copy()
        if o.name == "sort_bin_shuffle_x2":
            rng.shuffle(part)
        out.append(part)
    return np.concatenate(out) if out else by_len


def _every_n(num_seqs: int, k: int) -> np.ndarray:
    m = num_seqs // k
    idx = np.arange(m, dtype=np.int64).repeat(k)
    for i in range(1, k):
        idx[i::k] += i * m
    return idx


def full_order(
    method: Any,
    num_seqs: int,
    full_epoch: int,
    seq_len: Callable[[], np.ndarray],
    random_seed: int = 0,
    *,
    fixed_random_seed: int | None = None,
) -> np.ndarray:
    """The order of one full pass over the data (before ``partition_epoch``).

    ``random_seed`` is RETURNN's ``random_seed_offset``; ``fixed_random_seed`` replaces the
    per-epoch seed. ``seq_len`` is only called by the orderings that sort by length.
    """
    o = resolve(method, full_epoch)
    idx = np.arange(num_seqs, dtype=np.int64)
    if o.name == "default":
        return idx
    if o.name == "reverse":
        return idx[::-1].copy()
    if o.name == "default_every_n":
        return _every_n(num_seqs, o.bins or 1)
    if o.name in ("sorted", "sorted_reverse"):
        return _sort(idx, np.asarray(seq_len()), reverse=o.name == "sorted_reverse")
    seed = random_seed_for_epoch(
        full_epoch, n=o.n, fixed_random_seed=fixed_random_seed, random_seed_offset=random_seed
    )
    rng = np.random.RandomState(seed)
    if o.name == "random_sample":
        return rng.randint(0, num_seqs, size=num_seqs).astype(np.int64)
    perm = rng.permutation(num_seqs)
    if o.name == "random":
        return perm.astype(np.int64)
    return _binned(o, perm, np.asarray(seq_len()), rng)


def partition_bounds(num_seqs: int, num_parts: int, part: int) -> tuple[int, int]:
    """``[start, end)`` of part ``part`` (0-based): sizes differ by at most one, the first parts larger."""
    base, extra = divmod(num_seqs, num_parts)
    start = part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)


def seq_order(
    method: Any,
    *,
    num_seqs: int,
    epoch: int,
    seq_len: Callable[[], np.ndarray],
    random_seed: int = 0,
    partition_epoch: int = 1,
    fixed_random_seed: int | None = None,
    num_shards: int = 1,
    shard_index: int = 0,
) -> list[int]:
    """Dataset indices for (sub-)epoch ``epoch`` (1-based), as RETURNN's ``get_seq_order_for_epoch``.

    ``random_seed`` is the ``random_seed_offset``. ``num_shards`` / ``shard_index`` cut the
    order further, RETURNN's way: part ``((epoch - 1) % P) * num_shards + shard_index`` of
    ``P * num_shards`` parts.
    """
    return seq_order_array(
        method, num_seqs=num_seqs, epoch=epoch, seq_len=seq_len, random_seed=random_seed,
        partition_epoch=partition_epoch, fixed_random_seed=fixed_random_seed, num_shards=num_shards,
        shard_index=shard_index,
    ).tolist()


def seq_order_array(
    method: Any,
    *,
    num_seqs: int,
    epoch: int,
    seq_len: Callable[[], np.ndarray],
    random_seed: int = 0,
    partition_epoch: int = 1,
    fixed_random_seed: int | None = None,
    num_shards: int = 1,
    shard_index: int = 0,
) -> np.ndarray:
    """:func:`seq_order` as an int64 array (what the pipeline plans with)."""
    if epoch < 1:
        raise ValueError(f"epochs count from 1, got epoch={epoch}")
    if num_seqs <= 0:
        return np.zeros(0, dtype=np.int64)
    full_epoch = (epoch - 1) // partition_epoch + 1
    order = full_order(method, num_seqs, full_epoch, seq_len, random_seed, fixed_random_seed=fixed_random_seed)
    parts = partition_epoch * num_shards
    if parts == 1:
        return order.astype(np.int64, copy=False)
    start, end = partition_bounds(len(order), parts, ((epoch - 1) % partition_epoch) * num_shards + shard_index)
    return order[start:end].astype(np.int64, copy=False)
