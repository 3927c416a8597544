#!rnn.py
"""The config of the torchrun tests (tests/test_distributed.py): ``torchrun ... -m kit train THIS``.

13 train batches of 10 sequences per epoch (2 ranks train on 6 each, the 13th is left
out), no dropout and plain SGD, so that a run of W ranks can be compared with a single
process. The test sets ``torch_distributed``, ``model`` and ``num_epochs`` on the command line.

With ``KIT_DDP_DUMP`` set, each rank writes ``{KIT_DDP_DUMP}.rank{RANK}.pt`` at exit: its
final weights, the sequence tags of each train batch it trained on (per epoch), the class
of the ``model`` its ``train_step`` got, the files it wrote and its kit log messages.
"""

import atexit
import contextlib
import logging
import os

import torch
from helpers import event_log as _event_log
from helpers import models as _models

import kit
import kit.fileio as _fileio
from kit.data import Task12AXDataset


def get_model(*, epoch, step, **_kwargs):
    return _models.TinyModel(dropout=0.0)


def train_step(*, model, extern_data, **kwargs):
    ctx = kit.get_run_ctx()
    if ctx.stage == "train":
        _RECORD["seen"].setdefault(ctx.epoch, []).append(list(extern_data.seq_tags))
        _RECORD["model_types"].append(type(model).__name__)
        _RECORD["model"] = model
    _models.train_step(model=model, extern_data=extern_data, **kwargs)


extern_data = Task12AXDataset.extern_data
train = Task12AXDataset(130, seed=1, seq_ordering="random")
dev = Task12AXDataset(30, seed=2)  # 3 batches: 2 on rank 0, 1 on rank 1
batch_size = 1000
max_seqs = 10
optimizer = {"class": "sgd"}
learning_rate = 0.002
log_every_n_steps = 1

_RECORD = {"seen": {}, "model_types": [], "model": None, "written": [], "logs": [], "events": []}


class _Recorder(logging.Handler):
    def emit(self, record):
        _RECORD["logs"].append(f"{record.levelname}: {record.getMessage()}")


def _dump():
    model = _RECORD.pop("model")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()} if model is not None else {}
    torch.save(
        {**_RECORD, "state": state}, f"{os.environ['KIT_DDP_DUMP']}.rank{os.environ.get('RANK', 0)}.pt"
    )


if os.environ.get("KIT_DDP_DUMP"):
    _atomic_open = _fileio.atomic_open

    @contextlib.contextmanager
    def _recording_atomic_open(path, mode="wb"):
        _RECORD["written"].append(os.fspath(path))
        with _atomic_open(path, mode) as f:
            yield f

    _fileio.atomic_open = _recording_atomic_open  # every kit file write goes through it
    logging.getLogger("kit").addHandler(_Recorder())
    atexit.register(_dump)
    _event_log.install(_RECORD["events"])  # the CLI's engine, made after this import
