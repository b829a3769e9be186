#!/usr/bin/env bash
# The decode kernel's split merge on the H200: the default "tree" (a max, then the weighted sums:
# ~5 small XLA kernels after each decode-attention call) against "chain" (an online merge unrolled
# over the splits, elementwise: meant to fuse into one or two), $RKV_DECODE_SPLIT_MERGE.
# Written in session 7 and not run yet (no device time left): the resident rows are launch-bound
# (docs/DESIGN.md §7: 684 kernels a 2K step, 6.28 ms of host launching, bound 3.33 ms).
#   part a: resident 2K / 32K / 128K / 512K, tree and chain alternating, two rounds; then a trace
#           of resident 2K with each (the kernels a step, per stream, in the JSON).
# Every file goes to /tmp/sm and is packed into $OUT/sm_<part>.tgz after each step.
# Usage: bash benchmarks/split_merge_ab_h200.sh a
set -uo pipefail
export PYTHONUNBUFFERED=1
P=${P:-benchmarks/results/profile_h200_v3.json}
D=/tmp/sm; mkdir -p $D/x
PART=${1:-a}
pack() { tar czf $OUT/sm_$PART.tgz -C $D . 2>/dev/null; }
q() { grep -v -i warn | grep -v "^I1\|^W1"; }
case "$PART" in
  a)
    for i in 1 2; do for m in tree chain; do
      echo "== resident $m $i $(date +%T)"
      RKV_DECODE_SPLIT_MERGE=$m PYTHONPATH=$PWD timeout 150 python3 -m experiments.decode_bench \
        --profile=$P --plot= --out=$D/res_${m}_$i.json --configs=rkv_resident \
        --contexts=2048,32768,131072,524288 2>&1 | q | grep -E "tok/s|Error|error" | tail -5
      pack
    done; done
    for m in tree chain; do
      echo "== trace resident 2K $m $(date +%T)"
      RKV_DECODE_SPLIT_MERGE=$m PYTHONPATH=$PWD timeout 120 python3 -m experiments.decode_trace \
        --profile=$P --configs=resident:2048 --out=$D/trace_res2k_$m.json 2>&1 | q | tail -2
      pack
    done
    ;;
esac
echo "== done $(date +%T)"
