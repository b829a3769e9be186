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
    ("fused_ab/res_new.json", "shipped defaults (fused q/k/v and gate/up projections)",
     [("rkv_resident", 2048, 1, "bfloat16"), ("rkv_resident", 131072, 1, "bfloat16")]),
    ("session5/d/half_e1_t15.json", "shipped defaults: the hybrid CPU share and the first "
     "streamed tiles started before the append (rkv.rolling.early_cpu_share, early_puts); with "
     "both off in the same run, before and after it: 6.55 and 7.12 tok/s",
     [("rkv_offload", 131072, 1, "bfloat16")]),
    ("session6/d/1m_base1.json", "shipped defaults with the CPU kernel's 256-bit build (the "
     "512-bit path came later the same session): the median of the session's eight default "
     "runs on four machines is 7.72 tok/s (7.26-8.21: session6/a/1m_chain0_*, b/1m_base*, "
     "c/1m_f98_*, d/1m_base*)",
     [("rkv_offload", 1048576, 1, "bfloat16")]),
    ("session6/d/half512_e1.json", "shipped defaults, 256-bit CPU kernel build; with the early "
     "CPU share and puts off in the same run 2.53 tok/s (session6/d/half512_e0.json), on another "
     "machine 2.11 (session6/c/); 2.66 in session 3 before the early starts",
     [("rkv_offload", 524288, 1, "bfloat16")]),
    ("session6/c/2m_int8.json", "shipped defaults, 256-bit CPU kernel build, the profile's "
     "fallback int8 share 0.52 (2 of 6 tiles a layer on the CPU); the bound uses the int8 rate. "
     "With the 512-bit build and its measured int8 share (0.75) on another machine: 4.48 tok/s, "
     "bound 7.89 (session6/e/2m_int8_v4.json); 3.52 in session 4 before the early starts",
     [("rkv_offload", 2097152, 1, "int8")]),
    ("session3/res_32k_512k.json", "shipped defaults (fused projections)",
     [("rkv_resident", 32768, 1, "bfloat16"), ("rkv_resident", 524288, 1, "bfloat16")]),
    ("session6/c/b8_128k.json", "shipped defaults (the cpu tactic in every layer; 39.82 in "
     "session 3)",
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
