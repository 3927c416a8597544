"""RETURNN's run-tool keys against the installed RETURNN on the same run: ``calculate_exp_loss``,
``log_grad_norm`` (scores in the learning-rate file), ``epoch_start`` / ``epoch_end`` (the callbacks' calls)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kit.scores import parse_returnn_lr_file
from tests.returnn_compat.returnn_helpers import FIXTURES, needs_returnn, run_python

CONFIG = str(FIXTURES / "shared_run.config")


def _run(tool: str, run_dir: Path, keys: dict[str, str], variant: str = "") -> dict:
    """Train with the shared config and ``keys`` appended to it (Python source, as a user writes them)."""
    run_dir.mkdir()
    config = run_dir / "run.config"
    config.write_text(Path(CONFIG).read_text() + "".join(f"\n{k} = {v}" for k, v in keys.items()) + "\n")
    env = {"RUN_DIR": str(run_dir), "VARIANT": variant}
    run_python(["-m", "returnn", str(config)] if tool == "returnn" else ["-m", "kit", "train", str(config)], env=env)
    return parse_returnn_lr_file((run_dir / "learning_rates").read_text())["epochs"]


@needs_returnn
@pytest.mark.parametrize("variant, keys", [
    ("", {"calculate_exp_loss": "True", "log_grad_norm": "True"}),
    ("clip_sgd", {"log_grad_norm": "True"}),  # the norm clip_grad_norm_ returns, reused
    ("clip_sgd", {"log_grad_norm": "1.5", "calculate_exp_loss": "True"}),  # measured before the clip
])
def test_exp_loss_and_grad_norm_scores_equal_returnns(tmp_path, variant, keys):
    keys = {**keys, "num_epochs": "2"}
    want = _run("returnn", tmp_path / "returnn", keys, variant)
    got = _run("kit", tmp_path / "kit", keys, variant)
    p = keys["log_grad_norm"].rstrip("0").rstrip(".").replace("True", "2")
    for epoch in (1, 2):
        w, g = want[epoch]["scores"], got[epoch]["scores"]
        assert f"train_loss_grad_norm:p{p}" in w, sorted(w)
        if keys.get("calculate_exp_loss"):
            assert {"train_loss_ce:exp", "dev_loss_ce:exp"} <= set(w)
            assert "train_loss_fer:exp" not in w and "train_loss_grad_norm:p2:exp" not in w
        assert set(g) == set(w)
        for key in w:
            assert g[key] == w[key], (epoch, key, g[key], w[key])  # bitwise
    assert got[2]["scores"]["train_loss_grad_norm:p" + p] != got[1]["scores"]["train_loss_grad_norm:p" + p]


CALLBACKS = """
def _note(kind):
    def fn(*, epoch, step, model, dataset_name, **kwargs):
        total = float(sum(p.detach().double().sum() for p in model.parameters()))
        with open(os.path.join(run_dir, "callbacks"), "a") as f:
            f.write(f"{kind} {dataset_name} {epoch} {step} {total!r} {model.training}\\n")
    return fn


epoch_start = _note("start")
epoch_end = _note("end")


def startup_callback(*, config, **kwargs):
    with open(os.path.join(run_dir, "callbacks"), "a") as f:
        f.write(f"startup {config.typed_value('num_epochs')}\\n")
"""


@needs_returnn
def test_epoch_callbacks_and_packed_batch_size_as_returnn(tmp_path):
    keys = {"num_epochs": "2", "packed_batch_size": "30", "sort_dataset": "False"}
    for tool in ("returnn", "kit"):
        run_dir = tmp_path / tool
        run_dir.mkdir()
        config = run_dir / "run.config"
        config.write_text(Path(CONFIG).read_text() + CALLBACKS + "".join(f"\n{k} = {v}" for k, v in keys.items()))
        args = ["-m", "returnn", str(config)] if tool == "returnn" else ["-m", "kit", "train", str(config)]
        run_python(args, env={"RUN_DIR": str(run_dir), "STEP_LOG": str(run_dir / "steps")})
    want, got = ((tmp_path / t / "callbacks").read_text().splitlines() for t in ("returnn", "kit"))
    assert want[0] == "startup 2" and len(want) == 9  # startup, then (train, dev) x (start, end) x 2 epochs
    assert got == want  # the same calls, arguments and weights, in the same order
    steps = (tmp_path / "returnn" / "steps").read_text()
    assert (tmp_path / "kit" / "steps").read_text() == steps
    unpacked = _run("kit", tmp_path / "unpacked", {"num_epochs": "2"})
    assert unpacked[1]["meta"]["epoch_num_train_steps"] < parse_returnn_lr_file(
        (tmp_path / "kit" / "learning_rates").read_text())["epochs"][1]["meta"]["epoch_num_train_steps"]
