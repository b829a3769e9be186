"""experiments.copy_queue_probe runs end to end on a CPU (tiny tiles) and writes its JSON."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_copy_queue_probe_writes_every_variant(tmp_path):
  out = tmp_path / "cq.json"
  subprocess.run([sys.executable, "-m", "experiments.copy_queue_probe", "--tiles=1",
                  "--tile_mib=1", "--repeats=1", f"--out={out}"], cwd=ROOT, check=True,
                 capture_output=True, timeout=300)
  data = json.loads(out.read_text())
  rows = data["rows"]
  assert set(rows) == {"alone_numpy", "behind_numpy", "alone_pinned", "behind_pinned",
                       "behind_d2h", "tiles_only"}
  for name, row in rows.items():
    assert ("small_ms" in row) == (name != "tiles_only")
    assert ("tiles_ms" in row) == (name != "alone_numpy" and name != "alone_pinned")
    assert all(v["median"] > 0 for v in row.values())
  assert data["tile_bytes"] == 2 * (1 << 20) and data["tiles_gbps"] > 0


def test_copy_queue_probe_checks_out_before_work(tmp_path):
  # --out naming a directory is refused before any tile is made (no variant line printed).
  res = subprocess.run([sys.executable, "-m", "experiments.copy_queue_probe",
                        f"--out={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert res.returncode != 0 and "--out=" in res.stderr and "is a directory" in res.stderr
  assert "alone_numpy" not in res.stdout
