"""Summaries of ``jax.profiler`` traces (``.xplane.pb``, read by ``jax.profiler.ProfileData``,
no TensorBoard): per device stream the busy time and the top kernels, host spans named
``rkv.*``. Shared by the lab's trace scripts (``decode_trace``, ``prefill_bench --trace``)."""

from __future__ import annotations

import bisect
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


def _clip_union(intervals, lo, hi) -> int:
  return union_ns([(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi])


def layer_chain(main, worker, h2d, d2h, large_ns: int = SMALL_COPY_NS) -> dict:
  """A hybrid (or cpu) decode step's layers, event by event: what each layer's time went to.

  ``main``: the dispatching thread's ``rkv.*`` spans ``[(start_ns, duration_ns, name)]`` (the
  thread of ``rkv.layer.attend``); ``worker``: the CPU share's (``rkv.cpu.*``, the worker
  thread's); ``h2d``: the device's host-to-device copies ``[(start, duration)]`` (all streams);
  ``d2h``: its device-to-host copies. A layer is the time from one ``rkv.layer.attend`` to the
  next (the last of a step, followed by the logits, is dropped: its window is not a layer).

  Per layer, offsets from the layer's start: when the worker began (``rkv.cpu.tail``), its query
  copy (``rkv.cpu.q_to_host``) and when the device-to-host copy it waited for ran, the setup
  before the kernel, the kernel (``rkv.cpu.kernel``); the main thread's append, stream dispatch,
  wait for the worker (``rkv.cpu.wait``) and the next layer's join (with ``$RKV_HOST_SHARE``,
  whose C++ worker leaves no events, its share's start dispatch and its wait, ``rkv.share.*``,
  in place of the worker's spans); the PCIe link's busy and idle
  time (tile copies of at least ``large_ns``). Returns the medians over layers (ns) and the
  layer count; ``chain_ns`` is the worker's path: its start offset through the end of its
  kernel, plus the main thread's time from the end of its wait to the next layer (merge and
  join)."""
  starts = sorted(a for a, _, n in main if n == "rkv.layer.attend")
  if len(starts) < 2 or not (worker or any(n.startswith("rkv.share.") for _, _, n in main)):
    return dict(layers=0)
  periods = [b - a for a, b in zip(starts, starts[1:])]
  typical = statistics.median(periods)
  large = [(a, a + d) for a, d in h2d if d >= large_ns]
  rows = collections.defaultdict(list)

  def first(spans, name, lo, hi):
    hits = [(a, d) for a, d, n in spans if n == name and lo <= a < hi]
    return min(hits) if hits else None

  for lo, hi in zip(starts, starts[1:]):
    if hi - lo > 2 * typical:  # a step boundary (logits, sampling, the next step's entry)
      continue
    rows["layer_ns"].append(hi - lo)
    busy = _clip_union(large, lo, hi)
    rows["link_busy_ns"].append(busy)
    rows["link_idle_ns"].append(hi - lo - busy)
    for key, name in (("append", "rkv.append"), ("dispatch", "rkv.stream.dispatch"),
                      ("wait", "rkv.cpu.wait"), ("join", "rkv.layer.join"),
                      ("share_start", "rkv.share.start"), ("share_wait", "rkv.share.wait")):
      hit = first(main, name, lo, hi)
      if hit is not None:
        rows[f"main_{key}_ns"].append(hit[1])
    wait = first(main, "rkv.cpu.wait", lo, hi)
    tail = first(worker, "rkv.cpu.tail", lo, hi)
    q = first(worker, "rkv.cpu.q_to_host", lo, hi)
    kernel = first(worker, "rkv.cpu.kernel", lo, hi)
    if tail is None or q is None or kernel is None:
      continue
    rows["worker_start_ns"].append(tail[0] - lo)
    rows["q_to_host_ns"].append(q[1])
    copies = sorted(a + d for a, d in d2h if a >= q[0] and a + d <= q[0] + q[1])
    if copies:
      rows["q_copy_done_after_request_ns"].append(copies[0] - q[0])
    rows["setup_ns"].append(kernel[0] - (q[0] + q[1]))
    rows["kernel_ns"].append(kernel[1])
    kernel_end = kernel[0] + kernel[1]
    if wait is not None:
      rows["chain_ns"].append(kernel_end - lo + hi - (wait[0] + wait[1]))
  out = {k: statistics.median(v) for k, v in sorted(rows.items())}
  out["layers"] = len(rows["layer_ns"])
  out["large_ns"] = large_ns
  return out


# What the GPU client's launch of a program is named on the launching thread (jaxlib 0.11's
# stream-executor PJRT client): the launch, the start of its thunks, and the program's name.
LAUNCH = "[0] PjRtStreamExecutorRawLoadedExecutable::Execute"
THUNKS = "[0] GpuExecutable::ExecuteThunks"
PROGRAM = "CommonPjRtLoadedExecutable::Execute ("


def launch_gaps(events) -> dict:
  """``events``: one host thread's spans ``[(start_ns, duration_ns, name)]``. Per program, the
  time from each launch to the start of its thunks: what the launching thread waited for before
  the program went out (its arguments' transfers being enqueued, donation holds), which no
  ``rkv.*`` span shows. Session 19 found the int8 append's 1.1 ms this way (docs/DESIGN.md §6).
  Returns program name -> count, median and total ns, largest total first."""
  thunks = sorted(a for a, _, n in events if n == THUNKS)
  names = sorted((a, n[len(PROGRAM):].rstrip(")")) for a, _, n in events if n.startswith(PROGRAM))
  name_starts = [a for a, _ in names]
  gaps = collections.defaultdict(list)
  for a, d, n in events:
    if n != LAUNCH:
      continue
    j = bisect.bisect_left(thunks, a)
    k = bisect.bisect_right(name_starts, a) - 1
    if j < len(thunks) and thunks[j] < a + d and k >= 0:
      gaps[names[k][1]].append(thunks[j] - a)
  rows = {p: dict(count=len(g), median_ns=statistics.median(g), total_ns=sum(g))
          for p, g in gaps.items()}
  return dict(sorted(rows.items(), key=lambda kv: -kv[1]["total_ns"]))


# A transfer's work on PJRT's async work threads (jaxlib 0.11): a tile's host-to-device copy is
# enqueued there (named MemcpyD2D: pinned host memory is one of the device's memory spaces), and
# the dispatching thread's device_put shows as BATCHED_PUT.
RUNNER_THREAD = "pjrt_async_work_runner"
RUNNER_COPY = "MemcpyD2D"
BATCHED_PUT = "BatchedCopyToDeviceWithSharding: dispatch"
PUT_COPY = "CopyToMemorySpace_Direct"  # one array's copy requested inside a BATCHED_PUT


def copies_in_kernels(kernels, runner_copies, puts) -> dict:
  """Whether PJRT's work threads can enqueue tile copies while the CPU kernel runs.

  ``kernels``: ``[(start_ns, end_ns)]`` while a layer's CPU share was in flight (the worker's
  ``rkv.cpu.kernel`` spans; with ``$RKV_HOST_SHARE``, from the share's start dispatch to the end
  of its wait, which returns only once the kernel is done); ``runner_copies``: start ns of the
  copies PJRT's work threads enqueued (:data:`RUNNER_COPY`); ``puts``: start ns of the
  dispatching thread's ``device_put`` s that requested copies (:func:`_copy_requests`). Returns how many copies were
  enqueued inside a kernel's window against the share of the time the windows cover, and for
  the puts issued inside a window and outside, the median wait from the put to the next copy
  enqueued (what a put waits for a work thread). Why (docs/DESIGN.md §6): with the CPU kernel
  on 15 of the H200 host's 16 cores and the dispatching thread on the 16th, no work thread
  enqueued a copy during any Python-worker kernel in five committed traces, and under the host
  share most tiles put after the kernel began waited 0.5-2.5 ms for their first copy."""
  kernels = sorted(kernels)
  runner = sorted(runner_copies)
  starts = [a for a, _ in kernels]

  def inside(t):
    i = bisect.bisect_right(starts, t) - 1
    return i >= 0 and kernels[i][0] <= t < kernels[i][1]

  waits = {True: [], False: []}
  for p in sorted(puts):
    j = bisect.bisect_left(runner, p)
    if j < len(runner):
      waits[inside(p)].append(runner[j] - p)
  span = (runner[-1] - runner[0]) if len(runner) > 1 else 0
  covered = _clip_union([(a, b) for a, b in kernels], runner[0], runner[-1]) if span else 0
  med = lambda v: statistics.median(v) if v else None
  return dict(kernels=len(kernels), runner_copies=len(runner),
              runner_copies_in_kernels=sum(1 for r in runner if inside(r)),
              kernel_time_fraction=covered / span if span else None,
              puts_in_kernels=len(waits[True]), put_wait_in_kernels_ns=med(waits[True]),
              puts_outside=len(waits[False]), put_wait_outside_ns=med(waits[False]))


# The CUDA driver call by which the GPU client records a completion event on a stream (a host
# callback): PJRT makes one per transfer or program it must report done.
HOST_FUNC = "cuLaunchHostFunc"


def host_func_calls(by_thread: dict, layer_starts) -> dict:
  """``by_thread``: thread kind (``main``, ``pjrt``) -> that kind's spans ``[(start_ns,
  duration_ns, name)]``. Per kind, the :data:`HOST_FUNC` calls: count, median ns, and the median
  over layers (from one ``rkv.layer.attend`` to the next in ``layer_starts``) of their count and
  summed ns. Why: in an H100 trace (session 22) these calls took ~0.1 ms each on PJRT's threads,
  25 in a 4.45 ms layer, where a driver call alone takes a few us: contention for the CUDA
  context, which more arrays per tile (each copy's event) adds to (docs/DESIGN.md §6)."""
  starts = sorted(layer_starts)
  windows = list(zip(starts, starts[1:]))
  out = {}
  for kind, spans in sorted(by_thread.items()):
    calls = [(a, d) for a, d, n in spans if n == HOST_FUNC]
    if not calls:
      continue
    per = [[d for a, d in calls if lo <= a < hi] for lo, hi in windows]
    out[kind] = dict(count=len(calls), median_ns=statistics.median(d for _, d in calls),
                     per_layer_count=statistics.median(len(p) for p in per) if per else None,
                     per_layer_ns=statistics.median(sum(p) for p in per) if per else None)
  return out


def _copy_requests(events) -> list:
  """The start ns of each :data:`BATCHED_PUT` in ``events`` ``[(start, duration, name)]`` (one
  thread's) that requested copies (a :data:`PUT_COPY` inside it): other arguments' puts move
  nothing."""
  copies = sorted(a for a, _, n in events if n == PUT_COPY)
  out = []
  for a, d, n in events:
    if n == BATCHED_PUT:
      j = bisect.bisect_left(copies, a)
      if j < len(copies) and copies[j] < a + d:
        out.append(a)
  return sorted(out)


def _share_windows(main, d2h) -> list:
  """With ``$RKV_HOST_SHARE``: when each share's kernel may run, from its query's landing on the
  host (the end of the first device-to-host copy, ``d2h`` ``[(start, duration)]``, after the
  start's dispatch) to the end of its wait (the main thread's ``rkv.share.*`` spans ``[(start,
  duration, name)]``; the wait returns only once the kernel is done, so the window may be
  longer than the kernel, never shorter)."""
  ends = sorted(a + d for a, d in d2h)
  out, begun = [], None
  for a, d, n in sorted(main):
    if n == "rkv.share.start":
      begun = a
    elif n == "rkv.share.wait" and begun is not None:
      j = bisect.bisect_left(ends, begun)
      if j < len(ends) and ends[j] < a + d:
        out.append((ends[j], a + d))
      begun = None
  return out


def load_profile(xplane_path: str):
  """The ``jax.profiler.ProfileData`` of a ``.xplane.pb``, or of a ``.xplane.pb.gz`` (a trace
  kept by ``decode_trace --xplane_dir``)."""
  import jax
  if xplane_path.endswith(".gz"):
    import gzip
    with gzip.open(xplane_path, "rb") as f:
      return jax.profiler.ProfileData.from_serialized_xspace(f.read())
  return jax.profiler.ProfileData.from_file(xplane_path)


def summarize(xplane_path: str, top: int) -> dict:
  """Per device plane: each line's (stream's) busy ns and top events by total ns, the union of
  each kind's busy time, the small host-to-device copies queued behind tiles
  (:func:`small_copies_behind_large`); host spans named ``rkv.*`` (count, total, median ns); the
  traced window's wall ns."""
  pd = load_profile(xplane_path)
  out = dict(devices={}, host_spans={})
  lo, hi = None, None
  copies = {}  # device plane -> (its H2D copies, its D2H copies), for layer_chain
  threads = dict(main=[], worker=[])  # rkv.* spans of the dispatching thread and of the worker
  runner_copies, puts = [], []  # for copies_in_kernels
  driver = dict(main=[], pjrt=[])  # for host_func_calls
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
      # The device-to-host copies by event name: the compute stream's line is named after every
      # kind it runs (kernels too).
      copies[plane.name] = ([x for ev in h2d.values() for x in ev],
                            [(e.start_ns, e.duration_ns) for line in plane.lines
                             for e in line.events if e.name == "MemcpyD2H"])
    elif plane.name.startswith("/host:CPU"):
      spans = collections.defaultdict(list)
      for line in plane.lines:
        named = [(e.start_ns, e.duration_ns, e.name) for e in line.events
                 if e.name.startswith("rkv.")]
        for _, d, n in named:
          spans[n].append(d)
        if line.name.startswith(RUNNER_THREAD):
          runner_copies += [e.start_ns for e in line.events if e.name == RUNNER_COPY]
          driver["pjrt"] += [(e.start_ns, e.duration_ns, e.name) for e in line.events
                             if e.name == HOST_FUNC]
        if any(n == "rkv.layer.attend" for _, _, n in named):
          threads["main"] += named
          driver["main"] += [(e.start_ns, e.duration_ns, e.name) for e in line.events
                             if e.name == HOST_FUNC]
          puts += _copy_requests([(e.start_ns, e.duration_ns, e.name) for e in line.events])
          out.setdefault("launch_gaps", {})[plane.name] = launch_gaps(
              [(e.start_ns, e.duration_ns, e.name) for e in line.events])
        elif any(n == "rkv.cpu.tail" for _, _, n in named):
          threads["worker"] += named
      out["host_spans"] = {n: dict(count=len(d), total_ns=sum(d), median_ns=statistics.median(d))
                           for n, d in sorted(spans.items())}
  out["device_window_ns"] = None if lo is None else hi - lo
  every_d2h = [x for _, d2h in copies.values() for x in d2h]
  kernels = ([(a, a + d) for a, d, n in threads["worker"] if n == "rkv.cpu.kernel"]
             or _share_windows(threads["main"], every_d2h))
  if kernels and runner_copies:
    out["copies_in_kernels"] = copies_in_kernels(kernels, runner_copies, puts)
  attends = [a for a, _, n in threads["main"] if n == "rkv.layer.attend"]
  if attends and (driver["main"] or driver["pjrt"]):
    out["host_func_calls"] = host_func_calls(driver, attends)
  if threads["worker"] or any(n.startswith("rkv.share.") for _, _, n in threads["main"]):
    out["layer_chain"] = {name: layer_chain(threads["main"], threads["worker"], h2d_all, d2h_all)
                          for name, (h2d_all, d2h_all) in copies.items()}
  return out


# summarize's fields keyed by plane (or thread) name; the others are the whole trace's.
_PLANE_FIELDS = ("devices", "busy_union_ns", "h2d_small_copies", "link_gaps", "launch_gaps",
                 "layer_chain")


def summarize_dir(trace_dir: str, top: int) -> dict:
  """:func:`summarize` of the newest ``.xplane.pb`` under ``trace_dir``."""
  pb = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  if not pb:
    raise FileNotFoundError(f"no .xplane.pb under {trace_dir}")
  return summarize(pb[-1], top)


def main(argv=None) -> None:
  """``python -m lab.trace_summary OUT.json TRACE...``: the summary of each kept trace
  (``.xplane.pb`` or ``.xplane.pb.gz``), keyed by file name (by the path given where two share
  one); ``--only KEY`` keeps one field of the device plane (e.g. ``link_gaps``; ``launch_gaps``
  is the host plane's), or a field of the whole trace (``copies_in_kernels``)."""
  import argparse
  import json
  ap = argparse.ArgumentParser(prog="python -m lab.trace_summary")
  ap.add_argument("out")
  ap.add_argument("traces", nargs="+")
  ap.add_argument("--only", default=None)
  ap.add_argument("--top", type=int, default=25)
  args = ap.parse_args(argv)
  result = {}
  names = [os.path.basename(p) for p in args.traces]
  for path, name in zip(args.traces, names):
    summary = summarize(path, args.top)
    if args.only:
      if args.only not in summary:
        raise ValueError(f"--only: {args.only!r} is not a summary field ({sorted(summary)})")
      if args.only in _PLANE_FIELDS:
        (summary,) = summary[args.only].values()  # the one GPU plane (or host thread)
      else:
        summary = summary[args.only]
    result[name if names.count(name) == 1 else path] = summary  # decode_trace names repeat
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
