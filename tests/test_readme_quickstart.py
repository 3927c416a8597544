"""README's Quick start, run literally in a fresh folder, twice: it learns what the text says, and the
second run resumes with nothing left to train, without a traceback, leaving the files as they were.

The figures are read from the README's own sentences, so text and run cannot drift apart.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import kit

ROOT = Path(__file__).resolve().parent.parent


def quick_start() -> tuple[str, str]:
    """The Quick start's python block and its prose (whitespace folded)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the Quick start should hold one python block"
    prose = " ".join(re.sub(r"```python\n.*?```", "", section, flags=re.S).split())
    return blocks[0], prose


def stated_figures(prose: str) -> dict[str, str]:
    """The dev frame errors the README states: the always-0 baseline and after epochs 1, 2 and 3."""
    patterns = {
        "baseline": r"Always answering 0 gets a dev frame error \(`dev_loss_fer`\) of (\d\.\d+)",
        "1": r"After epoch 1 the model is no better than that \((\d\.\d+)\)",
        "2": r"in epoch 2 \((\d\.\d+)\)",
        "3": r"ends epoch 3 at (\d\.\d+)",
    }
    found = {key: re.search(pattern, prose) for key, pattern in patterns.items()}
    assert all(found.values()), f"the Quick start no longer states {[k for k, m in found.items() if not m]}"
    return {key: m.group(1) for key, m in found.items() if m}


def agrees(stated: str, measured: float) -> bool:
    """``measured`` is what ``stated`` says, to within one unit of its last written digit."""
    unit = 10.0 ** -len(stated.split(".")[1])
    return abs(float(stated) - measured) <= unit


def printed_scores(stdout: str) -> dict[int, dict[str, float]]:
    """The table the Quick start prints (``epoch`` rows of train_loss_ce, dev_loss_ce, dev_loss_fer)."""
    rows = {}
    for line in stdout.splitlines():
        cells = line.split()
        if len(cells) == 4 and cells[0].isdigit():
            rows[int(cells[0])] = dict(zip(("train_loss_ce", "dev_loss_ce", "dev_loss_fer"), map(float, cells[1:])))
    return rows


def always_zero_error() -> float:
    dev = kit.data.Task12AXDataset(100, seed=2)
    ones = frames = 0
    for i in range(len(dev)):
        classes = dev.get_seq(i)["classes"]
        ones, frames = ones + int(classes.sum()), frames + classes.size
    return ones / frames


def run(script: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, script.name], cwd=script.parent, env=env, capture_output=True, text=True,
                          timeout=600)


def files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_figure_check_catches_a_wrong_figure():
    """Negative control: a stated figure one digit off, or far off, does not agree with the run."""
    assert agrees("0.02", 0.0236) and agrees("0.14", 0.1414) and agrees("0.01", 0.0124)
    assert not agrees("0.005", 0.0124) and not agrees("0.03", 0.0124) and not agrees("0.14", 0.12)


def test_quick_start_runs_twice_as_printed_and_shows_what_the_readme_says(tmp_path):
    code, prose = quick_start()
    stated = stated_figures(prose)
    assert "num_epochs=3" in code and 'model="runs/demo/model"' in code and "runs/demo/model.003.pt" in prose
    script = tmp_path / "quickstart.py"
    script.write_text(code, encoding="utf-8")

    first = run(script)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "finished epoch 3" in first.stderr, "no progress lines while it ran"  # logging.basicConfig
    scores = printed_scores(first.stdout)
    assert sorted(scores) == [1, 2, 3], first.stdout
    assert agrees(stated["baseline"], always_zero_error())
    for epoch in (1, 2, 3):
        assert agrees(stated[str(epoch)], scores[epoch]["dev_loss_fer"]), (epoch, stated, scores)
    assert (tmp_path / "runs" / "demo" / "model.003.pt").is_file()
    before = files(tmp_path / "runs")

    second = run(script)
    output = second.stdout + second.stderr
    assert second.returncode == 0 and "Traceback" not in output, output[-3000:]
    assert "runs/demo/model.003.pt" in output  # resumed from the last epoch's checkpoint
    assert "nothing left to train" in output
    assert printed_scores(second.stdout) == scores  # the same table again
    after = files(tmp_path / "runs")
    assert {k: v for k, v in after.items() if k != "demo/model.lock"} == \
           {k: v for k, v in before.items() if k != "demo/model.lock"}  # no checkpoint or score file rewritten

