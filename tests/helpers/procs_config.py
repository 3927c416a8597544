#!rnn.py
"""The config of tests/test_processes.py: a Session's ``processes=2`` against torchrun on the same config.

12 train batches of 10 sequences per epoch (6 steps on each of 2 ranks), dropout (the ranks draw
different masks), Adam. ``KIT_PROCS_STEP_SLEEP`` slows each step (a pause must land mid-epoch);
``KIT_PROCS_FAIL_AT`` makes the step of that global step raise (on every rank, and in a replay).
"""

import os
import time

from helpers import models as _models

import kit
from kit.data import Task12AXDataset


def get_model(*, epoch, step, **_kwargs):
    return _models.TinyModel(dropout=0.2)


def train_step(*, model, extern_data, **kwargs):
    # set in the test's kernel only: a worker (RANK set) that sees it was forked from the kernel, not spawned
    if "RANK" in os.environ and getattr(_models, "KERNEL_ONLY_MARK", False):
        raise RuntimeError("this worker sees the kernel's memory: it was forked, not spawned")
    ctx = kit.get_run_ctx()
    if ctx.stage == "train":
        if os.environ.get("KIT_PROCS_FAIL_AT") and ctx.step == int(os.environ["KIT_PROCS_FAIL_AT"]):
            raise ValueError(f"planted failure at global step {ctx.step}")
        time.sleep(float(os.environ.get("KIT_PROCS_STEP_SLEEP", "0")))
    _models.train_step(model=model, extern_data=extern_data, **kwargs)


extern_data = Task12AXDataset.extern_data
train = Task12AXDataset(120, seed=1, seq_ordering="random")
dev = Task12AXDataset(30, seed=2)
batch_size = 1000
max_seqs = 10
optimizer = {"class": "adam"}
learning_rate = 0.01
num_epochs = 3
log_every_n_steps = 1000
