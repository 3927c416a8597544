"""The end-to-end benchmarks' contenders do the same work (same final weights); gpu_check runs anywhere."""

import copy
import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import end_to_end as e  # noqa: E402


def small(name):
    w = copy.copy(e.WORKLOADS[name])
    w.num_seqs = w.max_seqs * 3  # three batches: the runs below cross an epoch end
    return w


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_kit_and_the_loops_end_on_the_same_weights(name):
    w = small(name)
    runs = e.contenders(w)
    e.interleave(runs, turn=2, rounds=2, warmup=1)
    base = runs["loop, pre-collated"].model
    for key, run in runs.items():
        assert e.same_weights(base, run.model) == "identical", key
    runs["loop + DataLoader"].run(1)  # negative control: one more step changes the weights
    assert e.same_weights(base, runs["loop + DataLoader"].model) != "identical"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_gpu_check_exits_cleanly_without_cuda():
    env = dict(os.environ, PYTHONPATH=os.path.dirname(BENCH))
    out = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_check.py")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0 and "no CUDA" in out.stdout


def test_step_lines_counts_kit_code_only_in_kit_steps_and_more_with_the_guard():
    import step_lines

    runs = e.contenders(small("mlp"))
    for run in runs.values():
        run.run(2)
    loop, off, on = (step_lines.count(runs[k], 2) for k in
                     ("loop, pre-collated", "kit ArrayDataset, guard off", "kit ArrayDataset, guard on"))
    assert sum(loop.lines.values()) == 0 and loop.calls["kit"] == 0 and loop.calls["torch"] > 0
    assert sum(off.lines.values()) > 0 and off.lines["kit/engine/engine.py", "train_step"] > 0
    assert sum(on.lines.values()) > sum(off.lines.values())  # the guard's check runs in kit's code
    assert any(path == "kit/engine/guard.py" for path, _ in on.lines)
    assert not any(path == "kit/engine/guard.py" and fn == "_check" for path, fn in off.lines)


def test_report_holds_a_torch_dataset_on_the_mlp_to_the_per_item_loop_and_the_rest_to_the_targets(capsys):
    class Run:
        model = torch.nn.Linear(2, 2)

    times = {"loop, pre-collated": [1.0] * 3, "loop + per-item collate": [1.30] * 3,
             "kit ArrayDataset, guard off": [1.06] * 3, "kit TorchDataset, guard off": [1.20] * 3,
             "kit TorchDataset, guard on": [1.35] * 3}
    e.report(e.WORKLOADS["mlp"], dict.fromkeys(times, Run()), times, "loop, pre-collated")
    lines = {line.split("  ")[1].strip(): line for line in capsys.readouterr().out.splitlines() if "kit " in line}
    assert lines["kit ArrayDataset, guard off"].endswith("≤ 1.05 MISSED")
    assert lines["kit TorchDataset, guard off"].endswith("< per-item loop ok")
    assert lines["kit TorchDataset, guard on"].endswith("< per-item loop MISSED")
