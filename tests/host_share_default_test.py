"""rkv.offload.host_share.share_on: what ``$RKV_HOST_SHARE`` unset, 0 and 1 mean, and where the
share cannot be built (no CPU kernel, no C++ compiler) that unset falls back to the Python worker
rather than failing a decode step, with a warning. Builds nothing: the availability checks and
the build are patched."""

import warnings

import pytest

from rkv.offload import cpu_build
from rkv.offload import host_share
from rkv.offload import share_build


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
  monkeypatch.delenv(host_share.HOST_SHARE_ENV, raising=False)
  cached = host_share.share_available, host_share._loads  # tests patch them: clear the real ones
  for f in cached:
    f.cache_clear()
  yield
  for f in cached:
    f.cache_clear()


def _no_compiler():
  raise cpu_build.CompilerNotFoundError("rkv host share: no C++ compiler")


def test_unavailable_without_the_cpu_kernel(monkeypatch):
  monkeypatch.setattr(cpu_build, "kernel_available", lambda: (False, "no C compiler found"))
  assert host_share.share_available() == (False, "no C compiler found")


def test_unavailable_without_a_build_or_a_compiler(monkeypatch, tmp_path):
  monkeypatch.setattr(cpu_build, "kernel_available", lambda: (True, ""))
  monkeypatch.setattr(share_build, "cached_path", lambda: str(tmp_path / "absent.so"))
  monkeypatch.setattr(share_build, "find_compiler", _no_compiler)
  ok, why = host_share.share_available()
  assert not ok and "no C++ compiler" in why


def test_available_with_a_compiler(monkeypatch, tmp_path):
  monkeypatch.setattr(cpu_build, "kernel_available", lambda: (True, ""))
  monkeypatch.setattr(share_build, "cached_path", lambda: str(tmp_path / "absent.so"))
  monkeypatch.setattr(share_build, "find_compiler", lambda: "/usr/bin/c++")
  assert host_share.share_available() == (True, "")


@pytest.mark.parametrize("default_on", [False, True])
@pytest.mark.parametrize("available", [False, True])
@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_unset_is_the_default_where_the_share_can_run(monkeypatch, default_on, available,
                                                      backend):
  monkeypatch.setattr(host_share, "DEFAULT_ON", default_on)
  monkeypatch.setattr(host_share, "share_available", lambda: (available, "" if available else "no"))
  monkeypatch.setattr(host_share.jax, "default_backend", lambda: backend)
  monkeypatch.setattr(host_share, "_registered", lambda: None)
  expected = default_on and available and backend == "gpu"
  if default_on and backend == "gpu" and not available:
    with pytest.warns(UserWarning, match="Python worker"):
      assert host_share.share_on() is False
  else:
    assert host_share.share_on() is expected
  # Set, the variable wins either way: =1 where the share cannot be built then fails with the
  # build's own error when a share is made (no silent fallback from an explicit request).
  monkeypatch.setenv(host_share.HOST_SHARE_ENV, "1")
  assert host_share.share_on() is True
  monkeypatch.setenv(host_share.HOST_SHARE_ENV, "0")
  assert host_share.share_on() is False
  monkeypatch.setenv(host_share.HOST_SHARE_ENV, "maybe")
  with pytest.raises(ValueError, match="RKV_HOST_SHARE"):
    host_share.share_on()


def test_the_shipped_default_is_on_for_gpus_only(monkeypatch):
  # The Python worker stays the default of a CPU backend (this suite's); a GPU backend where the
  # share builds takes it (session 24's H100 runs, host_share.DEFAULT_ON).
  assert host_share.DEFAULT_ON is True
  monkeypatch.setattr(host_share, "share_available", lambda: (True, ""))
  monkeypatch.setattr(host_share, "_registered", lambda: None)
  monkeypatch.setattr(host_share.jax, "default_backend", lambda: "cpu")
  assert host_share.share_on() is False
  monkeypatch.setattr(host_share.jax, "default_backend", lambda: "gpu")
  assert host_share.share_on() is True


def test_a_share_that_fails_to_build_falls_back_to_the_worker_with_a_warning(monkeypatch):
  monkeypatch.setattr(host_share, "share_available", lambda: (True, ""))
  monkeypatch.setattr(host_share.jax, "default_backend", lambda: "gpu")

  def broken():
    raise RuntimeError("rkv host share: compiling failed (c++ ...)")

  monkeypatch.setattr(host_share, "_registered", broken)
  with pytest.warns(UserWarning, match="compiling failed.*Python worker"):
    assert host_share.share_on() is False
  # Asked once a process: the next step neither builds again nor warns again.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert host_share.share_on() is False
  # Asked for by name, the share is on and fails where it is made, with the build's error.
  monkeypatch.setenv(host_share.HOST_SHARE_ENV, "1")
  assert host_share.share_on() is True
