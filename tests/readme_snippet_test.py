"""The README's Python snippet runs as pasted: each ```python block of README.md is executed in a
fresh namespace, as a reader would paste it into an interpreter (stdout captured)."""

import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_blocks(text: str) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_has_a_python_snippet():
  with open(README, encoding="utf-8") as f:
    blocks = python_blocks(f.read())
  assert blocks and "rkv.generate_text" in blocks[0]


@pytest.mark.slow
def test_readme_python_snippets_run_as_pasted(smollm2, capsys):
  del smollm2  # only for its skip where the packaged model is absent
  with open(README, encoding="utf-8") as f:
    blocks = python_blocks(f.read())
  for i, code in enumerate(blocks):
    namespace = {"__name__": "__main__"}
    exec(compile(code, f"README.md[python block {i}]", "exec"), namespace)
  out = capsys.readouterr().out
  assert "Paris" in out and "prompt tokens" in out  # the streamed reply, then out.summary()
