"""RETURNN's run-context calls (``rf.get_run_ctx().mark_as_loss(name=..., loss=...)``) on kit's ``RunCtx``.

:func:`get_run_ctx` returns a :class:`ReturnnRunCtx` over the kit context of the running step:
RETURNN's keyword forms, its ``stage`` names, ``expected_outputs`` as a ``TensorDict`` of the
config's ``model_outputs`` (whose dims a forward step may give lengths), and RETURNN Tensor views
accepted wherever a tensor goes. Everything is handed on to kit's :class:`kit.run_ctx.RunCtx`,
so losses are summed and normalized exactly as kit (and RETURNN) do.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kit.compat.tensor import Dim, Tensor, TensorDict
from kit.run_ctx import DEFAULT_OUTPUT_NAME, Loss, Output, RunCtx
from kit.run_ctx import get_run_ctx as kit_get_run_ctx

_STAGES = {"train": "train_step", "eval": "train_step", "forward": "forward_step"}


class ReturnnRunCtx:
    """RETURNN's ``RunCtx`` interface over one kit run context."""

    def __init__(self, ctx: RunCtx):
        self.kit_ctx = ctx
        self.expected_outputs: TensorDict | None = _expected_outputs_view(ctx.expected_outputs)

    @property
    def stage(self) -> str:
        """RETURNN's stage name: ``"train_step"`` (also in eval) or ``"forward_step"``."""
        return _STAGES[self.kit_ctx.stage]

    @property
    def train_flag(self) -> bool:
        return self.kit_ctx.train_flag

    @property
    def epoch(self) -> int:
        return self.kit_ctx.epoch

    @property
    def step(self) -> int:
        return self.kit_ctx.step

    @property
    def losses(self) -> dict[str, Loss]:
        return self.kit_ctx.losses

    @property
    def outputs(self) -> dict[str, Output]:
        return self.kit_ctx.outputs

    def mark_as_loss(
        self,
        loss: Any,
        name: str,
        *,
        dims: Sequence[Any] | None = None,
        scale: float = 1.0,
        as_error: bool = False,
        use_normalized_loss: bool = False,
        use_flatten_frames: bool = True,
        custom_inv_norm_factor: Any = None,
    ) -> Loss:
        """RETURNN's ``mark_as_loss``: summed over (unpadded) elements, reported per element.

        A :class:`Tensor` view with a dynamic axis is masked by its lengths, as RETURNN does;
        ``dims`` and ``use_flatten_frames`` change nothing in the reported or optimized values.
        """
        mask = None
        if isinstance(loss, Tensor):
            mask = _mask_of(loss)
            loss = loss.raw_tensor
        if isinstance(custom_inv_norm_factor, Tensor):
            custom_inv_norm_factor = custom_inv_norm_factor.raw_tensor
        return self.kit_ctx.mark_as_loss(
            loss, name, scale=scale, as_error=as_error, use_normalized_loss=use_normalized_loss,
            custom_inv_norm_factor=custom_inv_norm_factor, mask=mask,
        )

    def mark_as_output(self, tensor: Any, name: str, *, dims: Sequence[Any] | None = None) -> Output:
        """RETURNN's ``mark_as_output``; lengths come from the tensor's (or the expected output's) dims."""
        lengths = None
        if isinstance(tensor, Tensor):
            lengths = tensor.lengths
            tensor = tensor.raw_tensor
        if lengths is None and dims is not None:
            lengths = _first_lengths(dims)
        if lengths is None and self.expected_outputs is not None and name in self.expected_outputs:
            lengths = self.expected_outputs[name].lengths
        return self.kit_ctx.mark_as_output(tensor, name, lengths=lengths, dims=dims)

    def mark_as_default_output(self, tensor: Any, *, shape: Sequence[Any] | None = None) -> Output:
        return self.mark_as_output(tensor, DEFAULT_OUTPUT_NAME, dims=shape)

    def total_loss(self) -> torch.Tensor:
        return self.kit_ctx.total_loss()

    def check_outputs_complete(self) -> None:
        self.kit_ctx.check_outputs()

    def __repr__(self) -> str:
        return f"<RunCtx stage={self.stage!r} train_flag={self.train_flag!r} step={self.step!r} (kit)>"


_VIEWS: weakref.WeakKeyDictionary[RunCtx, ReturnnRunCtx] = weakref.WeakKeyDictionary()


def returnn_view(ctx: RunCtx) -> ReturnnRunCtx:
    """The one RETURNN view of ``ctx`` (so lengths set on ``expected_outputs`` are seen later)."""
    view = _VIEWS.get(ctx)
    if view is None:
        view = _VIEWS[ctx] = ReturnnRunCtx(ctx)
    return view


def get_run_ctx() -> ReturnnRunCtx:
    """``returnn.frontend.get_run_ctx()`` inside a kit step (RETURNN not installed)."""
    return returnn_view(kit_get_run_ctx())


def _mask_of(loss: Tensor) -> torch.Tensor | None:
    dynamic = [i for i, d in enumerate(loss.dims) if d.is_dynamic()]
    if not dynamic or loss.raw_tensor is None:
        return None
    mask = torch.ones((), dtype=torch.bool, device=loss.raw_tensor.device)
    for axis in dynamic:
        lengths = loss.dims[axis].dyn_size
        if lengths is None:
            continue
        time = torch.arange(loss.raw_tensor.shape[axis], device=loss.raw_tensor.device)
        frames = time[None, :] < lengths.to(loss.raw_tensor.device)[:, None]  # [B, T_axis]
        shape = [1] * loss.raw_tensor.dim()
        shape[0], shape[axis] = frames.shape[0], frames.shape[1]
        mask = mask & frames.reshape(shape)
    return torch.broadcast_to(mask, loss.raw_tensor.shape)


def _first_lengths(dims: Sequence[Any]) -> torch.Tensor | None:
    for dim in dims:
        sizes = getattr(dim, "dyn_size", None)
        if isinstance(sizes, torch.Tensor):
            return sizes
    return None


def _expected_outputs_view(spec: Mapping[str, Any] | Sequence[str] | None) -> TensorDict | None:
    """``model_outputs`` as RETURNN's ``TensorDict`` template: batch, a time axis, the feature axis."""
    if spec is None or not isinstance(spec, Mapping):
        return None
    views = {}
    for name, entry in spec.items():
        entry = entry if isinstance(entry, Mapping) else {}
        shape = entry.get("shape")
        if shape is None:
            shape = (None,) if entry.get("sparse") else (None, entry.get("dim"))
        dims = [Dim(None, name="batch", kind="batch")]
        dims += [Dim(None, name=f"{name}_time") if n is None else Dim(int(n)) for n in shape]
        for dim in dims[1:]:
            if dim.is_dynamic():
                dim.dyn_size_ext = Tensor(f"{name}:seq_len", dims[:1], "int32")
        views[name] = Tensor(name, dims)
    return TensorDict(views)
