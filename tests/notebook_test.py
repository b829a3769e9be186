"""Executes notebooks/tour.ipynb top to bottom (short context, Agg backend): every cell must run.

No Jupyter dependency: the code cells are run in order in one namespace, as a kernel would. The
notebook's own asserts (offloaded == resident answers, every tactic identical to resident) are
what this test checks, plus the figures it leaves behind.
"""

import json
import pathlib

import pytest

TOUR = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "tour.ipynb"


def code_cells(path):
  nb = json.loads(path.read_text())
  assert nb["nbformat"] == 4
  return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.slow
def test_tour_runs(monkeypatch):
  pytest.importorskip("matplotlib")
  monkeypatch.setenv("RKV_TOUR_CONTEXT", "1024")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  namespace = {"__name__": "__main__"}
  for i, source in enumerate(code_cells(TOUR)):
    try:
      exec(compile(source, f"{TOUR.name}[cell {i}]", "exec"), namespace)
    except Exception as e:  # name the failing cell
      raise AssertionError(f"{TOUR.name}: code cell {i} failed: {type(e).__name__}: {e}") from e
  assert namespace["CONTEXT"] == 1024
  assert namespace["gates"].check_gate(namespace["metrics"], namespace["cfg"].dtype)[0]
  assert len(namespace["fig"].axes) >= 2
  import matplotlib.pyplot as plt
  plt.close("all")
