"""RETURNN's ``use_dummy_datasets``: kit's config gets exactly the dataset dicts RETURNN's own
``setup_dummy_datasets`` makes (RETURNN's ``DummyGenericDataset``, its sequence counts and seeds), and trains on them."""

from __future__ import annotations

import json

import pytest

from tests.returnn_compat.returnn_helpers import needs_returnn, run_python

CONFIG = """
train = {"class": "Task12AXDataset", "num_seqs": 50}
dev = {"class": "Task12AXDataset", "num_seqs": 10}
eval_datasets = {"devtrain": {"class": "Task12AXDataset", "num_seqs": 5}}
extern_data = {"data": {"dim": 9}, "classes": {"dim": 2, "sparse": True}}
use_dummy_datasets = True
"""

RETURNN_SIDE = """
import json, sys
from returnn.config import Config, global_config_ctx
import returnn.__main__ as main
config = Config()
config.update(json.loads(sys.argv[1]))
main.config = config
with global_config_ctx(config):
    main.setup_dummy_datasets()
print(json.dumps({k: config.typed_value(k) for k in ("train", "dev", "eval_datasets")}, sort_keys=True))
"""

CONFIG_KIT = CONFIG + """
train_dummy_dataset_num_seqs = 20
model = "{model}"
"""

KIT_SIDE = """
import json, sys
import kit
config = kit.Config(**json.loads(sys.argv[1]))
print(json.dumps({k: config.typed_value(k) for k in ("train", "dev", "eval_datasets")}, sort_keys=True))
"""


@needs_returnn
@pytest.mark.parametrize("counts", [{}, {"train_dummy_dataset_num_seqs": 30, "dummy_dataset_num_seqs": 7},
                                    {"dummy_dataset_num_seqs": 4}])
def test_dummy_datasets_are_returnns(counts):
    namespace: dict = {}
    exec(CONFIG, namespace)  # noqa: S102 - the test's own config text
    values = json.dumps({**{k: v for k, v in namespace.items() if not k.startswith("__")}, **counts})
    want = json.loads(run_python(["-c", RETURNN_SIDE, values]).stdout.strip().splitlines()[-1])
    got = json.loads(run_python(["-c", KIT_SIDE, values]).stdout.strip().splitlines()[-1])
    assert got == want and want["train"]["class"] == "DummyGenericDataset"


@needs_returnn
def test_a_session_reads_dummy_data_shaped_by_extern_data(tmp_path):
    import numpy as np

    import kit
    from kit.data import make_dataset

    path = tmp_path / "dummy.config"
    path.write_text(CONFIG_KIT.replace("{model}", str(tmp_path / "model")))
    config = kit.Config.from_file(path)
    train = make_dataset(config.typed_value("train"))  # what the engine builds from the config
    assert len(train) == 20 and type(train).__name__ == "ReturnnDataset"  # RETURNN's class, through kit's adapter
    seq = train.get_seq(0)
    assert seq["data"].shape[1] == 9 and seq["data"].dtype == np.float32 and seq["classes"].max() < 2
