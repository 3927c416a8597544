"""The registry of known config keys: the single source for validation and ``docs/config.md``.

Each key has a name, a short type description, a default, a one-line doc and an optional
check that returns a problem string (what was expected) or ``None``. Names and meanings
follow RETURNN wherever RETURNN has the key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Check = Callable[[Any], "str | None"]


@dataclass(frozen=True)
class Key:
    name: str
    type: str
    default: Any
    doc: str
    check: Check | None = None
    section: str = ""


# ---- reusable checks -------------------------------------------------------------------


def _returnn_options(module: str, options_class: str) -> Check:
    """A dict of RETURNN's options for a key, checked by ``module.options_class.parse`` (a ConfigError naming the
    key and the bad option); the module (and torch) is imported only when a config sets the key."""

    def check(v: Any) -> str | None:
        if v is None:
            return None
        import importlib

        from kit.errors import ConfigError

        try:
            getattr(importlib.import_module(module), options_class).parse(v)
        except ConfigError as exc:
            return "a dict of RETURNN's options: " + str(exc).split(": ", 1)[1]
        return None

    return check


_cuda_graph_spec = _returnn_options("kit.engine.cuda_graph", "GraphOptions")
_optimizer_step_spec = _returnn_options("kit.engine.optimizer_step", "OptimizerStepOptions")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def positive_int(v: Any) -> str | None:
    return None if _is_int(v) and v > 0 else "a positive int"


def non_negative_int(v: Any) -> str | None:
    return None if _is_int(v) and v >= 0 else "an int >= 0"


def optional_positive_int(v: Any) -> str | None:
    return None if v is None else positive_int(v)


def non_negative_number(v: Any) -> str | None:
    return None if _is_num(v) and v >= 0 else "a number >= 0"


def optional_non_negative_number(v: Any) -> str | None:
    return None if v is None else non_negative_number(v)


def finite_non_negative_number(v: Any) -> str | None:
    return None if _is_num(v) and math.isfinite(v) and v >= 0 else "a finite number >= 0"


def positive_number(v: Any) -> str | None:
    return None if _is_num(v) and v > 0 else "a number > 0"


def boolean(v: Any) -> str | None:
    return None if isinstance(v, bool) else "True or False"


def optional_str(v: Any) -> str | None:
    return None if v is None or isinstance(v, str) else "a string or None"


def odd_window(v: Any) -> str | None:
    """RETURNN's ``window``: None, or an odd int >= 1 (an even one has no centre frame)."""
    if v is None:
        return None
    if not _is_int(v) or v < 1:
        return "an odd int >= 1 (1: no window)"
    return "an odd int >= 1 (an even window has no centre frame)" if v % 2 == 0 else None


def one_of(*choices: Any) -> Check:
    def check(v: Any) -> str | None:
        return None if v in choices else "one of " + ", ".join(repr(c) for c in choices)

    return check


def int_or_per_key(allow_none: bool = True) -> Check:
    """An int budget, or a dict key -> int (RETURNN's per-key form)."""

    def check(v: Any) -> str | None:
        if v is None and allow_none:
            return None
        if _is_int(v) and v > 0:
            return None
        if isinstance(v, dict) and v and all(isinstance(k, str) and _is_int(x) and x > 0 for k, x in v.items()):
            return None
        return "a positive int or a dict data key -> positive int"

    return check


def batch_limit(check: Check) -> Check:
    """``check``, or a callable (RETURNN calls it per sequence with ``epoch``, ``epoch_continuous``, ``seq_idx``)."""

    def either(v: Any) -> str | None:
        if callable(v) and not isinstance(v, type):
            return None
        problem = check(v)
        return None if problem is None else f"{problem}, or a function f(*, epoch, epoch_continuous, seq_idx, **kwargs)"

    return either


def int_or_callable(v: Any) -> str | None:
    return None if callable(v) or (_is_int(v) and v > 0) else "a positive int or a callable"


def number_or_callable(v: Any) -> str | None:
    return None if v is None or callable(v) or (_is_num(v) and v > 0) else "a number > 0 or a function lr -> lr"


def str_or_list(v: Any) -> str | None:
    if v is None or isinstance(v, str) or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)):
        return None
    return "a score key or a list of score keys"


def optional_callable(v: Any) -> str | None:
    return None if v is None or callable(v) else "a callable or None"


def _chunk_spec_ok(v: Any) -> bool:
    if _is_int(v):
        return v > 0
    if isinstance(v, str):
        return re.fullmatch(r"\d+(:\d+)?", v) is not None and int(v.split(":")[0]) > 0
    if isinstance(v, (tuple, list)) and len(v) == 2:
        return all(_chunk_spec_ok(x) if not isinstance(x, dict) else _per_key_ints(x) for x in v)
    return False


def _per_key_ints(v: dict) -> bool:
    return all(isinstance(k, str) and _is_int(x) and x > 0 for k, x in v.items())


