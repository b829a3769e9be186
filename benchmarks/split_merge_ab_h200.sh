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
D=/tmp/sm NAME=sm PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
case "$PART" in
  a)
    for i in 1 2; do for m in tree chain; do
      RKV_DECODE_SPLIT_MERGE=$m T=150 run res_${m}_$i --configs=rkv_resident \
        --contexts=2048,32768,131072,524288
    done; done
    for m in tree chain; do
      RKV_DECODE_SPLIT_MERGE=$m T=120 trace res2k_$m --configs=resident:2048
    done
    ;;
esac
echo "== done $(date +%T)"
