"""``python -m kit train`` stopped by Ctrl-C, SIGTERM or SIGUSR1 mid-epoch: the step finishes, a step
checkpoint is written, the exit status says which signal, and the same command resumes to exactly the
result of an uninterrupted run. Also: a finished training re-run has nothing to do; the final line once."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import kit
from kit.cli import main

CONFIG = textwrap.dedent(
    """\
    #!rnn.py
    import os, time
    import torch
    import kit

    train = {"class": "Task12AXDataset", "num_seqs": 40, "seed": 1, "seq_ordering": "random"}
    dev = {"class": "Task12AXDataset", "num_seqs": 8, "seed": 2}
    extern_data = {"data": {"shape": (None, 9)}, "classes": {"shape": (None,), "sparse_dim": 2}}
    batch_size = 1000
    max_seqs = 5
    num_epochs = 2
    optimizer = {"class": "adam"}
    learning_rate = 0.01
    log_every_n_steps = 1
    model = "run/model"
    STEP_SLEEP = float(os.environ.get("KIT_TEST_STEP_SLEEP", "0"))  # slow steps: time to signal mid-epoch


    def get_model(*, epoch, step, **_kwargs):
        return torch.nn.Sequential(torch.nn.Linear(9, 8), torch.nn.Tanh(), torch.nn.Dropout(0.3),
                                   torch.nn.Linear(8, 2))


    def train_step(*, model, extern_data, **_kwargs):
        time.sleep(STEP_SLEEP)
        data, classes = extern_data["data"], extern_data["classes"]
        logits = model(data.tensor)
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), classes.tensor, reduction="none")
        kit.get_run_ctx().mark_as_loss(ce, "ce", mask=classes.mask())
    """
)


def kit_cmd(*args: str, cwd: Path, **env: str) -> subprocess.Popen:
    full_env = dict(os.environ, PYTHONPATH=str(Path(kit.__file__).resolve().parents[1]), **env)
    return subprocess.Popen([sys.executable, "-m", "kit", *args], cwd=cwd, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def final_state(run_dir: Path) -> tuple[dict, dict, str]:
    model_file = kit.checkpoints.load(run_dir / "run" / "model.002.pt")
    train_state = kit.checkpoints.load(run_dir / "run" / "model.002.opt.pt")
    scores = kit.ScoreTable.load(run_dir / "run" / "model.scores.json")
    return model_file["model"], train_state["optimizer"], repr([scores.scores(e) for e in scores.epochs])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, str, str]:
    """An uninterrupted run (its folder, stdout, stderr)."""
    root = tmp_path_factory.mktemp("reference")
    (root / "cfg.py").write_text(CONFIG)
    proc = kit_cmd("train", "cfg.py", cwd=root)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    return root, out, err


SIGNALS = [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGUSR1, 138)]


def _stop_mid_epoch(proc: subprocess.Popen, sig: signal.Signals) -> tuple[int, str, str]:
    """Wait for step 2 of epoch 1 in the log on stderr, send ``sig``; (status, stdout, stderr)."""
    lines = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line, "".join(lines)[-2000:]
        lines.append(line)
        if line.startswith("ep 1 train, step 2,"):
            break
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, "".join(lines) + err


def test_a_signal_mid_epoch_saves_a_step_checkpoint_and_the_rerun_ends_bitwise_equal(tmp_path, reference):
    """Each signal stops its own run; the runs (slowed by the config, not by kit) go side by side."""
    dirs = {sig: tmp_path / sig.name for sig, _ in SIGNALS}
    for d in dirs.values():
        d.mkdir()
        (d / "cfg.py").write_text(CONFIG)
    procs = {sig: kit_cmd("train", "cfg.py", cwd=dirs[sig], KIT_TEST_STEP_SLEEP="0.15") for sig, _ in SIGNALS}
    with concurrent.futures.ThreadPoolExecutor(len(SIGNALS)) as pool:  # each is signalled at its own step 2
        results = {sig: pool.submit(_stop_mid_epoch, procs[sig], sig) for sig in procs}
    stops = {}
    for sig, status in SIGNALS:
        code, out, err = results[sig].result()
        assert code == status, err[-2000:]
        stop = re.search(r"kit: stopped by (SIG\w+) at epoch 1, step (\d+) \(global step (\d+)\); saved "
                         r"(model\.001\.step\d+)\. Resume with: python -m kit train cfg\.py", err)
        assert stop and stop[1] == sig.name, err[-2000:]
        assert int(stop[2]) >= 3 and stop[4] == f"model.001.step{int(stop[3]):08d}"  # the running step finished
        assert (dirs[sig] / "run" / f"{stop[4]}.pt").exists() and "finished epoch" not in out
        stops[sig] = stop[4]
    reruns = {sig: kit_cmd("train", "cfg.py", cwd=dirs[sig]) for sig in dirs}
    ref_weights, ref_optimizer, ref_scores = final_state(reference[0])
    resumed = []
    for sig, rerun in reruns.items():
        out, err = rerun.communicate(timeout=300)
        assert rerun.returncode == 0, err[-2000:]
        assert f"{stops[sig]}.pt" in err and not re.search(r"^ep 1 train, step 0,", err, re.M)  # not started over
        weights, optimizer, scores = final_state(dirs[sig])
        if (weights.keys() == ref_weights.keys() and all(torch.equal(weights[k], ref_weights[k]) for k in weights)
                and str(optimizer) == str(ref_optimizer) and scores == ref_scores):
            resumed.append(sig.name)
    print(f"\nsignals: {len(resumed)} resumed bitwise / {len(SIGNALS)} tried ({', '.join(resumed)})")
    assert len(resumed) == len(SIGNALS)


def test_rerunning_a_finished_training_has_nothing_to_do(reference, capsys):
    cwd = os.getcwd()
    os.chdir(reference[0])
    try:
        assert main(["-q", "train", "cfg.py", "num_epochs=1"]) == 0
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    assert out.strip() == "already trained to epoch 2 \u2265 num_epochs=1: nothing to do"


def test_the_final_finished_epoch_line_shows_once(reference):
    _, out, err = reference
    assert (out + err).count("finished epoch 2:") == 1 and out.startswith("finished epoch 2: train_loss_ce")
    assert err.count("finished epoch 1:") == 1  # the log keeps the other epochs' lines


@pytest.mark.parametrize("what", ["cfg.py", "run/model", "run/model.scores.json", "run", "run/"])
def test_checkpoints_and_scores_accept_a_config_a_prefix_a_score_file_or_a_folder(reference, capsys, what):
    cwd = os.getcwd()
    os.chdir(reference[0])
    try:
        assert main(["-q", "checkpoints", what]) == 0
        listed = capsys.readouterr().out
        assert main(["-q", "scores", what]) == 0
        table = capsys.readouterr().out
    finally:
        os.chdir(cwd)
    rows = [line.split() for line in listed.splitlines()[2:4]]
    assert [r[:3] for r in rows] == [["model.001", "epoch", "1"], ["model.002", "epoch", "2"]]
    assert "model.scores.json (2 epochs)" in table.splitlines()[0]
    assert [line.split()[0] for line in table.splitlines()[2:4]] == ["1", "2"]
