"""experiments.chain_probe runs end to end on a CPU (tiny cache) and writes every variant."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_chain_probe_writes_every_variant(tmp_path):
  out = tmp_path / "cp.json"
  env = {k: v for k, v in os.environ.items() if not k.startswith("RKV_")}
  subprocess.run([sys.executable, "-m", "experiments.chain_probe", "--steps=2", "--window=64",
                  "--tile=32", "--tiles=3", "--switch_us=300", f"--out={out}"], cwd=ROOT,
                 check=True, capture_output=True, timeout=300, env=env)
  data = json.loads(out.read_text())
  rows = data["rows"]
  assert set(rows) == {"default", "worker_first", "q_copy", "both", "switch_300us"}
  assert rows["both"]["switches"] == {"RKV_WORKER_FIRST": "1", "RKV_EARLY_Q_COPY": "1"}
  for row in rows.values():
    # The kernel starts inside the call, and the call takes at least that long.
    assert 0 < row["kernel_start_ms"]["median"] < row["attend_ms"]["median"]
  assert data["tiles"] == 3 and data["kv_dtype"] == "int8"


def test_chain_probe_refuses_a_switch_already_set(tmp_path):
  env = dict(os.environ, RKV_WORKER_FIRST="1")
  res = subprocess.run([sys.executable, "-m", "experiments.chain_probe", "--steps=1",
                        "--window=64", "--tile=32", "--tiles=3"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=env)
  assert res.returncode != 0 and "RKV_WORKER_FIRST" in res.stderr
