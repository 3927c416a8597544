"""``Session.eval``, ``Session.forward`` and ``Session.lr_find``: runs of the model beside training, with the
session's datasets and state around the engine's (``lr_find`` leaves the training state bitwise as it was)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kit.errors import ConfigError, SessionStateError
from kit.session.lifecycle import Status
from kit.session.seq_tags import resolve_tags

if TYPE_CHECKING:
    from kit.session.parts import SessionParts


def evaluate(parts: SessionParts, datasets: Any) -> dict[str, dict[str, float]]:
    """Scores per dataset; the config's eval datasets at an epoch end go into that epoch's score row."""
    parts.setup()
    if datasets is not None and not isinstance(datasets, Mapping):
        datasets = {"eval": datasets}
    if datasets is not None:
        from kit.data import make_dataset

        datasets = {name: make_dataset(ds) for name, ds in datasets.items()}
    engine = parts.engine
    with parts.entered():
        results = engine.eval_model(datasets)
    p = engine.progress
    at_epoch_end = not p.epoch_running and p.epoch > 1 and not parts.lifecycle.inspecting
    if datasets is None and at_epoch_end and engine.scores is not None:
        engine.record_eval(p.epoch - 1, results)
        engine.save_scores()
    return results


def forward(parts: SessionParts, data: Any, callback: Any, dataset: str | None) -> Any:
    """Outputs per sequence of a dataset, a Batch, or seq tags looked up in the session's datasets."""
    parts.setup()
    if parts.config.typed_value("forward_step") is None:
        raise ConfigError("config key 'forward_step' is not set: forward needs forward_step(*, model, extern_data, **kwargs)")
    from kit.data.batch import Batch

    seq_indices = None
    if isinstance(data, (list, tuple)) and all(isinstance(t, str) for t in data):
        data, seq_indices = resolve_tags(parts.engine.datasets, list(data), dataset)
    elif isinstance(data, (Mapping, str)) and not isinstance(data, Batch):  # a Batch is a Mapping too
        from kit.data import make_dataset

        data = make_dataset(data)
    with parts.entered():
        return parts.engine.forward(data, callback, seq_indices=seq_indices)


def find_lr(parts: SessionParts, **options: Any) -> Any:
    """The LR sweep (:func:`kit.lr_finder.lr_find`) at a step boundary of a session that is not training."""
    if parts.lifecycle.status is Status.RUNNING:
        raise SessionStateError("lr_find: the session is training (in the background); "
                                "call session.pause() and session.wait() first")
    parts.lifecycle.check_can_train()
    from kit.lr_finder import lr_find

    parts.prepare_training()
    with parts.entered():
        return lr_find(parts.engine, **options)
