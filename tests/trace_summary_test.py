"""The lab's trace summary: the small host-to-device copies queued behind tiles (pure function)."""

from lab.trace_summary import small_copies_behind_large


def test_small_copies_behind_large():
  us = 1000
  lines = {
      # A tile (1.7 ms), then a small copy 5 us after it ends: queued behind it.
      "Stream #20(MemcpyH2D)": [(0, 1700 * us), (1705 * us, 10 * us)],
      # A small copy long after a tile (idle stream), and one after another small copy.
      "Stream #21(MemcpyH2D)": [(0, 1700 * us), (3000 * us, 10 * us), (3015 * us, 8 * us)],
      # A small copy first on its stream, then a tile: nothing before it.
      "Stream #22(MemcpyH2D)": [(500 * us, 20 * us), (600 * us, 1600 * us)],
  }
  got = small_copies_behind_large(lines)
  assert (got["small"], got["behind_large"], got["large_ns_before_them"]) == (4, 1, 1700 * us)
  # Events out of order are sorted per stream first; a wider gap counts the second stream too.
  shuffled = {k: v[::-1] for k, v in lines.items()}
  assert small_copies_behind_large(shuffled) == got
  wide = small_copies_behind_large(lines, gap_ns=2000 * us)
  assert (wide["behind_large"], wide["large_ns_before_them"]) == (2, 3400 * us)
  assert small_copies_behind_large({}) == dict(small=0, behind_large=0, large_ns_before_them=0,
                                                small_ns=100_000, gap_ns=20_000)


def test_link_gaps_across_streams():
  from lab.trace_summary import link_gaps
  us = 1000
  lines = {
      # Two tiles back to back on two streams, then a 1 ms gap, then a third tile.
      "Stream #20(MemcpyH2D)": [(0, 800 * us), (2600 * us, 800 * us)],
      "Stream #21(MemcpyH2D)": [(800 * us, 800 * us)],
      # Small copies are not tiles: one right after the second tile, one inside the gap.
      "Stream #15(MemcpyH2D)": [(1605 * us, 3 * us), (2000 * us, 2 * us)],
      # A 20 us step between two queued copies is not an idle gap.
      "Stream #22(MemcpyH2D)": [(3420 * us, 500 * us)],
  }
  got = link_gaps(lines)
  assert (got["gaps"], got["gap_ns"], got["busy_ns"]) == (1, 1000 * us, 2900 * us)
  assert got["median_gap_ns"] == 1000 * us
  assert link_gaps({})["gaps"] == 0


def test_summarize_reads_a_kept_gzipped_trace(tmp_path):
  # decode_trace --xplane_dir keeps traces gzipped; the summary reads them as they are, and the
  # command line writes one summary per file.
  import glob
  import gzip
  import json
  import jax
  import jax.numpy as jnp
  from lab import trace_summary
  with jax.profiler.trace(str(tmp_path / "t")):
    with jax.profiler.TraceAnnotation("rkv.test_span"):
      jax.block_until_ready(jnp.ones(8) * 2)
  (pb,) = glob.glob(str(tmp_path / "t" / "**" / "*.xplane.pb"), recursive=True)
  gz = tmp_path / "kept.xplane.pb.gz"
  with open(pb, "rb") as src, gzip.open(gz, "wb") as dst:
    dst.write(src.read())
  plain = trace_summary.summarize(pb, 5)
  assert plain["host_spans"]["rkv.test_span"]["count"] == 1
  assert trace_summary.summarize(str(gz), 5) == plain
  out = tmp_path / "s.json"
  trace_summary.main([str(out), str(gz)])
  assert json.load(open(out))["kept.xplane.pb.gz"]["host_spans"] == json.loads(
      json.dumps(plain["host_spans"]))


