"""Evaluation of one dataset: the user's ``train_step`` with ``train_flag=False``, losses summed on the device.

Results are named ``<dataset>_loss_<loss>``; ``chunking`` applies as in training (RETURNN's torch
engine; ``chunking_in_eval=False`` evaluates whole sequences); under torchrun each rank evaluates its share and the sums are added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kit.config import Config
from kit.engine.accounting import EpochAccounting, stack_losses
from kit.engine.user_code import check_accepts_kwargs
from kit.errors import ConfigError, DataError
from kit.run_ctx import RunCtx

if TYPE_CHECKING:
    from kit.data.dataset import Dataset
    from kit.engine.loader_draws import LoaderDraws
    from kit.engine.parts import Built
    from kit.engine.progress import Progress


def evaluate_dataset(b: Built, config: Config, p: Progress, name: str, dataset: Dataset,
                     loaders: LoaderDraws | None = None) -> tuple[dict[str, float], set[str]]:
    """``({"<name>_loss_<loss>": value}, error score keys)`` for one eval dataset (call under no_grad);
    ``loaders``: the engine's record of RETURNN's DataLoaders (:mod:`kit.engine.loader_draws`)."""
    from kit.data.pipeline import Pipeline

    train_step = config.typed_value("train_step")
    if train_step is None:
        raise ConfigError("config key 'train_step' is not set: eval runs train_step with train_flag=False")
    check_accepts_kwargs(train_step, "train_step")
    make_pipeline = b.dist.pipeline if b.dist else Pipeline.from_config  # a rank's share
    pipeline = make_pipeline(dataset, config, train=False, extern_data=b.extern_data)
    try:
        pipeline.set_epoch(max(1, p.epoch - (0 if p.epoch_running else 1)))
    except DataError as exc:  # say which eval dataset: the pipeline only knows the class
        raise DataError(f"eval dataset {name!r}: {exc}") from None
    if loaders is not None:  # what RETURNN's eval DataLoader draws before its first batch
        loaders.before_eval(name, pipeline.batches_are_datapipe)
    acc = EpochAccounting()
    try:
        for batch in pipeline:
            ctx = RunCtx("eval", train_flag=False, epoch=p.epoch, step=acc.num_steps)
            b.compute.run_user_step(train_step, ctx, b.compute.to_device(batch), stage=f"eval of {name!r}")
            acc.add(stack_losses(ctx.losses))
    finally:
        pipeline.close()
    if b.dist:  # the sums of all ranks' shares
        b.dist.all_reduce_accounting(acc)
    if acc.num_steps == 0:
        raise DataError(f"eval dataset {name!r} is empty (or every sequence was filtered out)")
    prefix = f"{name}_loss_"
    return acc.scores(prefix, exp=config.bool("calculate_exp_loss")), acc.error_keys(prefix)
