"""One decode layer of a kept ``jax.profiler`` trace, event by event: what the dispatching
thread, the copy engine, the compute stream and PJRT's threads did, in time order, as offsets
from the layer's ``rkv.layer.attend``. Where :mod:`lab.trace_summary`'s ``layer_chain`` gives
medians over layers, this shows one, to find what a median hides (which program's dispatch took
the time, where the link waited).

  python -m lab.trace_timeline TRACE.xplane.pb.gz --layer=10 --layers=1 --min_us=150
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

from lab import trace_summary

# A tile copy is at least this long (a query's or a partial's copy is far shorter).
TILE_COPY_NS = trace_summary.SMALL_COPY_NS


class Event(NamedTuple):
  start_ns: int
  duration_ns: int
  track: str  # "main" (the thread of rkv.layer.attend), "h2d", "d2h", "gpu", "pjrt"
  name: str


def layer_timeline(events, layer: int, layers: int = 1) -> list[tuple[float, float, Event]]:
  """``events`` in any order; the ones that start within layers ``[layer, layer + layers)`` (from
  the ``layer``-th ``rkv.layer.attend`` on the main track to the ``layer + layers``-th, or the
  last event), each as ``(start_ms, end_ms, event)`` relative to the layer's start, in time
  order. A ValueError when the trace holds fewer layers."""
  starts = sorted(e.start_ns for e in events if e.track == "main" and e.name == "rkv.layer.attend")
  if not 0 <= layer < len(starts) or layers < 1:
    raise ValueError(f"layer {layer} (+{layers}): the trace holds {len(starts)} layer starts")
  lo = starts[layer]
  hi = starts[layer + layers] if layer + layers < len(starts) else None
  out = []
  for e in sorted(events):
    if e.start_ns >= lo and (hi is None or e.start_ns < hi):
      out.append(((e.start_ns - lo) / 1e6, (e.start_ns + e.duration_ns - lo) / 1e6, e))
  return out


def trace_events(xplane_path: str, min_ns: int) -> list[Event]:
  """The events :func:`layer_timeline` reads, from a kept trace: the main thread's ``rkv.*``
  spans and its other spans of at least ``min_ns``; tile copies (``MemcpyH2D`` of at least
  :data:`TILE_COPY_NS`), every device-to-host copy, compute-stream kernels and PJRT work-thread
  spans of at least ``min_ns``."""
  out = []
  for plane in trace_summary.load_profile(xplane_path).planes:
    if plane.name.startswith("/device:GPU"):
      for line in plane.lines:
        for e in line.events:
          if e.name.startswith("MemcpyH2D"):
            if e.duration_ns >= TILE_COPY_NS:
              out.append(Event(e.start_ns, e.duration_ns, "h2d", e.name))
          elif e.name == "MemcpyD2H":
            out.append(Event(e.start_ns, e.duration_ns, "d2h", e.name))
          elif e.duration_ns >= min_ns and not e.name.startswith("Memcpy"):
            out.append(Event(e.start_ns, e.duration_ns, "gpu", e.name))
    elif plane.name.startswith("/host:CPU"):
      for line in plane.lines:
        main = any(e.name == "rkv.layer.attend" for e in line.events)
        pjrt = line.name.startswith(trace_summary.RUNNER_THREAD)
        for e in line.events:
          if main and (e.name.startswith("rkv.") or e.duration_ns >= min_ns):
            out.append(Event(e.start_ns, e.duration_ns, "main", e.name))
          elif pjrt and e.duration_ns >= min_ns:
            out.append(Event(e.start_ns, e.duration_ns, "pjrt", e.name))
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m lab.trace_timeline")
  ap.add_argument("trace")
  ap.add_argument("--layer", type=int, default=10, help="the first layer shown (0-based)")
  ap.add_argument("--layers", type=int, default=1, help="how many layers")
  ap.add_argument("--min_us", type=float, default=150.0,
                  help="shortest non-rkv span shown (µs); tile copies and D2H copies always")
  args = ap.parse_args(argv)
  rows = layer_timeline(trace_events(args.trace, int(args.min_us * 1e3)), args.layer,
                        args.layers)
  print(f"{'start':>8} {'end':>8} {'ms':>7}  track  name (ms from layer {args.layer}'s start)")
  for a, b, e in rows:
    print(f"{a:8.3f} {b:8.3f} {e.duration_ns / 1e6:7.3f}  {e.track:5s}  {e.name[:90]}")


if __name__ == "__main__":
  main()
