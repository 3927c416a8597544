"""``CharTextDataset``: next-character prediction on the Python standard library's own sources.

Real text that ships with every Python, so examples and tests need no download.
"""

from __future__ import annotations

import os
import sysconfig
from typing import Any

import numpy as np

from kit.data.dataset import Dataset, SeqDict
from kit.data.packed import PackedKey
from kit.errors import ConfigError, DataError
from kit.fileio import read_capped

# id 0 = unknown char; then "\t", "\n" and printable ASCII: a fixed vocabulary, the same for every split
MAX_SOURCE_BYTES = 64 << 20  # one source file of the corpus (the standard library's largest is ~1 MB)
VOCAB = ["<unk>", "\t", "\n"] + [chr(c) for c in range(32, 127)]
_CHAR_TO_ID = {c: i for i, c in enumerate(VOCAB)}
_LUT = np.zeros(128, dtype=np.int64)
for _c, _i in _CHAR_TO_ID.items():
    if len(_c) == 1:
        _LUT[ord(_c)] = _i


def encode_text(text: str) -> np.ndarray:
    """Char ids (int64); chars outside the vocabulary map to 0 (``<unk>``)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.zeros(len(codes), dtype=np.int64)
    ascii_ = codes < 128
    ids[ascii_] = _LUT[codes[ascii_]]
    return ids


def decode_ids(ids: Any) -> str:
    return "".join(VOCAB[int(i)] if int(i) else "\ufffd" for i in ids)


def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted ``.py`` files directly in the standard library folder (no sub-packages, no tests)."""
    root = root or sysconfig.get_paths()["stdlib"]
    try:
        names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    except OSError as exc:
        raise DataError(f"CharTextDataset: cannot list the stdlib folder {root!r}: {exc.strerror}") from None
    return [os.path.join(root, n) for n in names]


class CharTextDataset(Dataset):
    """Character-level sequences from the stdlib's ``.py`` files.

    ``data`` = char ids of the text, ``classes`` = the next char (both sparse int64,
    ``sparse_dim = len(VOCAB)``). The split is by file: every ``dev_every``-th file of
    the sorted list is dev, the rest train. ``mode="lines"`` makes one sequence per line
    (with its newline; lines of fewer than ``min_len + 1`` chars are skipped);
    ``mode="pieces"`` cuts each file into pieces of ``piece_len`` frames. Tags are
    ``"<file>:<line>"`` or ``"<file>@<char offset>"``.
    """

    vocab = VOCAB

    def __init__(
        self,
        split: str = "train",
        *,
        mode: str = "lines",
        piece_len: int = 200,
        min_len: int = 1,
        max_files: int | None = 40,
        dev_every: int = 10,
        root: str | None = None,
        **opts: Any,
    ):
        opts.setdefault("name", f"stdlib-{split}")
        super().__init__(**opts)
        if split not in ("train", "dev", "all"):
            raise ConfigError(f"CharTextDataset: split must be 'train', 'dev' or 'all', got {split!r}")
        if mode not in ("lines", "pieces"):
            raise ConfigError(f"CharTextDataset: mode must be 'lines' or 'pieces', got {mode!r}")
        self.extern_data = {
            "data": {"shape": (None,), "sparse_dim": len(VOCAB)},
            "classes": {"shape": (None,), "sparse_dim": len(VOCAB)},
        }
        files = stdlib_files(root)
        if max_files is not None:
            files = files[:max_files]
        keep = {
            "train": lambda i: i % dev_every != 0,
            "dev": lambda i: i % dev_every == 0,
            "all": lambda i: True,
        }
        files = [f for i, f in enumerate(files) if keep[split](i)]
        self._ids, self._starts, self._lens, self._tags = self._load(files, mode, piece_len, min_len)

    @staticmethod
    def _load(files: list[str], mode: str, piece_len: int, min_len: int) -> tuple:
        chunks, starts, lens, tags, offset = [], [], [], [], 0
        for path in files:
            text = read_capped(path, MAX_SOURCE_BYTES, "CharTextDataset", DataError,
                               "a source file of the corpus is read whole into memory").decode("utf-8", "replace")
            ids = encode_text(text)
            name = os.path.basename(path)
            if mode == "lines":
                pos = 0
                for line_no, line in enumerate(text.splitlines(keepends=True), start=1):
                    if len(line) - 1 >= min_len:  # n chars give n - 1 (input, next char) frames
                        starts.append(offset + pos)
                        lens.append(len(line) - 1)
                        tags.append(f"{name}:{line_no}")
                    pos += len(line)
            else:
                for pos in range(0, max(len(ids) - 1, 0), piece_len):
                    n = min(piece_len, len(ids) - 1 - pos)
                    if n >= min_len:
                        starts.append(offset + pos)
                        lens.append(n)
                        tags.append(f"{name}@{pos}")
            chunks.append(ids)
            offset += len(ids)
        all_ids = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        return all_ids, np.array(starts, np.int64), np.array(lens, np.int64), tags

    @property
    def num_seqs(self) -> int:
        return len(self._lens)

    def get_seq(self, idx: int) -> SeqDict:
        idx = self._check_index(idx)
        s, n = int(self._starts[idx]), int(self._lens[idx])
        return {"data": self._ids[s : s + n].copy(), "classes": self._ids[s + 1 : s + n + 1].copy()}

    def get_seq_tag(self, idx: int) -> str:
        return self._tags[self._check_index(idx)]

    def get_seq_length(self, idx: int) -> dict[str, int]:
        n = int(self._lens[self._check_index(idx)])
        return {"data": n, "classes": n}

    def seq_lengths(self) -> dict[str, np.ndarray]:
        return {"data": self._lens, "classes": self._lens}

    def packed(self) -> dict[str, PackedKey] | None:
        # every sequence is a window over one id array: the classes window is shifted by one
        return {
            "data": PackedKey(self._ids, self._starts, self._lens),
            "classes": PackedKey(self._ids[1:], self._starts, self._lens),
        }
