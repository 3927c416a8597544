"""Old import path of the TensorBoard writer: it lives in :mod:`kit.loggers.tensorboard` now."""

from kit.loggers.tensorboard import (
    DEFAULT_LOG_EVERY,
    OPTION_KEYS,
    TensorBoardLogger,
    check_options,
    default_log_dir,
)

__all__ = ["DEFAULT_LOG_EVERY", "OPTION_KEYS", "TensorBoardLogger", "check_options", "default_log_dir"]
