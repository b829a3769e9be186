"""Executes notebooks/tour.ipynb top to bottom (short context, Agg backend): every cell must run;
and the committed copy is the executed one (every code cell's outputs, its plots as PNG).

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


def test_committed_tour_is_executed_with_its_plots():
  nb = json.loads(TOUR.read_text())
  code = [c for c in nb["cells"] if c["cell_type"] == "code"]
  # Executed in order, top to bottom, by one kernel (scripts/execute_notebook.py, `make notebook`).
  assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
  assert all(c["outputs"] for c in code), [i for i, c in enumerate(code) if not c["outputs"]]
  errors = [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
  assert not errors, errors[0].get("evalue")
  pngs = [o for c in code for o in c["outputs"] if "image/png" in o.get("data", {})]
  assert pngs and all(len(o["data"]["image/png"]) > 10_000 for o in pngs)  # real plots, base64
  text = "".join("".join(o.get("text", "")) for c in code for o in c["outputs"])
  assert "identical to resident: True" in text and "identical to resident: False" not in text
