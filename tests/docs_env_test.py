"""The README's table of environment variables matches the code, both ways: every ``RKV_*``
variable the library or the setup reads has a row, and every row names one they read."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _section(text: str, title: str) -> str:
  start = text.index(f"## {title}\n")
  end = text.find("\n## ", start + 1)
  return text[start:end if end >= 0 else None]


def test_every_rkv_variable_has_a_row_and_every_row_is_read():
  read = set()
  for path in glob.glob(os.path.join(ROOT, "rkv", "**", "*.py"), recursive=True):
    with open(path, encoding="utf-8") as f:
      read |= set(re.findall(r"[\"'](RKV_[A-Z0-9_]+)[\"']", f.read()))
  for path in (os.path.join(ROOT, "scripts", "setup.sh"), os.path.join(ROOT, "Makefile")):
    with open(path, encoding="utf-8") as f:
      read |= set(re.findall(r"\$\{?(RKV_[A-Z0-9_]+)", f.read()))
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    table = _section(f.read(), "Environment variables")
  rows = set(re.findall(r"^\| `(RKV_[A-Z0-9_]+)` \|", table, flags=re.M))
  assert len(read) > 15  # the scan found the library's variables at all
  assert read - rows == set(), "read by the code, missing from the README table"
  assert rows - read == set(), "in the README table, read nowhere"
