"""RETURNN's tensor API (``Dim``, ``Tensor``, ``TensorDict``) as views over kit's batch fields.

A pure-torch RETURNN step function reads ``extern_data["data"].raw_tensor`` and the lengths
through ``.dims[1].dyn_size_ext.raw_tensor``; these views answer exactly those reads from a
:class:`kit.Field`, without copying anything. They also keep kit's own names (``.tensor``,
``.lengths``, ``.mask()``), so a kit-style step function works on them unchanged.

Used when RETURNN is not installed (``returnn.tensor`` then resolves to these classes) and as the
types of the ``dims`` entries of an ``extern_data`` spec written for RETURNN.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch


class Dim:
    """A named axis: static (``dimension`` an int) or dynamic (``dimension`` None, sizes per sequence).

    For a dynamic axis, ``dyn_size_ext`` is a :class:`Tensor` over the batch axis whose
    ``raw_tensor`` holds the lengths (int32, on the CPU), as in RETURNN.
    """

    def __init__(self, dimension: int | None, *, name: str | None = None, kind: str | None = None):
        if dimension is not None and (isinstance(dimension, bool) or not isinstance(dimension, int)):
            raise TypeError(f"Dim: dimension must be an int or None, got {dimension!r}")
        self.dimension = dimension
        self.name = name
        self.kind = kind
        self.dyn_size_ext: Tensor | None = None

    @property
    def size(self) -> int | None:
        """RETURNN's ``Dim.size``: the static size, None for a dynamic axis."""
        return self.dimension

    @property
    def capacity(self) -> int | None:
        return self.dimension

    @property
    def dyn_size(self) -> torch.Tensor | None:
        """The lengths of a dynamic axis (RETURNN's older ``dyn_size``)."""
        return None if self.dyn_size_ext is None else self.dyn_size_ext.raw_tensor

    def is_batch_dim(self) -> bool:
        return self.kind == "batch"

    def is_dynamic(self) -> bool:
        return self.dimension is None and not self.is_batch_dim()

    def is_static(self) -> bool:
        return self.dimension is not None

    def get_dim_value(self) -> int | torch.Tensor:
        """The size of this axis in the current batch (the max length for a dynamic axis)."""
        if self.dimension is not None:
            return self.dimension
        sizes = self.dyn_size
        if sizes is None:
            raise ValueError(f"{self!r}: no sizes known outside of a step")
        return int(sizes.max()) if sizes.numel() else 0

    def __repr__(self) -> str:
        return f"Dim({self.name or '?'}, {'B' if self.is_batch_dim() else self.dimension})"


batch_dim = Dim(None, name="batch", kind="batch")
"""The batch axis (RETURNN's ``returnn.tensor.batch_dim``)."""

single_step_dim = Dim(1, name="single-step")


class Tensor:
    """A RETURNN ``Tensor`` view: ``raw_tensor`` plus named ``dims`` (batch first).

    Built by :class:`TensorDict` from a kit field; ``raw_tensor`` may also be assigned, as RETURNN
    step functions do with ``expected_outputs[...].dims[1].dyn_size_ext.raw_tensor = lengths``.
    """

    def __init__(
        self,
        name: str,
        dims: Sequence[Dim] = (),
        dtype: str | None = None,
        *,
        sparse_dim: Dim | None = None,
        feature_dim: Dim | None = None,
        raw_tensor: torch.Tensor | None = None,
        available_for_inference: bool = True,
    ):
        self.name = name
        self.dims = tuple(dims)
        self._dtype = dtype
        self.sparse_dim = sparse_dim
        self._feature_dim = feature_dim
        self.raw_tensor = raw_tensor
        self.available_for_inference = available_for_inference

    # ---- RETURNN's names ------------------------------------------------------------------

    @property
    def dtype(self) -> str:
        """The dtype as RETURNN writes it (``"float32"``, ``"int64"``)."""
        if self.raw_tensor is not None:
            return str(self.raw_tensor.dtype).rsplit(".", 1)[-1]
        return self._dtype or "float32"

    @property
    def sparse(self) -> bool:
        return self.sparse_dim is not None

    @property
    def batch_dim(self) -> Dim | None:
        return next((d for d in self.dims if d.is_batch_dim()), None)

    @property
    def feature_dim(self) -> Dim | None:
        """The last static axis of a dense tensor (None for sparse data)."""
        if self._feature_dim is not None or self.sparse:
            return self._feature_dim
        static = [d for d in self.dims if d.is_static() and not d.is_batch_dim()]
        return static[-1] if static else None

    @property
    def dim(self) -> int | None:
        """RETURNN's ``Tensor.dim``: the class count (sparse) or the feature dimension."""
        target = self.sparse_dim if self.sparse else self.feature_dim
        return None if target is None else target.dimension

    @property
    def batch_ndim(self) -> int:
        return len(self.dims)

    @property
    def shape(self) -> tuple[int | None, ...]:
        """The shape without the batch axis (None for dynamic axes), RETURNN's meaning."""
        return tuple(d.dimension for d in self.dims if not d.is_batch_dim())

    @property
    def batch_shape(self) -> tuple[int | None, ...]:
        return tuple(d.dimension for d in self.dims)

    def get_time_dim_tag(self) -> Dim:
        dynamic = [d for d in self.dims if d.is_dynamic()]
        if not dynamic:
            raise ValueError(f"{self!r} has no dynamic (time) axis")
        return dynamic[0]

    def get_sequence_lengths(self) -> torch.Tensor:
        lengths = self.get_time_dim_tag().dyn_size
        if lengths is None:
            raise ValueError(f"{self!r}: sequence lengths are not known")
        return lengths

    def copy_template(self) -> Tensor:
        return Tensor(self.name, self.dims, self._dtype, sparse_dim=self.sparse_dim,
                      feature_dim=self._feature_dim, available_for_inference=self.available_for_inference)

    # ---- kit's names, so that kit-style step functions work on the view too ---------------

    @property
    def tensor(self) -> torch.Tensor:
        if self.raw_tensor is None:
            raise ValueError(f"{self!r} has no raw_tensor")
        return self.raw_tensor

    @property
    def lengths(self) -> torch.Tensor | None:
        dynamic = [d for d in self.dims if d.is_dynamic()]
        return dynamic[0].dyn_size if dynamic else None

    def mask(self) -> torch.Tensor:
        """Bool ``[B, T]``: True for real frames (kit's ``Field.mask``)."""
        lengths = self.lengths
        if lengths is None:
            raise ValueError(f"{self!r} has no time axis, so it has no mask")
        time = torch.arange(self.tensor.shape[1], device=self.tensor.device)
        return time[None, :] < lengths.to(self.tensor.device)[:, None]

    def __repr__(self) -> str:
        sparse = f", sparse_dim={self.sparse_dim!r}" if self.sparse else ""
        return f"Tensor({self.name!r}, {list(self.dims)!r}, {self.dtype!r}{sparse})"


