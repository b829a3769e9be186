"""The library apart from the lab: nothing under rkv/ imports matplotlib, torch, transformers or
the lab (lab/, experiments/, benchmarks/), at module level or inside a function."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "rkv"
FORBIDDEN = ("matplotlib", "torch", "transformers", "lab", "experiments", "benchmarks", "tests")


def _imported_roots(path: pathlib.Path):
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      yield node.lineno, node.module.split(".")[0]


def test_no_library_source_imports_the_lab_or_its_dependencies():
  found = [f"{p.relative_to(ROOT)}:{line}: {name}"
           for p in sorted(LIBRARY.rglob("*.py")) for line, name in _imported_roots(p)
           if name in FORBIDDEN]
  assert not found, found


def test_importing_every_library_module_loads_none_of_them():
  # A fresh interpreter: this test process has the lab and matplotlib loaded by other tests.
  code = f"""
import importlib, pkgutil, sys
import rkv
names = [m.name for m in pkgutil.walk_packages(rkv.__path__, "rkv.")]
for name in names:
  importlib.import_module(name)
bad = sorted(m for m in sys.modules if m.split(".")[0] in {FORBIDDEN!r})
print(len(names), bad)
assert not bad, bad
"""
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stdout + out.stderr
  assert int(out.stdout.split()[0]) > 20  # the walk found the package's modules


def test_no_test_file_imports_another_test_files_helpers():
  # Shared cases, checks and tolerances live in tests/support/ (and tests/numpy_reference.py).
  found = [f"{p.name}:{line}: {name}"
           for p in sorted((ROOT / "tests").glob("*_test.py"))
           for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, (ast.Import, ast.ImportFrom))
           for line, name in [(node.lineno, n) for n in (
               [a.name for a in node.names] if isinstance(node, ast.Import) else
               [f"{node.module}.{a.name}" for a in node.names])]
           if name.startswith("tests.") and "_test" in name]
  assert not found, found
