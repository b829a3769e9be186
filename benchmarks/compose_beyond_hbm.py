"""Builds benchmarks/results/decode_beyond_hbm_h200.json from the H200 runs of issue 10.

Each row is copied unchanged from the run that measured it, with ``source`` (the run's file) and
``settings`` (what differed from rkv's shipped defaults in that run) added. Rows of the same run
compare directly; across runs, only ratios to the bound (each row's own) are comparable.

  python3 benchmarks/compose_beyond_hbm.py
"""

import json
import os

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RUNS = os.path.join(HERE, "beyond_hbm")
# (file, settings, rows to take: (config, context, batch, kv_dtype))
PICK = [
    ("session12/c/res_c.json", "shipped defaults of session 12: the split merge in a second "
     "Pallas kernel, the queries packed in the kernel, and the resident cache's length passed "
     "as kv_fill, so the key bounds come from q_pos alone (one small fusion, no reduction over "
     "k_pos); a call is 3 kernels where session 11 had ~10 (Nsight Compute, session12/c/). "
     "Each step waited for: 173.62 / 155.21 / 104.81. Session 12 part a, one machine, "
     "alternating with session 11's code (out/base = 6a8c4c5) over two rounds, with an earlier "
     "form that derived the bounds inside the kernel (5% slower kernel at 128K, 152 registers "
     "against 128, session12/b/): 221.07 / 192.51 / 123.68 and 220.86 / 192.95 / 124.06 "
     "against 217.98 / 183.93 / 120.67 and 214.93 / 182.60 / 120.70",
     [("rkv_resident", c, 1, "bfloat16") for c in (2048, 32768, 131072)]),
    ("session11/a/res512.json", "shipped defaults of session 11 (command buffers with custom "
     "calls, the donated step I/O; the tree split merge, queries packed by XLA, k_pos reduced "
     "for the key bounds); each step waited for in the same run: 46.26. Not rerun at session "
     "12's code; session 12 part a ran its earlier form (bounds derived in the kernel) against "
     "session 11's code on one machine: 51.44 against 51.83. Session 8's defaults (no command "
     "buffers): 50.41 (session8/a/res.json)",
     [("rkv_resident", 524288, 1, "bfloat16")]),
    ("session12/b/half128.json", "shipped defaults of session 12 (the offloaded layers' window "
     "partials pack the queries in the kernel; their k_pos reduction stays: the window is not "
     "filled from index 0); each step waited for: 8.25. Session 11 (on another machine): 8.42 "
     "(session11/a/half128_on.json); command buffers off / on, alternating over two runs: "
     "8.69 / 8.43 (session10/e/), 7.76 / 8.42 (session11/a/). Session 8 (off): 8.55",
     [("rkv_offload", 131072, 1, "bfloat16")]),
    ("session12/c/1m_new.json", "shipped defaults of session 12; each step waited for: 8.12. "
     "On the same machine, alternating with session 11's code (out/base = 6a8c4c5): this tree "
     "8.24 and 8.20 (session12/d/1m_new2.json), session 11's 8.41 (session12/c/1m_base.json) "
     "and 8.18 (session12/d/1m_base2.json). On part b's machine the same code ran 7.12 "
     "(session12/b/1m.json). Session 11: 8.41 (session11/a/1m.json); session 7's ten runs on "
     "four machines: 4.23-8.63, median 8.12",
     [("rkv_offload", 1048576, 1, "bfloat16")]),
    ("session8/b/half512.json", "session 8's defaults (command buffers off; not rerun since); "
     "each step waited for: 3.06; 2.69 in session 7",
     [("rkv_offload", 524288, 1, "bfloat16")]),
    ("session12/b/2m_int8.json", "shipped defaults of session 12, the profile's fallback int8 "
     "share 0.52; the bound uses the int8 rate. Each step waited for: 4.82. Session 11's three "
     "runs with command buffers on: 4.22 (session11/b/), 5.04 (session11/d/), 5.31 "
     "(session11/e/); off: 5.26, 5.36. Session 8 (off): 5.41",
     [("rkv_offload", 2097152, 1, "int8")]),
    ("session12/b/b8.json", "shipped defaults of session 12 (the ninth session's planner: the "
     "one-tile tail laid out as two 4992-cell tiles, hybrid); each step waited for: 56.29. "
     "Session 11: 57.61 (session11/b/b8.json); session 9 (command buffers off): 57.14 / 55.72 "
     "(session9/b/b8_plan_1/2.json); the eighth session's plan (one 8960-cell tile, cpu) 44.57",
     [("rkv_offload", 131072, 8, "bfloat16")]),
]
# The rows' bounds use the profile their plan was made with (profile_h200_v3.json, probed with the
# CPU kernel's 256-bit build; without an int8 share, so the int8 row's CPU rate is the fallback
# 0.52 of bf16's). The kernel that ran is the 512-bit build, probed in profile_h200_v6.json: each
# offloaded row also carries its bound at those rates (faster links: a higher bound, a larger
# measured / bound ratio), so no row is flattered by a stale rate.
KERNEL_PROFILE = "profile_h200_v6.json"


