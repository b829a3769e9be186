"""Executes a notebook in place with its outputs (plots included), as the committed
notebooks/tour.ipynb was: `make notebook`, or `python scripts/execute_notebook.py PATH`.

Needs the `notebook` extra (`pip install -e ".[notebook]"`: nbclient, ipykernel). The kernel runs
in the repository root, so the notebook imports `lab` as the tests do.
"""

import os
import sys

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv):
  if len(argv) != 2:
    print(f"usage: {argv[0]} NOTEBOOK.ipynb", file=sys.stderr)
    return 2
  path = argv[1]
  # normalize adds the cell ids nbformat >= 5.1.4 wants.
  nb = nbformat.from_dict(nbformat.validator.normalize(nbformat.read(path, as_version=4))[1])
  NotebookClient(nb, timeout=3600, kernel_name="python3",
                 resources={"metadata": {"path": ROOT}}).execute()
  nbformat.write(nb, path)
  print(f"executed {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
