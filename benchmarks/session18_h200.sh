# Session 18's plan for the H200 (written on a session with no GPU lent; nothing in it has run
# yet). The committed traces, read event by event on the CPU machine (`lab.trace_summary
# .layer_chain`, benchmarks/results/beyond_hbm/layer_chains.json), put a hybrid layer's time on
# the CPU share's chain: at 2M int8 (session17/b/) a 5.46 ms layer, the worker starting 0.84 ms
# in (the main thread's tile puts hold the GIL first), its query copy 0.81 ms, setup 0.35, the
# kernel 2.40, while the PCIe link idled 1.88 ms a layer and the main thread waited 0.74. Five
# switches, each off by default until this measures them:
#   RKV_NEXT_PUTS=1           the next layer's first tiles put while this layer waits for its CPU
#                             share (rkv.offload.stream.NEXT_PUTS_ENV; the reserve counts them)
#   RKV_EARLY_Q_COPY=1        the query's host copy requested before the CPU share is submitted
#   RKV_WORKER_FIRST=1        the main thread goes on only once the worker holds the GIL, so its
#                             query copy and setup run before the layer's puts and append
#   RKV_TILES_ONE_PROGRAM=1   a hybrid layer's staged tiles attended and merged in one program
#   RKV_SWITCH_INTERVAL_US=N  the GIL switch interval during steps with cpu / hybrid layers (an
#                             alternative to RKV_WORKER_FIRST, which needs the long default)
# And the structural lever, built and tested on the CPU backend only:
#   RKV_HOST_SHARE=1          the CPU share in a C++ thread of rkv.offload.host_share, started by
#                             an FFI custom call right after the program that makes the query (its
#                             copies and a host function on the stream), awaited right before the
#                             next join: no Python thread, GIL or query round trip in the chain
# Each part is one device call (10 minutes at most):
#   bash benchmarks/session18_h200.sh a   # the host share's GPU tests (its CUDA handlers: bit-
#                                         # equal to the Python path), then 2M int8 alternating:
#                                         # default / RKV_HOST_SHARE=1 twice, the share with the
#                                         # next puts and the one-program tiles, and a trace
#   bash benchmarks/session18_h200.sh b   # the GPU-only tests, then the Python-path switches
#                                         # at 2M int8, alternating: the default and the first
#                                         # four on, twice each; all with the switch interval
#                                         # instead of the handoff; next puts alone and with the
#                                         # handoff
#   bash benchmarks/session18_h200.sh c   # 1M, 128K half and B=8 x 128K, the default, then
#                                         # with the host share
# With RKV_NEXT_PUTS=1 the planner's reserve counts the next layer's tiles too (4 more tiles: 267
# MB less window at 2M int8), so those rows' plans differ a little: each row records its own.
# Rows are planned on the shipped v3 profile, like the table's, unless named _probed.
# Results: benchmarks/results/beyond_hbm/session18/{a,b,c}/; one line a row, with the medians of
# each set of switches: python3 -m lab.ab_summary benchmarks/results/beyond_hbm/session18/a
D=/tmp/s18 NAME=s18 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
# The first four switches on, for the command that follows (a function or a program).
all_on() {
  RKV_NEXT_PUTS=1 RKV_EARLY_Q_COPY=1 RKV_TILES_ONE_PROGRAM=1 RKV_WORKER_FIRST=1 "$@"
}
int8_2m() {  # TAG
  T=150 run $1 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8
}
host() { { uptime; nproc; lscpu | grep -E "Model name|MHz|Flags"; } > $D/host_$PART.txt 2>&1; }
case "$PART" in
  a)
    host
    echo "== pytest host share $(date +%T)"
    timeout 150 python3 -m pytest -q -m gpu tests/host_share_test.py tests/generate_test.py \
      -k "host_share or cuda" -p no:cacheprovider > $D/pytest_host_share.txt 2>&1
    tail -3 $D/pytest_host_share.txt; pack
    int8_2m 2m_int8_default1
    RKV_HOST_SHARE=1 int8_2m 2m_int8_share1
    int8_2m 2m_int8_default2
    RKV_HOST_SHARE=1 int8_2m 2m_int8_share2
    RKV_HOST_SHARE=1 RKV_NEXT_PUTS=1 RKV_TILES_ONE_PROGRAM=1 int8_2m 2m_int8_share_puts_one
    RKV_HOST_SHARE=1 T=170 trace 2m_int8_share --configs=beyond:2097152 --kv_dtype=int8 \
      --warmup=2 --steps=4 --trace_steps=2
    ;;
  b)
    host
    echo "== pytest -m gpu $(date +%T)"
    timeout 250 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > $D/pytest_gpu.txt 2>&1
    tail -3 $D/pytest_gpu.txt; pack
    int8_2m 2m_int8_default1
    all_on int8_2m 2m_int8_all1
    int8_2m 2m_int8_default2
    all_on int8_2m 2m_int8_all2
    RKV_NEXT_PUTS=1 RKV_EARLY_Q_COPY=1 RKV_TILES_ONE_PROGRAM=1 RKV_SWITCH_INTERVAL_US=200 \
      int8_2m 2m_int8_all_si200
    RKV_NEXT_PUTS=1 int8_2m 2m_int8_next_puts
    RKV_NEXT_PUTS=1 RKV_WORKER_FIRST=1 int8_2m 2m_int8_next_puts_worker_first
    ;;
  c)
    host
    for side in default share; do
      if [ $side = share ]; then export RKV_HOST_SHARE=1; else unset RKV_HOST_SHARE; fi
      T=130 run 1m_$side --configs=rkv_offload --budget=auto --contexts=1048576
      T=90 run half128_$side --configs=rkv_offload --contexts=131072
      T=110 run b8_$side --configs=rkv_offload --budget=auto --contexts=131072 --batch=8
    done
    unset RKV_HOST_SHARE
    ;;
esac
echo "== done $(date +%T)"
