"""``returnn.tensor``: views over kit's batch fields with RETURNN's names."""

from kit.compat.tensor import Dim, Tensor, TensorDict, batch_dim, single_step_dim

__all__ = ["Dim", "Tensor", "TensorDict", "batch_dim", "single_step_dim"]
