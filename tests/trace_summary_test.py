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
