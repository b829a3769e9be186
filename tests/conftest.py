"""Shared test set-up: the repo root importable (``tests.support``, ``tests.numpy_reference``,
``lab``), and the ``gpu`` marker skipped without a GPU. Markers are declared in pyproject.toml
(``--strict-markers``): ``gpu``, ``slow``. Shared cases, checks and tolerances live in
``tests/support/``; no test file imports another's helpers."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_collection_modifyitems(config, items):
  import jax
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU; runs on the H200 only")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
