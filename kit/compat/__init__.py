"""RETURNN compatibility: RETURNN's names on kit's objects, applied at the config boundary.

- :mod:`kit.compat.tensor`: ``Dim`` / ``Tensor`` / ``TensorDict`` views over kit's batch fields;
- :mod:`kit.compat.run_ctx`: RETURNN's run-context calls on kit's ``RunCtx``;
- :mod:`kit.compat.imports`: ``import returnn...`` in a config without RETURNN installed;
- :mod:`kit.compat.step`, :mod:`kit.compat.bridge`: RETURNN-style user functions adapted for kit;
- :mod:`kit.compat.returnn_keys`: every RETURNN config key and kit's status for it;
- :mod:`kit.compat.returnn_run`: continuing (and handing back) a RETURNN run directory;
- :mod:`kit.compat.seeding`: RETURNN's frontend seeded where RETURNN's engine seeds it;
- :mod:`kit.compat.run_files`: RETURNN's rule for old optimizer states in a run directory.

The engine never sees any of it: :func:`adapt_config_values` rewrites what a config holds before
kit reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kit.compat.imports import note_fallback_used, returnn_imports, returnn_installed
from kit.compat.returnn_keys import RETURNN_KEYS, is_returnn_only_key, translate, warn_unsupported

USER_FUNCTION_KEYS = ("get_model", "train_step", "forward_step")

__all__ = [
    "RETURNN_KEYS",
    "adapt_config_values",
    "is_returnn_only_key",
    "note_fallback_used",
    "returnn_imports",
    "returnn_installed",
]


def adapt_config_values(
    values: Mapping[str, Any], get: Callable[[str], Any], *, source: str | None = None
) -> dict[str, Any]:
    """``values`` (a config's new settings) with RETURNN's forms turned into kit's.

    RETURNN-only keys are translated or named in one warning and dropped; ``extern_data`` written
    with RETURNN ``dims`` gets kit's ``shape`` form; RETURNN-style user functions are wrapped.
    ``get(name)`` reads the current value of a key not in ``values``.
    """
    out = {k: v for k, v in values.items() if not is_returnn_only_key(k)}
    updates, unsupported = translate(values, lambda n: values[n] if n in values else get(n))
    out.update(updates)
    warn_unsupported(unsupported, source)

    def current(name: str) -> Any:
        return values[name] if name in values else get(name)

    if "extern_data" in out:
        out["extern_data"] = kit_extern_data(out["extern_data"])
    if any(k in out for k in USER_FUNCTION_KEYS):
        from kit.compat.global_config import ReturnnGlobals
        from kit.compat.step import adapt_function

        spec = {"extern_data": current("extern_data"), "model_outputs": current("model_outputs"),
                "returnn_globals": ReturnnGlobals(values)}  # RETURNN's global config holds them all (rf_* keys too)
        for key in USER_FUNCTION_KEYS:
            if key in out:
                out[key] = adapt_function(key, out[key], spec)
    return out


def kit_extern_data(spec: Any) -> Any:
    """RETURNN's ``{"dims": [batch_dim, time_dim, feature_dim], ...}`` entries as kit's ``shape`` form."""
    if not isinstance(spec, Mapping) or not any(isinstance(v, Mapping) and "dims" in v for v in spec.values()):
        return spec
    from kit.compat.tensor import dims_spec_to_kit

    return {k: dims_spec_to_kit(v) if isinstance(v, Mapping) and "dims" in v else v for k, v in spec.items()}
