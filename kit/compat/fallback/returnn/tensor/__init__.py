"""``returnn.tensor``: views over kit's batch fields with RETURNN's names."""

from kit.compat.tensor import Dim, Tensor, TensorDict, batch_dim, single_step_dim

__all__ = ["Dim", "Tensor", "TensorDict", "batch_dim", "single_step_dim"]


def __getattr__(name: str) -> object:
    """Anything else is RETURNN's own: one error saying what to install."""
    from kit.compat.imports import missing_attribute

    raise missing_attribute('returnn.tensor', name)
