"""Executes one notebook with nbclient: `python tests/run_notebook.py NOTEBOOK WORKDIR`.

`test_notebooks.py` runs this in a process of its own, so that the Jupyter client's threads (zmq sockets, an asyncio
loop) and its environment changes stay out of the pytest worker.
"""

import os
import sys

import nbformat
from nbclient import NotebookClient


def main(path: str, workdir: str) -> None:
  nb = nbformat.read(path, as_version=4)
  # The kernel inherits this environment: CPU only, no display; the package is installed (editable) in the venv.
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["MPLBACKEND"] = "Agg"
  NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": workdir}}).execute()


if __name__ == "__main__":
  main(*sys.argv[1:])
