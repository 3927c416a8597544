"""``preload_from_files`` and ``load_model_post_hooks`` through the engine, with RETURNN's rules.

``init_for_train=True`` entries apply only when training starts fresh (or from
``import_model_train_epoch1``); the others (RETURNN's default, "init for recog") only when
not training: ``engine.task`` "eval" / "forward", or a config that cannot train.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.faults import write_malicious_checkpoint
from helpers.models import TinyModel, tiny_config

import kit
from kit import checkpoints
from kit.engine.engine import Engine
from kit.errors import CheckpointError, UnsafeCheckpointError


def constant_weights(value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in TinyModel().state_dict().items()}


def fresh_weights() -> dict[str, torch.Tensor]:
    engine = Engine(kit.Config(tiny_config()))
    engine.setup()
    return engine.model.state_dict()


def same(model: torch.nn.Module, weights: dict[str, torch.Tensor], keys=None) -> bool:
    state = model.state_dict()
    keys = list(weights) if keys is None else keys
    return all(torch.equal(state[k], weights[k]) for k in keys)


def engine_for(task: str = "train", **keys) -> Engine:
    engine = Engine(kit.Config(tiny_config(**keys)))
    engine.task = task
    engine.setup()
    return engine


@pytest.fixture
def donor(tmp_path) -> str:
    path = tmp_path / "donor.pt"
    torch.save({"model": constant_weights(0.5)}, path)
    return str(path)


def test_init_for_train_applies_when_training_starts_fresh_and_never_on_resume(tmp_path, donor):
    prefix = str(tmp_path / "model")
    preload = {"init": {"filename": donor, "init_for_train": True}}
    engine = engine_for(model=prefix, num_epochs=1, preload_from_files=preload)
    assert same(engine.model, constant_weights(0.5))
    engine.train()
    engine.close()
    trained = checkpoints.load(f"{prefix}.001.pt")["model"]
    assert not same_as_donor(trained)

    resumed = engine_for(model=prefix, num_epochs=2, preload_from_files=preload)
    assert resumed.progress.epoch == 2 and same(resumed.model, trained)
    evaluating = engine_for("eval", model=prefix, preload_from_files=preload)
    assert same(evaluating.model, trained)
    forward_only = engine_for(model=prefix, train=None, train_step=None, preload_from_files=preload)
    assert same(forward_only.model, trained)


def same_as_donor(weights: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, torch.full_like(v, 0.5)) for v in weights.values())


def test_init_for_train_applies_on_top_of_import_model_train_epoch1(tmp_path):
    torch.save({"model": constant_weights(0.25)}, tmp_path / "imported.pt")
    torch.save({"weight": torch.full((2, 16), 0.5), "bias": torch.full((2,), 0.5)}, tmp_path / "out.pt")
    out = str(tmp_path / "out.pt")
    preload = {"out": {"filename": out, "init_for_train": True, "prefix": "out.", "checkpoint_key": None}}
    engine = engine_for(import_model_train_epoch1=str(tmp_path / "imported.pt"), preload_from_files=preload)
    assert same(engine.model, constant_weights(0.25), ["inp.weight", "inp.bias"])
    assert same(engine.model, constant_weights(0.5), ["out.weight", "out.bias"])


def test_recog_entries_apply_only_when_not_training(tmp_path, donor):
    prefix = str(tmp_path / "model")
    preload = {"recog": {"filename": donor}}  # init_for_train=False, RETURNN's default
    assert same(engine_for(model=prefix, preload_from_files=preload).model, fresh_weights())
    for task in ("eval", "forward"):
        assert same(
            engine_for(task, model=prefix, preload_from_files=preload).model, constant_weights(0.5)
        ), task
    forward_only = engine_for(train=None, train_step=None, preload_from_files=preload)
    assert same(forward_only.model, constant_weights(0.5))


def test_entries_are_applied_in_reverse_sorted_order_so_the_first_name_wins(tmp_path):
    for name, value in (("a", 0.1), ("b", 0.2)):
        torch.save({"model": constant_weights(value)}, tmp_path / f"{name}.pt")
    preload = {n: {"filename": str(tmp_path / f"{n}.pt")} for n in ("b", "a")}
    assert same(engine_for("eval", preload_from_files=preload).model, constant_weights(0.1))


def test_prefix_checkpoint_key_ignore_params_and_var_name_mapping(tmp_path):
    path = tmp_path / "output_layer.pt"
    torch.save({"w": torch.full((2, 16), 0.75), "b": torch.full((2,), 0.75), "extra": torch.zeros(3)}, path)
    opts = {
        "filename": str(path),
        "prefix": "out.",
        "checkpoint_key": None,
        "ignore_params": ["out.extra"],
        "var_name_mapping": {"out.weight": "w", "out.bias": "b"},
        "init_for_train": True,
    }
    engine = engine_for(preload_from_files={"out": opts})
    fresh = fresh_weights()
    assert same(engine.model, fresh, ["inp.weight", "inp.bias"])
    assert torch.equal(engine.model.out.weight, torch.full((2, 16), 0.75))
    assert torch.equal(engine.model.out.bias, torch.full((2,), 0.75))


def test_missing_keys_are_an_error_unless_ignore_missing(tmp_path):
    path = tmp_path / "partial.pt"
    torch.save({"model": {"weight": torch.full((2, 16), 0.75)}}, path)
    opts = {"filename": str(path), "prefix": "out.", "init_for_train": True}
    with pytest.raises(CheckpointError, match=r"(?s)missing key\(s\).*'out\.bias'"):
        engine_for(preload_from_files={"out": opts})
    engine = engine_for(preload_from_files={"out": {**opts, "ignore_missing": True}})
    assert torch.equal(engine.model.out.weight, torch.full((2, 16), 0.75))
    assert torch.equal(engine.model.out.bias, fresh_weights()["out.bias"])
    with pytest.raises(CheckpointError, match="prefix 'decoder.' matches no parameter"):
        engine_for(preload_from_files={"out": {**opts, "prefix": "decoder."}})


def test_preload_fills_what_the_loaded_model_lacks_as_in_returnn(tmp_path):
    """``load`` of a model without the output layer + a preload entry for it (e.g. an external LM)."""
    weights = constant_weights(0.25)
    torch.save(
        {"model": {k: v for k, v in weights.items() if k.startswith("inp.")}, "epoch": 5}, tmp_path / "am.pt"
    )
    torch.save(
        {"model": {"weight": torch.full((2, 16), 0.5), "bias": torch.full((2,), 0.5)}}, tmp_path / "lm.pt"
    )
    preload = {"lm": {"filename": str(tmp_path / "lm.pt"), "prefix": "out."}}
    engine = engine_for("forward", load=str(tmp_path / "am.pt"), preload_from_files=preload)
    assert same(engine.model, weights, ["inp.weight", "inp.bias"])
    assert same(engine.model, constant_weights(0.5), ["out.weight", "out.bias"])
    with pytest.raises(
        CheckpointError, match=r"am\.pt.*: missing key\(s\) in state_dict: 'out\.bias', 'out\.weight'$"
    ):
        engine_for("forward", load=str(tmp_path / "am.pt"))


seen_by_hook: list[dict[str, torch.Tensor]] = []


def record_and_edit(*, model: torch.nn.Module, **_kwargs) -> None:
    seen_by_hook.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    with torch.no_grad():
        model.out.bias.fill_(3.0)


def test_load_model_post_hooks_run_once_after_every_load(tmp_path, donor):
    seen_by_hook.clear()
    prefix = str(tmp_path / "model")
    keys = dict(model=prefix, num_epochs=1, load_model_post_hooks=[record_and_edit])
    preload = {"init": {"filename": donor, "init_for_train": True}}
    engine = engine_for(preload_from_files=preload, **keys)
    assert len(seen_by_hook) == 1 and same_as_donor(seen_by_hook[0])  # after the preload
    assert torch.equal(engine.model.out.bias, torch.full((2,), 3.0))  # what the hook did stays
    engine.train()
    engine.close()

    resumed = engine_for(**{**keys, "num_epochs": 2})
    assert len(seen_by_hook) == 2
    assert all(
        torch.equal(v, seen_by_hook[1][k]) for k, v in checkpoints.load(f"{prefix}.001.pt")["model"].items()
    )
    assert torch.equal(resumed.model.out.bias, torch.full((2,), 3.0))

    with pytest.raises(kit.ConfigError, match=r"must accept \*\*kwargs"):
        engine_for(load_model_post_hooks=[lambda model: None])


@pytest.mark.parametrize("payload", ["os.system", "touch"])
def test_a_preload_file_that_runs_code_is_refused(tmp_path, payload):
    marker = tmp_path / "pwned"
    evil = write_malicious_checkpoint(tmp_path / "evil.pt", marker, payload)
    with pytest.raises(UnsafeCheckpointError, match="evil.pt"):
        engine_for(preload_from_files={"evil": {"filename": evil, "init_for_train": True}})
    assert not os.path.exists(marker)