def chunking_spec(v: Any) -> str | None:
    if v in (None, 0, False):
        return None
    if isinstance(v, dict):
        if _per_key_ints(v):
            return None
    elif _chunk_spec_ok(v):
        return None
    return "an int size, 'size:step', (size, step), or per-key dicts of ints (e.g. chunking='100:50')"


def amp_spec(v: Any) -> str | None:
    dtypes = ("float16", "bfloat16", "fp16", "bf16")
    if v is None or v is False:
        return None
    if isinstance(v, str) and v in dtypes:
        return None
    if isinstance(v, dict) and v.get("dtype") in dtypes:
        return None
    return "'float16', 'bfloat16', or {'dtype': ..., 'grad_scaler': {...}}"


def optimizer_spec(v: Any) -> str | None:
    if v is None or callable(v):
        return None
    if isinstance(v, dict):
        if "class" not in v:
            return "a dict with a 'class' entry, e.g. {'class': 'adamw'}"
        if "lr" in v or "learning_rate" in v:
            return "no 'lr' inside 'optimizer': set the config key 'learning_rate' instead"
        return None
    return "a dict {'class': 'adamw', ...}, an optimizer class, or a callable"


def learning_rates_spec(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, (list, tuple)) and all(finite_non_negative_number(x) is None for x in v):
        return None
    if isinstance(v, dict) and all(_is_int(k) and k > 0 and finite_non_negative_number(x) is None
                                   for k, x in v.items()):
        return None
    return "a list of finite numbers >= 0 (per epoch), or a dict epoch -> number (strings are never evaluated)"


CLEANUP_DEFAULTS: dict[str, Any] = {"keep_last_n": 2, "keep_best_n": 4, "keep": (), "dry_run": False}


def cleanup_problems(v: Any) -> list[str]:
    """Everything wrong with a ``cleanup_old_models`` value (one source for the config check and cleanup)."""
    if v is None or isinstance(v, bool):
        return []
    if not isinstance(v, dict):
        return [f"cleanup_old_models: got {v!r}, expected True, False, or a dict (keep_last_n, keep_best_n, keep, dry_run)"]
    problems = [f"cleanup_old_models: unknown option {k!r} (known: {', '.join(CLEANUP_DEFAULTS)})"
                for k in v if k not in CLEANUP_DEFAULTS]
    best = v.get("keep_best_n", 4)
    counts = [("keep_last_n", v.get("keep_last_n", 2))]
    counts += [(f"keep_best_n[{k!r}]", n) for k, n in best.items()] if isinstance(best, dict) else [("keep_best_n", best)]
    problems += [f"cleanup_old_models: {name} must be an int >= 0, got {n!r}" for name, n in counts
                 if not (_is_int(n) and n >= 0)]
    keep = v.get("keep", ())
    if not isinstance(keep, (list, tuple, set, frozenset, range)) or not all(_is_int(e) for e in keep):
        problems.append(f"cleanup_old_models: keep must be a list of epochs (ints), got {keep!r}")
    if not isinstance(v.get("dry_run", False), bool):
        problems.append(f"cleanup_old_models: dry_run must be True or False, got {v['dry_run']!r}")
    return problems


def cleanup_spec(v: Any) -> str | None:
    problems = cleanup_problems(v)
    if not problems:
        return None
    return "True, False or a dict of keep_last_n, keep_best_n, keep, dry_run; here: " + "; ".join(
        p.removeprefix("cleanup_old_models: ") for p in problems)


