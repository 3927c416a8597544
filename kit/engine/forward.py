"""Forward: run ``forward_step`` over data and hand outputs per sequence to a callback.

Callback protocol (RETURNN's ``ForwardCallbackIface``): ``init(*, model)``,
``process_seq(*, seq_tag, outputs)`` with numpy arrays without the batch axis, cut to
the sequence's length, and ``finish()``. Without a callback the outputs are collected
into a :class:`ForwardResult`.
"""

from __future__ import annotations

import html
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kit.config import Config
from kit.data.batch import Batch
from kit.engine.user_code import check_accepts_kwargs
from kit.errors import ConfigError
from kit.events import ForwardEnd
from kit.rng import RngState
from kit.run_ctx import RunCtx

logger = logging.getLogger("kit")

if TYPE_CHECKING:
    from kit.data.dataset import Dataset
    from kit.engine.parts import Built
    from kit.engine.progress import Progress


class ForwardResult(Mapping[str, dict[str, np.ndarray]]):
    """seq_tag → {output name: numpy array}, in dataset order."""

    def __init__(self) -> None:
        self._outputs: dict[str, dict[str, np.ndarray]] = {}
        self._order: dict[str, int] = {}

    # callback protocol, so a ForwardResult can collect by itself
    def init(self, *, model: torch.nn.Module, **_: Any) -> None:
        pass

    def process_seq(self, *, seq_tag: str, outputs: dict[str, np.ndarray], seq_idx: int = 0, **_: Any) -> None:
        self._outputs[seq_tag] = outputs
        self._order[seq_tag] = seq_idx

    def finish(self, **_: Any) -> None:
        tags = sorted(self._outputs, key=lambda t: self._order[t])
        self._outputs = {t: self._outputs[t] for t in tags}

    def __getitem__(self, tag: str) -> dict[str, np.ndarray]:
        try:
            return self._outputs[tag]
        except KeyError:
            raise KeyError(f"no forward output for seq tag {tag!r}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._outputs)

    def __len__(self) -> int:
        return len(self._outputs)

    def to_pandas(self) -> Any:
        """One row per sequence; scalar outputs as values, short ones as lists, long ones as shapes."""
        import pandas as pd

        rows = {}
        for tag, outs in self._outputs.items():
            rows[tag] = {name: _cell(arr) for name, arr in outs.items()}
        return pd.DataFrame.from_dict(rows, orient="index").rename_axis("seq_tag")

    def _repr_html_(self) -> str:
        head = list(self._outputs.items())[:10]
        rows = "".join(
            f"<tr><td>{html.escape(tag)}</td>"
            + "".join(f"<td>{html.escape(name)}: {a.shape} {a.dtype}</td>" for name, a in outs.items())
            + "</tr>"
            for tag, outs in head
        )
        more = f"<p>… {len(self) - len(head)} more</p>" if len(self) > len(head) else ""
        return f"<p>ForwardResult: {len(self)} sequences</p><table>{rows}</table>{more}"

    def __repr__(self) -> str:
        return f"ForwardResult({len(self)} sequences)"


def _cell(arr: np.ndarray) -> Any:
    if arr.ndim == 0:
        return arr.item()
    if arr.size <= 8:
        return arr.tolist()
    return f"array{arr.shape} {arr.dtype}"


def run_forward(b: Built, config: Config, progress: Progress, data: Dataset | Batch, callback: Any = None, *,
                seq_indices: list[int] | None = None) -> Any:
    """Forward ``data`` (a dataset or a Batch), longest sequences first, outputs to ``callback``."""
    forward_step = config.typed_value("forward_step")
    if forward_step is None:
        raise ConfigError("config key 'forward_step' is not set: forward needs forward_step(*, model, extern_data, **kwargs)")
    check_accepts_kwargs(forward_step, "forward_step")
    run = _Forward(b, config, forward_step, max(1, progress.epoch))
    result = callback if callback is not None else ForwardResult()
    rng, was_training = RngState.capture(), b.model.training
    b.model.eval()
    try:
        with torch.no_grad():
            result.init(model=b.model)
            for batch in run.batches(data, seq_indices):
                run.batch(batch, result)
            result.finish()
    finally:
        rng.restore()
        b.model.train(was_training)
    b.compute.events.emit(ForwardEnd(result))
    return result if callback is None else None


class _Forward:
    """One forward run: its batches, and each batch through ``forward_step`` (split on a CUDA OOM)."""

    def __init__(self, b: Built, config: Config, forward_step: Any, epoch: int):
        self.b, self.config, self.forward_step, self.epoch = b, config, forward_step, epoch

    def batches(self, data: Dataset | Batch, seq_indices: list[int] | None) -> Iterator[Batch]:
        if isinstance(data, Batch):
            yield data
            return
        from kit.data.pipeline import Pipeline

        _check_length_filter(self.config)
        # longest first (RETURNN's sort_dataset): an OOM shows up at once, not after an hour; the user's dataset
        # object is untouched
        pipeline = Pipeline.from_config(data, self.config, train=False, extern_data=_keys_of(self.b.extern_data, data),
                                        seq_ordering="sorted_reverse" if self.config.bool("sort_dataset") else None,
                                        seq_indices=seq_indices)
        pipeline.set_epoch(self.epoch)
        try:
            yield from pipeline
        finally:
            pipeline.close()

    def batch(self, batch: Batch, callback: Any) -> None:
        """Run one batch; on CUDA OOM split it in halves (recursively) when allowed."""
        try:
            outputs = self.run(batch)
        except torch.cuda.OutOfMemoryError:
            if not self.config.bool("forward_auto_split_batch_on_oom") or batch.num_seqs <= 1:
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            half = batch.num_seqs // 2
            self.batch(batch.select(slice(0, half)), callback)
            self.batch(batch.select(slice(half, None)), callback)
            return
        _deliver(batch, outputs, callback)

    def run(self, batch: Batch) -> dict[str, Any]:
        ctx = RunCtx("forward", train_flag=False, epoch=self.epoch, step=batch.batch_idx,
                     expected_outputs=self.config.typed_value("model_outputs"))
        compute = self.b.compute
        try:
            compute.forward(self.forward_step, ctx, batch.to(self.b.device, non_blocking=True))
            ctx.check_outputs()
        except torch.cuda.OutOfMemoryError:  # not a user error: the caller splits the batch
            raise
        except Exception as exc:
            compute.report_user_error(exc, stage="forward", batch=batch, rng=None)
            raise
        return dict(ctx.outputs)


def _check_length_filter(config: Config) -> None:
    """RETURNN's rule: forward keeps every sequence unless ``allow_skipping_seqs_in_forward`` lets the length
    filter (``min_seq_length`` / ``max_seq_length``) drop some, which it then notes."""
    low, high = config.typed_value("min_seq_length"), config.typed_value("max_seq_length")
    if low is None and high is None:
        return
    if not config.bool("allow_skipping_seqs_in_forward"):
        raise ConfigError(
            f"forward keeps every sequence, but min_seq_length {low!r}, max_seq_length {high!r} would drop some "
            "(as in RETURNN): unset them for forward, or set allow_skipping_seqs_in_forward=True")
    logger.warning("Note: allow_skipping_seqs_in_forward is enabled (with min_seq_length %r, max_seq_length %r): "
                   "sequences may be skipped, this may lead to incorrect evaluation results!", low, high)


def _keys_of(extern_data: Any, data: Any) -> Any:
    """``extern_data`` less the keys that ``data`` does not have: new input comes without targets.

    Inference on raw input (``session.forward(ArrayDataset([{"data": ...}]))``) must not need
    the ``classes`` that only training reads; a key the data lacks and ``forward_step`` reads
    is still a KeyError naming it.
    """
    if extern_data is None or not hasattr(data, "get_seq") or len(data) == 0:
        return extern_data
    present = set(data.get_seq(0))
    if not present & set(extern_data) or present >= set(extern_data):
        return extern_data  # nothing to drop, or nothing in common: the usual error names the keys
    from kit.data.extern_data import ExternData

    subset = ExternData(extern_data)
    subset.specs = {k: spec for k, spec in subset.specs.items() if k in present}
    return subset


def _deliver(batch: Batch, outputs: dict[str, Any], callback: Any) -> None:
    """One device→host copy per output per batch, then numpy slices per sequence."""
    host: dict[str, tuple[np.ndarray, list[int] | None]] = {}
    for name, out in outputs.items():
        tensor = out.tensor.detach()
        if tensor.dtype in (torch.bfloat16, torch.float16):
            tensor = tensor.float()
        array = tensor.cpu().numpy()
        host[name] = (array, _lengths_for(out, array, batch))
    for i, tag in enumerate(batch.seq_tags):
        seq_out = {}
        for name, (array, lengths) in host.items():
            # array[i, ...]: a 0-d array (not a numpy scalar) for per-sequence values
            seq_out[name] = array[i, : lengths[i]] if lengths is not None else array[i, ...]
        seq_idx = batch.seq_idx[i] if batch.seq_idx else i
        callback.process_seq(seq_tag=tag, outputs=seq_out, **({"seq_idx": seq_idx} if isinstance(callback, ForwardResult) else {}))


def _lengths_for(out: Any, array: np.ndarray, batch: Batch) -> list[int] | None:
    """Explicit ``lengths=``; else the lengths of an input whose padded time matches axis 1."""
    if out.lengths is not None:
        lengths = out.lengths
        return lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    if array.ndim < 2:
        return None
    for field in batch.fields.values():
        if field.lengths is not None and field.tensor.shape[1] == array.shape[1]:
            return field.lengths.tolist()
    return None