class TensorDict(Mapping[str, Tensor]):
    """RETURNN's ``TensorDict``: name -> :class:`Tensor`; ``.data`` is the underlying dict."""

    def __init__(self, data: Mapping[str, Tensor] | None = None):
        self.data: dict[str, Tensor] = dict(data or {})

    def __getitem__(self, key: str) -> Tensor:
        try:
            return self.data[key]
        except KeyError:
            raise KeyError(f"extern_data has no key {key!r}; it has {sorted(self.data)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        return f"TensorDict({self.data!r})"

    def reset_content(self) -> None:
        for tensor in self.data.values():
            tensor.raw_tensor = None


def field_view(name: str, field: Any, *, sparse_dim: int | None = None, batch: Dim | None = None) -> Tensor:
    """A :class:`Tensor` view of one kit field: batch axis, then a dynamic time axis when it has lengths."""
    raw = field.tensor
    dims: list[Dim] = [batch or Dim(None, name="batch", kind="batch")]
    start = 1
    if field.lengths is not None:
        time = Dim(None, name=f"{name}_time")
        time.dyn_size_ext = Tensor(f"{name}:seq_len", dims[:1], "int32", raw_tensor=field.lengths)
        dims.append(time)
        start = 2
    dims += [Dim(int(n), name=f"{name}_dim{axis}") for axis, n in enumerate(raw.shape[start:], start)]
    sparse = sparse_dim if sparse_dim is not None else getattr(field, "sparse_dim", None)
    sparse_tag = Dim(int(sparse), name=f"{name}_sparse") if sparse is not None else None
    return Tensor(name, dims, raw_tensor=raw, sparse_dim=sparse_tag)


def batch_view(batch: Mapping[str, Any]) -> TensorDict:
    """A :class:`TensorDict` over every field of a kit batch; one batch axis shared by all."""
    shared = Dim(None, name="batch", kind="batch")
    return TensorDict({key: field_view(key, field, batch=shared) for key, field in batch.items()})


def dims_spec_to_kit(spec: Mapping[str, Any]) -> dict[str, Any]:
    """An ``extern_data`` entry written with RETURNN ``dims`` (``Dim`` objects) as kit's ``shape`` form.

    Works for RETURNN's own ``Dim`` class as well as this module's: both have ``dimension``.
    """
    dims = list(spec["dims"])
    out = {k: v for k, v in spec.items() if k not in ("dims", "sparse_dim", "feature_dim")}
    if dims and _is_batch(dims[0]):
        dims = dims[1:]
    out["shape"] = tuple(getattr(d, "dimension", d) for d in dims)
    sparse = spec.get("sparse_dim")
    if sparse is not None:
        out["sparse_dim"] = getattr(sparse, "dimension", sparse)
    return out


def _is_batch(dim: Any) -> bool:
    check = getattr(dim, "is_batch_dim", None)
    return bool(check()) if callable(check) else False
