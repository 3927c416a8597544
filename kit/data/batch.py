"""``Batch`` and ``Field``: what user code receives as ``extern_data``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class Field:
    """One data key of a batch: a zero-padded tensor plus per-sequence lengths.

    ``tensor`` is ``[B, T, ...]`` for keys with a time axis (``lengths`` int32 ``[B]`` on
    the CPU) and ``[B, ...]`` for keys without one (``lengths`` is None).
    """

    tensor: torch.Tensor
    lengths: torch.Tensor | None = None
    sparse_dim: int | None = None
    _ready_mask: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _view: Any = field(default=None, init=False, repr=False, compare=False)  # RETURNN's Tensor view, built on first use

    def prepare_mask(self, ready: torch.Tensor | None = None) -> None:
        """Build the (CPU) mask now (or take ``ready``, the data path's), for the next :meth:`mask`
        call to hand out: the data path does this while its code is warm, for batches loaded ahead
        of their step."""
        if ready is not None:  # the data path's own, made with the tensor (so: for it)
            self._ready_mask = ready
        elif self.lengths is not None and self.tensor.is_cpu and self.lengths.is_cpu:
            self._ready_mask = self.mask()

    def mask(self) -> torch.Tensor:
        """Bool ``[B, T]`` on the tensor's device: True for real frames, False for padding (a new
        tensor per call)."""
        ready = self._ready_mask
        if ready is not None:  # prepared ahead: handed out once
            self._ready_mask = None
            return ready
        if self.lengths is None:
            raise ValueError("this field has no time axis, so it has no mask")
        t = self.tensor
        if t.is_cpu and self.lengths.is_cpu:  # two numpy ops: a fraction of the host time of five torch ops
            return torch.from_numpy(np.arange(t.shape[1]) < self.lengths.numpy()[:, None])
        time = torch.arange(t.shape[1], device=t.device)
        return time[None, :] < self.lengths.to(t.device, non_blocking=True)[:, None]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Field:
        return Field(self.tensor.to(device, non_blocking=non_blocking), self.lengths, self.sparse_dim)

    def pin_memory(self) -> Field:
        return Field(self.tensor.pin_memory(), self.lengths, self.sparse_dim)

    def cpu_copy(self) -> Field:
        """A detached CPU copy (what a debug context keeps)."""
        lengths = None if self.lengths is None else self.lengths.clone()
        return Field(self.tensor.detach().to("cpu", copy=True), lengths, self.sparse_dim)

    def select_seqs(self, idx: list[int]) -> Field:
        """The field of some sequences (the time axis cut to the longest selected one)."""
        sel = torch.tensor(idx, dtype=torch.long)
        tensor = self.tensor.index_select(0, sel.to(self.tensor.device))
        lengths = None
        if self.lengths is not None:
            lengths = self.lengths.index_select(0, sel)
            tensor = tensor[:, : int(lengths.max()) if len(idx) else 0]
        return Field(tensor, lengths, self.sparse_dim)

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def num_frames(self) -> int:
        """Real (unpadded) frames, counted on the CPU without a device sync."""
        return int(self.lengths.sum()) if self.lengths is not None else self.tensor.shape[0]

    # ---- RETURNN's tensor API (``returnn.tensor.Tensor``'s names that do not clash with kit's) ----------
    # A RETURNN step function reads ``extern_data["data"].raw_tensor`` and its lengths through ``.dims``,
    # whatever kit guessed about it. ``shape``, ``dtype`` and ``sparse_dim`` keep kit's meaning (torch's
    # shape and dtype, the class count); RETURNN's ``Dim`` for the classes is ``dims``' ``sparse_dim``.

    @property
    def raw_tensor(self) -> torch.Tensor:
        """RETURNN's name for :attr:`tensor`."""
        return self.tensor

    @raw_tensor.setter
    def raw_tensor(self, value: torch.Tensor) -> None:
        self.tensor, self._view = value, None

    def returnn_view(self) -> Any:
        """This field as a RETURNN ``Tensor`` view (:mod:`kit.compat.tensor`): the same one on every call."""
        view = self._view
        if view is None or view.raw_tensor is not self.tensor:
            from kit.compat.tensor import field_view

            view = self._view = field_view("data", self)
        return view

    @property
    def dims(self) -> tuple[Any, ...]:
        """RETURNN's ``dims``: batch, then the time axis (``.dyn_size_ext.raw_tensor``: the lengths), then the rest."""
        return self.returnn_view().dims  # type: ignore[no-any-return]

    @property
    def batch_dim(self) -> Any:
        return self.returnn_view().batch_dim

    @property
    def feature_dim(self) -> Any:
        return self.returnn_view().feature_dim

    @property
    def dim(self) -> int | None:
        """RETURNN's ``Tensor.dim``: the class count (sparse) or the feature dimension."""
        return self.returnn_view().dim  # type: ignore[no-any-return]

    @property
    def sparse(self) -> bool:
        return self.sparse_dim is not None

    @property
    def batch_ndim(self) -> int:
        return self.tensor.dim()

    @property
    def batch_shape(self) -> tuple[int | None, ...]:
        return self.returnn_view().batch_shape  # type: ignore[no-any-return]

    def get_time_dim_tag(self) -> Any:
        return self.returnn_view().get_time_dim_tag()

    def get_sequence_lengths(self) -> torch.Tensor:
        """RETURNN's name for :attr:`lengths` (an error for a field without a time axis, as in RETURNN)."""
        return self.returnn_view().get_sequence_lengths()  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        sparse = f", sparse_dim={self.sparse_dim}" if self.sparse_dim is not None else ""
        lengths = "" if self.lengths is None else f", lengths={self.lengths.tolist()}"
        return f"Field({tuple(self.tensor.shape)}, {self.tensor.dtype}{sparse}{lengths})"


