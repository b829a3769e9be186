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
