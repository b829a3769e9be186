#!/usr/bin/env bash
# The decode kernel's wrapper on the H200: fewer XLA launches around each decode-attention call.
# Written in session 7 and not run yet (no device time left). Why: a resident decode step is
# launch-bound (docs/DESIGN.md §7: 684 kernels a 2K step, 6.28 ms of host launching against a
# 3.33 ms bound), and each decode-attention call is ~11 kernels: ~5 small fusions before it (the
# packed queries, their positions, the key bounds) and ~5 after it (the split merge). Arms:
#   base   the defaults: split merge "tree", queries packed by the wrapper
#   chain  $RKV_DECODE_SPLIT_MERGE=chain: the online split merge, elementwise over the splits
#   both   chain and $RKV_DECODE_QUERY_PACK=kernel: each program gathers its rows from q itself
#   part a: resident 2K / 32K / 128K / 512K, the three arms in turn; a trace of resident 2K, base
#   part b: the same rows in the reverse order; a trace of resident 2K, both (kernels a step, per
#           stream, in the JSON: compare with part a's)
# Every file goes to /tmp/dw and is packed into $OUT/dw_<part>.tgz after each step.
# Usage: bash benchmarks/decode_wrapper_ab_h200.sh a|b
D=/tmp/dw NAME=dw PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
arm() {  # arm NAME COMMAND...: the command (run, trace, rows) under that arm's switches
  local name=$1; shift
  local merge=tree pack=wrapper
  [ $name = chain ] && merge=chain
  [ $name = both ] && merge=chain pack=kernel
  RKV_DECODE_SPLIT_MERGE=$merge RKV_DECODE_QUERY_PACK=$pack "$@"
}
rows() { T=150 run res_$1_$PART --configs=rkv_resident --contexts=2048,32768,131072,524288; }
case "$PART" in
  a)
    for a in base chain both; do arm $a rows $a; done
    T=120 arm base trace res2k_base --configs=resident:2048
    ;;
  b)
    for a in both chain base; do arm $a rows $a; done
    T=120 arm both trace res2k_both --configs=resident:2048
    ;;
esac
echo "== done $(date +%T)"
