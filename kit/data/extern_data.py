"""``ExternData``: the parsed ``extern_data`` spec, and per-sequence validation against it.

Accepted per key (``None`` in ``shape`` marks the time axis, which must come first)::

    {"shape": (None, 40)}                              # float32 features
    {"shape": (None,), "sparse_dim": 10}               # int64 labels in [0, 10)
    {"shape": (3,), "dtype": "int32"}                  # no time axis: static shape
    {"dim": 40}            == {"shape": (None, 40)}    # RETURNN shorthand
    {"dim": 10, "sparse": True} == {"shape": (None,), "sparse_dim": 10}
    (40, 2) / (10, 1)                                  # RETURNN's old (dim, ndim) tuples

``available_for_inference`` and ``dim_tags`` are accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kit.errors import ConfigError, DataError

_KNOWN = {
    "shape",
    "dtype",
    "sparse_dim",
    "dim",
    "sparse",
    "available_for_inference",
    "dim_tags",
    "time_dim_axis",
}


STRING = np.dtype(object)
"""The dtype of a key declared ``"dtype": "string"`` (RETURNN's): str arrays are kept as they come (kind U, S or O)."""


@dataclass(frozen=True)
class DataSpec:
    """One data key: ``shape`` with None for the time axis, numpy ``dtype``, ``sparse_dim``."""

    key: str
    shape: tuple[int | None, ...]
    dtype: np.dtype
    sparse_dim: int | None = None

    @property
    def has_time(self) -> bool:
        return len(self.shape) > 0 and self.shape[0] is None

    def describe(self) -> str:
        shape = (
            "("
            + ", ".join("T" if d is None else str(d) for d in self.shape)
            + ("," if len(self.shape) == 1 else "")
            + ")"
        )
        sparse = f", sparse_dim {self.sparse_dim}" if self.sparse_dim is not None else ""
        return f"shape {shape} {self.dtype}{sparse}"


def _parse_key(key: str, spec: Any) -> tuple[DataSpec | None, list[str]]:
    where = f"extern_data[{key!r}]"
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and all(isinstance(x, int) for x in spec):
        dim, ndim = spec  # RETURNN's num_outputs form: ndim 1 = sparse labels, 2 = dense features
        spec = {"dim": dim, "sparse": ndim == 1}
    if not isinstance(spec, Mapping):
        return None, [f"{where}: expected a dict like {{'shape': (None, 40)}}, got {spec!r}"]
    problems = [
        f"{where}: unknown entry {k!r} (known: {', '.join(sorted(_KNOWN))})" for k in spec if k not in _KNOWN
    ]
    sparse_dim = spec.get("sparse_dim")
    if spec.get("sparse"):
        sparse_dim = sparse_dim if sparse_dim is not None else spec.get("dim")
        if sparse_dim is None:
            problems.append(f"{where}: 'sparse': True needs 'dim' (the number of classes)")
    if sparse_dim is not None and (
        not isinstance(sparse_dim, int) or isinstance(sparse_dim, bool) or sparse_dim < 1
    ):
        problems.append(f"{where}: sparse_dim must be a positive int, got {sparse_dim!r}")
        sparse_dim = None
    if "shape" in spec:
        shape = spec["shape"]
        if not isinstance(shape, (tuple, list)) or not all(
            d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 0) for d in shape
        ):
            return None, problems + [f"{where}: shape must be a tuple of ints and None, got {shape!r}"]
        shape = tuple(shape)
        if any(d is None for d in shape[1:]):
            problems.append(f"{where}: shape {shape}: only the first axis may be None (the time axis)")
    elif "dim" in spec:
        dim = spec["dim"]
        if sparse_dim is None and not (isinstance(dim, int) and dim >= 1):
            problems.append(f"{where}: dim must be a positive int, got {dim!r}")
        shape = (None,) if sparse_dim is not None else (None, dim)
    else:
        return None, problems + [f"{where}: needs 'shape' (e.g. (None, 40)) or RETURNN's 'dim'"]
    default_dtype = "int64" if sparse_dim is not None else "float32"
    try:
        dtype = STRING if spec.get("dtype") == "string" else np.dtype(spec.get("dtype") or default_dtype)
    except TypeError:
        return None, problems + [f"{where}: unknown dtype {spec.get('dtype')!r}"]
    if sparse_dim is not None and dtype.kind not in "iu":
        problems.append(f"{where}: sparse data needs an int dtype, got {dtype}")
    return DataSpec(key, shape, dtype, sparse_dim), problems


