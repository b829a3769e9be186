import json, sys
for f in sys.argv[1:]:
  d = json.load(open(f))
  for r in d["rows"]:
    print(f.split("/")[-1], r["config"], "step", round(r["step_ms"], 2), "host", round(r["host_ms"], 2))
    for k, v in sorted(r["trace"].get("host_spans", {}).items(), key=lambda kv: -kv[1]["total_ns"])[:12]:
      print("   ", k, v["count"], round(v["median_ns"] / 1e3), "us median")
    print("   busy", {k: {a: round(b / 3e6, 1) for a, b in v.items()} for k, v in r["trace"]["busy_union_ns"].items()})
    for dev, st in r["trace"]["devices"].items():
      for sn, s in st.items():
        if "Compute" in sn:
          for t in s["top"][:6]:
            print("     ", t["name"], round(t["total_ns"] / t["count"] / 1e3, 1), "us x", t["count"])
