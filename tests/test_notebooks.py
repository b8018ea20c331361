"""Executes every notebook in notebooks/ at tiny size (they import the package only)."""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
  nb = nbformat.read(path, as_version=4)
  assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
  # The kernel inherits this environment: CPU only, no display; the package is installed (editable) in the venv.
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["MPLBACKEND"] = "Agg"
  client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
