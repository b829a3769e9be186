"""The recall needle job (`make demo-recall`) at a short context: the shipped recall model answers
the needle through an offloaded plan exactly as through resident caches (answers, tokens and logit
gate)."""

import pytest

from lab import demo


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "hybrid"])
def test_demo_short_context(mode):
  lines = []
  result = demo.run(demo.DemoConfig(context=1024, depth=0.25, mode=mode, tile_cells=256,
                                    min_tile_cells=128, check_tokens=8, decode_tokens=4),
                    log=lines.append)
  assert result["correct"], result
  assert result["identical_to_resident"] and result["gate_passed"], result
  assert result["host_bytes"] > 3 * result["device_bytes"]  # most of the KV is off the device
  if mode == "hybrid":
    assert result["tactics"] == ["hybrid"]
  text = "\n".join(lines)
  assert "layer" in text and "CORRECT" in text and "PASSED" in text


def test_demo_config_errors():
  with pytest.raises(ValueError, match="device_share"):
    demo.DemoConfig(device_share=1.0)
  with pytest.raises(ValueError, match="depth"):
    demo.DemoConfig(depth=1.5)
  with pytest.raises(ValueError, match="check_tokens"):
    demo.DemoConfig(context=128, check_tokens=128)
