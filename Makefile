# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
PY := .venv/bin/python

.PHONY: setup demo demo-recall test bench notebook
setup:
	@bash scripts/setup.sh

# SmolLM2 answers a question about a real document with most of its KV on the host (CPU: ~2 min).
demo: setup
	$(PY) -m experiments.document_demo

# The shipped recall model finds a needle at 8K tokens with 80% of the KV on the host.
demo-recall: setup
	$(PY) -m experiments.demo

# Two pytest processes, split by file name (a name matching neither half would run in both, never
# in neither): in one process, XLA's CPU compiler segfaulted after ~1240 tests of the whole suite
# (while each file passed on its own), so no process runs the whole suite's accumulated programs.
test: setup
	$(PY) -m pytest -q tests --ignore-glob='tests/[n-z]*'
	$(PY) -m pytest -q tests --ignore-glob='tests/[a-m]*'


# Re-executes notebooks/tour.ipynb in place (outputs and plots), with the notebook extra.
notebook: setup
	$(PY) -m pip install -q -e ".[notebook]"
	$(PY) scripts/execute_notebook.py notebooks/tour.ipynb
