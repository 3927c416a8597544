"""Every config key RETURNN's PyTorch engine reads, and what kit does with it.

Statuses:

- ``kit``: a kit key with RETURNN's meaning (see docs/config.md);
- ``translated``: rewritten at the config boundary into kit's keys with RETURNN's meaning
  (``batching``, ``max_seqs=-1``);
- ``to RETURNN``: kit does nothing with it but hands it, as RETURNN does, to RETURNN's own code that reads
  it: RETURNN's global config and behaviour version around a RETURNN-style config's user code
  (:mod:`kit.compat.global_config`; with RETURNN installed);
- ``no effect``: nothing to do in kit (TensorFlow-only switches, ``backend="torch"``), accepted quietly
  when the value is RETURNN's default or the one kit implies, else treated as unsupported;
- ``unsupported``: named in one warning when a config sets it, then ignored;
- ``replaced``: an error that names kit's replacement.

``docs/returnn_keys.md`` is generated from this table (``python -m kit.config.docs``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kit.config.keys import KEYS

logger = logging.getLogger("kit")


@dataclass(frozen=True)
class ReturnnKey:
    name: str
    status: str  # "kit" | "translated" | "no effect" | "unsupported"
    note: str = ""
    quiet_values: tuple[Any, ...] = ()  # "no effect" keys: values that need no warning


def _u(name: str, note: str = "") -> ReturnnKey:
    return ReturnnKey(name, "unsupported", note)


def _n(name: str, note: str, *quiet: Any) -> ReturnnKey:
    return ReturnnKey(name, "no effect", note, quiet)


def _g(name: str, note: str) -> ReturnnKey:
    return ReturnnKey(name, "to RETURNN", note)


def _t(name: str, note: str) -> ReturnnKey:
    return ReturnnKey(name, "translated", note)


# The keys RETURNN 1.20261022 reads on its torch path (returnn/__main__.py, returnn/torch/, the
# learning-rate control, the dataset defaults) that are not kit keys of the same name.
_OTHER: list[ReturnnKey] = [
    _t("batching", "the train dataset dict's seq_ordering when it sets none (RETURNN's meaning); for a dataset object, kit's seq_ordering"),
    _t("max_seqs", "-1 (RETURNN: no limit) becomes None; other values are kit's key"),
    ReturnnKey("debug_shell_before_train_loop", "replaced", "an error that points to debug_hook (a shell cannot run in a notebook)"),
    _n("backend", "kit is the torch backend", "torch"),
    _n("use_tensorflow", "TensorFlow only", False, None),
    _g("behavior_version", "RETURNN's BehaviorVersion, set once per process (as RETURNN) for a config whose user code uses RETURNN: its frontend's defaults follow it; a second config asking for another version is a ConfigError"),
    _n("propagate_behavior_version_to_subprocs", "RETURNN's subprocesses"),
    _n("decouple_constraints", "weight decay is always decoupled in torch", True),
    _n("network", "TensorFlow network dict", None),
    _n("tf_session_opts", "TensorFlow only"),
    _n("distributed_tf", "TensorFlow only", None),
    _n("use_horovod", "TensorFlow only", False, None),
    _n("patch_atfork", "RETURNN's fork handling", False, None),
    _n("EnableAutoNumpySharedMemPickling", "RETURNN's multiprocessing pickler", False, None),
    _n("sprint_trainer_exec_path", "RASR/Sprint training", None),
    _u("PYTORCH_CUDA_ALLOC_CONF"),
    _n("__debug_dummy_distributed_rank_and_size", "RETURNN's own test hook (returnn/datasets/basic.py: a faked (rank, size) for its dataset sharding tests); kit's ranks come from torchrun", None),
    _u("analyze_dataset", "RETURNN 1.20261022's task='analyze_data' (returnn/__main__.py analyze_data) fails at its first sequence: returnn/util/basic.py inplace_increment raises NotImplementedError (removed with Theano); its running mean also weights each sequence's sum by the sequence's length. No RETURNN run reads it to an end, so there is no meaning for kit to match"),
    _n("cache_size", "a memory budget for RETURNN's preloading cache (returnn/__main__.py get_cache_byte_sizes, given to RETURNN's CachedDataset classes as cache_byte_size): it changes memory, not results; kit's HDFDataset reads on demand with a bounded set of open files (docs/data_prefetch.md)"),
    _u("calculate_exp_loss"),
    _n("check_learning_rates", 'read only by the command-line tool in returnn/learning_rate_control.py (its demo(), which replays a learning-rate file); training never reads it', None),
    _n("chunk_eval", "RETURNN's Dataset.get_default_kwargs_eval: chunking inside RETURNN's dev/eval Dataset objects, which only the TF engine's batches use; RETURNN's torch engine chunks in its pipeline from `chunking` (kit: chunking_in_eval)", None),
    _n("chunking_variance", "a RETURNN Dataset default (returnn/datasets/basic.py) used only by Dataset._iterate_seqs, the TF engine's chunking; RETURNN's torch engine chunks in returnn/torch/data/pipeline.py, which ignores it", 0, 0.0, None),
    _u("combine_labels", "RETURNN's forward-to-HDF task (returnn/__main__.py, the TF net-dict branch of task='forward'; TensorFlow backend)"),
    _n("context_window", "a RETURNN Dataset default (returnn/datasets/basic.py) used only by Dataset._iterate_seqs, the TF engine's chunking; RETURNN's torch engine chunks in returnn/torch/data/pipeline.py, which ignores it", None),
    _u("data_key", "RETURNN 1.20261022's task='analyze_data' (returnn/__main__.py analyze_data) fails at its first sequence: returnn/util/basic.py inplace_increment raises NotImplementedError (removed with Theano); its running mean also weights each sequence's sum by the sequence's length. No RETURNN run reads it to an end, so there is no meaning for kit to match; TF networks read it too"),
    _t("dataset_random_seed_offset", "the random_seed_offset of every dataset dict (train, dev, eval, eval_datasets, forward_data) of a kit or RETURNN class that sets none, as RETURNN's Dataset default; dataset objects and custom classes keep their own"),
    _t("dummy_dataset_num_seqs", "with use_dummy_datasets: the sequences of each dummy dev/eval dataset (RETURNN's default: a twentieth of train's, else 100)"),
    _u("epoch", "RETURNN's task='eval' (returnn/__main__.py: the epoch to evaluate, set as load_epoch) and its analyze_data task; kit's eval takes load_epoch"),
    _u("epoch_end"),
    _u("epoch_start"),
    _u("eval_output_file", "returnn/__main__.py passes it to eval_model for task='eval'; only RETURNN's TF engine takes it (returnn/torch/engine.py eval_model has no such parameter); kit's eval writes the score table"),
    _u("eval_output_file_per_seq", "returnn/__main__.py passes it to eval_model for task='eval'; only RETURNN's TF engine takes it (returnn/torch/engine.py eval_model has no such parameter)"),
    _u("forward_batch_size", "RETURNN's forward-to-HDF task (returnn/__main__.py, the TF net-dict branch of task='forward'; TensorFlow backend); the torch engine forwards with batch_size / batch_size_dev"),
    _u("forward_use_search", "RETURNN's forward-to-HDF task (returnn/__main__.py, the TF net-dict branch of task='forward'; TensorFlow backend)"),
    _g("inf_value", "read by RETURNN's frontend backends (get_global_inf_value) from RETURNN's global config, which kit sets around the config's user code"),
    _u("ipython", "RETURNN's own process: returnn/__main__.py starts an IPython kernel beside training; kit runs in Jupyter itself"),
    _u("log", "RETURNN's own log files (returnn/log.py); kit logs through Python's logging (the CLI to stderr), the run's event log and the trackers"),
    _u("log_batch_size"),
    _u("log_format", "RETURNN's own log files (returnn/log.py); kit logs through Python's logging (the CLI to stderr)"),
    _u("log_grad_norm"),
    _u("loss_name", "returnn/__main__.py passes it to eval_model for task='eval'; only RETURNN's TF engine takes it (returnn/torch/engine.py eval_model has no such parameter)"),
    _u("need_data", "RETURNN's own process start (returnn/__main__.py need_data: False skips loading train/dev/eval); kit builds the datasets a command uses when it uses them"),
    _n("on_size_limit", "RETURNN's Dataset.get_default_kwargs_eval: chunking inside RETURNN's dev/eval Dataset objects, which only the TF engine's batches use", 'ignore', None),
    _g("onnx_export", "read by RETURNN's tensor dims (returnn/util/basic.py is_onnx_export_global) from RETURNN's global config, which kit sets around the config's user code"),
    _u("output_file", "RETURNN's forward-to-HDF task (returnn/__main__.py, the TF net-dict branch of task='forward'; TensorFlow backend); kit's forward: forward_callback, or `--output` (npz)"),
    _u("output_per_seq_file_format", "returnn/__main__.py passes it to eval_model for task='eval'; only RETURNN's TF engine takes it (returnn/torch/engine.py eval_model has no such parameter)"),
    _u("output_per_seq_format", "returnn/__main__.py passes it to eval_model for task='eval'; only RETURNN's TF engine takes it (returnn/torch/engine.py eval_model has no such parameter)"),
    _g("packed_fallback_allowed", "read by RETURNN's frontend (returnn/frontend/_packed_backend.py) from RETURNN's global config, which kit sets around the config's user code"),
    _n("pretrain_learning_rate", "RETURNN's network pretraining (returnn/pretrain.py, TF net dicts) and its learning_rate_control.py command-line tool; the torch engine has no pretraining", None),
    _u("reset_dev_memory_caches"),
    *[_g(f"rf_{n}", "read by RETURNN's frontend modules (returnn/frontend/...) from RETURNN's global config, which "
            "kit sets around the config's user code (kit.compat.global_config; parity-tested with rf_dropout_broadcast)")
      for n in ("att_dropout_broadcast", "batch_norm_distributed", "conformer_conv_norm_use_mask", "dropout_broadcast",
                "module_output_keep_dtype", "moments_float32", "moments_use_fixed_masking", "native_opt",
                "packed_att_fast_paths", "packed_warn_regap", "scatter_use_fixed_masking",
                "specaugment_num_masks_per_seq", "use_consistent_same_padding")],
    _u("search_data", "RETURNN's task='search' (returnn/__main__.py): only RETURNN's TF engine has search(); kit: forward with a forward_step that searches"),
    _u("search_do_eval", "RETURNN's task='search' (returnn/__main__.py): only RETURNN's TF engine has search()"),
    _u("search_output_file", "RETURNN's task='search' (returnn/__main__.py): only RETURNN's TF engine has search()"),
    _u("search_output_file_format", "RETURNN's task='search' (returnn/__main__.py): only RETURNN's TF engine has search()"),
    _u("search_output_layer", "RETURNN's task='search' (returnn/__main__.py): only RETURNN's TF engine has search() (output layers of a net dict)"),
    _u("sort_dataset"),
    _u("startup_callback"),
    _u("statistics", "RETURNN's task='analyze' (returnn/__main__.py): only RETURNN's TF engine has analyze(); kit has no such task"),
    _u("statistics_dtype", "RETURNN 1.20261022's task='analyze_data' (returnn/__main__.py analyze_data) fails at its first sequence: returnn/util/basic.py inplace_increment raises NotImplementedError (removed with Theano); its running mean also weights each sequence's sum by the sequence's length. No RETURNN run reads it to an end, so there is no meaning for kit to match"),
    _u("statistics_save_prefix", "RETURNN 1.20261022's task='analyze_data' (returnn/__main__.py analyze_data) fails at its first sequence: returnn/util/basic.py inplace_increment raises NotImplementedError (removed with Theano); its running mean also weights each sequence's sum by the sequence's length. No RETURNN run reads it to an end, so there is no meaning for kit to match"),
    _u("stop_for_resubmission_safety_factor"),
    _u("stop_for_resubmission_when_low_time_left"),
    _u("target", "RETURNN 1.20261022's task='analyze_data' (returnn/__main__.py analyze_data) fails at its first sequence: returnn/util/basic.py inplace_increment raises NotImplementedError (removed with Theano); its running mean also weights each sequence's sum by the sequence's length. No RETURNN run reads it to an end, so there is no meaning for kit to match; TF layers read it too (kit's train_step names its targets)"),
    _u("torch_cuda_graph"),
    _n("torch_dataloader_shard_workers", "RETURNN's DataLoader sharding over workers (returnn/torch/data/returnn_dataset_wrapper.py); kit's workers always share out the data (RETURNN's True, its default since behavior_version 37); False (every worker yields all data) warns", None, True),
    _u("torch_profile"),
    _u("torch_watch_stall", "see docs/config.md"),
    _t("train_dummy_dataset_num_seqs", "with use_dummy_datasets: the dummy train dataset's sequences (RETURNN's default 1000)"),
    _t("use_dummy_datasets", "train/dev/eval/forward_data/eval_datasets become RETURNN's DummyGenericDataset over extern_data, as RETURNN's setup_dummy_datasets makes them (needs RETURNN installed)"),
    _u("use_lovely_tensors"),
    _u("use_train_proc_manager", "RETURNN's own process model (returnn/util/train_proc_manager.py restarts its process after a crash); kit runs in the caller's process or under torchrun"),
    _u("wandb_opts"),
    _u("watch_memory"),
    _u("web_server_port", "RETURNN's task='search_server' (returnn/__main__.py): only RETURNN's TF engine has web_server()"),
]

# RETURNN keys that kit has under the same name with RETURNN's meaning
_SAME = (
    "accum_grad_multiple_step allow_skipping_seqs_in_forward apply_cleanup_old_models_to_optim_states batch_size batch_size_dev batch_size_train chunking cleanup_old_models dev device dry_run "
    "dynamic_learning_rate eval eval_datasets extern_data forward_auto_split_batch_on_oom forward_callback "
    "forward_data forward_step get_model gpu_local_cpu_affinity grad_clip grad_scaler gradient_clip gradient_clip_global_norm gradient_noise "
    "import_model_train_epoch1 learning_rate learning_rate_control learning_rate_control_error_measure "
    "learning_rate_control_min_num_epochs_per_new_lr learning_rate_control_relative_error_relative_lr "
    "learning_rate_decay learning_rate_file learning_rate_growth learning_rates load load_epoch "
    "load_model_post_hooks log_verbosity max_seq_length min_chunk_size min_learning_rate min_seq_length model "
    "model_outputs newbob_error_threshold newbob_learning_rate_decay newbob_learning_rate_growth "
    "newbob_multi_num_epochs newbob_multi_update_interval newbob_relative_error_div_by_old "
    "newbob_relative_error_grow_threshold newbob_relative_error_threshold num_epochs optimizer packed_batch_cost "
    "packed_batch_cost_dev packed_batch_cost_train packed_batch_size packed_batch_size_dev packed_batch_size_train "
    "preload_from_files "
    "random_seed save_interval start_batch start_epoch stop_on_nonfinite_train_score task torch_amp torch_dataloader_opts "
    "torch_batching torch_distributed torch_log_memory_usage torch_optimizer_step train train_step use_tensorboard "
    "tensorboard_opts window shuffle_frames_of_nseqs"
).split()

RETURNN_KEYS: dict[str, ReturnnKey] = {k.name: k for k in _OTHER}
for _name in _SAME:
    RETURNN_KEYS.setdefault(_name, ReturnnKey(_name, "kit", "see docs/config.md"))
for _name, _key in list(RETURNN_KEYS.items()):  # a key kit has learned since (e.g. tensorboard_opts)
    if _name in KEYS and _key.status in ("unsupported", "no effect"):
        RETURNN_KEYS[_name] = ReturnnKey(_name, "kit", "see docs/config.md")


def _seq_ordering_for_train(value: Any, get: Callable[[str], Any]) -> dict[str, Any]:
    train = get("train")
    if isinstance(train, Mapping) and train.get("seq_ordering") is None:
        return {"train": {**train, "seq_ordering": value}}
    if isinstance(train, Mapping):
        return {}  # the dataset's own seq_ordering wins, as in RETURNN
    return {"seq_ordering": value}


_DATASET_KEYS = ("train", "dev", "eval", "forward_data")


def _seed_offset_for_datasets(value: Any, get: Callable[[str], Any]) -> dict[str, Any]:
    """RETURNN's ``dataset_random_seed_offset``: the default ``random_seed_offset`` of its datasets."""
    if not value:
        return {}

    def with_offset(spec: Any) -> Any:
        named = isinstance(spec, Mapping) and isinstance(spec.get("class"), str) and "." not in spec["class"]
        return {**spec, "random_seed_offset": int(value)} if named and "random_seed_offset" not in spec else spec

    updates = {k: with_offset(get(k)) for k in _DATASET_KEYS if with_offset(get(k)) is not get(k)}
    evals = get("eval_datasets")
    if isinstance(evals, Mapping) and any(with_offset(v) is not v for v in evals.values()):
        updates["eval_datasets"] = {name: with_offset(v) for name, v in evals.items()}
    return updates


