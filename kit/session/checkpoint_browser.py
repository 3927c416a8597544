"""``session.checkpoints``: browse, inspect, compare and restore checkpoint files.

``load`` only puts weights into the model for a look (training refuses to continue
until ``restore`` or ``reload_latest``); ``restore`` rewinds the whole training state.
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from kit import checkpoints
from kit.errors import CheckpointError, CorruptCheckpointError, SessionStateError

if TYPE_CHECKING:
    from kit.session.facade import Session
    from kit.session.parts import SessionParts

# verification hashes whole files: remember results per (path, size, mtime)
_VERIFIED: dict[tuple, bool] = {}


def _stat_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns

# the table's columns (score columns and is_best_* follow when there are scores)
TABLE_COLUMNS = ("name", "kind", "epoch", "global_train_step", "path", "size_mb", "time", "complete", "verified",
                 "would_remove")


class CheckpointBrowser:
    """``session.checkpoints``: the checkpoint files under the session's ``model`` prefix."""

    def __init__(self, session: Session, parts: SessionParts):
        self._session, self._parts = session, parts
        self.prefix: str = session.config.typed_value("model") or ""

    # ---- listing ------------------------------------------------------------------------

    def list(self) -> list[checkpoints.Checkpoint]:
        return checkpoints.list_checkpoints(self.prefix) if self.prefix else []

    def find(self, which: Any) -> checkpoints.Checkpoint:
        """A checkpoint by epoch number, ``"step:N"`` (global step), Checkpoint, or file path."""
        if isinstance(which, checkpoints.Checkpoint):
            return which
        found = self.list()
        if isinstance(which, int):
            match = [c for c in found if c.kind == "epoch" and c.epoch == which]
        elif isinstance(which, str) and which.startswith("step:"):
            if not which[5:].strip().isdigit():
                raise CheckpointError(f"checkpoints.find({which!r}): after 'step:' comes a global train step, "
                                      "e.g. 'step:1250'")
            match = [c for c in found if c.global_train_step == int(which[5:]) and c.kind == "step"]
        else:
            match = [c for c in found if str(which) in (c.path, c.name)]
        if not match:
            known = ", ".join(c.name for c in found) or "none"
            raise CheckpointError(f"no checkpoint {which!r} under model={self.prefix!r} (found: {known})")
        return match[-1]

    def verified(self, ckpt: checkpoints.Checkpoint) -> bool:
        """Whether the files match the manifest's sha256 (remembered while no file changes); an epoch whose
        training state was removed (RETURNN's rule keeps the last two) is judged by its weights."""
        key = (ckpt.path, *(_stat_key(p) for p in (ckpt.path, ckpt.opt_path, ckpt.manifest_path)))
        if key not in _VERIFIED:
            try:
                checkpoints.verify(ckpt, train_state=not ckpt.weights_only)
                _VERIFIED[key] = True
            except CheckpointError:
                _VERIFIED[key] = False
        return _VERIFIED[key]

    @property
    def table(self) -> Any:
        """DataFrame: one row per checkpoint with what one chooses by — name, kind, epoch, step,
        complete / verified, scores, best flags (``is_best_<score>``) and, with ``cleanup_old_models``
        set, the cleanup preview (``would_remove``). Paths, sizes and times: :attr:`table_all`."""
        frame = self.table_all
        hidden = {"path", "size_mb", "time"}
        if not self._session.config.typed_value("cleanup_old_models"):
            hidden.add("would_remove")
        return frame[[c for c in frame.columns if c not in hidden]]

    @property
    def table_all(self) -> Any:
        """DataFrame: :attr:`table` plus each checkpoint's path, size (MB), time and cleanup preview."""
        import pandas as pd

        scores = self._session.info().score_table
        ckpts = self.list()
        # the cleanup each epoch end runs, as a dry run: same scores, same protection
        would_remove = {c.path for c in self._parts.cleanup_preview()} if ckpts else set()
        rows = []
        for c in ckpts:
            row = {"name": c.name, "kind": c.kind, "epoch": c.epoch, "global_train_step": c.global_train_step,
                   "path": c.path, "size_mb": round(c.size / 2**20, 3),
                   "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.mtime)) if c.mtime else None,
                   "complete": c.complete, "verified": c.complete and self.verified(c),
                   "would_remove": c.path in would_remove}
            if c.kind == "epoch" and scores is not None and c.epoch in scores.epochs:
                row.update(scores.scores(c.epoch))
            rows.append(row)
        frame = pd.DataFrame(rows, columns=None if rows else list(TABLE_COLUMNS))  # empty: the columns stay
        for key in [k for k in frame.columns if "_loss_" in k or k.endswith("_score")]:
            best = frame[key].min()
            frame[f"is_best_{key}"] = frame[key] == best
        return frame

    # ---- inspect / restore --------------------------------------------------------------

    def load(self, which: Any) -> checkpoints.Checkpoint:
        """Put a checkpoint's weights into the model for inspection; training state untouched."""
        ckpt = self._usable(which)
        model_file, _ = checkpoints.load_checkpoint(ckpt, load_train_state=False)
        self._parts.inspect(ckpt.name, model_file["model"])
        print(f"loaded the weights of {ckpt.name} for inspection; training state untouched. "
              "train_* refuses until session.checkpoints.restore(...) or session.checkpoints.reload_latest()")
        return ckpt

    def restore(self, which: Any) -> checkpoints.Checkpoint:
        """Rewind the whole training state (weights, optimizer, progress, data, RNG, scores)."""
        ckpt = self._usable(which)
        self._parts.restore(ckpt)
        return ckpt

    def reload_latest(self) -> None:
        """Leave inspection: put back the training state from before :meth:`load`, or (when there is none in
        memory) restore the newest complete checkpoint."""
        self._parts.reload_latest()

    def _usable(self, which: Any) -> checkpoints.Checkpoint:
        ckpt = self.find(which)
        if not ckpt.complete:
            raise CorruptCheckpointError(f"checkpoint {ckpt.path} is incomplete (no manifest): it cannot be loaded")
        checkpoints.verify(ckpt)
        return ckpt

    def export_safetensors(self, which: Any, path: str | None = None) -> str:
        ckpt = self._usable(which)
        model_file, _ = checkpoints.load_checkpoint(ckpt, load_train_state=False)
        return checkpoints.export_safetensors(model_file["model"], path or ckpt.path[: -len(".pt")] + ".safetensors")

    def delete(self, which: Any) -> None:
        ckpt = self.find(which)
        last = self._session.info().last_checkpoint
        if last is not None and ckpt.path == last.path:
            raise SessionStateError(f"{ckpt.name} is the session's newest checkpoint; it is kept")
        checkpoints.delete(ckpt)

    # ---- compare ----------------------------------------------------------------------

    def weights(self, which: Any) -> dict[str, torch.Tensor]:
        if which == "current":
            return {k: v.detach().cpu() for k, v in self._parts.model().state_dict().items()}
        model_file, _ = checkpoints.load_checkpoint(self._usable(which), load_train_state=False)
        return model_file["model"]

    def compare(self, a: Any, b: Any = "current", *, batch: Any = None) -> Any:
        """DataFrame per parameter: norms of a and b, L2 difference, relative change.

        With ``batch``, ``.attrs["outputs"]`` holds the max abs difference of each forward
        output of the two weight sets on that batch.
        """
        import pandas as pd

        wa, wb = self.weights(a), self.weights(b)
        rows = []
        for name in wa:
            if name not in wb or not torch.is_floating_point(wa[name]):
                continue
            ta, tb = wa[name].double(), wb[name].double()
            na, nb, diff = ta.norm().item(), tb.norm().item(), (tb - ta).norm().item()
            rows.append({"param": name, "shape": tuple(ta.shape), "norm_a": na, "norm_b": nb,
                         "l2_diff": diff, "rel_change": diff / na if na > 0 else math.inf if diff else 0.0})
        frame = pd.DataFrame(rows).set_index("param")
        if batch is not None:
            frame.attrs["outputs"] = self._compare_outputs(wa, wb, batch)
        return frame

    def _compare_outputs(self, wa: dict, wb: dict, batch: Any) -> dict[str, float]:
        session = self._session
        model = self._parts.model()
        live = {k: v.detach().clone() for k, v in model.state_dict().items()}
        outs = []
        try:
            for weights in (wa, wb):
                checkpoints.load_into_model(model, weights)
                result = session.forward(batch)
                outs.append(result)
        finally:
            checkpoints.load_into_model(model, live)
        diffs: dict[str, float] = {}
        for tag in outs[0]:
            for name, arr in outs[0][tag].items():
                d = float(abs(arr - outs[1][tag][name]).max()) if arr.size else 0.0
                diffs[name] = max(diffs.get(name, 0.0), d)
        return diffs

    def widget(self) -> Any:
        from kit.widgets.checkpoints import CheckpointWidget

        return CheckpointWidget(self, session=self._session)  # it refreshes on the session's checkpoint events

    def _repr_html_(self) -> str:
        try:
            return self.table._repr_html_()
        except ImportError:
            return f"<pre>{self!r}</pre>"

    def __repr__(self) -> str:
        return "CheckpointBrowser(" + ", ".join(c.name for c in self.list()) + ")"

