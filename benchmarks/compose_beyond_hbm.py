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
    ("session8/a/res.json", "shipped defaults: each step one program with its greedy pick and "
     "next positions, queued one ahead (step i+1 launched before step i is waited for); each "
     "step waited for in the same run (sync_tokens_per_s): 171.39 / 145.46 / 98.16 / 45.67",
     [("rkv_resident", c, 1, "bfloat16") for c in (2048, 32768, 131072, 524288)]),
    ("session8/a/half128.json", "shipped defaults (steps queued one ahead, the join, the "
     "512-bit CPU kernel); each step waited for: 8.48",
     [("rkv_offload", 131072, 1, "bfloat16")]),
    ("session8/b/1m_base_2.json", "shipped defaults (steps queued one ahead, the join, the "
     "512-bit CPU kernel); the same run's first 1M row also 8.54 (session8/a/1m_base_1.json); "
     "each step waited for: 8.40 / 8.34. Session 7's ten runs on four machines: 4.23-8.63, "
     "median 8.12",
     [("rkv_offload", 1048576, 1, "bfloat16")]),
    ("session8/b/half512.json", "shipped defaults (steps queued one ahead); each step waited "
     "for: 3.06; 2.69 in session 7",
     [("rkv_offload", 524288, 1, "bfloat16")]),
    ("session8/b/2m_int8.json", "shipped defaults (steps queued one ahead), the profile's "
     "fallback int8 share 0.52; the bound uses the int8 rate; each step waited for: 4.94 "
     "(4.75 in session 7)",
     [("rkv_offload", 2097152, 1, "int8")]),
    ("session8/b/b8_128k.json", "shipped defaults (the cpu tactic in every layer, steps queued "
     "one ahead); each step waited for: 44.20; 38.70 in session 7",
     [("rkv_offload", 131072, 8, "bfloat16")]),
]


def main():
  rows, env = [], None
  for name, settings, keys in PICK:
    with open(os.path.join(RUNS, name)) as f:
      run = json.load(f)
    env = env or {k: run.get(k) for k in ("device", "jax", "jaxlib", "platform")}
    for r in run["rows"]:
      if (r["config"], r["context"], r["batch"], r["kv_dtype"]) in keys:
        rows.append(dict(r, source=f"beyond_hbm/{name}", settings=settings))
  rows.sort(key=lambda r: (r["config"], r["batch"], r["context"]))
  out = dict(env, rows=rows, doc=__doc__.strip().splitlines()[0])
  with open(os.path.join(HERE, "decode_beyond_hbm_h200.json"), "w") as f:
    json.dump(out, f, indent=1)
  for r in rows:
    print(f"{r['config']:13s} {r['context']:>8d} B={r['batch']} {r['kv_dtype']:9s} "
          f"{r['tokens_per_s']:7.2f} tok/s  bound {r['bound_tokens_per_s']:7.2f}  "
          f"x{r['bound_ratio']:.2f}  tail {r.get('host_kv_gib') or 0:.2f} GiB  {r['source']}")


if __name__ == "__main__":
  main()
