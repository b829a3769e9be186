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


# A host-to-device copy this short is not a tail tile (a 22K-cell bf16 tile takes ~1.7 ms at
# 53 GB/s): a query's positions, the CPU partial going up for the merge. "Right after" a long copy
# on the same stream: it most likely waited for that one (streams run their copies in order).
SMALL_COPY_NS = 100_000
QUEUED_GAP_NS = 20_000


def small_copies_behind_large(lines: dict, small_ns: int = SMALL_COPY_NS,
                              gap_ns: int = QUEUED_GAP_NS) -> dict:
  """``lines``: stream name -> ``[(start_ns, duration_ns)]`` of its host-to-device copies. Counts
  the small copies (under ``small_ns``) and those that began within ``gap_ns`` of the end of a
  long copy on the same stream (queued behind a tile, most likely), with the long copies' total
  time just before them: what a transfer moved ahead of its layer may delay."""
  small = behind = 0
  waited = 0
  for events in lines.values():
    prev_end, prev_dur = None, 0
    for start, dur in sorted(events):
      if dur < small_ns:
        small += 1
        if prev_end is not None and prev_dur >= small_ns and 0 <= start - prev_end <= gap_ns:
          behind += 1
          waited += prev_dur
      prev_end, prev_dur = start + dur, dur
  return dict(small=small, behind_large=behind, large_ns_before_them=waited,
              small_ns=small_ns, gap_ns=gap_ns)


# A gap between tile copies shorter than this is the engine moving to the next queued copy.
IDLE_GAP_NS = 50_000


def link_gaps(lines: dict, large_ns: int = SMALL_COPY_NS, idle_ns: int = IDLE_GAP_NS) -> dict:
  """``lines`` as for :func:`small_copies_behind_large`. The link's idle gaps between its tile
  copies (those of at least ``large_ns``), over all host-to-device streams together: the copy
  engine runs one such copy at a time whatever the stream (H200 traces,
  benchmarks/results/beyond_hbm/session5/xplane/), so a gap is time the link could have moved a
  tile. Returns the number of gaps of at least ``idle_ns`` (shorter ones are the engine moving to
  the next queued copy), their total and median ns, and the busy ns they separate."""
  large = sorted((a, a + d) for ev in lines.values() for a, d in ev if d >= large_ns)
  gaps, end = [], None
  for a, b in large:
    if end is not None and a - end >= idle_ns:
      gaps.append(a - end)
    end = b if end is None else max(end, b)
  return dict(gaps=len(gaps), gap_ns=sum(gaps),
              median_gap_ns=statistics.median(gaps) if gaps else 0, busy_ns=union_ns(large),
              large_ns=large_ns, idle_ns=idle_ns)


def summarize(xplane_path: str, top: int) -> dict:
  """Per device plane: each line's (stream's) busy ns and top events by total ns, the union of
  each kind's busy time, the small host-to-device copies queued behind tiles
  (:func:`small_copies_behind_large`); host spans named ``rkv.*`` (count, total, median ns); the
  traced window's wall ns."""
  import jax
  if xplane_path.endswith(".gz"):  # a trace kept by decode_trace --xplane_dir
    import gzip
    with gzip.open(xplane_path, "rb") as f:
      pd = jax.profiler.ProfileData.from_serialized_xspace(f.read())
  else:
    pd = jax.profiler.ProfileData.from_file(xplane_path)
  out = dict(devices={}, host_spans={})
  lo, hi = None, None
  for plane in pd.planes:
    if plane.name.startswith("/device:GPU"):
      lines = {}
      spans = collections.defaultdict(list)  # what kind of stream -> [(start, end)]
      h2d = {}  # H2D stream -> [(start, duration)]
      for line in plane.lines:
        kind = "h2d" if "MemcpyH2D" in line.name else (
            "compute" if "Compute" in line.name else None)
        if kind:
          spans[kind] += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events]
        if kind == "h2d":
          h2d[line.name] = [(e.start_ns, e.duration_ns) for e in line.events]
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
      out.setdefault("h2d_small_copies", {})[plane.name] = small_copies_behind_large(h2d)
      out.setdefault("link_gaps", {})[plane.name] = link_gaps(h2d)
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


def main(argv=None) -> None:
  """``python -m lab.trace_summary OUT.json TRACE...``: the summary of each kept trace
  (``.xplane.pb`` or ``.xplane.pb.gz``), keyed by file name; ``--only KEY`` keeps one field of
  the device plane (e.g. ``link_gaps``)."""
  import argparse
  import json
  ap = argparse.ArgumentParser(prog="python -m lab.trace_summary")
  ap.add_argument("out")
  ap.add_argument("traces", nargs="+")
  ap.add_argument("--only", default=None)
  ap.add_argument("--top", type=int, default=25)
  args = ap.parse_args(argv)
  result = {}
  for path in args.traces:
    summary = summarize(path, args.top)
    if args.only:
      if args.only not in summary:
        raise ValueError(f"--only: {args.only!r} is not a summary field ({sorted(summary)})")
      (summary,) = summary[args.only].values()  # the one GPU plane
    result[os.path.basename(path)] = summary
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
