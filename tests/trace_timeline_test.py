"""lab.trace_timeline: one layer's events from a trace, as offsets from the layer's start."""

import pytest

from lab import trace_timeline as tt

E = tt.Event


def _events():
  # Two layers starting at 1000 and 5000 ns (a third at 9000); events of each track around them.
  return [
      E(9_000, 100, "main", "rkv.layer.attend"),
      E(5_200, 2_000, "h2d", "MemcpyH2D"),
      E(1_000, 3_000, "main", "rkv.layer.attend"),
      E(5_000, 3_000, "main", "rkv.layer.attend"),
      E(900, 50, "d2h", "MemcpyD2H"),  # before layer 0: not in it
      E(1_500, 500, "gpu", "rkv_decode_attention"),
      E(4_999, 10, "pjrt", "cuLaunchHostFunc"),
  ]


def test_layer_timeline_keeps_the_layers_events_in_time_order():
  rows = tt.layer_timeline(_events(), 0)
  assert [(a, b, e.name) for a, b, e in rows] == [
      (0.0, 0.003, "rkv.layer.attend"), (0.0005, 0.001, "rkv_decode_attention"),
      (0.003999, 0.004009, "cuLaunchHostFunc")]
  two = tt.layer_timeline(_events(), 0, layers=2)
  assert [e.name for _, _, e in two][-2:] == ["rkv.layer.attend", "MemcpyH2D"]
  last = tt.layer_timeline(_events(), 2)  # the last layer runs to the trace's end
  assert [e.start_ns for _, _, e in last] == [9_000]


def test_layer_timeline_refuses_a_layer_the_trace_does_not_hold():
  with pytest.raises(ValueError, match="holds 3 layer starts"):
    tt.layer_timeline(_events(), 3)
  with pytest.raises(ValueError, match="holds 3 layer starts"):
    tt.layer_timeline(_events(), 0, layers=0)