@dataclass(repr=False)
class StringField(Field):
    """A data key of strings (RETURNN's dtype ``"string"``, e.g. ``OggZipDataset``'s ``raw``): one per sequence.

    ``tensor`` (and ``raw_tensor``) is a numpy array ``[B]`` of ``str``, as RETURNN hands it to a step
    function: strings are not converted to torch, and they stay on the CPU when the batch moves to a device.
    """

    tensor: np.ndarray  # type: ignore[assignment]

    @property
    def strings(self) -> list[str]:
        """The sequences' strings as a Python list."""
        return [str(s) for s in self.tensor.tolist()]

    def mask(self) -> torch.Tensor:
        raise ValueError("a string field has no time axis, so it has no mask")

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Field:
        return self  # strings stay on the host (as RETURNN's numpy array)

    def pin_memory(self) -> Field:
        return self

    def cpu_copy(self) -> Field:
        return StringField(self.tensor.copy())

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.tensor.shape)

    @property
    def dtype(self) -> Any:  # the numpy dtype: torch has none for strings
        return self.tensor.dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def select_seqs(self, idx: list[int]) -> Field:
        return StringField(self.tensor[np.asarray(idx, dtype=np.int64)])

    def __repr__(self) -> str:
        return f"StringField({self.tensor.shape[0]} strings)"


