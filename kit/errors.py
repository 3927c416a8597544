"""The exceptions kit raises on purpose, importable as ``kit.<Name>``."""

from __future__ import annotations


class KitError(Exception):
    """Base class of every error kit raises deliberately."""


class ConfigError(KitError, ValueError):
    """One or more config values are wrong; the message lists every problem at once."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            msg = self.problems[0]
        else:
            msg = f"{len(self.problems)} config problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(msg)


class DataError(KitError, ValueError):
    """A dataset or batch does not match what ``extern_data`` declares, or is unusable."""


class NonFiniteLossError(KitError, FloatingPointError):
    """A loss or gradient norm was NaN/Inf; the update was not applied."""

    def __init__(self, message: str, *, epoch: int | None = None, step: int | None = None,
                 nonfinite: list[str] | None = None, global_train_step: int | None = None):
        super().__init__(message)
        self.epoch = epoch
        self.step = step
        self.global_train_step = global_train_step
        self.nonfinite = list(nonfinite or [])


class CheckpointError(KitError):
    """Base class of checkpoint problems."""


class UnsafeCheckpointError(CheckpointError):
    """A file needs code execution to unpickle and was refused."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is truncated, corrupt, or does not match its manifest."""


class PrefixLockedError(CheckpointError, RuntimeError):
    """Another live run holds the lock on this model prefix (the message names its pid)."""


class ScoreFileError(KitError, ValueError):
    """A score / learning-rate file cannot be read (or would need code execution to be read); names the file."""


class SessionStateError(KitError, RuntimeError):
    """A Session call is not allowed in the session's current state."""
