"""The command line: ``python -m kit train|eval|forward|scores|checkpoints CONFIG [key=value ...]``.

Training and the error paths run as real subprocesses; the read-only commands run
in-process through ``kit.cli.main`` on the run the subprocess left behind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kit
from kit.cli import main, parse_override

CONFIG = textwrap.dedent(
    """\
    #!rnn.py
    import torch

    import kit

    train = {"class": "Task12AXDataset", "num_seqs": 40, "seed": 1}
    dev = {"class": "Task12AXDataset", "num_seqs": 10, "seed": 2}
    extern_data = {"data": {"shape": (None, 9)}, "classes": {"shape": (None,), "sparse_dim": 2}}
    batch_size = 1000
    max_seqs = 10
    num_epochs = 3
    optimizer = {"class": "adam"}
    learning_rate = 0.01
    log_every_n_steps = 1000


    def get_model(*, epoch, step, **_kwargs):
        return torch.nn.Sequential(torch.nn.Linear(9, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


    def train_step(*, model, extern_data, **_kwargs):
        data, classes = extern_data["data"], extern_data["classes"]
        logits = model(data.tensor)
        if USER_ERROR:
            raise ValueError("user code failed on purpose")
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), classes.tensor, reduction="none")
        ctx = kit.get_run_ctx()
        ctx.mark_as_loss(ce, "ce", mask=classes.mask())
        ctx.mark_as_loss((logits.argmax(-1) != classes.tensor).float(), "fer", mask=classes.mask(), as_error=True)


    def forward_step(*, model, extern_data, **_kwargs):
        data = extern_data["data"]
        kit.get_run_ctx().mark_as_output(model(data.tensor).argmax(-1), "classes", lengths=data.lengths)


    USER_ERROR = False
    """
)


def run_kit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(kit.__file__).resolve().parents[1]))
    return subprocess.run(
        [sys.executable, "-m", "kit", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """One real ``python -m kit train`` run (1 epoch by override) that the other tests read."""
    root = tmp_path_factory.mktemp("cli")
    cfg = root / "cfg.py"
    cfg.write_text(CONFIG)
    prefix = root / "run" / "model"
    proc = run_kit(
        "-q", "train", str(cfg), "num_epochs=1", f"model={prefix}", "learning_rate=0.005", cwd=root
    )
    return {"root": root, "cfg": cfg, "prefix": prefix, "proc": proc}


# ---- train ------------------------------------------------------------------------------------


def test_train_runs_with_overrides_and_writes_scores_and_checkpoint(trained):
    proc = trained["proc"]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("finished epoch 1: train_loss_ce ")
    table = kit.ScoreTable.load(f"{trained['prefix']}.scores.json")
    assert table.epochs == [1]  # num_epochs=1 (an int literal) overrode the file's 3
    assert table.learning_rate(1) == 0.005  # a float literal
    assert {"train_loss_ce", "train_loss_fer", "dev_loss_ce", "dev_loss_fer"} == set(table.scores(1))
    assert Path(f"{trained['prefix']}.001.pt").is_file()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("num_epochs=3", ("num_epochs", 3)),
        ("learning_rate=1e-3", ("learning_rate", 0.001)),
        ("max_seqs=None", ("max_seqs", None)),
        ("chunking=(50, 25)", ("chunking", (50, 25))),
        (
            "train={'class': 'Task12AXDataset', 'num_seqs': 5}",
            ("train", {"class": "Task12AXDataset", "num_seqs": 5}),
        ),
        ("model=runs/x/model", ("model", "runs/x/model")),  # not a literal: a string
        ("device=cpu", ("device", "cpu")),
        ("name=a=b", ("name", "a=b")),
    ],
)
def test_overrides_are_python_literals_else_strings(text, expected):
    assert parse_override(text) == expected


def test_override_without_equals_sign_is_a_clear_error(capsys, tmp_path):
    (tmp_path / "cfg.py").write_text(CONFIG)
    assert main(["scores", str(tmp_path / "cfg.py"), "num_epochs"]) == 1
    assert "expected key=value" in capsys.readouterr().err


# ---- errors: one message, non-zero exit, traceback only with --debug ---------------------------------


def test_bad_key_is_one_clear_message_without_traceback(trained):
    proc = run_kit("train", str(trained["cfg"]), "learnig_rate=0.1", cwd=trained["root"])
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert (
        "unknown config key 'learnig_rate'" in proc.stderr and "did you mean 'learning_rate'" in proc.stderr
    )
    assert proc.stderr.strip().startswith("kit: error:") and len(proc.stderr.strip().splitlines()) <= 2


def test_debug_shows_the_traceback(trained):
    proc = run_kit("--debug", "train", str(trained["cfg"]), "learnig_rate=0.1", cwd=trained["root"])
    assert proc.returncode != 0
    assert "Traceback (most recent call last)" in proc.stderr and "learnig_rate" in proc.stderr


def test_user_code_error_names_its_type_and_points_to_debug(capsys, tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(CONFIG.replace("USER_ERROR = False", "USER_ERROR = True"))
    code = main(["-q", "train", str(cfg), f"model={tmp_path / 'model'}"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("kit: ValueError: user code failed on purpose") and "--debug" in err
    assert "during train" in err and "batch of " in err  # the engine's note on the batch
    assert "Traceback" not in err


def test_missing_config_file_is_a_clear_error(capsys, tmp_path):
    assert main(["train", str(tmp_path / "nope.py")]) == 1
    err = capsys.readouterr().err
    assert "nope.py" in err and "cannot read it" in err and "Traceback" not in err


# ---- read-only commands on the trained run ---------------------------------------------------------


def test_scores_from_config_or_file(trained, capsys):
    assert main(["scores", str(trained["cfg"]), f"model={trained['prefix']}"]) == 0
    by_config = capsys.readouterr().out
    assert main(["scores", f"{trained['prefix']}.scores.json"]) == 0
    by_file = capsys.readouterr().out
    assert by_config == by_file and re.search(r"^1 +0.005 ", by_file, re.M) and "dev_loss_fer" in by_file


def test_console_script_runs(trained):
    script = Path(sys.executable).with_name("kit")
    if not script.exists():
        pytest.skip("the 'kit' console script is not installed in this environment")
    proc = subprocess.run(
        [str(script), "scores", f"{trained['prefix']}.scores.json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "(1 epochs)" in proc.stdout


def test_checkpoints_lists_the_epoch_checkpoint(trained, capsys):
    assert main(["checkpoints", str(trained["cfg"]), f"model={trained['prefix']}"]) == 0
    out = capsys.readouterr().out
    assert "model.001" in out or "epoch 1" in out


def test_eval_loads_the_trained_model_and_reproduces_the_dev_score(trained, capsys):
    assert main(["-q", "eval", str(trained["cfg"]), f"model={trained['prefix']}", "num_epochs=1"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("dev: "))
    printed = dict(part.rsplit(" ", 1) for part in line.removeprefix("dev: ").split(", "))
    stored = kit.ScoreTable.load(f"{trained['prefix']}.scores.json").scores(1)
    assert float(printed["dev_loss_ce"]) == pytest.approx(stored["dev_loss_ce"], rel=1e-3)


def test_forward_writes_outputs_cut_per_sequence(trained, capsys, tmp_path):
    out_file = tmp_path / "out.npz"
    code = main(
        [
            "-q",
            "forward",
            str(trained["cfg"]),
            f"model={trained['prefix']}",
            "num_epochs=1",
            "--output",
            str(out_file),
        ]
    )
    assert code == 0 and "10 sequences" in capsys.readouterr().out
    arrays = np.load(out_file)
    ds = kit.data.Task12AXDataset(10, seed=2)
    assert sorted(arrays.files) == sorted(f"{ds.get_seq_tag(i)}/classes" for i in range(10))
    for i in range(10):
        assert arrays[f"{ds.get_seq_tag(i)}/classes"].shape == (ds.get_seq_length(i)["data"],)


# ---- progress on a terminal -------------------------------------------------------------------


def _run_on_a_tty(args: list[str], cwd: Path) -> str:
    """``python -m kit ...`` with stdout and stderr on a pseudo-terminal; everything it wrote."""
    import fcntl
    import pty
    import struct
    import termios

    env = dict(os.environ, PYTHONPATH=str(Path(kit.__file__).resolve().parents[1]))
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 120-column terminal
    proc = subprocess.Popen([sys.executable, "-m", "kit", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=120)
    os.close(leader)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def test_train_on_a_terminal_shows_a_progress_bar_with_step_eta_and_losses(tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(CONFIG)
    out = _run_on_a_tty(["train", str(cfg), "num_epochs=2", f"model={tmp_path / 'model'}"], tmp_path)
    assert "epoch 1/2: 100%|" in out and "epoch 2/2: 100%|" in out  # one bar per epoch, filled
    bar = [line for line in out.replace("\r", "\n").splitlines() if line.startswith("epoch 2/2:")][-1]
    assert " step " in bar and " ce " in bar and " fer " in bar and "<" in bar  # elapsed<remaining
    assert "finished epoch 1" in out  # the log lines still come, above the bars


def test_train_without_a_terminal_has_log_lines_and_no_bar(trained):
    assert "%|" not in trained["proc"].stderr and "%|" not in trained["proc"].stdout


def test_a_run_in_returnns_layout_leaves_returnns_files_and_attach_still_follows_it(tmp_path, capsys):
    """With learning_rate_file (RETURNN's layout) the run directory holds only what RETURNN leaves: the model
    files, the last two optimizer states and the learning-rate file; the event log lives in kit's state
    directory, where kit.attach finds it."""
    cfg = tmp_path / "cfg.py"
    cfg.write_text(CONFIG)
    run = tmp_path / "run"
    proc = run_kit("-q", "train", str(cfg), f"model={run / 'model'}", f"learning_rate_file={run / 'learning_rates'}",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in run.iterdir()) == [
        "learning_rates", "model.001.pt", "model.002.opt.pt", "model.002.pt", "model.003.opt.pt", "model.003.pt"]
    watched = kit.attach(run / "model")
    assert watched.status == "done"
    assert [e["epoch"] for e in watched.events if e["event"] == "epoch_end"] == [1, 2, 3]
    assert watched.checkpoints == ["model.001", "model.002", "model.003"]
    assert str(run) not in os.path.dirname(kit.eventlog.run_base(str(run / "model")))
    # the next things a user does: the folder's scores (RETURNN's learning_rate_file) and checkpoints
    assert main(["scores", str(run)]) == 0
    assert "dev_loss_ce" in capsys.readouterr().out
    assert main(["checkpoints", str(run)]) == 0
    listing = capsys.readouterr().out
    assert re.search(r"model\.001 .* ok, weights only", listing)  # its .opt.pt went by RETURNN's rule
    assert re.search(r"model\.003 .* ok ", listing) and "CORRUPT" not in listing
