"""lab.ncu_profile: the bracketed decode calls (CPU, interpret mode) and the ncu CSV reader."""

import pytest

from lab import ncu_profile

# What `ncu --csv --page details` writes for one profiled call, cut down: the program's own
# lines first, then the header, metric rows (16 fields) and rule rows (20 fields).
_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
           '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
           '"Metric Value","Rule Name","Rule Type","Rule Description","Estimated Speedup Type",'
           '"Estimated Speedup"')


def _metric(kid, kernel, section, name, unit, value, grid="(1, 8, 33)"):
  return (f'"{kid}","1","python3","h","{kernel}","1","14","(128, 1, 1)","{grid}","0","9.0",'
          f'"{section}","{name}","{unit}","{value}",')


_CSV = "\n".join([
    "==PROF== Connected to process 1",
    f"{ncu_profile.CALL_MARK} keys=131072 overrides={{}}",
    _HEADER,
    _metric(0, "input_reduce_fusion", "GPU Speed Of Light Throughput", "Duration", "ns", "3,008",
            grid="(1, 1, 1)"),
    _metric(1, "rkv_decode_attention", "GPU Speed Of Light Throughput", "Duration", "ns",
            "131,776"),
    _metric(1, "rkv_decode_attention", "GPU Speed Of Light Throughput", "Memory Throughput",
            "%", "85.20"),
    _metric(1, "rkv_decode_attention", "Memory Workload Analysis", "Memory Throughput",
            "byte/s", "4,098,403,108,305.00"),
    _metric(1, "rkv_decode_attention", "Occupancy", "Achieved Occupancy", "%", "12.27"),
    ('"1","1","python3","h","rkv_decode_attention","1","14","(128, 1, 1)","(1, 8, 33)","0",'
     '"9.0","Occupancy","","","","TheoreticalOccupancy","OPT","limited by shared memory.","",'
     '"14.8"'),
    _metric(2, "loop_convert_fusion", "GPU Speed Of Light Throughput", "Duration", "ns", "2,624",
            grid="(32, 1, 1)"),
])


def test_parse_reads_metrics_units_rules_and_calls():
  calls, kernels = ncu_profile.parse(_CSV)
  assert calls == [f"{ncu_profile.CALL_MARK} keys=131072 overrides={{}}"]
  assert [k.name for k in kernels] == ["input_reduce_fusion", "rkv_decode_attention",
                                       "loop_convert_fusion"]
  decode = kernels[1]
  assert decode.value("Duration") == 131776.0
  assert decode.value("Memory Throughput") == 85.2
  assert decode.value("Memory Throughput (byte/s)") == 4098403108305.0
  assert decode.value("Registers Per Thread") is None
  assert decode.rules == (("TheoreticalOccupancy", "limited by shared memory."),)
  assert decode.grid == "(1, 8, 33)"


def test_summary_puts_the_decode_figures_under_their_call():
  text = ncu_profile.summarize(_CSV)
  lines = text.splitlines()
  call = lines.index(f"=== {ncu_profile.CALL_MARK} keys=131072 overrides={{}}")
  assert "input_reduce_fusion" in lines[call - 1] and "3,008" in lines[call - 1]
  body = "\n".join(lines[call:])
  assert "131,776 ns" in body and "4,098,403,108,305.00 byte/s" in body
  assert "rule TheoreticalOccupancy: limited by shared memory." in body
  assert "loop_convert_fusion" in lines[-1]


def test_parse_refuses_text_without_an_ncu_table():
  with pytest.raises(ValueError, match="no ncu CSV header"):
    ncu_profile.parse("==ERROR== Failed to profile \"input_reduce_fusion\"\n")


def test_profiled_calls_run_between_start_and_stop_once_each():
  events, logged = [], []
  records = ncu_profile.profile_decode_calls(
      [[256, {}], [256, {"num_splits": 2}], [256, {"kv_fill": True}]],
      start=lambda: events.append("start"), stop=lambda: events.append("stop"), warmup=1,
      log=logged.append)
  assert events == ["start", "stop"] * 3
  assert [r["overrides"] for r in records] == [{}, {"num_splits": 2}, {"kv_fill": True}]
  assert records[1]["block_sizes"]["num_splits"] == 2
  assert all(r["finite"] for r in records)
  assert all(line.startswith(ncu_profile.CALL_MARK) for line in logged) and len(logged) == 3


@pytest.mark.parametrize("runs, match", [
    ([], "runs is empty"),
    ([[0, {}]], "keys >= 1"),
    ([[256]], "keys >= 1"),
    ([[256, {"block_q": 64}]], "not BlockSizes fields"),
    ([[256, {"kv_fill": 256}]], "kv_fill must be true or false"),
    ([[256, {}], [256, {"block_k": 48}]], "power of two"),
])
def test_bad_runs_are_refused_before_anything_is_profiled(runs, match):
  events = []
  with pytest.raises(ValueError, match=match):
    ncu_profile.profile_decode_calls(runs, start=lambda: events.append("start"),
                                     stop=lambda: events.append("stop"))
  assert events == []
