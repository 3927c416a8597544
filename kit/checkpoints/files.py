"""Checkpoint files on disk: atomic save with a manifest, safe load, verify, latest, delete (names: naming.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from kit import fileio
from kit.checkpoints import hashing
from kit.checkpoints.foreign import foreign_file_error, foreign_files
from kit.checkpoints.hashing import hash_in_background, write_torch_file
from kit.checkpoints.manifest import (  # noqa: F401 - MANIFEST_FORMAT: a public name of this module
    EMBEDDED,
    MANIFEST_FORMAT,
    embedded_manifest,
    manifest_fields,
    read_manifest_file,
)
from kit.checkpoints.naming import checkpoint_file_pattern, checkpoint_paths
from kit.checkpoints.safe_load import (  # noqa: F401 - public names of this module before the split
    CheckpointNotFoundError,
    NotSafetensorsError,
    export_safetensors,
    load,
    refuse_if_code_carrying,
)
from kit.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError

logger = logging.getLogger("kit")

_KINDS = ("step", "epoch")  # order at equal global step: a step checkpoint is older than the epoch one
_MARK = "kit_version"  # in every file kit writes: see foreign.py


# ----------------------------------------------------------------------------------------------
# naming


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One checkpoint on disk (it may be incomplete: ``complete`` means the manifest is present)."""

    epoch: int
    global_train_step: int | None
    kind: str  # "epoch" | "step"
    path: str
    opt_path: str
    manifest_path: str
    complete: bool
    embedded: bool = False  # the manifest is inside the model file (RETURNN's layout): no manifest file

    @property
    def name(self) -> str:
        """The file name of the model file without ``.pt``, e.g. ``model.003`` or ``model.003.step00001250``."""
        return os.path.basename(self.path)[: -len(".pt")]

    @property
    def exists(self) -> bool:
        return os.path.exists(self.path)

    @property
    def weights_only(self) -> bool:
        """Complete, but its training-state file is gone (RETURNN's rule keeps the last two epochs'): its
        weights still load and verify (``verify(ckpt, train_state=False)``), training cannot continue from it."""
        return self.complete and not os.path.exists(self.opt_path)

    @property
    def size(self) -> int:
        """Bytes of the model and training-state files together."""
        return sum(os.path.getsize(p) for p in (self.path, self.opt_path) if os.path.exists(p))

    @property
    def mtime(self) -> float | None:
        for p in (self.manifest_path, self.path):
            if os.path.exists(p):
                return os.path.getmtime(p)
        return None

    @property
    def sort_key(self) -> tuple[float, int, int]:
        step = -1 if self.global_train_step is None else self.global_train_step
        return (step, self.epoch, _KINDS.index(self.kind))

    def manifest(self) -> dict:
        """The parsed manifest; :class:`CorruptCheckpointError` if missing or unreadable."""
        return _read_manifest(self)

    def __str__(self) -> str:
        state = "" if self.complete else " (incomplete)"
        return f"{self.name} [epoch {self.epoch}, step {self.global_train_step}]{state}"


def list_checkpoints(prefix: str) -> list[Checkpoint]:
    """Every checkpoint of ``prefix`` with at least one file present, oldest first.

    Never raises or blocks on what the files hold: a malformed manifest only makes its
    checkpoint's step unknown here (loading it then says what is wrong).
    """
    directory = os.path.dirname(prefix) or "."
    if not os.path.isdir(directory):
        return []
    pattern = checkpoint_file_pattern(prefix)
    found = set()
    for name in os.listdir(directory):
        m = pattern.match(name)
        if m:
            found.add((int(m.group(1)), None if m.group(2) is None else int(m.group(2))))
    ckpts = [_make_checkpoint(prefix, epoch, step) for epoch, step in found]
    return _sorted(ckpts)


def _make_checkpoint(prefix: str, epoch: int, step: int | None) -> Checkpoint:
    kind = "epoch" if step is None else "step"
    path, opt_path, manifest_path = checkpoint_paths(prefix, epoch, global_train_step=step, kind=kind)
    complete = os.path.exists(manifest_path)
    if kind == "epoch" and complete:
        try:
            step = read_manifest_file(manifest_path)["global_train_step"]
        except CorruptCheckpointError:
            step = None
    if not complete and (embedded := embedded_manifest(path)) is not None:
        if (embedded["epoch"], embedded["kind"]) == (epoch, kind):
            return Checkpoint(epoch, embedded["global_train_step"], kind, path, opt_path, manifest_path, True,
                              embedded=True)
    return Checkpoint(epoch, step, kind, path, opt_path, manifest_path, complete)


