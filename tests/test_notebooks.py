"""Executes every notebook in notebooks/ at tiny size (they import the package only), each in a process of its own
(`run_notebook.py`)."""

import pathlib
import subprocess
import sys

import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
RUNNER = pathlib.Path(__file__).parent / "run_notebook.py"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
  nb = nbformat.read(path, as_version=4)
  assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
  proc = subprocess.run([sys.executable, str(RUNNER), str(path), str(tmp_path)], capture_output=True, text=True,
                        timeout=900, check=False)
  assert proc.returncode == 0, f"{path.name} failed:\n{proc.stderr[-6000:]}"
