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
    ("session7/d/half128.json", "shipped defaults: a rolling layer's merge and post_attention in "
     "the next layer's pre_attention program (the join), the CPU kernel's 512-bit build; 8.55 tok/s "
     "on another machine the same session (session7/c/half128_h0.json)",
     [("rkv_offload", 131072, 1, "bfloat16")]),
    ("session7/d/1m_base_2.json", "shipped defaults (the join, the 512-bit CPU kernel): the "
     "session's ten default runs on four machines ran 4.23-8.63 tok/s, median 8.12 "
     "(session7/a/1m_join_*, b/1m_v3_*, c/1m_h0_*, d/1m_base_*, e/1m_buf1_*; the last two with "
     "the CPU kernel's cached tile pointers, the same as without in that run); session 6's "
     "eight, 7.72",
     [("rkv_offload", 1048576, 1, "bfloat16")]),
    ("session7/d/half512.json", "shipped defaults (the join, the 512-bit CPU kernel); 2.42 in "
     "session 6, 2.66 in session 3",
     [("rkv_offload", 524288, 1, "bfloat16")]),
    ("session7/d/2m_int8.json", "shipped defaults (the join, the 512-bit CPU kernel), the "
     "profile's fallback int8 share 0.52 (2 of 6 tiles a layer on the CPU); the bound uses the "
     "int8 rate. Planned with the v6 probe (int8 share 0.75) on another machine: 4.95 tok/s, "
     "bound 8.19 (session7/b/2m_int8_v6.json); 5.20 in session 6",
     [("rkv_offload", 2097152, 1, "int8")]),
    ("session3/res_32k_512k.json", "shipped defaults (fused projections)",
     [("rkv_resident", 32768, 1, "bfloat16"), ("rkv_resident", 524288, 1, "bfloat16")]),
    ("session7/d/b8_128k.json", "shipped defaults (the cpu tactic in every layer, the join); "
     "39.50 in session 6, 39.82 in session 3",
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