def device_spec(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return None
    return "None (auto), 'cpu', 'gpu', 'cuda', 'cuda:N', 'mps' or 'meta'"


def lr_control_spec(v: Any) -> str | None:
    return one_of("constant", "newbob", "newbob_rel", "newbob_abs", "newbob_multi_epoch")(v)


def _torch_batching_spec(v: Any) -> str | None:
    if v is None or callable(v) or (isinstance(v, dict) and isinstance(v.get("class"), str)):
        return None
    return "a callable f(dataset, *, train, **kwargs) -> IterableDataset of batches, or {'class': name, ...}"


def _packed_cost_spec(v: Any) -> str | None:
    if v is None or (isinstance(v, dict) and v and all(isinstance(k, str) and callable(f) for k, f in v.items())):
        return None
    return "a dict name -> f(lengths) -> cost (the name also a packed_batch_size entry)"


def _online_shuffle_spec(v: Any) -> str | None:
    size = v.get("buffer_size") if isinstance(v, dict) and set(v) <= {"buffer_size"} else v
    if v is None or (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        return None
    return "an int >= 1 (the shuffle buffer's batches) or {'buffer_size': int >= 1}"


def seq_ordering_spec(v: Any) -> str | None:
    if v is None:
        return None
    from kit.data import ordering  # the one parser of orderings (imported late: data imports config)
    from kit.errors import ConfigError

    try:
        ordering.check(v)
    except ConfigError as exc:
        return str(exc).split("expected ", 1)[-1]
    return None


_LOADER_RESERVED = ("batch_size", "batch_sampler", "sampler", "shuffle", "collate_fn", "drop_last", "dataset")
_LOADER_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "num_workers": (lambda x: _is_int(x) and x >= 0, "an int >= 0"),
    "pin_memory": (lambda x: isinstance(x, bool), "True or False"),
    "persistent_workers": (lambda x: isinstance(x, bool), "True or False"),
    "timeout": (lambda x: _is_num(x) and x >= 0, "a number >= 0 (seconds)"),
    "prefetch_factor": (lambda x: x is None or (_is_int(x) and x >= 1), "None or an int >= 1"),
    "pin_memory_device": (lambda x: isinstance(x, str), "a device name"),
    "multiprocessing_context": (lambda x: x is None or isinstance(x, str) or hasattr(x, "Process"),
                                "None, 'fork', 'spawn' or 'forkserver'"),
    "worker_init_fn": (lambda x: x is None or callable(x), "None or a function worker_id -> None"),
    "generator": (lambda x: x is None or type(x).__name__ == "Generator", "None or a torch.Generator"),
    "in_order": (lambda x: isinstance(x, bool), "True or False"),
}


def dataloader_opts_spec(v: Any) -> str | None:
    """``torch_dataloader_opts``: a dict of DataLoader keywords kit does not set itself, each of its type."""
    if v is None:
        return None
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        return "a dict of torch DataLoader options, e.g. {'num_workers': 2}"
    if reserved := [k for k in v if k in _LOADER_RESERVED]:
        return f"no {', '.join(map(repr, reserved))} (kit's batch plan sets them: batch_size, max_seqs, seq_ordering)"
    for key, value in v.items():
        if key not in _LOADER_CHECKS:
            return (f"no option {key!r}: torch_dataloader_opts takes "
                    f"{', '.join(sorted(_LOADER_CHECKS))}")
        ok, what = _LOADER_CHECKS[key]
        if not ok(value):
            return f"{key!r} to be {what}"
    return None


def eval_datasets_spec(v: Any) -> str | None:
    if v is None or (isinstance(v, dict) and all(isinstance(k, str) for k in v)):
        return None
    return "a dict name -> dataset, e.g. eval_datasets={'dev': {...}, 'test': {...}}"


def preload_spec(v: Any) -> str | None:
    expected = ("a dict name -> {'filename': ..., 'prefix': ..., 'init_for_train': ...}, "
                "e.g. preload_from_files={'base': {'filename': 'base.pt'}}")
    if v is None:
        return None
    if not isinstance(v, dict):
        return expected
    bad = [name for name, entry in v.items() if not isinstance(entry, dict) or "filename" not in entry]
    if bad:
        return f"{expected}; entry {bad[0]!r} is not a dict with a 'filename'"
    return None


def dataset_spec(v: Any) -> str | None:
    return None  # checked when the dataset is built (kit.data.make_dataset), with its own message


def _tensorboard_opts(v: Any) -> str | None:
    from kit.loggers.tensorboard import check_options

    return check_options(v)


def _dict_or_none(what: str) -> Check:
    def check(v: Any) -> str | None:
        return None if v is None or isinstance(v, dict) else what

    return check


def _csv_log(v: Any) -> str | None:
    if v is None or isinstance(v, (bool, str, dict)):
        return None
    return "True, a file path, or {'path': .., 'log_every_n_train_steps': ..}"


def _log_grad_norm(v: Any) -> str | None:
    if v is None or isinstance(v, bool) or (isinstance(v, str) and v.lower() in ("true", "false", "none")):
        return None
    return None if _is_num(v) and v > 0 else "True (the 2-norm), a number p > 0, or False / None"


def _torch_profile(v: Any) -> str | None:
    from kit.profile import check_profile

    return check_profile(v)


def _grad_clip(v: Any) -> str | None:
    if v is None or (_is_num(v) and v == 0):
        return None
    return ("0 or unset: RETURNN's torch engine refuses grad_clip; the option is called gradient_clip_global_norm "
            "(clip the global norm) or gradient_clip (clip each value)")


def _watch_stall(v: Any) -> str | None:
    from kit.engine.watch_stall import check_options

    return check_options(v)


def _k(section: str, name: str, type_: str, default: Any, doc: str, check: Check | None = None) -> Key:
    return Key(name=name, type=type_, default=default, doc=doc, check=check, section=section)


# ---- the registry ----------------------------------------------------------------------

_KEYS: list[Key] = [
    # user code
    _k("user code", "get_model", "callable", None, "get_model(*, epoch, step, **kwargs) -> torch.nn.Module", optional_callable),
    _k("user code", "train_step", "callable", None, "train_step(*, model, extern_data, **kwargs): marks losses", optional_callable),
    _k("user code", "forward_step", "callable", None, "forward_step(*, model, extern_data, **kwargs): marks outputs", optional_callable),
    _k("user code", "forward_callback", "object", None, "object with init/process_seq/finish used by `python -m kit forward`"),
    _k("user code", "extern_data", "dict", None, "data keys -> {'shape': (None, 40)} / {'shape': (None,), 'sparse_dim': 10} / RETURNN's {'dim': .., 'sparse': ..}"),
    _k("user code", "model_outputs", "dict", None, "declared forward outputs, checked against mark_as_output"),
    # data
    _k("data", "train", "dataset", None, "training dataset (object or dict with 'class')", dataset_spec),
    _k("data", "dev", "dataset", None, "dev dataset; evaluated after each train epoch", dataset_spec),
    _k("data", "eval", "dataset", None, "eval dataset; evaluated after each train epoch", dataset_spec),
    _k("data", "eval_datasets", "dict", None, "name -> dataset, evaluated after each train epoch", eval_datasets_spec),
    _k("data", "forward_data", "dataset", None, "dataset for `python -m kit forward`", dataset_spec),
    _k("data", "batch_size", "int | dict | callable", 5000, "frames per batch including padding (max_len * num_seqs), per key or for all keys; a callable f(*, epoch, epoch_continuous, seq_idx, **kw) gives it per sequence, as in RETURNN", batch_limit(int_or_per_key(allow_none=False))),
    _k("data", "batch_size_train", "int | dict | callable", None, "batch_size for training only (RETURNN's); unset: batch_size", batch_limit(int_or_per_key())),
    _k("data", "batch_size_dev", "int | dict | callable", None, "batch_size for evaluation and forwarding (RETURNN's); unset: batch_size", batch_limit(int_or_per_key())),
    _k("data", "max_seqs", "int | callable", None, "maximum number of sequences per batch; a callable as for batch_size", batch_limit(optional_positive_int)),
    _k("data", "packed_batch_size", "int | dict", None, "RETURNN's: also bound each batch's summed sequence lengths (no padding), per key or for all keys; both limits apply", int_or_per_key()),
    _k("data", "packed_batch_size_train", "int | dict", None, "packed_batch_size for training only (RETURNN's); unset: packed_batch_size", int_or_per_key()),
    _k("data", "packed_batch_size_dev", "int | dict", None, "packed_batch_size for evaluation and forwarding (RETURNN's); unset: packed_batch_size", int_or_per_key()),
    _k("data", "packed_batch_cost", "dict", None, "RETURNN's: name -> f(lengths) -> cost per sequence (lengths: a dict key -> length); a batch's summed cost stays within packed_batch_size[name]", _packed_cost_spec),
    _k("data", "packed_batch_cost_train", "dict", None, "packed_batch_cost for training only (RETURNN's); unset: packed_batch_cost", _packed_cost_spec),
    _k("data", "packed_batch_cost_dev", "dict", None, "packed_batch_cost for evaluation and forwarding (RETURNN's); unset: packed_batch_cost", _packed_cost_spec),
    _k("data", "torch_batching", "callable | dict", None, "RETURNN's: a batcher f(dataset, *, train, **kwargs) over the epoch's streamed sequence dicts (after length filter and chunking) returning an IterableDataset of lists of them, or {'class': <returnn.torch.data.pipeline class>, ...}; replaces batch_size, max_seqs and packed_batch_*; run once per epoch when it is planned (each sequence read once more), see kit/data/custom_batching.py", _torch_batching_spec),
    _k("data", "sort_dataset", "bool", True, "RETURNN's: forward runs the data longest first (sorted_reverse); False keeps the dataset's own order", boolean),
    _k("data", "min_seq_length", "int | dict", None, "drop sequences shorter than this (per key or all keys)", int_or_per_key()),
    _k("data", "max_seq_length", "int | dict", None, "drop sequences longer than this (per key or all keys)", int_or_per_key()),
    _k("data", "allow_skipping_seqs_in_forward", "bool", False, "RETURNN's: forward applies min_seq_length / max_seq_length only with this set (with a warning that sequences may be lost); without it they are an error in forward", boolean),
    _k("data", "chunking", "int | str | tuple | dict", None, "cut training sequences into chunks: size, 'size:step', (size, step), per-key dicts", chunking_spec),
    _k("data", "min_chunk_size", "int | dict", None, "drop final chunks shorter than this", int_or_per_key()),
    _k("data", "chunking_in_eval", "bool", True, "chunk eval datasets too, as RETURNN's torch engine does; False evaluates whole sequences", boolean),
    _k("data", "online_shuffle_batches", "int | dict", None, "RETURNN's: train batches shuffled within blocks of this many (or {'buffer_size': n}); complete_frac stays in order", _online_shuffle_spec),
    _k("data", "window", "int", None, "RETURNN's Dataset default: the input features ('data') as a sliding window over time, each frame with its window//2 neighbours on either side (zero-padded), [T, D*window]; odd. Given to every train/dev/eval/eval_datasets dict that sets none: kit's Task12AXDataset and HDFDataset and RETURNN's own classes (through the adapter) apply it; another kit class refuses a window > 1, as RETURNN's MetaDataset does. Declare extern_data 'data' with dim D*window", odd_window),
    _k("data", "shuffle_frames_of_nseqs", "int", 0, "RETURNN's Dataset default for the train dataset (eval datasets get 0): each epoch's order is taken in groups of n sequences (positions g*n..g*n+n-1) and the frames of each group are permuted among them with numpy RandomState(g*n), lengths kept, 'data' and frame-aligned targets alike (for frame-wise training). kit's HDFDataset and RETURNN's own classes (through the adapter) take it; another kit class refuses it. kit shuffles each epoch by that epoch's groups, the last group being the rest; RETURNN 1.20261022 (HDFDataset only) needs cache_byte_size large enough for all data (cache off: AssertionError), a sequence count that n divides (else it hangs), no target keys (else a TypeError in its preload thread leaves the data half shuffled), and keeps the frames of the first epoch it loads for later epochs", non_negative_int),
    _k("data", "seq_ordering", "str", None, "override the datasets' own seq_ordering for training", seq_ordering_spec),
    _k("data", "torch_dataloader_opts", "dict", None, "{'num_workers': k, ...}; workers never duplicate data",
       dataloader_opts_spec),
    _k("data", "data_prefetch", "int", 4, "batches loaded ahead on a background thread while the step runs (kit's own datasets that read files: HDF, DistributeFilesDataset, or Meta/Concat over them; in-memory data loads on the training thread, where it is faster; 0: off)", non_negative_int),
    _k("data", "random_seed", "int", 42, "seed for model init and training randomness (data orders follow RETURNN: epoch, fixed_random_seed, random_seed_offset)", non_negative_int),
    # training loop
    _k("training", "task", "str", "train", "RETURNN's task; in kit the command (train / eval / forward) or the Session call decides what runs", one_of("train", "eval", "forward")),
    _k("training", "num_epochs", "int", 5, "final (sub)epoch to train (RETURNN's default 5)", positive_int),
    _k("training", "start_batch", "str", "auto", "RETURNN's: only 'auto' (continue after the newest checkpoint); another value is an error, as in RETURNN", one_of("auto")),
    _k("training", "start_epoch", "int | str", "auto", "first epoch to train ('auto': continue after the newest checkpoint)"),
    _k("training", "accum_grad_multiple_step", "int | callable", 1, "micro-batches per update; gradients are summed, not averaged", int_or_callable),
    _k("training", "torch_amp", "str | dict", None, "autocast dtype: 'float16' / 'bfloat16' / {'dtype': .., 'grad_scaler': {..}}", amp_spec),
    _k("training", "grad_scaler", "dict | bool", None, "GradScaler options; default: on for float16 only; False disables"),
    _k("training", "torch_cuda_graph", "dict", None, "RETURNN's whole-step CUDA graph / Inductor compile: {'batch_size_bound': n, 'dim_capacity': {key: frames}, 'warmup_steps', 'capture_optimizer', 'compile', 'capture', 'mask_padding_seqs'}; capture needs CUDA (docs/cuda_graph.md)", _cuda_graph_spec),
    _k("training", "torch_optimizer_step", "dict", None, "RETURNN's separately compiled / CUDA-graph-captured optimizer step: {'compile': True, 'capture': True, 'dynamic_state_keys': [..]}; first update eager, then compiled, then captured and replayed; capture needs CUDA; not with a float16 GradScaler or torch_cuda_graph's capture_optimizer (docs/optimizer_step.md)", _optimizer_step_spec),
    _k("training", "stop_on_nonfinite_train_score", "bool", True, "check every micro-batch's losses and the gradients (before clipping); no update from NaN/Inf; raise NonFiniteLossError", boolean),
    _k("training", "nonfinite_check", "str", "auto", "when the guard's device flag is read: 'immediate' (after each micro-batch), 'deferred' (at log lines, checkpoints, epoch ends and train_* returns; the update is skipped on the device), 'auto' (immediate on CPU or with nonfinite_policy='skip', else deferred)", one_of("auto", "immediate", "deferred")),
    _k("training", "nonfinite_policy", "str", "raise", "'raise' or 'skip' a non-finite update", one_of("raise", "skip")),
    _k("training", "num_allowed_consec_invalid_gradient_steps", "int", 10, "with nonfinite_policy='skip': stop after this many skipped updates in a row", non_negative_int),
    _k("training", "log_every_n_steps", "int", 10, "interval (in steps) of the per-step log line", positive_int),
    _k("training", "log_verbosity", "int", 3, "RETURNN-style verbosity; >=4 logs every step", non_negative_int),
    _k("training", "default_float_dtype", "str", None, "RETURNN's: the model's parameters, the batches' float tensors and torch's default dtype inside every step in this dtype", one_of(None, "float16", "bfloat16", "float32", "float64")),
    _k("training", "calculate_exp_loss", "bool", False, "RETURNN's: add <loss>:exp = exp(loss) after every loss that is not an error (a perplexity), per step and per epoch (train_loss_ce:exp, dev_loss_ce:exp)", boolean),
    _k("training", "log_grad_norm", "bool | float", False, "RETURNN's: score grad_norm:p<p> (train_loss_grad_norm:p2), the p-norm of the gradients after unscaling and before noise and clipping, on every update step; True is p=2", _log_grad_norm),
    _k("training", "torch_log_memory_usage", "bool", False, "add device memory to log lines", boolean),
    _k("training", "device", "str", None, "None: cuda, then mps, then cpu; 'gpu' requires a GPU; PT_DEVICE env var overrides", device_spec),
    _k("training", "gpu_local_cpu_affinity", "bool", True, "RETURNN's: on Linux with a CUDA device, pin every thread of the process (and so the data workers) to the allowed CPUs local to its GPU (its NUMA node, widened to the socket when the node is below the rank's share; ranks sharing a node get disjoint slices); nothing pinned (logged) when the launcher bound the ranks or the topology is unknown; a notebook Session pins its shared kernel only when the config sets the key; see kit/engine/cpu_affinity.py", boolean),
    _k("training", "torch_distributed", "dict", None, "under torchrun: {'reduce_type': 'grad' (DDP) or 'param' (averaging), 'param_sync_step', 'options' (DDP kwargs), 'backend'}"),
    _k("training", "forward_auto_split_batch_on_oom", "bool", True, "split a forward batch in halves on CUDA OOM", boolean),
    _k("training", "use_tensorboard", "bool", False, "write TensorBoard event files (train losses and learning rate per step, every eval score per epoch); needs the tensorboard package", boolean),
    _k("training", "tensorboard_opts", "dict", None, "{'log_every_n_train_steps': 100, 'log_dir': ..}; log_dir defaults to {model}.tensorboard beside the checkpoints (without 'model': SummaryWriter's ./runs/...)", _tensorboard_opts),
    _k("trackers", "wandb_opts", "dict", None, "RETURNN's: log to Weights & Biases; the wandb.init arguments (+ 'log_every_n_train_steps', default 100; kit's 'all_ranks'); see docs/trackers.md", _dict_or_none("a dict of wandb.init arguments")),
    _k("trackers", "mlflow_opts", "dict", None, "log to MLflow: {'tracking_uri', 'experiment_name', 'run_name', 'run_id', 'tags', 'log_params', 'log_every_n_train_steps', 'all_ranks'} (default store: sqlite {model}.mlflow.db); see docs/trackers.md", _dict_or_none("a dict of MLflow options, e.g. {'experiment_name': 'x'}")),
    _k("trackers", "csv_log", "bool | str | dict", None, "append every logged metric to a CSV file (True: {model}.log.csv; a path; or {'path', 'log_every_n_train_steps', 'all_ranks'}); see docs/trackers.md", _csv_log),
    _k("training", "torch_profile", "bool | dict", None, "RETURNN's: torch profiler traces of each train epoch (torch_profile.json in the run folder); dict: torch.profiler.profile options + exit_after_profile, once, ranks; see docs/run_tools.md", _torch_profile),
    _k("training", "stop_for_resubmission_when_low_time_left", "bool", False, "RETURNN's: after an epoch, stop when SLURM's time left < the last epoch's wall time x the safety factor (CLI: step checkpoint, SIGINT to the job's process group, exit status 1); see docs/run_tools.md", boolean),
    _k("training", "stop_for_resubmission_safety_factor", "float", 1.2, "RETURNN's: the factor on the last epoch's wall time for stop_for_resubmission_when_low_time_left", positive_number),
    _k("training", "use_hot_reloading", "bool", False, "RETURNN's: with a terminal on stdin, each train step asks to reload changed modules (and the config file), retry the step, or continue; see docs/run_tools.md (notebooks: re-run the cell instead)", boolean),
    _k("callbacks", "startup_callback", "callable", None, "RETURNN's: startup_callback(config=config), once when the engine sets up (before data and model)", optional_callable),
    _k("callbacks", "epoch_start", "callable", None, "RETURNN's: fn(*, epoch, step, model, dataset_name, **kwargs) before the train epoch (dataset_name 'train') and before each eval dataset", optional_callable),
    _k("callbacks", "epoch_end", "callable", None, "RETURNN's: fn(*, epoch, step, model, dataset_name, **kwargs) after the train epoch (before its checkpoint and eval) and after each eval dataset", optional_callable),
    _k("memory", "torch_watch_stall", "float | dict", None, "RETURNN's: when no train step began for this many seconds, log STALL: lines with py-spy dumps of this process ({'timeout': s, 'native': True, 'repeat': 3}; unset: env RETURNN_WATCH_STALL); never kills; see kit/engine/watch_stall.py", _watch_stall),
    _k("memory", "watch_memory", "bool", False, "RETURNN's: a background thread logs 'MEMORY:' lines when this process or a child (data worker) appears, grows or exits", boolean),
    _k("memory", "reset_dev_memory_caches", "bool", False, "RETURNN's: gc.collect() and torch.cuda.empty_cache() before each train epoch, eval and forward", boolean),
    _k("memory", "PYTORCH_CUDA_ALLOC_CONF", "str", None, "RETURNN's: set as environment variable before CUDA starts (not with torch_distributed: a warning, as RETURNN)", optional_str),
    _k("training", "log_batch_size", "bool", False, "RETURNN's: with log_verbosity >= 5, a line per train step with num_seqs and max_size/sum_size per data key", boolean),
    _k("training", "use_lovely_tensors", "bool", False, "RETURNN's: lovely_tensors.monkey_patch() at set-up (tensor reprs as summaries); a warning when it is not installed", boolean),
    _k("training", "debug_hook", "callable", None, "callable(DebugContext) called on debug events (replaces debug_shell_before_train_loop)", optional_callable),
    # optimizer and learning rate
    _k("optimizer", "optimizer", "dict | class | callable", None, "{'class': 'adamw' | dotted path | type, **kwargs} (no 'lr': use learning_rate)", optimizer_spec),
    _k("optimizer", "learning_rate", "float", 1.0, "initial learning rate", finite_non_negative_number),
    _k("optimizer", "learning_rates", "list | dict", None, "learning rate per epoch (list from epoch 1, or dict epoch -> lr)", learning_rates_spec),
    _k("optimizer", "learning_rate_control", "str", "constant", "constant | newbob | newbob_abs | newbob_multi_epoch", lr_control_spec),
    _k("optimizer", "learning_rate_control_error_measure", "str | list", None, "score key(s) newbob looks at (default, with a warning: RETURNN's choice — dev_score, else the first dev_ key in sorted order)", str_or_list),
    _k("optimizer", "learning_rate_control_relative_error_relative_lr", "bool", False, "newbob: scale the relative error by the learning rate ratio", boolean),
    _k("optimizer", "learning_rate_control_min_num_epochs_per_new_lr", "int", 0, "newbob: keep a new lr at least this many epochs", non_negative_int),
    _k("optimizer", "learning_rate_decay", "float | callable", 0.5, "newbob: lr factor (or f(lr) -> lr) when the error does not improve enough", number_or_callable),
    _k("optimizer", "learning_rate_growth", "float | callable", 1.0, "newbob: lr factor (or f(lr) -> lr) when the error improves", number_or_callable),
    _k("optimizer", "newbob_learning_rate_growth", "float | callable", None, "alias of learning_rate_growth (RETURNN)", number_or_callable),
    _k("optimizer", "min_learning_rate", "float", 0.0, "lower bound for newbob", non_negative_number),
    _k("optimizer", "newbob_relative_error_threshold", "float", -0.01, "newbob: decay when relative error change > this"),
    _k("optimizer", "newbob_relative_error_grow_threshold", "float", None, "newbob_multi_epoch: grow when the mean relative error change < this (default newbob_relative_error_threshold)"),
    _k("optimizer", "newbob_relative_error_div_by_old", "bool", False, "newbob: relative error = (new - old) / |old| instead of / |new|", boolean),
    _k("optimizer", "newbob_error_threshold", "float", -0.01, "newbob_abs: decay when absolute error change > this"),
    _k("optimizer", "newbob_learning_rate_decay", "float | callable", None, "alias of learning_rate_decay (RETURNN)", number_or_callable),
    _k("optimizer", "newbob_multi_num_epochs", "int", 5, "newbob_multi_epoch: epochs averaged", positive_int),
    _k("optimizer", "newbob_multi_update_interval", "int", None, "newbob_multi_epoch: epochs between lr checks (default newbob_multi_num_epochs)", optional_positive_int),
    _k("optimizer", "dynamic_learning_rate", "callable", None, "f(*, global_train_step, epoch, epoch_continuous, learning_rate, **kw) -> lr, every step", optional_callable),
    _k("optimizer", "gradient_clip", "float", None, "clip each gradient value to [-v, v]", optional_non_negative_number),
    _k("optimizer", "gradient_clip_global_norm", "float", None, "clip the global gradient norm to this", optional_non_negative_number),
    _k("optimizer", "gradient_clip_norm", "float", None, "alias of gradient_clip_global_norm (RETURNN)", optional_non_negative_number),
    _k("optimizer", "grad_clip", "float", 0.0, "RETURNN's torch engine refuses it (a mistaken name): any value but 0 is an error naming gradient_clip_global_norm / gradient_clip", _grad_clip),
    _k("optimizer", "gradient_noise", "float", None, "add Gaussian noise with this stddev to gradients", optional_non_negative_number),
    _k("optimizer", "weight_decay_modules_blacklist", "list", None, "module types whose params never decay (default: norms, Embedding)"),
    _k("optimizer", "weight_decay_custom_include_check", "callable", None, "f(*, module, param_name, param, **kw) -> bool | None", optional_callable),
    _k("optimizer", "param_groups_custom", "callable", None, "f(*, model, rf_model, optimizer_class, optimizer_opts, **kw) -> list of param group dicts (may hold learning_rate_multiplier); as RETURNN, optimizer_opts are the optimizer's keywords (lr included) and an option the function pops from them (e.g. learning_rate_multipliers_by_patterns) is not passed to the optimizer", optional_callable),
    # files and checkpoints
    _k("checkpoints", "model", "str", None, "checkpoint path prefix: epoch e is {model}.{e:03d}.pt", optional_str),
    _k("checkpoints", "learning_rate_file", "str", None, "score table file (default {model}.scores.json beside the checkpoints)", optional_str),
    _k("checkpoints", "run_files", "str", None, "the files a run leaves beside its checkpoints: 'kit' (a manifest per checkpoint, {learning_rate_file}.kit.json, {model}.events.jsonl) or 'returnn' (only what RETURNN leaves: model files, the last two epochs' .opt.pt, learning_rate_file; the manifest goes inside the model file, the CLI's event log into kit's state directory); default 'returnn' when learning_rate_file is set or the model prefix holds RETURNN's checkpoints, else 'kit'", one_of(None, "kit", "returnn")),
    _k("checkpoints", "save_interval", "int", 1, "save a checkpoint every N epochs (and always the final one)", positive_int),
    _k("checkpoints", "save_every_n_steps", "int", None, "also save a step checkpoint every N train steps", optional_positive_int),
    _k("checkpoints", "dry_run", "bool", False, "RETURNN's: train, read checkpoints and score files as usual, but write nothing (no checkpoint, score file, lock, cleanup or event log)", boolean),
    _k("checkpoints", "cleanup_old_models", "bool | dict", None, "keep_last_n, keep_best_n, keep, dry_run", cleanup_spec),
    _k("checkpoints", "apply_cleanup_old_models_to_optim_states", "bool", False, "RETURNN's: False keeps the optimizer states of the last two epochs only (epoch N's save deletes N-2's .opt.pt); True leaves them to cleanup_old_models", boolean),
    _k("checkpoints", "preload_from_files", "dict", None, "name -> {filename, prefix, checkpoint_key, ignore_params, ..., init_for_train}", preload_spec),
    _k("checkpoints", "load_model_post_hooks", "list", None, "callables f(*, model, **kw) run after loading weights"),
    _k("checkpoints", "load", "str", None, "checkpoint file to start from"),
    _k("checkpoints", "epoch", "int", None, "RETURNN's: for `python -m kit eval` without 'load', the epoch to evaluate (as load_epoch, which must match when set); train and forward ignore it, as RETURNN's torch path does", optional_positive_int),
    _k("checkpoints", "load_epoch", "int", None, "epoch checkpoint to start from", optional_positive_int),
    _k("checkpoints", "import_model_train_epoch1", "str", None, "initialize epoch 1 from this checkpoint (model only)", optional_str),
]

KEYS: dict[str, Key] = {k.name: k for k in _KEYS}

# RETURNN keys kit deliberately does not take; each maps to what to use instead.
REPLACED_KEYS: dict[str, str] = {
    "debug_shell_before_train_loop": (
        "'debug_shell_before_train_loop' is not supported: a terminal shell cannot run in a notebook; "
        "set 'debug_hook' (e.g. kit.debug.post_mortem) instead"
    ),
}


def config_reference_markdown() -> str:
    """The generated ``docs/config.md`` text."""
    lines = [
        "# Config keys",
        "",
        "Generated from `kit/config/keys.py` by `python -m kit.config.docs`; do not edit by hand.",
        "",
    ]
    sections: dict[str, list[Key]] = {}
    for key in _KEYS:
        sections.setdefault(key.section, []).append(key)
    for section, keys in sections.items():
        lines += [f"## {section}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for key in keys:
            doc, type_ = key.doc.replace("|", "\\|"), key.type.replace("|", "\\|")
            lines.append(f"| `{key.name}` | {type_} | `{key.default!r}` | {doc} |")
        lines.append("")
    return "\n".join(lines)
