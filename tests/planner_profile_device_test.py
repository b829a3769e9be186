"""The planner says which profile it plans with, and warns when that profile was measured on
another kind of device than the one it plans for."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest

import rkv
from rkv.planner import placement


def test_warns_on_another_device_kind():
  prof = rkv.residency.H200_DEFAULT
  with pytest.warns(UserWarning, match="measured on 'NVIDIA H200', but this device is 'cpu'"):
    assert not placement.check_profile_device(prof, device_kind="cpu")


@pytest.mark.parametrize("profile_device,device_kind", [
    ("NVIDIA H200", "NVIDIA H200"), ("", "cpu"), ("NVIDIA H200", "")])
def test_silent_when_the_kinds_match_or_one_is_unknown(profile_device, device_kind):
  prof = dataclasses.replace(rkv.residency.H200_DEFAULT, device=profile_device)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert placement.check_profile_device(prof, device_kind=device_kind)


def test_plan_logs_its_profile(caplog):
  cfg = rkv.models.ModelConfig.preset("tiny-llama", dtype="float32")
  with caplog.at_level(logging.INFO, logger="rkv.planner"):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # on CPU the default H200 profile warns (tested above)
      rkv.plan(cfg, 512, 1, residency=rkv.ResidencyConfig(vram_target_mib=1 << 20))
  assert any("profile H200_DEFAULT" in r.getMessage() for r in caplog.records)


def test_host_kernel_split_on_the_builtin_profile_warns_once_on_a_gpu(monkeypatch):
  monkeypatch.setattr(placement, "_BUILTIN_PROFILE_WARNED", [])
  prof = rkv.residency.H200_DEFAULT
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    # no warning: another backend, no host-kernel layer, or a probed profile
    assert not placement.check_builtin_profile(prof, ("hybrid",), platform="cpu")
    assert not placement.check_builtin_profile(prof, ("resident", "stream"), platform="gpu")
    probed = dataclasses.replace(prof, source="rkv.probe on gpu (NVIDIA H200)")
    assert not placement.check_builtin_profile(probed, ("cpu",), platform="gpu")
    overridden = prof.replace(cpu_attn_gbps=40.0)  # ResidencyConfig(cpu_attn_gbps=40)
    assert not placement.check_builtin_profile(overridden, ("cpu",), platform="gpu")
  with pytest.warns(UserWarning, match="run `rkv calibrate`"):
    assert placement.check_builtin_profile(prof, ("resident", "hybrid"), platform="gpu")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert not placement.check_builtin_profile(prof, ("hybrid",), platform="gpu")  # once
