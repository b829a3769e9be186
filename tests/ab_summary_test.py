"""lab.ab_summary: one line per decode-bench row of an A/B folder, medians per set of switches."""

import json

from lab import ab_summary


def _result(path, t, env, tok_s, **row):
  payload = dict(time=t, rows=[dict(config="rkv_offload", context=2097152, batch=1,
                                    kv_dtype="int8", tokens_per_s=tok_s, bound_tokens_per_s=8.0,
                                    bound_ratio=8.0 / tok_s, host_kv_gib=9.9, **row)])
  if env is not None:
    payload["env"] = env
  path.write_text(json.dumps(payload))


def test_rows_in_run_order_and_medians_per_switches(tmp_path, capsys):
  mem = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.98"}  # every run's: not a side of the A/B
  _result(tmp_path / "b_all1.json", "2026-12-05T00:02:00Z", dict(mem, RKV_NEXT_PUTS="1"), 7.0)
  _result(tmp_path / "a_default1.json", "2026-12-05T00:01:00Z", mem, 6.0)
  _result(tmp_path / "c_default2.json", "2026-12-05T00:03:00Z", mem, 6.4)
  _result(tmp_path / "d_all2.json", "2026-12-05T00:04:00Z", dict(mem, RKV_NEXT_PUTS="1"), 7.4)
  _result(tmp_path / "e_old.json", "2026-12-01T00:00:00Z", None, 5.0)
  (tmp_path / "probe.json").write_text(json.dumps({"format": "rkv.Profile"}))
  rows, medians = ab_summary.summarize([str(tmp_path)])
  assert [r["file"] for r in rows] == ["e_old.json", "a_default1.json", "b_all1.json",
                                       "c_default2.json", "d_all2.json"]
  key = ("rkv_offload", 2097152, 1, "int8")
  assert medians[("defaults",) + key] == 6.2
  assert medians[("RKV_NEXT_PUTS=1",) + key] == 7.2
  assert medians[("not recorded",) + key] == 5.0
  ab_summary.main([str(tmp_path)])
  out = capsys.readouterr()
  assert "7.20 tok/s  RKV_NEXT_PUTS=1" in out.out and "probe.json: no decode rows" in out.err
