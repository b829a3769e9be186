"""lab.ab_summary: one line per decode-bench row of an A/B folder, medians per set of switches."""

import json

import pytest

from lab import ab_summary


def _result(path, t, env, tok_s, code=None, **row):
  payload = dict(time=t, rows=[dict(config="rkv_offload", context=2097152, batch=1,
                                    kv_dtype="int8", tokens_per_s=tok_s, bound_tokens_per_s=8.0,
                                    bound_ratio=8.0 / tok_s, host_kv_gib=9.9, **row)])
  if env is not None:
    payload["env"] = env
  if code is not None:
    payload["code"] = code
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
  key = ("rkv_offload", 2097152, 1, "int8", "")
  assert medians[("defaults",) + key] == 6.2
  assert medians[("RKV_NEXT_PUTS=1",) + key] == 7.2
  assert medians[("not recorded",) + key] == 5.0
  ab_summary.main([str(tmp_path)])
  out = capsys.readouterr()
  assert "7.20 tok/s  RKV_NEXT_PUTS=1" in out.out and "probe.json: no decode rows" in out.err


def test_runs_of_other_code_are_other_sides(tmp_path, capsys):
  # An A/B of two trees (the previous one from git archive) sets the same switches: the code
  # each result records keeps their medians apart.
  for i, (code, tok_s) in enumerate([("aaa", 6.0), ("bbb", 6.5), ("aaa", 6.25), ("bbb", 6.75)]):
    _result(tmp_path / f"r{i}.json", f"2026-12-05T00:0{i}:00Z", {}, tok_s, code=code)
  _, medians = ab_summary.summarize([str(tmp_path)])
  key = ("defaults", "rkv_offload", 2097152, 1, "int8")
  assert medians[key + ("aaa",)] == 6.125 and medians[key + ("bbb",)] == 6.625
  ab_summary.main([str(tmp_path)])
  assert "6.62 tok/s  code bbb  defaults" in capsys.readouterr().out


def test_the_code_fingerprint_follows_the_sources(tmp_path):
  from rkv import benchmarking
  (tmp_path / "pkg").mkdir()
  (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
  (tmp_path / "pkg" / "k.cc").write_text("int f();\n")
  (tmp_path / "pkg" / "notes.txt").write_text("not code")
  first = benchmarking.code_fingerprint(str(tmp_path / "pkg"))
  assert len(first) == 12 and int(first, 16) >= 0
  (tmp_path / "copy").mkdir()  # the same files elsewhere (a git archive): the same fingerprint
  for name in ("a.py", "k.cc"):
    (tmp_path / "copy" / name).write_text((tmp_path / "pkg" / name).read_text())
  assert benchmarking.code_fingerprint(str(tmp_path / "copy")) == first
  (tmp_path / "copy" / "k.cc").write_text("int g();\n")  # a kernel edit changes it
  assert benchmarking.code_fingerprint.__wrapped__(str(tmp_path / "copy")) != first
  assert benchmarking.environment()["code"] == benchmarking.code_fingerprint()
  with pytest.raises(ValueError, match="root"):
    benchmarking.code_fingerprint(str(tmp_path / "missing"))


def test_a_rows_in_process_sweep_is_printed_under_it(tmp_path, capsys):
  sweep = {"planned": dict(tokens_per_s=6.5, rounds=3, vs_planned=1.0),
           "RKV_HOST_SHARE=1": dict(tokens_per_s=7.15, rounds=3, vs_planned=1.1)}
  _result(tmp_path / "s.json", "2026-12-06T00:00:00Z", {}, 6.4, sweep_medians=sweep)
  ab_summary.main([str(tmp_path)])
  out = capsys.readouterr().out
  assert "sweep RKV_HOST_SHARE=1" in out and "7.15 tok/s  x1.100 of planned  (3 rounds)" in out
