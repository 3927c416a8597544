"""Put this directory on PYTHONPATH to start Python as if RETURNN were not installed.

A meta-path finder refuses the real ``returnn`` package (kit's own stand-in in
``kit/compat/fallback`` stays importable while kit activates it).
"""

import importlib.machinery
import sys


class _HideReturnn:
    def find_spec(self, name, path=None, target=None):
        if name != "returnn" and not name.startswith("returnn."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        origin = (spec.origin or "") if spec is not None else ""
        if spec is not None and "site-packages" in origin:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden for the test)", name=name)
        return None


sys.meta_path.insert(0, _HideReturnn())
