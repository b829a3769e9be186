# Session 23's GPU plan. Since session 18 six switches aimed at the hybrid layer's host chain have
# been built but never timed on an H200 (README, "Environment variables": RKV_EARLY_Q_COPY,
# RKV_WORKER_FIRST, RKV_SWITCH_INTERVAL_US, RKV_TILES_ONE_PROGRAM, RKV_EARLY_PUT_ALL, and the host
# share RKV_HOST_SHARE with its put reorder of session 20), and separate runs of one setting on
# one machine spread by ±8% at 2M int8 (session 22). decode_bench --sweep_env now times every
# setting on one fill in one process, alternating with the defaults, so each part below is one
# process per row and the sweep's medians (row["sweep_medians"]) are the A/B.
# Expected, written before it ran: at 2M int8 the one-program forms (two programs a layer for the
# device side) shorten the main thread by ~1 ms a layer where the link idles 1.4-1.9 ms: up to
# +15% if the layer is the main thread's; the host share +0-10%; the rest within ±3%.
# Session 23 ran parts h and h2 (H100s; benchmarks/results/beyond_hbm/session23/); no H200 could be
# started in five tries and the device time ran out before h3, so a, a2, h3 and b are unrun.
# Session 24 ran h3 on an H100 (beyond_hbm/session24/h100_h3/); its H200 runs are
# benchmarks/session24_h200.sh, written for the share as the default.
#   bash benchmarks/session23_h200.sh a   # the host share's split at 2M int8 (32K and 16K
#                                         # tiles) and 1M
#   bash benchmarks/session23_h200.sh a3  # the 2M int8 sweep of the other switches
#   bash benchmarks/session23_h200.sh a2  # the B=8 x 128K sweep
#   bash benchmarks/session23_h200.sh h   # part a's sweeps on an H100 (1M int8, 10 GiB tail;
#                                         # 128K half), where no H200 comes
#   bash benchmarks/session23_h200.sh h2  # the host share's split on the H100 (1M int8, 128K half)
#   bash benchmarks/session23_h200.sh h3  # the share-aware plan on the H100, against the worker
#   bash benchmarks/session23_h200.sh b   # the winner's trace (set WIN to its settings)
# Then here: python3 -m lab.trace_summary --only=layer_chain OUT.json $D/x/... and
# python3 -m lab.trace_timeline TRACE --layer=10.
D=/tmp/s23_${1:-a} NAME=s23 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
SWEEP=RKV_EARLY_Q_COPY=1,RKV_WORKER_FIRST=1,RKV_SWITCH_INTERVAL_US=200,RKV_TILES_ONE_PROGRAM=1
SWEEP=$SWEEP,RKV_EARLY_PUT_ALL=1+RKV_TILES_ONE_PROGRAM=1,RKV_HOST_SHARE=1
SWEEP=$SWEEP,RKV_HOST_SHARE=1+RKV_TILES_ONE_PROGRAM=1
# share_split TAG CPU_TILES ARGS...: the share for the whole process (its plan too), the split
# swept to CPU_TILES, and the Python worker (RKV_HOST_SHARE=0) at the plan's split.
share_split() {
  local tag=$1 tiles=$2; shift 2
  (export RKV_HOST_SHARE=1; run $tag --configs=rkv_offload --split_cpu_tiles=$tiles \
     --sweep_env=RKV_HOST_SHARE=0 "$@")
}
INT1M_T10="--budget=fraction --offload_fraction=0.155 --contexts=1048576 --kv_dtype=int8"
case "$PART" in
  a)
    # Part h2 (an H100, in-process, three rounds): with the host share the best split moved to the
    # CPU: 1M int8 (7 tiles a layer) 7.95 / 7.97 tok/s at 3 / 4 CPU tiles against 6.74 at the
    # plan's 2 and 6.43 without the share; 128K half 9.47 at 2 of 3 against 9.15 and 8.53. The
    # plan's split assumes the Python worker's fixed cost (2.19 ms a call); the share's is its two
    # stream-ordered copies. Here the same on the H200 rows, the share for the whole process (its
    # plan made with the share's fixed cost since a6d6bef; each part is packed as it ends, so a
    # call cut short keeps the rows before).
    host
    T=170 share_split 2m_int8_share_split 2,3,4 --budget=auto --contexts=2097152 \
      --kv_dtype=int8 --sweep_rounds=3
    T=150 share_split 1m_share_split 1,2 --budget=auto --contexts=1048576 --sweep_rounds=2
    T=170 share_split 2m_int8_share_t16k 5,6,7 --budget=auto --contexts=2097152 --kv_dtype=int8 \
      --tile_cells=16384 --sweep_rounds=2
    ;;
  a3)
    # Part a's fourth step, cut from it in session 24 to keep one call inside ten minutes.
    host
    T=170 run 2m_int8_sweep --configs=rkv_offload --budget=auto --contexts=2097152 \
      --kv_dtype=int8 --sweep_env=$SWEEP --sweep_rounds=2
    ;;
  a2)
    host
    T=170 run b8_sweep --configs=rkv_offload --budget=auto --contexts=131072 --batch=8 \
      --sweep_env=$SWEEP --sweep_rounds=2
    ;;
  h)
    # Part a's sweeps where no H200 comes, on one H100 (80 GB): 1M int8 with a 10 GiB tail (32
    # hybrid layers, like 2M int8's on the H200: session 20's part h2) and 128K half-offloaded
    # (bf16, an 8 GiB tail, as on the H200). A check of the mechanism, not a row of the table.
    host
    T=200 run 1m_int8_t10_sweep --configs=rkv_offload $INT1M_T10 --sweep_env=$SWEEP --sweep_rounds=3
    T=150 run half128_sweep --configs=rkv_offload --contexts=131072 --sweep_env=$SWEEP \
      --sweep_rounds=3
    ;;
  h2)
    # Part h's rows with the host share for the whole process and its PCIe/CPU split swept (the
    # plan's 2 of 7 CPU tiles at 1M int8, 1 of 3 at 128K half): with the share at ~96% of the
    # link's time at 1M int8 (5 tiles of ~49 MB at ~55 GB/s), more CPU tiles may win.
    host
    T=170 share_split 1m_int8_t10_share_split 3,4 $INT1M_T10 --sweep_rounds=3
    T=120 share_split half128_share_split 2 --contexts=131072 --sweep_rounds=3
    ;;
  h3)
    # The planner now plans a share's split with the share's fixed cost (Profile.for_host_share):
    # with RKV_HOST_SHARE=1 for the process, 1M int8 (10 GiB tail) should plan 3 of 7 tiles on
    # the CPU and 128K half 2 of 3. Each against the other splits and, at the share's plan, the
    # Python worker (RKV_HOST_SHARE=0): does the worker gain from that split too?
    host
    T=170 share_split 1m_int8_t10_share_plan 2,4 $INT1M_T10 --sweep_rounds=3
    T=120 share_split half128_share_plan 1 --contexts=131072 --sweep_rounds=3
    ;;
  b)
    host
    # WIN: the winner's settings, space-separated (e.g. WIN="RKV_TILES_ONE_PROGRAM=1").
    (export ${WIN:?set WIN to the winning settings}; T=110 trace 2m_int8_win \
      --configs=beyond:2097152 --kv_dtype=int8 --warmup=2 --steps=4 --trace_steps=2)
    ;;
esac
echo "== done $(date +%T)"
