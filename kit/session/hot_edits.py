"""Hot edits in a notebook: re-run the cell that defines ``train_step``, ``forward_step`` or the model's class,
and the next ``session.train_*`` call runs the new code on the same state (weights, optimizer, position).

At each train call (``run_begin``) a function or class of the session that its module now binds to a
*different* object of the same name — what re-running its cell does — is replaced: the config's
``train_step`` / ``forward_step`` / ``get_model`` by the new function, and each module of the model whose
class was redefined gets the new class (``module.__class__``: its parameters and buffers stay). A code
version (a hash of the sources of ``train_step``, ``forward_step`` and the model's own classes) is recorded
per run segment: the history's ``code_version`` column says which version trained each step, the score
meta's ``code_version`` which versions trained each epoch (written when the train call ends) (comma-separated when it changed mid-epoch).
"""

from __future__ import annotations

import bisect
import hashlib
import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("kit")

FUNCTION_KEYS = ("train_step", "forward_step", "get_model")


def redefined(obj: Any) -> Any:
    """The object ``obj``'s module binds to ``obj``'s name now, when it is another one of the same kind and
    qualified name (its cell ran again); None otherwise."""
    name, qualname = getattr(obj, "__name__", None), getattr(obj, "__qualname__", "")
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    if module is None or not name or name != qualname:  # nested or local definitions are not looked up
        return None
    now = getattr(module, name, None)
    if now is None or now is obj or type(now) is not type(obj) or getattr(now, "__qualname__", "") != qualname:
        return None
    return now


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        code = getattr(obj, "__code__", None)
        return repr((code.co_code, code.co_consts)) if code is not None else repr(obj)


def _own_classes(model: Any) -> list[type]:
    """The model's module classes that are not torch's own, in first-seen order."""
    seen: dict[type, None] = {}
    for module in model.modules() if model is not None else []:
        cls = type(module)
        if not cls.__module__.startswith("torch."):
            seen.setdefault(cls, None)
    return list(seen)


def code_version(functions: list[Any], classes: list[type]) -> str:
    """A short hash of the functions' and classes' sources (the same code gives the same version)."""
    digest = hashlib.sha256()
    for obj in [*functions, *classes]:
        if obj is not None:
            digest.update(f"{getattr(obj, '__qualname__', '')}\n{_source(obj)}\n".encode())
    return digest.hexdigest()[:10]


class HotEdits:
    """Subscribes to a session's events; ``segments`` holds ``(first global step, code version)``.

    Reads the engine through what it needs: ``model()`` (None before set-up), ``global_step()``, ``scores()``
    (the score table or None) and ``save_scores()``."""

    def __init__(self, config: Any, history: Any, *, model: Callable[[], Any], global_step: Callable[[], int],
                 scores: Callable[[], Any], save_scores: Callable[[], None]):
        self.config, self.history = config, history
        self._model, self._global_step, self._scores, self._save_scores = model, global_step, scores, save_scores
        self.segments: list[tuple[int, str]] = []
        # per call only lookups: the model's own classes once per model, a version once per set of code objects
        self._classes: tuple[Any, list[type]] | None = None  # (weakref to the model, its own classes)
        self._version: tuple[tuple[Any, ...], str] | None = None  # (the code objects hashed, their version)

    def attach(self, events: Any) -> HotEdits:
        events.on("run_begin", self.on_run_begin)
        events.on("run_end", self.on_run_end)
        return self

    def refresh(self) -> list[str]:
        """Swap in redefined functions and model classes; returns what changed."""
        changed, updates = [], {}
        for key in FUNCTION_KEYS:
            new = redefined(self.config.typed_value(key, None))
            if new is not None:
                updates[key] = new
                changed.append(key)
        if updates:
            self.config.update(updates)
        model = self._model()
        new_classes = {cls: new for cls in self._own_classes(model) if (new := redefined(cls)) is not None}
        if new_classes:
            for module in model.modules():
                new_cls = new_classes.get(type(module))
                if new_cls is not None:
                    module.__class__ = new_cls
            changed += [cls.__qualname__ for cls in new_classes.values()]
            self._classes = None  # the model's classes changed
        return list(dict.fromkeys(changed))

    def _own_classes(self, model: Any) -> list[type]:
        """The model's own classes, looked up once per model (walking its modules at every call would cost
        a large model milliseconds)."""
        if model is None:
            return []
        if self._classes is None or self._classes[0]() is not model:
            self._classes = (weakref.ref(model), _own_classes(model))
        return self._classes[1]

    def current_version(self) -> str:
        functions = [self.config.typed_value(k, None) for k in ("train_step", "forward_step")]
        objects = (*functions, *self._own_classes(self._model()))
        if self._version is None or len(self._version[0]) != len(objects) or \
                any(a is not b for a, b in zip(self._version[0], objects)):
            # hashing reads the sources (inspect.getsource: milliseconds): only when the code objects changed
            self._version = (objects, code_version(functions, list(objects[len(functions):])))
        return self._version[1]

    def on_run_begin(self, **_: Any) -> None:
        changed = self.refresh()
        version = self.current_version()
        step = self._global_step()
        if not self.segments or self.segments[-1][1] != version:
            if self.segments:
                logger.info("code version %s from global step %d (%s)", version, step,
                            "redefined: " + ", ".join(changed) if changed else "the code changed")
            self.segments.append((step, version))
            self.history.code_segments = self.segments

    def version_at(self, global_step: int) -> str | None:
        starts = [s for s, _ in self.segments]
        i = bisect.bisect_right(starts, global_step) - 1
        return self.segments[i][1] if i >= 0 else None

    def on_run_end(self, **_: Any) -> None:
        """The epochs this call ended get their code versions in the score meta (one score file write)."""
        table = self._scores()
        if table is None or not self.segments:
            return
        changed = False
        for epoch in table.epochs:
            meta = table.meta(epoch)
            first, end = meta.get("global_train_step"), meta.get("global_train_step_end")
            if "code_version" in meta or first is None or end is None or end <= self.segments[0][0]:
                continue  # known already, not trained yet, or trained before this session
            versions = [v for s, v in self.segments if first <= s < end]
            start = self.version_at(first)
            table.set_meta(epoch, code_version=",".join(dict.fromkeys(([start] if start else []) + versions)))
            changed = True
        if changed:
            self._save_scores()
