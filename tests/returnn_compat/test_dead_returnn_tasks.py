"""Keys kit leaves unsupported because the installed RETURNN cannot run what reads them: pinned here, so that a
RETURNN release that runs them again fails this test (and the keys get RETURNN's meaning in kit)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.returnn_compat.returnn_helpers import needs_returnn

CONFIG = """#!rnn.py
backend = "torch"
task = "analyze_data"
train = {"class": "Task12AXDataset", "num_seqs": 5}
statistics_save_prefix = %r
log_verbosity = 2
"""


@needs_returnn
def test_returnns_analyze_data_task_fails_at_its_first_sequence(tmp_path):
    (tmp_path / "analyze.config").write_text(CONFIG % str(tmp_path / "stats"))
    proc = subprocess.run([sys.executable, "-m", "returnn", str(tmp_path / "analyze.config")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode != 0
    assert "NotImplementedError" in proc.stdout + proc.stderr and "inplace_increment" in proc.stdout + proc.stderr
    assert not list(tmp_path.glob("stats.*"))  # no statistics file: nothing for kit to match