class ExternData(Mapping[str, DataSpec]):
    """Parsed ``extern_data``; all problems of a bad spec are raised as one ConfigError."""

    def __init__(self, spec: Mapping[str, Any] | ExternData):
        if isinstance(spec, ExternData):
            self.specs: dict[str, DataSpec] = dict(spec.specs)
            return
        if not isinstance(spec, Mapping) or not spec:
            raise ConfigError(f"extern_data: expected a non-empty dict data key -> spec, got {spec!r}")
        self.specs, problems = {}, []
        for key, value in spec.items():
            parsed, key_problems = _parse_key(str(key), value)
            problems += key_problems
            if parsed is not None:
                self.specs[str(key)] = parsed
        if problems:
            raise ConfigError(problems)

    def __getitem__(self, key: str) -> DataSpec:
        return self.specs[key]

    def __iter__(self):
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def time_keys(self) -> list[str]:
        return [k for k, s in self.specs.items() if s.has_time]

    def __repr__(self) -> str:
        return "ExternData(" + ", ".join(f"{k}: {s.describe()}" for k, s in self.specs.items()) + ")"

    def check_seq(
        self, seq: Mapping[str, np.ndarray], tag: str, *, check_sparse: bool = True
    ) -> dict[str, np.ndarray]:
        """Validate one sequence; returns it with declared dtypes applied (same kind only).

        Raises DataError naming the key, what was expected and received, and the tag.
        ``check_sparse=False`` leaves the label range to a check on the whole batch
        (:func:`kit.data.collate.collate` does that, one reduction per batch). The batch loader
        itself checks whole batches with a few numpy operations and calls this per sequence
        only to name the one that fails.
        """
        out = dict(seq)
        for key, spec in self.specs.items():
            if key not in seq:
                raise self.missing_key(key, seq, tag)
            out[key] = check_array(spec, np.asarray(seq[key]), tag, check_sparse=check_sparse)
        return out

    def missing_key(self, key: str, seq_keys: Iterable[str], tag: str) -> DataError:
        """The error for a declared ``key`` that sequence ``tag`` (with ``seq_keys``) lacks."""
        return DataError(
            f"data key {key!r} is missing in sequence {tag!r}: expected the keys of extern_data "
            f"{list(self.specs)}, received {sorted(seq_keys)} ({key!r} is declared as {self.specs[key].describe()})"
        )


def check_array(spec: DataSpec, a: np.ndarray, tag: str, *, check_sparse: bool = True) -> np.ndarray:
    """One array against its spec (see :meth:`ExternData.check_seq`)."""
    if not layout_ok(spec, a):
        _check_layout(spec, a, tag)
    if check_sparse and spec.sparse_dim is not None and a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= spec.sparse_dim:
            bad = lo if lo < 0 else hi
            raise _fail(
                spec, a, tag, "sparse label out of range", f"labels in [0, {spec.sparse_dim})", f"label {bad}"
            )
    return a if a.dtype == spec.dtype or spec.dtype == STRING else a.astype(spec.dtype)


def _fail(spec: DataSpec, a: np.ndarray, tag: str, what: str, expected: Any, received: Any) -> DataError:
    return DataError(
        f"data key {spec.key!r} in sequence {tag!r}: {what}: expected {expected}, received {received} "
        f"(extern_data declares {spec.describe()}; array shape {a.shape}, dtype {a.dtype})"
    )


def _check_layout(spec: DataSpec, a: np.ndarray, tag: str) -> None:
    if a.ndim != len(spec.shape):
        raise _fail(spec, a, tag, "wrong rank", f"{len(spec.shape)} axes {spec.describe()}", f"{a.ndim} axes")
    for axis, (want, got) in enumerate(zip(spec.shape, a.shape)):
        if want is not None and want != got:
            raise _fail(spec, a, tag, f"wrong size of axis {axis}", want, got)
    if not kind_ok(spec, a.dtype):
        kind = {"f": "float", "O": "string"}.get(spec.dtype.kind, "int")
        raise _fail(spec, a, tag, "wrong dtype kind", f"{spec.dtype} ({kind})", a.dtype)


def layout_ok(spec: DataSpec, a: np.ndarray) -> bool:
    """Whether ``a`` has the declared rank and static sizes and an accepted dtype (no message built)."""
    if a.ndim != len(spec.shape) or (a.shape[1:] if spec.has_time else a.shape) != (
        spec.shape[1:] if spec.has_time else spec.shape
    ):
        return False
    return a.dtype == spec.dtype or kind_ok(spec, a.dtype)


_ACCEPTED_KINDS = {"f": "f", "i": "iu", "u": "iu", "b": "b", "c": "c", "O": "USO"}  # declared kind -> accepted


def kind_ok(spec: DataSpec, dtype: np.dtype) -> bool:
    """Whether arrays of ``dtype`` are accepted for ``spec`` (and cast to its dtype): same kind of number."""
    return dtype.kind in _ACCEPTED_KINDS.get(spec.dtype.kind, spec.dtype.kind)


def labels_in_range(a: np.ndarray, sparse_dim: int) -> bool:
    """Whether every label of ``a`` lies in ``[0, sparse_dim)``; one reduction for integer arrays
    (viewed as unsigned, a negative label is a huge one)."""
    if not a.size:
        return True
    if a.dtype.kind == "i":
        return int(a.view(f"u{a.dtype.itemsize}").max()) < sparse_dim
    if a.dtype.kind == "u":
        return int(a.max()) < sparse_dim
    return bool(a.min() >= 0 and a.max() < sparse_dim)


def make_extern_data(spec: Any) -> ExternData | None:
    return None if spec is None else ExternData(spec)