def test_layer_chain_of_synthetic_layers():
  # Two layers of 5 ms (a third start closes the second), and a step boundary after them that
  # is not a layer. Per layer: the worker begins 0.8 ms in, its query copy takes 0.8 (the D2H
  # copy done 0.4 after the request), 0.3 of setup, a 2.4 ms kernel; the main thread waits
  # 3.6-4.4 and the next join runs 4.5-5.0; the link copies 1.0-4.0.
  from lab.trace_summary import layer_chain
  ms = 1_000_000
  main, worker, h2d, d2h = [], [], [], []
  for lo in (0, 5 * ms):
    main += [(lo, 4 * ms, "rkv.layer.attend"), (lo + int(1.1 * ms), ms, "rkv.append"),
             (lo + int(3.6 * ms), int(0.8 * ms), "rkv.cpu.wait"),
             (lo + int(4.5 * ms), ms // 2, "rkv.layer.join")]
    worker += [(lo + int(0.8 * ms), int(3.6 * ms), "rkv.cpu.tail"),
               (lo + int(0.8 * ms), int(0.8 * ms), "rkv.cpu.q_to_host"),
               (lo + int(1.9 * ms), int(2.4 * ms), "rkv.cpu.kernel")]
    h2d += [(lo + ms, int(1.5 * ms)), (lo + int(2.5 * ms), int(1.5 * ms)), (lo + ms, 5000)]
    d2h += [(lo + int(1.19 * ms), int(0.01 * ms))]
  main += [(10 * ms, 4 * ms, "rkv.layer.attend"), (30 * ms, ms, "rkv.layer.attend")]
  got = layer_chain(main, worker, h2d, d2h)
  assert got["layers"] == 2
  want = dict(layer_ns=5 * ms, worker_start_ns=0.8 * ms, q_to_host_ns=0.8 * ms,
              q_copy_done_after_request_ns=0.4 * ms, setup_ns=0.3 * ms, kernel_ns=2.4 * ms,
              main_append_ns=ms, main_wait_ns=0.8 * ms, main_join_ns=0.5 * ms,
              link_busy_ns=3 * ms, link_idle_ns=2 * ms,
              chain_ns=(4.3 + 0.6) * ms)  # kernel end 4.3, then wait end 4.4 -> next layer 5.0
  for key, value in want.items():
    assert abs(got[key] - value) < 2, (key, got[key], value)
  assert layer_chain(main[:1], worker, h2d, d2h) == dict(layers=0)


def test_layer_chain_with_host_shares():
  # $RKV_HOST_SHARE: no worker spans (its thread is C++); the share's start dispatch and wait
  # take their place, the link's time as before.
  from lab.trace_summary import layer_chain
  ms = 1_000_000
  main = []
  for lo in (0, 4 * ms, 8 * ms):
    main += [(lo, 3 * ms, "rkv.layer.attend"), (lo + int(3.2 * ms), int(0.2 * ms),
                                                "rkv.share.wait"),
             (lo + int(3.6 * ms), int(0.1 * ms), "rkv.share.start")]
  got = layer_chain(main, [], [(ms, 2 * ms), (5 * ms, 2 * ms)], [])
  assert got["layers"] == 2 and "worker_start_ns" not in got
  assert abs(got["main_share_wait_ns"] - 0.2 * ms) < 2
  assert abs(got["main_share_start_ns"] - 0.1 * ms) < 2
  assert abs(got["link_busy_ns"] - 2 * ms) < 2 and abs(got["layer_ns"] - 4 * ms) < 2


def test_launch_gaps_per_program():
  from lab.trace_summary import LAUNCH, PROGRAM, THUNKS, launch_gaps
  us = 1000

  def launch(t, name, gap, thunks=50 * us):
    # A program's launch span on the launching thread, its name, and its thunks after ``gap``.
    return [(t, gap + thunks + 10 * us, PROGRAM + name + ")"), (t + us, gap + thunks, LAUNCH),
            (t + us + gap, thunks, THUNKS)]

  events = (launch(0, "jit__write_quantized", 1100 * us) + launch(2000 * us, "jit_join", 30 * us) +
            launch(3000 * us, "jit__write_quantized", 900 * us) +
            [(5000 * us, 10 * us, LAUNCH)])  # a launch with no thunks inside it: not counted
  got = launch_gaps(events[::-1])  # any order
  assert list(got) == ["jit__write_quantized", "jit_join"]  # largest total first
  assert got["jit__write_quantized"] == dict(count=2, median_ns=1000 * us, total_ns=2000 * us)
  assert got["jit_join"] == dict(count=1, median_ns=30 * us, total_ns=30 * us)
  assert launch_gaps([]) == {}


def test_copies_in_kernels_counts_the_work_threads_copies_and_the_puts_waits():
  # Two kernels (1-3 ms, 6-8 ms): work-thread copies at 0.5, 3.1, 3.2 and 5 ms (none inside a
  # kernel); a put at 0.3 ms (outside: its copy 0.2 ms later) and one at 1.5 ms (inside: it
  # waits for the copy at 3.1 ms, 1.6 ms). A put after the last copy has none to wait for.
  from lab.trace_summary import copies_in_kernels
  ms = 1_000_000
  got = copies_in_kernels([(6 * ms, 8 * ms), (1 * ms, 3 * ms)],
                          [int(3.2 * ms), int(0.5 * ms), int(3.1 * ms), 5 * ms],
                          [int(1.5 * ms), int(0.3 * ms), 9 * ms])
  assert got["kernels"] == 2 and got["runner_copies"] == 4
  assert got["runner_copies_in_kernels"] == 0
  assert abs(got["kernel_time_fraction"] - 2 / 4.5) < 1e-9  # 1-3 ms of the copies' 0.5-5 ms
  assert (got["puts_in_kernels"], got["put_wait_in_kernels_ns"]) == (1, int(1.6 * ms))
  assert (got["puts_outside"], got["put_wait_outside_ns"]) == (1, int(0.2 * ms))
  inside = copies_in_kernels([(0, 10 * ms)], [ms, 2 * ms], [])
  assert inside["runner_copies_in_kernels"] == 2 and inside["put_wait_in_kernels_ns"] is None


def test_share_windows_run_from_the_query_landing_to_the_wait():
  # Each share: its start's dispatch, the query's copy to the host landing 0.4 ms later, its
  # wait ending 3 ms after the start. A wait with no start before it is no window.
  from lab.trace_summary import _share_windows
  ms = 1_000_000
  main = [(int(0.5 * ms), int(0.1 * ms), "rkv.share.wait")]
  d2h = []
  for lo in (1 * ms, 5 * ms):
    main += [(lo, int(0.2 * ms), "rkv.share.start"), (lo + int(2.5 * ms), int(0.5 * ms),
                                                       "rkv.share.wait")]
    d2h.append((lo + int(0.3 * ms), int(0.1 * ms)))
  assert _share_windows(main[::-1], d2h) == [(int(1.4 * ms), 4 * ms), (int(5.4 * ms), 8 * ms)]


def test_copy_requests_are_the_puts_that_move_something():
  from lab.trace_summary import BATCHED_PUT, PUT_COPY, _copy_requests
  events = [(100, 50, BATCHED_PUT), (110, 5, PUT_COPY), (120, 5, PUT_COPY),  # a tile's put
            (300, 20, BATCHED_PUT),  # an argument's put that copies nothing
            (500, 30, BATCHED_PUT), (510, 5, PUT_COPY)]
  assert _copy_requests(events[::-1]) == [100, 500]
  assert _copy_requests([]) == []


def test_host_func_calls_per_thread_and_layer():
  # Two layers (attend at 0, 1000 and 2000 ns); PJRT's thread makes 3 calls in the first and 1 in
  # the second, the main thread 1 in each; other names are not counted.
  from lab import trace_summary
  f = trace_summary.HOST_FUNC
  by_thread = dict(
      main=[(0, 1000, "rkv.layer.attend"), (100, 10, f), (1100, 30, f), (1200, 5, "other")],
      pjrt=[(10, 100, f), (20, 200, f), (30, 300, f), (1500, 50, f), (1600, 7, "other")])
  out = trace_summary.host_func_calls(by_thread, [0, 1000, 2000])
  assert out["pjrt"] == dict(count=4, median_ns=150, per_layer_count=2, per_layer_ns=325)
  assert out["main"] == dict(count=2, median_ns=20, per_layer_count=1, per_layer_ns=20)
  assert trace_summary.host_func_calls(dict(main=[(0, 5, "other")]), [0, 10]) == {}
