# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
PY := .venv/bin/python

.PHONY: setup demo test bench
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m experiments.demo

test: setup
	$(PY) -m pytest -q tests

