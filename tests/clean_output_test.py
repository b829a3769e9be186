"""What rkv prints: no JAX backend-probe lines, the planner's details at DEBUG under a one-line
INFO summary, warnings on one line in the CLI, and `rkv chat`'s per-turn TTFT with the earlier
turns' KV kept."""

import logging
import os
import subprocess
import sys
import warnings

import pytest

import rkv
from rkv import _env, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _record(msg, level=logging.INFO):
  return logging.LogRecord(_env.BACKEND_PROBE_LOGGER, level, "xla_bridge.py", 837, msg, (), None)


def test_backend_probe_filter_drops_only_the_quiet_probe_lines():
  logger = logging.getLogger(_env.BACKEND_PROBE_LOGGER)
  assert _env.quiet_backend_probe({})  # installed (again: once)
  (flt,) = [f for f in logger.filters if isinstance(f, _env._DropBackendProbe)]
  assert not flt.filter(_record("Unable to initialize backend 'tpu': INTERNAL: libtpu.so"))
  assert flt.filter(_record("Unable to initialize backend 'cuda': boom", logging.WARNING))
  assert flt.filter(_record("An NVIDIA GPU may be present on this machine", logging.WARNING))
  assert not _env.quiet_backend_probe({_env.SHOW_BACKEND_PROBE_ENV: "1"})


@pytest.mark.parametrize("show", [False, True])
def test_an_absl_script_prints_no_backend_probe(show):
  # absl shows INFO logs by default: before rkv's filter, every experiment's first line was
  # "Unable to initialize backend 'tpu'" on a machine without a TPU.
  code = ("from absl import app\n"
          "def main(argv):\n"
          "  import rkv, jax\n"
          "  print(jax.devices()[0].platform)\n"
          "app.run(main)\n")
  env = dict(os.environ)
  env.pop(_env.SHOW_BACKEND_PROBE_ENV, None)
  if show:
    env[_env.SHOW_BACKEND_PROBE_ENV] = "1"
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  import jax
  if jax.default_backend() == "cpu" and show:
    assert "Unable to initialize backend" in proc.stderr  # the probe ran; the filter hid it
  if not show:
    assert "Unable to initialize backend" not in proc.stderr, proc.stderr


def test_plan_logs_one_info_line_and_its_details_at_debug(caplog):
  cfg = rkv.models.ModelConfig.preset("tiny-llama", dtype="float32")
  res = rkv.ResidencyConfig(mode="auto", vram_target_mib=0.5, tile_cells=128, min_tile_cells=128)
  with caplog.at_level(logging.DEBUG, logger="rkv.planner"), warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the H200 profile on a CPU (tests/planner_profile_device_test.py)
    plan = rkv.plan(cfg, 2048, 1, residency=res)
  info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
  debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
  assert info == [plan.summary()]
  assert "rkv plan: context_len=2048" in info[0] and "host" in info[0]
  assert any("layer 0 ->" in m for m in debug) and any("profile" in m for m in debug)
  assert "GiB" in plan.table().splitlines()[1]  # the budget line says GiB, as the flags do


def test_cli_help_names_the_stream_mode_not_its_deprecated_alias(capsys):
  with pytest.raises(SystemExit):
    cli.main(["generate", "--help"])
  out = capsys.readouterr().out
  assert "{auto,resident,stream,cpu,hybrid,head}" in out and "--device_gib" in out
  assert "--show_plan" in out
  assert set(cli._MODES) == set(rkv.tactics.MODES) | set(rkv.tactics.DEPRECATED_MODES)


def test_cli_warnings_are_one_line():
  line = cli.one_line_warning("plan: the profile was measured elsewhere", UserWarning, "x.py", 3)
  assert line == "rkv: UserWarning: plan: the profile was measured elsewhere\n"


def test_cli_chat_keeps_the_cache_and_shows_ttft(smollm2, monkeypatch, capsys):
  turns = iter(["My name is Ada.", "What is my name?", ""])
  monkeypatch.setattr("builtins.input", lambda prompt="": next(turns))
  monkeypatch.setattr(cli, "_load", lambda args, log: smollm2)
  assert cli.main(["chat", "--max_new_tokens", "6", "--context", "256"]) == 0
  err = capsys.readouterr().err
  lines = [ln for ln in err.splitlines() if ln.startswith("TTFT")]
  assert len(lines) == 2, err
  assert "earlier turns' KV kept" not in lines[0] and "earlier turns' KV kept" in lines[1]
  first, second = (int(ln.split("(")[1].split()[0]) for ln in lines)
  assert second < first  # the second turn prefills its own tokens only
