"""``Task12AXDataset``: RETURNN's 12AX memory task, deterministic from a seed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kit.data import ordering
from kit.data.dataset import Dataset, SeqDict
from kit.data.window import check_window, sliding_window
from kit.errors import ConfigError


class Task12AXDataset(Dataset):
    """The 12AX task: 9 one-hot input symbols, 2 target classes per frame.

    Alphabet (RETURNN's, index = position): ``"123ABCXYZ"``. ``data`` is float32
    ``[T, 9]`` one-hot, ``classes`` int64 ``[T]``, ``T`` in 10..99.

    The rule (RETURNN's ``make_output_seq``): the digits ``1``/``2`` set the outer
    context, ``A``/``B`` the inner one; an ``X`` or ``Y`` has target 1 when
    outer + inner + it is ``1AX`` or ``2BY`` and clears the inner context; every other
    frame has target 0. ``3``, ``C`` and ``Z`` are distractors that change nothing.

    Without kit's ``seed``, the sequences are RETURNN's: sequence ``i`` is drawn from
    ``numpy.random.RandomState((s, i))`` with RETURNN's draws, where ``s`` is, as in RETURNN,
    ``fixed_random_seed`` when set (the same sequences and order seed every epoch), else the
    (full) epoch plus ``random_seed_offset``: new sequences every epoch. kit's ``seed=k``
    keeps one fixed set of sequences in every epoch, drawn from
    ``numpy.random.default_rng([k, i])`` (kit's own; the order still changes per epoch).
    The length is the first draw, so ``get_seq_length`` does not generate the sequence. Unlike RETURNN's generated datasets, ``sorted`` and
    ``laplace`` orders work (RETURNN falls back to the default order / refuses).

    Args:
        num_seqs: sequences per epoch.
        seed: kit's: fixed sequences from this seed (None: RETURNN's sequences and data seed).
        window: RETURNN's ``window`` (odd; the config key's value when the dict sets none): ``data``
            becomes a sliding window over time, ``[T, 9 * window]`` (:func:`kit.data.window.sliding_window`).
        **opts: the Dataset options (``seq_ordering``, ``fixed_random_seed``, ``partition_epoch``, ...).
    """

    symbols = "123ABCXYZ"
    num_classes = 2
    extern_data = {"data": {"shape": (None, 9)}, "classes": {"shape": (None,), "sparse_dim": 2}}

    def __init__(self, num_seqs: int = 1000, *, seed: int | None = None, window: int | None = None, **opts: Any):
        super().__init__(**opts)
        self.window = check_window(window, "Task12AXDataset")
        if self.window > 1:  # RETURNN reports the windowed dim (its get_data_dim): 9 * window
            self.extern_data = {**self.extern_data, "data": {"shape": (None, 9 * self.window)}}
        if not isinstance(num_seqs, int) or num_seqs < 0:
            raise ConfigError(f"Task12AXDataset: num_seqs must be an int >= 0, got {num_seqs!r}")
        if seed is not None and (not isinstance(seed, int) or seed < 0):
            raise ConfigError(f"Task12AXDataset: seed must be an int >= 0 or None, got {seed!r}")
        self._num_seqs, self.seed = num_seqs, seed
        self.data_seed = self._data_seed_for(1)

    def _data_seed_for(self, epoch: int) -> int:
        if self.seed is not None:
            return self.seed
        return ordering.random_seed_for_epoch(
            epoch,
            partition_epoch=self.partition_epoch,
            fixed_random_seed=self.fixed_random_seed,
            random_seed_offset=self.random_seed_offset or 0,
        )

    def init_epoch(self, epoch: int) -> bool:
        """Switch to the sequences of ``epoch`` (RETURNN: new ones per full epoch unless a seed is fixed)."""
        seed = self._data_seed_for(epoch)
        if seed == self.data_seed:
            return False
        self.data_seed, self._lengths_cache = seed, None
        return True

    @property
    def num_seqs(self) -> int:
        return self._num_seqs

    def _rng(self, idx: int) -> np.random.Generator | np.random.RandomState:
        idx = self._check_index(idx)
        if self.seed is not None:  # kit's fixed sequences (kept as they were: notebooks show their scores)
            return np.random.default_rng([int(self.seed), idx])
        return np.random.RandomState((int(self.data_seed), idx))

    @staticmethod
    def _length(rng: np.random.Generator | np.random.RandomState) -> int:
        if isinstance(rng, np.random.Generator):
            return int(rng.integers(10, 100))
        return int(rng.randint(10, 100))

    def get_seq_length(self, idx: int) -> dict[str, int]:
        n = self._length(self._rng(idx))
        return {"data": n, "classes": n}

    def get_seq(self, idx: int) -> SeqDict:
        rng = self._rng(idx)
        seq = self.encode(self._draw_symbols(rng, self._length(rng)))
        if self.window > 1:
            seq["data"] = sliding_window(seq["data"], self.window)
        return seq

    @staticmethod
    def _draw_symbols(rng: np.random.Generator | np.random.RandomState, n: int) -> str:
        # RETURNN's made-up distribution and draw order: frequent AX/BY pairs so that target 1 is not rare.
        text = str(rng.choice(["", "1", "2"]))
        while len(text) < n:
            if rng.uniform() < 0.5:
                text += str(rng.choice(["1", "2"]))
            if rng.uniform() < 0.9:
                text += str(rng.choice(["AX", "BY"]))
            while rng.uniform() < 0.5:
                symbols = Task12AXDataset.symbols
                if isinstance(rng, np.random.Generator):
                    text += symbols[int(rng.integers(0, 9))]
                else:
                    text += str(rng.choice(list(symbols)))
        return text[:n]

    @classmethod
    def targets(cls, text: str | Sequence[int]) -> np.ndarray:
        """Target classes (int64) for a symbol string like ``"1AXBY2BY"`` or a list of symbol ids."""
        chars = text if isinstance(text, str) else "".join(cls.symbols[i] for i in text)
        outer = inner = ""
        out = np.zeros(len(chars), dtype=np.int64)
        for t, c in enumerate(chars):
            if c not in cls.symbols:
                raise ValueError(f"12AX: unknown symbol {c!r}; the alphabet is {cls.symbols!r}")
            if c in "12":
                outer = c
            elif c in "AB":
                inner = c
            elif c in "XY":
                out[t] = int(outer + inner + c in ("1AX", "2BY"))
                inner = ""
        return out

    @classmethod
    def encode(cls, text: str) -> SeqDict:
        """The sequence dict (one-hot ``data``, ``classes``) for a hand-made symbol string."""
        ids = np.array([cls.symbols.index(c) for c in text], dtype=np.int64)
        data = np.zeros((len(text), len(cls.symbols)), dtype=np.float32)
        data[np.arange(len(text)), ids] = 1.0
        return {"data": data, "classes": cls.targets(text)}

    @classmethod
    def decode(cls, data: np.ndarray) -> str:
        """The symbol string of a one-hot ``data`` array."""
        return "".join(cls.symbols[i] for i in np.asarray(data).argmax(axis=-1))