def tail_rate_gbps(profile: dict, tactic: str, kv_dtype: str) -> float:
  """GB/s of a tail under ``tactic`` at ``profile``'s rates (docs/DESIGN.md §6)."""
  share = profile["cpu_int8_share"] if kv_dtype == "int8" else 1.0
  if tactic == "stream":
    return profile["pcie_gbps"]
  if tactic == "cpu":
    return profile["cpu_attn_gbps"] * share
  return profile["hybrid_pcie_gbps"] + profile["hybrid_cpu_gbps"] * share


def with_kernel_bound(row: dict, profile: dict) -> dict:
  if not row.get("tail_bytes"):
    return row
  (tactic,) = row["tactics"]
  rate = tail_rate_gbps(profile, tactic, row["kv_dtype"])
  bound_s = max(row["device_s"], row["tail_bytes"] / (rate * 1e9))
  return dict(row, kernel_profile=KERNEL_PROFILE, kernel_tail_gbps=rate,
              kernel_bound_tokens_per_s=row["batch"] / bound_s,
              kernel_bound_ratio=row["step_s"] / bound_s)


def main():
  with open(os.path.join(HERE, KERNEL_PROFILE)) as f:
    kernel_profile = json.load(f)
  rows, env = [], None
  for name, settings, keys in PICK:
    with open(os.path.join(RUNS, name)) as f:
      run = json.load(f)
    env = env or {k: run.get(k) for k in ("device", "jax", "jaxlib", "platform")}
    for r in run["rows"]:
      if (r["config"], r["context"], r["batch"], r["kv_dtype"]) in keys:
        rows.append(with_kernel_bound(dict(r, source=f"beyond_hbm/{name}", settings=settings),
                                      kernel_profile))
  rows.sort(key=lambda r: (r["config"], r["batch"], r["context"]))
  out = dict(env, rows=rows, doc=__doc__.strip().splitlines()[0])
  with open(os.path.join(HERE, "decode_beyond_hbm_h200.json"), "w") as f:
    json.dump(out, f, indent=1)
  for r in rows:
    print(f"{r['config']:13s} {r['context']:>8d} B={r['batch']} {r['kv_dtype']:9s} "
          f"{r['tokens_per_s']:7.2f} tok/s  bound {r['bound_tokens_per_s']:7.2f}  "
          f"x{r['bound_ratio']:.2f}  at the kernel's rates "
          f"{r.get('kernel_bound_tokens_per_s', r['bound_tokens_per_s']):7.2f} "
          f"x{r.get('kernel_bound_ratio', r['bound_ratio']):.2f}  "
          f"tail {r.get('host_kv_gib') or 0:.2f} GiB  {r['source']}")


if __name__ == "__main__":
  main()