def _dummy_datasets(get: Callable[[str], Any]) -> dict[str, Any]:
    """RETURNN's ``use_dummy_datasets``: every configured dataset becomes a ``DummyGenericDataset`` of random data
    shaped by ``extern_data`` (as RETURNN's ``setup_dummy_datasets``: its sequence counts and seeds)."""
    from zlib import crc32

    extern_data = get("extern_data")
    if not extern_data:
        from kit.errors import ConfigError

        raise ConfigError("config key 'use_dummy_datasets': needs 'extern_data' (the dummy data's shapes)")

    def dummy(num_seqs: int, seed_key: str | None) -> dict[str, Any]:
        spec = {"class": "DummyGenericDataset", "data_template": extern_data, "num_seqs": num_seqs}
        return spec if seed_key is None else {**spec, "fixed_random_seed": crc32(seed_key.encode("utf8"))}

    updates: dict[str, Any] = {}
    num_seqs = get("dummy_dataset_num_seqs")
    if get("train"):
        train_num_seqs = get("train_dummy_dataset_num_seqs") or num_seqs or 1000
        num_seqs = num_seqs or max(int(train_num_seqs) // 20, 1)
        updates["train"] = dummy(int(train_num_seqs), None)
    num_seqs = int(num_seqs or 100)
    updates.update({key: dummy(num_seqs, key) for key in ("dev", "eval", "forward_data") if get(key)})
    evals = get("eval_datasets")
    if isinstance(evals, Mapping) and evals:
        updates["eval_datasets"] = {key: dummy(num_seqs, key) for key in evals}
    return updates


def translate(values: Mapping[str, Any], get: Callable[[str], Any]) -> tuple[dict[str, Any], list[str]]:
    """RETURNN-only keys of ``values`` rewritten into kit keys; the names of unsupported ones.

    ``get(name)`` reads a key's current value (from ``values`` or the config being updated).
    Returns (kit key updates, unsupported key names); other RETURNN-only keys are dropped.
    """
    updates: dict[str, Any] = {}
    unsupported: list[str] = []
    for name, value in values.items():
        if name == "max_seqs" and value == -1:
            updates["max_seqs"] = None
            continue
        key = RETURNN_KEYS.get(name)
        if key is None or name in KEYS:
            continue
        if name == "use_dummy_datasets":
            if value:
                updates.update(_dummy_datasets(lambda n: updates.get(n, get(n))))
        elif name in ("dummy_dataset_num_seqs", "train_dummy_dataset_num_seqs"):
            continue  # read by use_dummy_datasets
        elif name == "dataset_random_seed_offset":
            updates.update(_seed_offset_for_datasets(value, lambda n: updates.get(n, get(n))))
        elif name == "batching":
            if value is not None:
                updates.update(_seq_ordering_for_train(value, lambda n: updates.get(n, get(n))))
        elif key.status == "no effect" and (not key.quiet_values or value in key.quiet_values):
            continue
        elif key.status == "to RETURNN":  # RETURNN's global config holds it (kit.compat.global_config)
            continue
        elif key.status != "kit":
            unsupported.append(name)
    return updates, unsupported


def is_returnn_only_key(name: str) -> bool:
    """A RETURNN key that kit does not have under this name."""
    return name in RETURNN_KEYS and name not in KEYS and RETURNN_KEYS[name].status != "replaced"


def warn_unsupported(names: list[str], source: str | None = None) -> str | None:
    """One warning naming every unsupported RETURNN key; returns its text (None when there are none)."""
    if not names:
        return None
    listed = ", ".join(f"'{n}'" for n in sorted(names))
    what = "key" if len(names) == 1 else "keys"
    verb = "is" if len(names) == 1 else "are"
    where = f" (in '{source}')" if source else ""
    text = f"RETURNN {what} {listed} {verb} not supported by kit; ignored{where}"
    logger.warning(text)
    return text


# where RETURNN's torch path reads its config (relative to the returnn package)
TORCH_PATH_SOURCES = ("__main__.py", "learning_rate_control.py", "torch", "datasets/basic.py")
_READ = re.compile(
    r"""config\.(?:typed_value|value|bool|int|float|list|dict|opt_typed_value|bool_or_other|has|is_true|"""
    r"""float_list|int_list|is_typed)\(\s*(f?)["']([A-Za-z_][A-Za-z0-9_]*)(\{[^}]*\})?([A-Za-z0-9_]*)["']"""
)


def returnn_config_reads(package_dir: str | os.PathLike[str]) -> set[str]:
    """The config keys RETURNN's torch path reads, found in its source (``package_dir``: the ``returnn``
    package); an f-string key ``batch_size_{'train' if train else 'dev'}`` counts as both of its forms."""
    root = Path(package_dir)
    files: list[Path] = []
    for rel in TORCH_PATH_SOURCES:
        path = root / rel
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.is_file() else []
    keys: set[str] = set()
    for path in files:
        for fmt, head, field, tail in _READ.findall(path.read_text(encoding="utf-8", errors="replace")):
            if fmt and field:
                keys |= {head + part + tail for part in re.findall(r"'([A-Za-z0-9_]*)'", field)} or {head + tail}
            else:
                keys.add(head + tail)
    return keys


def missing_returnn_keys(package_dir: str | os.PathLike[str]) -> list[str]:
    """RETURNN torch-path keys in neither kit's registry nor this table (each would be ignored without a warning)."""
    return sorted(k for k in returnn_config_reads(package_dir) if k not in RETURNN_KEYS and k not in KEYS)


def keys_without_reason(keys: Mapping[str, ReturnnKey] | None = None) -> list[str]:
    """The "unsupported", "no effect" and "replaced" keys of ``keys`` (default: the table) with no note saying why.

    Each such key must name where RETURNN reads it and why kit does not (TensorFlow backend, RETURNN's own
    process model or tasks, or what kit does not do yet)."""
    table = RETURNN_KEYS if keys is None else keys
    return sorted(n for n, k in table.items() if k.status != "kit" and not k.note.strip())


def returnn_keys_markdown() -> str:
    """The generated ``docs/returnn_keys.md`` text (a ValueError when a key kit does not support has no reason)."""
    if missing := keys_without_reason():
        raise ValueError(f"kit/compat/returnn_keys.py: no reason written beside {', '.join(missing)}")
    counts: dict[str, int] = {}
    for key in RETURNN_KEYS.values():
        counts[key.status] = counts.get(key.status, 0) + 1
    lines = [
        "# RETURNN's config keys in kit",
        "",
        "Generated from `kit/compat/returnn_keys.py` by `python -m kit.config.docs`; do not edit by hand.",
        "",
        "Every key RETURNN's PyTorch engine reads. `kit`: same name and meaning (docs/config.md); "
        "`translated`: rewritten into kit keys with RETURNN's meaning; `to RETURNN`: handed to RETURNN's own code "
        "(its global config and behaviour version, around a RETURNN-style config's user code); "
        "`no effect`: nothing to do in kit; "
        "`unsupported`: a config that sets it gets one warning naming it, and it is ignored.",
        "",
        "Counts: " + ", ".join(f"{status} {n}" for status, n in sorted(counts.items())),
        "",
        "| key | status | note |",
        "|---|---|---|",
    ]
    for name in sorted(RETURNN_KEYS, key=str.lower):
        key = RETURNN_KEYS[name]
        lines.append(f"| `{name}` | {key.status} | {key.note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
