"""A tutorial copied alone into an empty folder, run from the top twice (outputs kept, as "Run All" again):
no error, nothing on stderr, and what it leaves behind is what it says it leaves."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[2]


def run_all(path: Path, folder: Path) -> list[str]:
    """Run every cell in one kernel started in ``folder``; the problems a user would see."""
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(folder)}}).execute()
    problems = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.output_type == "error":
                problems.append(f"cell {i}: {out.ename}: {out.evalue[:200]}")
            elif out.output_type == "stream" and out.name == "stderr":
                problems.append(f"cell {i} stderr: {out.text[:200]}")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("name, leaves", [
    ("02_live_dashboard.ipynb", []),  # its checkpoints go to a temporary folder it removes
    ("09_cli_and_notebook.ipynb", []),  # its config and run are removed by its last cell
])
def test_a_tutorial_runs_twice_in_its_folder(tmp_path, monkeypatch, name, leaves) -> None:
    monkeypatch.setenv("KIT_TEST", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    shutil.copy(ROOT / "notebooks" / name, tmp_path / name)
    temp_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "kit-dashboard-*")))
    for attempt in (1, 2):
        assert run_all(tmp_path / name, tmp_path) == [], f"run {attempt}"
        assert sorted(os.listdir(tmp_path)) == sorted([name, *leaves]), f"run {attempt}"
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "kit-dashboard-*"))) == temp_before
