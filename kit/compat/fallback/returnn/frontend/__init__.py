"""``returnn.frontend`` as far as pure-torch configs use it: the run context (kit's, in RETURNN's forms)."""

from kit.compat.run_ctx import ReturnnRunCtx as RunCtx
from kit.compat.run_ctx import get_run_ctx
from kit.compat.tensor import Dim, Tensor, TensorDict, batch_dim

__all__ = ["Dim", "RunCtx", "Tensor", "TensorDict", "batch_dim", "get_run_ctx"]


def __getattr__(name: str) -> object:
    """Anything else is RETURNN's own: one error saying what to install."""
    from kit.compat.imports import missing_attribute

    raise missing_attribute('returnn.frontend', name)