class Batch(Mapping[str, Field]):
    """A padded batch of sequences: ``batch["data"].tensor``, ``batch.seq_tags``, ...

    ``complete_frac`` is the fraction of the epoch done once this batch is consumed
    (RETURNN's ``complete_frac``), ``seq_idx`` the sequence indices in the dataset.
    ``tag_of`` (``dataset.get_seq_tag``) makes ``seq_tags`` lazy: built from ``seq_idx`` on
    first read, so steps that never look at the tags never build them.
    """

    def __init__(
        self,
        fields: dict[str, Field],
        seq_tags: list[str] | None = None,
        seq_idx: list[int] | None = None,
        epoch: int = 1,
        complete_frac: float | None = None,
        batch_idx: int = 0,  # position of this batch in its epoch (0-based)
        *,
        tag_of: Callable[[int], str] | None = None,
    ):
        self.fields = fields
        self.seq_idx: list[int] = [] if seq_idx is None else seq_idx
        self.epoch = epoch
        self.complete_frac = complete_frac
        self.batch_idx = batch_idx
        self._seq_tags = seq_tags if seq_tags is not None or tag_of is not None else []
        self._tag_of = tag_of

    @property
    def seq_tags(self) -> list[str]:
        """The sequences' tags (built on first read when the batch came with ``tag_of``)."""
        if self._seq_tags is None:
            tag_of = self._tag_of
            self._seq_tags = [tag_of(i) for i in self.seq_idx] if tag_of is not None else []
        return self._seq_tags

    @seq_tags.setter
    def seq_tags(self, tags: list[str]) -> None:
        self._seq_tags = tags

    def __getstate__(self) -> dict[str, Any]:
        # to another process (a DataLoader worker's batch): the tags go as strings, not the dataset
        state = dict(self.__dict__)
        state["_seq_tags"], state["_tag_of"] = self.seq_tags, None
        return state

    def _same_meta(self, fields: dict[str, Field]) -> Batch:
        """A batch of other fields with this one's tags (lazy ones stay lazy), indices, epoch, position."""
        return Batch(fields, self._seq_tags, self.seq_idx, self.epoch, self.complete_frac, self.batch_idx,
                     tag_of=self._tag_of)

    @property
    def data(self) -> dict[str, Field]:
        """RETURNN's ``TensorDict.data``: the fields by key."""
        return self.fields

    def __getitem__(self, key: str) -> Field:
        try:
            return self.fields[key]
        except KeyError:
            raise KeyError(f"batch has no data key {key!r}; it has {sorted(self.fields)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_idx) if self._seq_tags is None else len(self._seq_tags)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._same_meta({k: f.to(device, non_blocking=non_blocking) for k, f in self.fields.items()})

    def with_float_dtype(self, dtype: torch.dtype) -> Batch:
        """The batch with its floating-point tensors in ``dtype`` (labels, lengths and masks as they are)."""
        fields = {k: Field(f.tensor.to(dtype), f.lengths, f.sparse_dim)
                  if not isinstance(f, StringField) and f.tensor.is_floating_point() and f.tensor.dtype != dtype
                  else f for k, f in self.fields.items()}
        return self._same_meta(fields)

    def pin_memory(self) -> Batch:
        return self._same_meta({k: f.pin_memory() for k, f in self.fields.items()})

    def select(self, index: slice | list[int]) -> Batch:
        """A sub-batch of some sequences (time axes cut to the longest selected sequence)."""
        idx = list(range(self.num_seqs))[index] if isinstance(index, slice) else list(index)
        fields = {key: f.select_seqs(idx) for key, f in self.fields.items()}
        lazy = self._seq_tags is None and self.seq_idx
        return Batch(
            fields,
            None if lazy else [self.seq_tags[i] for i in idx],
            [self.seq_idx[i] for i in idx] if self.seq_idx else [],
            self.epoch,
            self.complete_frac,
            self.batch_idx,
            tag_of=self._tag_of if lazy else None,
        )

    def summary(self) -> str:
        """Tags, shapes, dtypes, value ranges: appended to errors from user code."""
        tags = self.seq_tags[:5] + (["..."] if len(self.seq_tags) > 5 else [])
        lines = [f"batch of {self.num_seqs} seqs (epoch {self.epoch}, batch {self.batch_idx}), tags {tags}"]
        for key, f in self.fields.items():
            if isinstance(f, StringField):
                lines.append(f"  {key}: {len(f.tensor)} strings, e.g. {f.strings[:2]}")
                continue
            t = f.tensor
            desc = f"  {key}: shape {tuple(t.shape)} {t.dtype}"
            if t.numel() and t.device.type != "meta":
                desc += f", min {t.min().item():.4g}, max {t.max().item():.4g}"
                if f.sparse_dim is not None:
                    bad = int(((t < 0) | (t >= f.sparse_dim)).sum())
                    if bad:
                        desc += f", {bad} labels outside [0, {f.sparse_dim})"
            if f.lengths is not None:
                desc += f", lengths {int(f.lengths.min())}..{int(f.lengths.max())}"
            lines.append(desc)
        return "\n".join(lines)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={f!r}" for k, f in self.fields.items())
        return f"Batch({self.num_seqs} seqs, epoch={self.epoch}, {inner})"
