"""Writes a notebook (without outputs) from a Python file whose cells are separated by lines starting with '# %%'.

    python scripts/make_notebook.py notebooks/src/01_quickstart.py notebooks/01_quickstart.ipynb

A cell whose first line is '# %% [markdown]' becomes a markdown cell (its lines lose their leading '# ').
"""

import sys

import nbformat


def main(src: str, dst: str) -> None:
  cells, cur, kind = [], [], "code"

  def flush():
    text = "\n".join(cur).strip("\n")
    if text:
      cells.append(nbformat.v4.new_markdown_cell(text) if kind == "markdown" else nbformat.v4.new_code_cell(text))

  for line in open(src).read().splitlines():
    if line.startswith("# %%"):
      flush()
      cur, kind = [], ("markdown" if "[markdown]" in line else "code")
      continue
    cur.append(line[2:] if kind == "markdown" and line.startswith("# ") else ("" if kind == "markdown" and line == "#" else line))
  flush()
  nb = nbformat.v4.new_notebook(cells=cells)
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  nbformat.write(nb, dst)


if __name__ == "__main__":
  main(*sys.argv[1:])