def _sorted(ckpts: list[Checkpoint]) -> list[Checkpoint]:
    """Order by (global step, epoch, step-kind before epoch-kind).

    An epoch checkpoint whose step is unknown (no manifest) ended after every checkpoint of an
    epoch <= its own, so it is placed right after the newest of those.
    """
    known = [c for c in ckpts if c.global_train_step is not None]

    def key(c: Checkpoint) -> tuple:
        if c.global_train_step is not None:
            return c.sort_key
        before = [k.global_train_step for k in known if k.epoch <= c.epoch and k.global_train_step is not None]
        return (max(before, default=-1), c.epoch, _KINDS.index(c.kind))

    return sorted(ckpts, key=key)


# ----------------------------------------------------------------------------------------------
# saving


def _write_manifest(path: str, manifest: dict) -> None:
    fileio.atomic_write_bytes(path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())


LAYOUTS = ("kit", "returnn")


def save(
    prefix: str,
    *,
    epoch: int,
    model_state: dict,
    train_state: dict | None,
    global_train_step: int,
    effective_learning_rate: float | None = None,
    kind: str = "epoch",
    config_digest: str = "",
    extra_meta: dict | None = None,
    config_keys: Mapping[str, str] | None = None,
    layout: str = "kit",
) -> Checkpoint:
    """Write a checkpoint: model file, training-state file, then the manifest that completes it.

    A crash at any point leaves every earlier checkpoint untouched and this one incomplete
    (it does not count). Temp files left by an earlier crash of a writer of this prefix are
    removed first (never those of another prefix, nor of a live writer). ``config_keys``: a
    digest per config key, so that a resume can name the keys that changed.

    ``layout="returnn"``: only the files RETURNN writes — the training state first, then the model file,
    which carries the manifest (``kit_manifest``; the model file's own digest is left out) and, written
    last, completes the checkpoint. RETURNN reads both files as its own.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"checkpoint layout must be one of {LAYOUTS}, got {layout!r}")
    meta = manifest_fields(epoch, global_train_step, kind, effective_learning_rate, config_digest,
                            extra_meta, config_keys)
    path, opt_path, manifest_path = checkpoint_paths(
        prefix, epoch, global_train_step=global_train_step, kind=kind
    )
    directory = os.path.dirname(os.path.abspath(path))
    pattern = checkpoint_file_pattern(prefix)
    for stale in fileio.remove_stale_temp_files(directory, lambda name: pattern.match(name) is not None):
        logger.info("Removed temp file of an interrupted write: %s", stale)
    _refuse_foreign(path, opt_path, manifest_path)
    # Overwriting: un-complete the old checkpoint first (its manifest; in RETURNN's layout also the model
    # file that carries it), so that no manifest ever describes mixed files.
    _remove(manifest_path, *((path,) if layout == "returnn" else ()), directory=directory)
    model_file = {
        "model": model_state,
        "epoch": int(epoch),
        "step": int(global_train_step),
        "effective_learning_rate": meta["effective_learning_rate"],
        "kit_version": meta["kit_version"],
    }
    if layout == "kit":
        files = {"model": write_torch_file(path, model_file), "train_state": _write_train_state(opt_path, train_state)}
        _write_manifest(manifest_path, {**meta, "files": files})
    else:
        files = {"model": None, "train_state": _write_train_state(opt_path, train_state)}
        write_torch_file(path, {**model_file, EMBEDDED: {**meta, "embedded": True, "files": files}})
    logger.info("Saved checkpoint %s", path)
    return Checkpoint(int(epoch), int(global_train_step), kind, path, opt_path, manifest_path, True,
                      embedded=layout == "returnn")


def _write_train_state(opt_path: str, train_state: dict | None) -> dict[str, Any] | None:
    """The training-state file (marked as kit's; load_checkpoint takes the mark off); None removes a stale one."""
    import kit

    if train_state is None:
        _remove(opt_path, directory=None)
        return None
    if isinstance(train_state, dict):
        train_state = {**train_state, _MARK: kit.__version__}
    return write_torch_file(opt_path, train_state)


def _remove(*paths: str, directory: str | None) -> None:
    """Unlink those of ``paths`` that exist; then make the removal durable when ``directory`` is given."""
    removed = False
    for p in paths:
        if os.path.lexists(p):
            os.unlink(p)
            removed = True
    if removed and directory is not None:
        fileio.fsync_dir(directory)


def _refuse_foreign(path: str, opt_path: str, manifest_path: str) -> None:
    """A CheckpointError naming the first file of this checkpoint name that kit did not write.

    Files a readable kit manifest describes are kit's; any other existing file must carry kit's
    marks (a damaged file does not: kit's writes are atomic, so it is somebody else's).
    """
    if found := foreign_files_of(path, opt_path, manifest_path):
        raise CheckpointError(foreign_file_error(found[0]))


def foreign_files_of(path: str, opt_path: str, manifest_path: str) -> list[str]:
    """The model / training-state files of one checkpoint name that kit did not write."""
    described: set[str] = set()
    if os.path.lexists(manifest_path):
        try:
            entries = read_manifest_file(manifest_path)["files"]
        except CorruptCheckpointError:
            entries = {}
        described = {os.path.join(os.path.dirname(path), e["name"]) for e in entries.values() if e is not None}
    return foreign_files([p for p in (path, opt_path) if p not in described])


def _read_manifest(ckpt: Checkpoint) -> dict:
    if not os.path.lexists(ckpt.manifest_path) and (embedded := embedded_manifest(ckpt.path)) is not None:
        if (embedded["epoch"], embedded["kind"]) != (ckpt.epoch, ckpt.kind):
            raise CorruptCheckpointError(f"The manifest in {ckpt.path} describes epoch {embedded['epoch']} "
                                         f"({embedded['kind']}), not {ckpt.name}")
        return embedded
    if not os.path.lexists(ckpt.manifest_path):
        raise CorruptCheckpointError(
            f"Checkpoint {ckpt.name} is incomplete: manifest {ckpt.manifest_path} missing"
        )
    manifest = read_manifest_file(ckpt.manifest_path)
    if manifest.get("epoch") != ckpt.epoch or manifest.get("kind") != ckpt.kind:
        raise CorruptCheckpointError(
            f"Manifest {ckpt.manifest_path} describes epoch {manifest.get('epoch')} "
            f"({manifest.get('kind')}), not {ckpt.name}"
        )
    return manifest


def _check_size(path: str, entry: dict) -> None:
    if not os.path.isfile(path):
        raise CorruptCheckpointError(f"Checkpoint file missing: {path}")
    size = os.path.getsize(path)
    if size != entry["size"]:
        what = "truncated" if size < entry["size"] else "longer than written"
        raise CorruptCheckpointError(f"{path} is {what}: {size} bytes, manifest says {entry['size']}")


def _check_digest(path: str, entry: dict, digest: str) -> None:
    if digest != entry["sha256"]:
        raise CorruptCheckpointError(
            f"{path} is corrupt: sha256 {digest[:12]}… does not match the manifest ({entry['sha256'][:12]}…)"
        )


def _files_of(ckpt: Checkpoint, manifest: dict, *, train_state: bool) -> list[tuple[str, dict]]:
    """(path, manifest entry) of the files to check: the model file, and the training state if wanted."""
    files = [] if manifest["files"]["model"] is None else [(ckpt.path, manifest["files"]["model"])]
    if train_state and manifest["files"].get("train_state") is not None:
        files.append((ckpt.opt_path, manifest["files"]["train_state"]))
    return files


def _verify(ckpt: Checkpoint, *, train_state: bool = True) -> dict:
    manifest = _read_manifest(ckpt)
    for path, entry in _files_of(ckpt, manifest, train_state=train_state):
        _check_size(path, entry)
        _check_digest(path, entry, hashing.sha256_of(path))
    return manifest


def verify(ckpt: Checkpoint, *, train_state: bool = True) -> None:
    """Check the manifest and both files (presence, size, sha256); raises :class:`CorruptCheckpointError`.
    ``train_state=False``: the model file only (the weights, e.g. when the training state was removed)."""
    _verify(ckpt, train_state=train_state)


def latest(prefix: str, *, verify: bool = True) -> Checkpoint | None:
    """The newest complete (and, by default, verified) checkpoint; newer broken ones are warned about."""
    for ckpt in reversed(list_checkpoints(prefix)):
        try:
            if not ckpt.complete:
                raise CorruptCheckpointError("incomplete: no manifest (interrupted save or delete)")
            if verify:
                _verify(ckpt)
        except CorruptCheckpointError as e:
            _stop_if_unsafe(e)
            _warn_skipped(ckpt, e)
            continue
        return ckpt
    return None


def _stop_if_unsafe(error: CheckpointError) -> None:
    """A file that would run code is planted, not torn: never fall back past it."""
    if isinstance(error, UnsafeCheckpointError):
        raise error


def _warn_skipped(ckpt: Checkpoint, error: CorruptCheckpointError) -> None:
    logger.warning("Skipping checkpoint %s: %s; falling back to an older one", ckpt.name, error)


def load_checkpoint(ckpt: Checkpoint, *, load_train_state: bool = True) -> tuple[dict, dict | None]:
    """Load (model file dict, training state or None), verified against the manifest.

    The sha256 of the files is computed while they load (one read each from the page cache,
    in parallel); nothing loaded is returned unless the digests match.
    """
    manifest = _read_manifest(ckpt)
    files = _files_of(ckpt, manifest, train_state=load_train_state)
    for path, entry in files:
        try:
            _check_size(path, entry)
        except CorruptCheckpointError:
            refuse_if_code_carrying(path)  # a planted file is not a torn one, whatever its size
            raise
    digests = hash_in_background([path for path, _ in files])
    try:
        model_file = load(ckpt.path)
        if not isinstance(model_file, dict) or "model" not in model_file:
            raise CorruptCheckpointError(f"{ckpt.path} has no 'model' entry")
        model_file.pop(EMBEDDED, None)
        train_state = load(ckpt.opt_path) if any(path == ckpt.opt_path for path, _ in files) else None
    except UnsafeCheckpointError:
        digests()  # a file that would run code is the reason, whatever its hash
        raise
    except Exception:
        for (path, entry), digest in zip(files, digests()):
            _check_digest(path, entry, digest)  # a hash mismatch is the better reason; else the load error
        raise
    for (path, entry), digest in zip(files, digests()):
        _check_digest(path, entry, digest)
    if isinstance(train_state, dict):
        train_state.pop(_MARK, None)
    return model_file, train_state


def load_latest(prefix: str, *, load_train_state: bool = True) -> tuple[Checkpoint, dict, dict | None] | None:
    """Load the newest checkpoint that loads and verifies: (checkpoint, model file, training state).

    Like :func:`latest` followed by :func:`load_checkpoint`, but every file is read once (the hash is
    computed while loading); a broken newer checkpoint is warned about and skipped.
    """
    for ckpt in reversed(list_checkpoints(prefix)):
        try:
            if not ckpt.complete:
                raise CorruptCheckpointError("incomplete: no manifest (interrupted save or delete)")
            return (ckpt, *load_checkpoint(ckpt, load_train_state=load_train_state))
        except CorruptCheckpointError as e:
            _stop_if_unsafe(e)
            _warn_skipped(ckpt, e)
    return None


# ----------------------------------------------------------------------------------------------
# deleting and cleanup


def delete(ckpt: Checkpoint, *, dry_run: bool = False) -> None:
    """Remove a checkpoint: the manifest first (so it stops counting), then its files."""
    if dry_run:
        logger.info("Would delete checkpoint %s (%d bytes)", ckpt.name, ckpt.size)
        return
    size = ckpt.size
    directory = os.path.dirname(os.path.abspath(ckpt.path))
    foreign = foreign_files_of(ckpt.path, ckpt.opt_path, ckpt.manifest_path)
    for p in foreign:
        logger.warning("Not deleting %s: kit did not write it", p)
    for p in (ckpt.manifest_path, ckpt.path, ckpt.opt_path):
        if p in foreign:
            continue
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        if p == ckpt.manifest_path:
            fileio.fsync_dir(directory)
    logger.info("Deleted checkpoint %s (%d bytes)", ckpt.name, size)
