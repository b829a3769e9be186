#!/usr/bin/env bash
# Issue 10, chunked prefill, one device call (~6 min): the Mosaic kernel's GPU tests (explicit
# positions included), then experiments/prefill_bench.py (kernel rows at depth 0/128K/512K/1M,
# model chunks through the 1M plan, the integrated 1M prefill). JSON lands in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
out="${OUT:-benchmarks/results}"
quiet() { grep -v -i warn | grep -v "^I1\|^W1"; }
timeout 240 python3 -m pytest -q -m gpu tests/pallas_flash_attention_mgpu_test.py > "$out/mgpu_tests.txt" 2>&1
tail -4 "$out/mgpu_tests.txt"
timeout 420 python3 -m experiments.prefill_bench --out="$out/prefill_h200.json" \
  --profile=benchmarks/results/profile_h200_v3.json --n_outer=5 "$@" 2>&1 | quiet | tail -40
