"""Summarises an ``ncu --csv --page details`` file of benchmarks/ncu_decode.py: per profiled call, each
kernel's duration, and the decode kernel's throughput, occupancy, issue and stall figures and ncu's
rule findings. A lab script: ``python3 benchmarks/ncu_summary.py ncu_decode.csv > summary.txt``
(the committed CSVs are gzipped: ``python3 benchmarks/ncu_summary.py <(zcat ncu_decode.csv.gz)``).
The kernels before a call's decode kernel are its wrapper's (key bounds, query packing), the ones
after it the split merge's; the first line of a call block names the call."""

import csv
import sys

_KERNEL_METRICS = (
    "Duration", "Elapsed Cycles", "SM Frequency", "DRAM Frequency", "DRAM Throughput",
    "Memory Throughput", "Compute (SM) Throughput", "Max Bandwidth", "Mem Busy", "L2 Hit Rate",
    "Registers Per Thread", "Dynamic Shared Memory Per Block", "Block Limit Shared Mem",
    "Block Limit Registers", "Theoretical Occupancy", "Achieved Occupancy", "Waves Per SM",
    "Active Warps Per Scheduler", "Eligible Warps Per Scheduler", "Issue Slots Busy",
    "No Eligible", "Warp Cycles Per Issued Instruction")


def main(path):
  rows = list(csv.reader(open(path)))
  start = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
  hdr = rows[start]
  data = [dict(zip(hdr, r)) for r in rows[start + 1:] if len(r) >= 15 and r[0].isdigit()]
  calls = [r[0] for r in rows[:start] if r and r[0].startswith("S=")]
  call = -1
  for kid in sorted({d["ID"] for d in data}, key=int):
    ds = [d for d in data if d["ID"] == kid]
    name = ds[0]["Kernel Name"]
    metric = {d["Metric Name"]: (d["Metric Value"], d["Metric Unit"]) for d in ds}
    dur = metric.get("Duration", ("?", ""))
    if "rkv_decode" not in name:
      print(f"  {kid:>3} {name:<28} {dur[0]:>8} {dur[1]}  grid {ds[0]['Grid Size']}")
      continue
    call += 1
    print(f"=== {calls[call] if call < len(calls) else ''}")
    print(f"  {kid:>3} {name} grid {ds[0]['Grid Size']} block {ds[0]['Block Size']}")
    for m in _KERNEL_METRICS:
      if m in metric:
        print(f"        {m:<40} {metric[m][0]:>10} {metric[m][1]}")
    for d in ds:
      if d.get("Rule Type") in ("WRN", "OPT") and d.get("Rule Description"):
        print(f"        rule {d['Rule Name']}: {d['Rule Description'][:300]}")


if __name__ == "__main__":
  main(sys.argv[1])
