#!rnn.py
# RETURNN-style config: the toy 12AX task with an LSTM, Adam and newbob.
# Run: python -m kit train examples/12ax.py   (or the path kit.examples.path("12ax") gives, from anywhere;
#      overrides: num_epochs=2 model=/tmp/x/model ...)
import torch

import kit

train = {"class": "Task12AXDataset", "num_seqs": 1000, "seed": 1, "seq_ordering": "laplace:.10"}
dev = {"class": "Task12AXDataset", "num_seqs": 100, "seed": 2}
extern_data = {"data": {"shape": (None, 9)}, "classes": {"shape": (None,), "sparse_dim": 2}}

batch_size = 5000
max_seqs = 10
num_epochs = 5
model = "runs/12ax/model"
optimizer = {"class": "adam"}
learning_rate = 0.01
learning_rate_control = "newbob"
learning_rate_control_error_measure = "dev_loss_fer"
gradient_clip_global_norm = 5.0
log_every_n_steps = 50
cleanup_old_models = {"keep_last_n": 2}


class Model(torch.nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.lstm = torch.nn.LSTM(9, hidden, batch_first=True)
        self.out = torch.nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(x)[0])


def get_model(*, epoch: int, step: int, **_kwargs):
    return Model()


def train_step(*, model, extern_data: kit.Batch, **_kwargs):
    data, classes = extern_data["data"], extern_data["classes"]
    logits = model(data.tensor)
    mask = classes.mask()
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), classes.tensor, reduction="none")
    ctx = kit.get_run_ctx()
    ctx.mark_as_loss(ce, "ce", mask=mask)
    ctx.mark_as_loss((logits.argmax(-1) != classes.tensor).float(), "fer", mask=mask, as_error=True)


def forward_step(*, model, extern_data: kit.Batch, **_kwargs):
    data = extern_data["data"]
    kit.get_run_ctx().mark_as_output(model(data.tensor).argmax(-1), "classes", lengths=data.lengths)
