"""With RETURNN installed: RETURNN's own ``TensorDict`` and run context around a kit step.

Mirrors what RETURNN's torch engine does around ``train_step`` / ``forward_step`` (build
``extern_data`` with ``raw_dict_to_extern_data``, ``init_*_step_run_ctx``, read the marked losses
and outputs, ``reset_run_ctx``), and hands the results to kit's run context — so losses are
reported and differentiated from RETURNN's own summed loss and norm factor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy
import torch

from kit.run_ctx import RunCtx


class ReturnnBridge:
    """Converts kit batches to RETURNN ``TensorDict`` and RETURNN's marks back into kit's run context."""

    def __init__(self, extern_data: Mapping[str, Any] | None, model_outputs: Mapping[str, Any] | None):
        import returnn.frontend as rf  # type: ignore[import]
        from returnn.tensor import TensorDict  # type: ignore[import]
        from returnn.torch.data import extern_data as extern_data_util  # type: ignore[import]

        rf.select_backend_torch()
        if extern_data is None:
            raise ValueError("a RETURNN-style step function needs the config key 'extern_data'")
        self.template = extern_data_util.extern_data_template_from_config_opts(dict(extern_data))
        self.expected_outputs = None
        if model_outputs is not None:
            self.expected_outputs = TensorDict()
            self.expected_outputs.update(dict(model_outputs), auto_convert=True)

    def extern_data(self, batch: Mapping[str, Any], *, forward: bool) -> Any:
        from returnn.torch.data import extern_data as extern_data_util  # type: ignore[import]

        raw: dict[str, Any] = {}
        device: Any = "cpu"
        for key, field in batch.items():
            raw[key] = field.tensor  # a string key: numpy's str array, as RETURNN's collate leaves it
            if isinstance(field.tensor, torch.Tensor):
                device = field.tensor.device
            if field.lengths is not None:
                raw[f"{key}:seq_len"] = field.lengths
        if "seq_tag" in self.template.data and "seq_tag" not in raw:
            raw["seq_tag"] = numpy.array([str(t) for t in getattr(batch, "seq_tags", [])], dtype=str)
        tensors = extern_data_util.raw_dict_to_extern_data(
            raw, extern_data_template=self.template, device=device, with_eval_targets=not forward
        )
        with_kit_names(tensors)
        return tensors

    def run(self, fn: Callable[..., Any], *, model: Any, batch: Mapping[str, Any], ctx: RunCtx, **kwargs: Any) -> Any:
        import returnn.frontend as rf  # type: ignore[import]
        from returnn.frontend import run_ctx as rf_run_ctx  # type: ignore[import]

        forward = ctx.stage == "forward"
        extern_data = self.extern_data(batch, forward=forward)
        if forward:
            if self.expected_outputs is not None:
                self.expected_outputs.reset_content()
            rf.init_forward_step_run_ctx(expected_outputs=self.expected_outputs, step=ctx.step, epoch=ctx.epoch)
        else:
            rf.init_train_step_run_ctx(train_flag=ctx.train_flag, step=ctx.step, epoch=ctx.epoch)
        try:
            result = fn(model=model, extern_data=extern_data, **kwargs)
            returnn_ctx = rf.get_run_ctx()
            _hand_over_losses(returnn_ctx, ctx)
            _hand_over_outputs(returnn_ctx, ctx)
        finally:
            rf_run_ctx.reset_run_ctx()
        return result


_kit_tensor_class: list[type] = []


def kit_tensor_class() -> type:
    """RETURNN's ``Tensor`` with kit's field names added (``tensor``, ``lengths``, ``mask()``, ``num_frames()``)."""
    if not _kit_tensor_class:
        from returnn.tensor import Tensor  # type: ignore[import]

        class KitNamedTensor(Tensor):  # type: ignore[misc,valid-type]
            """A RETURNN ``Tensor`` that a kit-style step function can read too."""

            __slots__ = ()

            @property
            def tensor(self) -> torch.Tensor:
                return self.raw_tensor

            @property
            def lengths(self) -> torch.Tensor | None:
                dynamic = [d for d in self.dims if d.is_dynamic() and not d.is_batch_dim()]
                if not dynamic or dynamic[0].dyn_size_ext is None:
                    return None
                return dynamic[0].dyn_size_ext.raw_tensor

            def mask(self) -> torch.Tensor:
                lengths = self.lengths
                if lengths is None:
                    raise ValueError(f"{self!r} has no time axis, so it has no mask")
                raw = self.raw_tensor
                time = torch.arange(raw.shape[1], device=raw.device)
                return time[None, :] < lengths.to(raw.device)[:, None]

            def num_frames(self) -> int:
                lengths = self.lengths
                return int(lengths.sum()) if lengths is not None else int(self.raw_tensor.shape[0])

        _kit_tensor_class.append(KitNamedTensor)
    return _kit_tensor_class[0]


def with_kit_names(tensors: Any) -> None:
    """Give each tensor of RETURNN's ``TensorDict`` kit's field names too (its class becomes a subclass)."""
    cls = kit_tensor_class()
    for tensor in tensors.data.values():
        if type(tensor) is cls.__base__:
            tensor.__class__ = cls


def _raw(value: Any) -> Any:
    return getattr(value, "raw_tensor", value)


def _hand_over_losses(returnn_ctx: Any, ctx: RunCtx) -> None:
    for name, loss in returnn_ctx.losses.items():
        inv_norm = _raw(loss.get_inv_norm_factor())
        ctx.mark_as_loss(
            _raw(loss.get_summed_loss()), name, scale=loss.scale, as_error=loss.as_error,
            use_normalized_loss=loss.use_normalized_loss, custom_inv_norm_factor=inv_norm,
        )


def _hand_over_outputs(returnn_ctx: Any, ctx: RunCtx) -> None:
    for name, tensor in returnn_ctx.outputs.data.items():
        lengths = None
        for dim in tensor.dims[1:]:
            if dim.dyn_size_ext is not None and dim.dyn_size_ext.raw_tensor is not None:
                lengths = dim.dyn_size_ext.raw_tensor
                break
        raw = tensor.raw_tensor
        if isinstance(raw, torch.Tensor):
            ctx.mark_as_output(raw, name, lengths=lengths)
