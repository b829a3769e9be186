"""The lab: benchmarks and their harness, the recall model's training and scoring, the demo's story.

It depends on :mod:`rkv`, never the reverse (``tests/import_boundary_test.py`` holds both sides
to it); ``experiments/`` are the absl front ends. Not installed with the library: run it from a
checkout (``python -m experiments.X`` from the repository root). The plots need the ``lab``
extra (``pip install -e ".[lab]"``: matplotlib).
"""
