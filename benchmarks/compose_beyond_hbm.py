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
    ("session15/c/res.json", "shipped defaults at 49bf2c4 (session 15: the decode split floor "
     "256 keys, session 14's A/B in session14/splitfloor/; the split merge kernel, the queries "
     "packed in the kernel, kv_fill). Each step waited for: 184.96 / 155.88 / 105.48 / 47.34. "
     "Session 12 (512-key floor): 221.55 / 190.56 / 124.42 (session12/c/res_c.json); 512K "
     "51.67 in session 11 (session11/a/res512.json)",
     [("rkv_resident", c, 1, "bfloat16") for c in (2048, 32768, 131072, 524288)]),
    ("session15/c/half128.json", "shipped defaults at 49bf2c4; each step waited for: 8.68. On "
     "the same machine minutes earlier: 8.81 and 8.81 (session15/b/half128_base_*.json); "
     "session 14: 8.40 and 8.72 on two machines; session 12: 8.04",
     [("rkv_offload", 131072, 1, "bfloat16")]),
    ("session15/c/1m.json", "shipped defaults at 49bf2c4; each step waited for: 8.50. On the "
     "same machine minutes earlier: 8.55 and 8.77 (session15/b/1m_base_*.json); session 14: "
     "8.54 and 8.73 on two machines (session14/a/, c/); session 12: 8.24; session 7's ten runs "
     "on four machines: 4.23-8.63, median 8.12",
     [("rkv_offload", 1048576, 1, "bfloat16")]),
    ("session15/c/half512.json", "shipped defaults at 49bf2c4; each step waited for: 3.39. "
     "Session 8 (command buffers off): 3.07",
     [("rkv_offload", 524288, 1, "bfloat16")]),
    ("session22/h200_a2/2m_int8_default3b.json", "shipped defaults at 763e53c (session 22: "
     "the tiles' direct put and the CPU share's partial in pinned_host arrays, on top of session "
     "17's bfloat16 scales), planned with the profile's fallback int8 share 0.52; the bound "
     "uses the int8 rate. The lower median of four default runs on one machine (6.85, 5.94, "
     "6.95, 6.63; session22/h200_a2/README.md), alternating with the same code with both "
     "hand-offs off (RKV_DIRECT_PUTS=0 RKV_CPU_OUT_PINNED=0): 5.90, 6.23, 5.74. Each step "
     "waited for: 6.78. Session 17 (ae578a5, another machine): 6.54 / 6.47 (session17/d/); "
     "session 15 (float32 scales): 5.76",
     [("rkv_offload", 2097152, 1, "int8")]),
    ("session15/c/b8.json", "shipped defaults at 49bf2c4 (the one-tile tail laid out as two "
     "tiles, hybrid); each step waited for: 57.64. Session 14: 59.80 / 60.95 (session14/c/); "
     "session 12: 56.27; the eighth session's plan (one 8960-cell tile, cpu) 44.57",
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
