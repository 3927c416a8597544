"""The helpers of ``returnn.util.basic`` that RETURNN configs commonly call."""

from kit.compat.helpers import (
    BackendEngine,
    NotSpecified,
    get_login_username,
    get_model_filename_postfix,
    human_bytes_size,
    human_size,
    model_epoch_from_filename,
)

__all__ = [
    "BackendEngine",
    "NotSpecified",
    "get_login_username",
    "get_model_filename_postfix",
    "human_bytes_size",
    "human_size",
    "model_epoch_from_filename",
]


def __getattr__(name: str) -> object:
    """Anything else is RETURNN's own: one error saying what to install."""
    from kit.compat.imports import missing_attribute

    raise missing_attribute('returnn.util.basic', name)
