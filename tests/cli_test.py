"""The ``rkv`` console script (rkv/cli.py): help for every command, the plan table, a short
greedy generation through a subprocess, errors without tracebacks."""

import os
import subprocess
import sys
import tomllib

import pytest

from rkv import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_console_script_is_declared():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    scripts = tomllib.load(f)["project"]["scripts"]
  assert scripts == {"rkv": "rkv.cli:main"} and callable(cli.main)


@pytest.mark.parametrize("command", [None, "generate", "chat", "plan", "calibrate"])
def test_help(command, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(([command] if command else []) + ["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: rkv")
  if command is None:
    assert all(c in out for c in ("generate", "chat", "plan", "calibrate"))
  elif command in ("generate", "chat"):
    assert "--device_gib" in out and "--mode" in out and "--max_new_tokens" in out
    assert "--show_plan" in out
  elif command == "plan":  # it always prints the table, so it offers no flag to ask for it
    assert "--device_gib" in out and "--show_plan" not in out


def test_plan_table(capsys):
  assert cli.main(["plan", "--preset", "llama3-8b", "--context", "262144", "--device_gib", "16",
                   "--no_check_free"]) == 0
  out = capsys.readouterr().out
  assert "rkv plan: context_len=262144" in out and "stream" in out and "totals:" in out


def test_errors_are_one_line(capsys):
  assert cli.main(["plan", "--preset", "no-such-model", "--context", "8"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("rkv plan: error:") and "unknown preset" in err and "Traceback" not in err


def test_generate_subprocess(smollm2):
  del smollm2  # only for its skip when the packaged model is absent
  proc = subprocess.run(
      [sys.executable, "-m", "rkv.cli", "generate", "--prompt",
       "What is the capital of France?", "--max_new_tokens", "8"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == "The capital of France is Paris."
  assert "generated (eos)" in proc.stderr and "tok/s" in proc.stderr
