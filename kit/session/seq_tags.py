"""Finding sequences by tag among a session's datasets (``session.forward(["tag-1", ...])``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kit.errors import KitError

if TYPE_CHECKING:
    from kit.data.dataset import Dataset


class UnknownSeqTagError(KitError, KeyError):
    """``forward`` was given seq tags that no (or more than one) dataset of the session holds."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


def resolve_tags(datasets: Mapping[str, Any], tags: list[str], name: str | None) -> tuple[Any, list[int]]:
    """The one dataset (of ``datasets``, keyed as the engine keys them) holding ``tags``, and their indices."""
    datasets = {k: v for k, v in datasets.items() if v is not None}
    known = ", ".join(k.removeprefix("eval_datasets.") for k in datasets) or "none"
    if name is not None:
        key = name if name in datasets else f"eval_datasets.{name}"
        if key not in datasets:
            raise UnknownSeqTagError(f"forward(dataset={name!r}): no such dataset in this session (known: {known})")
        datasets = {key: datasets[key]}
    found: dict[int, tuple[str, Any, list[int]]] = {}
    for key, ds in datasets.items():
        try:
            found.setdefault(id(ds), (key, ds, [ds.get_seq_index(t) for t in tags]))
        except KeyError:
            continue
    if len(found) == 1:
        _, ds, indices = next(iter(found.values()))
        return ds, indices
    if found:
        where = ", ".join(repr(k.removeprefix("eval_datasets.")) for k, _, _ in found.values())
        raise UnknownSeqTagError(f"seq tags {tags[:3]} are in several datasets ({where}); "
                                 f"say which one: session.forward(tags, dataset=...)")
    missing = [t for t in tags if not any(_has_tag(ds, t) for ds in datasets.values())]
    scope = f"dataset {name!r}" if name else "any of this session's datasets"
    raise UnknownSeqTagError(f"unknown seq tag(s) {missing[:5]}: not in {scope} (known datasets: {known}; "
                             f"their tags look like {_tag_examples(datasets)})")


def _tag_examples(datasets: Mapping[str, Any]) -> str:
    for ds in datasets.values():
        try:
            return ", ".join(repr(ds.get_seq_tag(i)) for i in range(min(2, len(ds))))
        except Exception:  # a dataset without tags or length: no examples
            continue
    return "?"


def _has_tag(dataset: Dataset, tag: str) -> bool:
    try:
        dataset.get_seq_index(tag)
        return True
    except KeyError:
        return False
