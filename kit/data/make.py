"""``make_dataset``: a dataset object from a config value (object or ``{"class": ..., **opts}``)."""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from kit.data.dataset import ArrayDataset, Dataset, GeneratorDataset, TorchDataset
from kit.data.distrib_files import DistributeFilesDataset
from kit.data.hdf import HDFDataset
from kit.data.meta import ConcatDataset, MetaDataset, StaticDataset, set_child_builder
from kit.data.returnn_adapter import ReturnnDataset, is_returnn_dataset, returnn_dataset_class
from kit.data.text import CharTextDataset
from kit.data.toy import Task12AXDataset
from kit.errors import ConfigError, DataError

BUILTINS: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        ArrayDataset,
        GeneratorDataset,
        TorchDataset,
        Task12AXDataset,
        CharTextDataset,
        HDFDataset,
        StaticDataset,
        ConcatDataset,
        MetaDataset,
        DistributeFilesDataset,
    )
}


def _resolve_class(name: Any) -> type:
    if isinstance(name, type):
        return name
    if not isinstance(name, str) or not name:
        raise ConfigError(f"dataset 'class': expected a class name like 'Task12AXDataset', got {name!r}")
    if name in BUILTINS:
        return BUILTINS[name]
    if "." not in name:
        if returnn_dataset_class(name) is not None:
            return ReturnnDataset  # RETURNN's class, adapted through RETURNN's own Dataset API
        guess = difflib.get_close_matches(name, list(BUILTINS), n=1)
        hint = f" — did you mean '{guess[0]}'?" if guess else ""
        if not guess and name.endswith("Dataset"):
            hint = "; RETURNN's other dataset classes work through RETURNN: pip install returnn"
        raise ConfigError(
            f"dataset class {name!r} is not a built-in ({', '.join(sorted(BUILTINS))}); "
            f"give a dotted path 'package.module.Class' for your own{hint}"
        )
    module_name, _, attr = name.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"dataset class {name!r}: cannot import it ({exc})") from None
    if not callable(obj):
        raise ConfigError(f"dataset class {name!r} is not a class or callable")
    return obj


def make_dataset(
    obj: Any,
    *,
    returnn_defaults: Mapping[str, Any] | None = None,
    config_defaults: Mapping[str, Any] | None = None,
    **defaults: Any,
) -> Dataset:
    """Return ``obj`` if it is a dataset; build one from ``{"class": name, **opts}``.

    RETURNN's dataset classes come by their names: HDFDataset, MetaDataset, StaticDataset,
    ConcatDataset, DistributeFilesDataset and Task12AXDataset natively; with RETURNN installed,
    any other RETURNN class (and a RETURNN dataset object) through :class:`ReturnnDataset`.
    A map-style ``torch.utils.data.Dataset`` is wrapped in :class:`TorchDataset`.
    ``defaults`` (e.g. ``name=``) fill options the dict does not set; ``returnn_defaults`` those of a
    dict that RETURNN's own class reads (RETURNN's eval defaults for a dev dataset, say).
    ``config_defaults`` are RETURNN's Dataset defaults from the config (``window``), given as RETURNN
    gives them (``kwargs_update_from_config``) to a dict that sets none: see :func:`_with_config_defaults`.

    >>> make_dataset({"class": "Task12AXDataset", "num_seqs": 10}).num_seqs
    10
    """
    if isinstance(obj, Dataset):
        return obj
    if is_returnn_dataset(obj):
        return ReturnnDataset(obj, name=defaults.get("name"))
    if isinstance(obj, Mapping):
        opts = dict(obj)
        if "class" not in opts:
            raise ConfigError(
                f"dataset dict needs a 'class' entry (e.g. 'Task12AXDataset'), got keys {sorted(opts)}"
            )
        cls = _resolve_class(opts.pop("class"))
        given = {k: v for k, v in (config_defaults or {}).items() if v is not None}
        if cls is ReturnnDataset and obj.get("class") != "ReturnnDataset":
            kwargs = {**given, **(returnn_defaults or {})}
            return ReturnnDataset(dict(obj), name=defaults.get("name"), default_kwargs=kwargs)
        opts = _with_config_defaults(cls, opts, given)
        for k, v in defaults.items():
            opts.setdefault(k, v)
        _check_options(cls, opts)
        try:
            ds = cls(**opts)
        except (ConfigError, DataError):
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"dataset class {cls.__name__}: {exc}") from exc
        return make_dataset(ds) if not isinstance(ds, Dataset) else ds
    if (
        hasattr(obj, "__getitem__")
        and hasattr(obj, "__len__")
        and type(obj).__module__.split(".")[0] != "builtins"
    ):
        return TorchDataset(obj, **defaults)
    raise DataError(
        f"expected a kit.data.Dataset, a map-style torch Dataset or a dict {{'class': ..., ...}}, "
        f"got {type(obj).__name__}"
    )


def _with_config_defaults(cls: type, opts: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """``opts`` with the config's dataset defaults it does not set, for a class that takes them.

    RETURNN gives them to every dataset dict (its ``MetaDataset`` refuses a ``window``); a kit class
    without the option refuses one too, rather than ignore it.
    """
    takes = _known_options(cls) or []
    out = dict(opts)
    for name, value in given.items():
        if name in out:
            continue
        if name in takes:
            out[name] = value
        elif not (name == "window" and value == 1):
            raise ConfigError(
                f"config key {name!r} = {value!r}: dataset class {cls.__name__} has no {name} option "
                f"({_REFUSED_BY_RETURNN.get(name, 'RETURNN')} refuses one too; kit does not ignore it); set it in the "
                f"dicts of the datasets that take it ({_TAKEN_BY.get(name, 'see docs/config.md')}) instead"
            )
    return out


# the config's dataset defaults: which RETURNN classes refuse one, which classes take it
_REFUSED_BY_RETURNN = {"window": "RETURNN's MetaDataset", "shuffle_frames_of_nseqs": "RETURNN's MetaDataset, like its GeneratingDataset,"}
_TAKEN_BY = {
    "window": "Task12AXDataset, HDFDataset, RETURNN's GeneratingDataset classes",
    "shuffle_frames_of_nseqs": "HDFDataset, RETURNN's own HDFDataset through the adapter",
}


def _known_options(cls: type) -> list[str] | None:
    """The options ``cls`` takes by keyword (a kit Dataset's ``**opts`` go to ``Dataset.__init__``, so its
    options count); None when any is taken (another class with ``**kwargs``) or there is no signature."""
    try:
        params: Mapping[str, inspect.Parameter] = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        if not issubclass(cls, Dataset):
            return None
        params = {**params, **inspect.signature(Dataset.__init__).parameters}
    return [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and n != "self"]


def _check_options(cls: type, opts: dict[str, Any]) -> None:
    """Name every unknown option at once, with suggestions, before calling the class."""
    known = _known_options(cls)
    if known is None:
        return
    problems = []
    for name in opts:
        if name not in known:
            guess = difflib.get_close_matches(name, known, n=1)
            hint = f" — did you mean '{guess[0]}'?" if guess else f" (known: {', '.join(known)})"
            problems.append(f"dataset class {cls.__name__}: unknown option {name!r}{hint}")
    if problems:
        raise ConfigError(problems)


set_child_builder(make_dataset)  # the meta datasets build their children through it
