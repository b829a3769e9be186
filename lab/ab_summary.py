"""One line per decode-bench row of an A/B folder: what each run set and what it measured.

``python -m lab.ab_summary DIR [DIR ...]`` reads every ``*.json`` that ``experiments.decode_bench``
wrote there (an H200 script's part: ``benchmarks/results/beyond_hbm/session18/a/``) and prints,
per rkv row, in the order the runs were made: the file, the switches set for it (the ``env`` the
result recorded, rkv's defaults left out), tok/s, the bound and the ratio, the host GiB of its
plan, the library code that ran (``code``, :func:`rkv.benchmarking.code_fingerprint`; results
from before session 19 have none), under a row the medians of its in-process sweep
(``decode_bench --split_cpu_tiles`` / ``--sweep_env``: each variant's tok/s and its ratio to
the plan's own settings), and then the median tok/s of the files that set the same
switches and ran the same code. Files of other
benchmarks and rows without a tok/s are skipped (named on stderr). No jax: it only reads JSON.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys

# Variables every run has (set by rkv at import or by the scripts), not an A/B side.
NOT_A_SWITCH = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS")


def switches(result: dict) -> str:
  """The switches a result recorded (``defaults``: none set); ``not recorded`` for files written
  before results recorded them (session 18)."""
  env = result.get("env", result.get("environment", {}).get("env"))
  if env is None:
    return "not recorded"
  picked = {k: v for k, v in env.items() if k not in NOT_A_SWITCH}
  return " ".join(f"{k}={v}" for k, v in sorted(picked.items())) or "defaults"


def rows_of(path: str) -> list[dict]:
  with open(path) as f:
    result = json.load(f)
  out = []
  for row in result.get("rows", []):
    if not isinstance(row, dict) or row.get("tokens_per_s") is None:
      continue
    out.append(dict(file=os.path.basename(path), time=result.get("time", ""),
                    switches=switches(result), code=result.get("code", ""),
                    config=row.get("config"),
                    context=row.get("context"), batch=row.get("batch"),
                    kv_dtype=row.get("kv_dtype"), tokens_per_s=row["tokens_per_s"],
                    bound_tokens_per_s=row.get("bound_tokens_per_s"),
                    bound_ratio=row.get("bound_ratio"), host_kv_gib=row.get("host_kv_gib"),
                    sweep=row.get("sweep_medians") or {}))
  return out


def summarize(folders: list[str]) -> tuple[list[dict], dict[tuple, float]]:
  """The rows of every decode-bench file under ``folders`` (by run time), and the median tok/s
  of each (switches, config, context, batch, kv_dtype)."""
  rows = []
  for folder in folders:
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
      try:
        found = rows_of(path)
      except (OSError, ValueError) as e:
        print(f"skipped {path}: {e}", file=sys.stderr)
        continue
      if not found:
        print(f"skipped {path}: no decode rows", file=sys.stderr)
      rows += found
  rows.sort(key=lambda r: (r["time"], r["file"]))
  groups: dict[tuple, list[float]] = {}
  for r in rows:
    key = (r["switches"], r["config"], r["context"], r["batch"], r["kv_dtype"], r["code"])
    groups.setdefault(key, []).append(r["tokens_per_s"])
  return rows, {k: statistics.median(v) for k, v in groups.items()}


def _code(code: str) -> str:
  return f"code {code}  " if code else ""


def _fmt(x, spec: str) -> str:
  return "-" if x is None else format(x, spec)


def main(argv=None) -> None:
  folders = sys.argv[1:] if argv is None else argv
  if not folders:
    raise SystemExit("usage: python -m lab.ab_summary DIR [DIR ...]")
  rows, medians = summarize(folders)
  for r in rows:
    print(f"{r['file']:<40s} {r['context']:>8} B={r['batch']} {r['kv_dtype']:<8s} "
          f"{_fmt(r['tokens_per_s'], '7.2f')} tok/s  bound {_fmt(r['bound_tokens_per_s'], '6.2f')}"
          f"  x{_fmt(r['bound_ratio'], '.2f')}  host {_fmt(r['host_kv_gib'], '.2f')} GiB  "
          f"{_code(r['code'])}{r['switches']}")
    for variant, m in r["sweep"].items():  # an in-process sweep (decode_bench --sweep_env)
      print(f"    sweep {variant:<60s} {_fmt(m.get('tokens_per_s'), '7.2f')} tok/s  "
            f"x{_fmt(m.get('vs_planned'), '.3f')} of planned  ({m.get('rounds')} rounds)")
  print("medians:")
  for (sw, config, context, batch, kv, code), med in sorted(medians.items(),
                                                             key=lambda kv: kv[0][1:]):
    print(f"  {config} {context} B={batch} {kv}: {med:.2f} tok/s  {_code(code)}{sw}")


if __name__ == "__main__":
  main()
