"""Summaries of ``jax.profiler`` traces (``.xplane.pb``, read by ``jax.profiler.ProfileData``,
no TensorBoard): per device stream the busy time and the top kernels, host spans named
``rkv.*``. Shared by the lab's trace scripts (``decode_trace``, ``prefill_bench --trace``)."""

from __future__ import annotations

import collections
import glob
import os
import statistics


def union_ns(intervals) -> int:
  total, end = 0, None
  for a, b in sorted(intervals):
    if end is None or a > end:
      total += b - a
      end = b
    elif b > end:
      total += b - end
      end = b
  return total


def summarize(xplane_path: str, top: int) -> dict:
  """Per device plane: each line's (stream's) busy ns and top events by total ns; host spans
  named ``rkv.*`` (count, total, median ns); the traced window's wall ns."""
  import jax
  pd = jax.profiler.ProfileData.from_file(xplane_path)
  out = dict(devices={}, host_spans={})
  lo, hi = None, None
  for plane in pd.planes:
    if plane.name.startswith("/device:GPU"):
      lines = {}
      spans = collections.defaultdict(list)  # what kind of stream -> [(start, end)]
      for line in plane.lines:
        kind = "h2d" if "MemcpyH2D" in line.name else (
            "compute" if "Compute" in line.name else None)
        if kind:
          spans[kind] += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events]
        tot = collections.Counter()
        cnt = collections.Counter()
        busy = 0
        for e in line.events:
          tot[e.name] += e.duration_ns
          cnt[e.name] += 1
          busy += e.duration_ns
          lo = e.start_ns if lo is None else min(lo, e.start_ns)
          hi = e.start_ns + e.duration_ns if hi is None else max(hi, e.start_ns + e.duration_ns)
        if busy:
          lines[line.name] = dict(busy_ns=busy, events=sum(cnt.values()),
                                  top=[dict(name=n[:160], total_ns=t, count=cnt[n])
                                       for n, t in tot.most_common(top)])
      out["devices"][plane.name] = lines
      # Busy time of each kind of stream, overlaps merged: how long the PCIe link (any H2D
      # stream) and the compute stream were working within the traced window.
      out.setdefault("busy_union_ns", {})[plane.name] = {k: union_ns(v) for k, v in spans.items()}
    elif plane.name.startswith("/host:CPU"):
      spans = collections.defaultdict(list)
      for line in plane.lines:
        for e in line.events:
          if e.name.startswith("rkv."):
            spans[e.name].append(e.duration_ns)
      out["host_spans"] = {n: dict(count=len(d), total_ns=sum(d), median_ns=statistics.median(d))
                           for n, d in sorted(spans.items())}
  out["device_window_ns"] = None if lo is None else hi - lo
  return out


def summarize_dir(trace_dir: str, top: int) -> dict:
  """:func:`summarize` of the newest ``.xplane.pb`` under ``trace_dir``."""
  pb = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  if not pb:
    raise FileNotFoundError(f"no .xplane.pb under {trace_dir}")
  return summarize(pb[-1], top)
