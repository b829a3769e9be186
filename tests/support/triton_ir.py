"""Verifying the Triton IR of Pallas kernels on a CPU host: what interpret mode cannot catch
(non-power-of-two tiles, unsupported primitives, bad dot operands)."""

from __future__ import annotations

import pytest


def record_verified_lowerings(monkeypatch) -> list:
  """Makes Pallas lower its Triton kernels for an H200 on this host and records, per lowered
  kernel, whether the module verifies (the returned list fills as kernels are lowered). Uses
  private jax hooks, the only way to name a GPU on a CPU host; skips if they moved."""
  try:
    from jax._src.pallas.triton import gpu_info, lowering
    from jax._src.pallas.triton import pallas_call_registration as registration
  except ImportError as e:
    pytest.skip(f"jax's Pallas Triton internals moved: {e}")
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  verified = []
  lower_module = lowering.lower_jaxpr_to_triton_module

  def lower_and_verify(*args, **kwargs):
    result = lower_module(*args, **kwargs)
    verified.append(result.module.operation.verify())
    return result

  monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
  return verified
