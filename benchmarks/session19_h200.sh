# Session 19 on the H200: the first GPU run of session 18's host share (RKV_HOST_SHARE=1: a
# hybrid / cpu layer's CPU share in a C++ thread, started and awaited by XLA FFI custom calls, no
# Python worker in the layer's chain), which session 18 built and tested on the CPU backend only.
# Session 18's plan (benchmarks/session18_h200.sh) needed three calls; this session has two, so:
#   bash benchmarks/session19_h200.sh a   # the share's GPU tests (its CUDA handlers bit-equal to
#                                         # the Python path); if they pass, 2M int8 alternating
#                                         # default / share twice, then 1M and 128K half, default
#                                         # and share; if they fail, session 18's Python-path
#                                         # switches at 2M int8 instead (no row runs a share
#                                         # whose GPU tests failed)
#   bash benchmarks/session19_h200.sh b   # the share with the next puts and one-program tiles
#                                         # at 2M int8, a traced 2M int8 step with the share and
#                                         # one without, and the full -m gpu suite
#   bash benchmarks/session19_h200.sh c   # the append's offset kept on the device (rkv.cache
#                                         # ._device_offset) A/B against the last commit's tree
#                                         # in ab_prev/ (git archive 208825c rkv lab experiments
#                                         # benchmarks/results/profile_h200_v3.json), default and
#                                         # share, at 2M int8 alternating; a traced 2M int8 step
#                                         # with the share; 1M default and share
#   bash benchmarks/session19_h200.sh d   # part c's A/B again on another machine (c's was noisy:
#                                         # the same code ran 3.23 and 6.23 tok/s): previous /
#                                         # new default, twice
# Rows are planned on the shipped v3 profile, like the table's. Results:
# benchmarks/results/beyond_hbm/session19/{a,b,c,d}/; python3 -m lab.ab_summary DIR for the medians;
# the traces' summaries (session19/layer_chains.json, launch_gaps.json): python3 -m
# lab.trace_summary --only=layer_chain OUT b/x/2m_int8_default/*.gz b/x/2m_int8_share/*.gz
# c/x/2m_int8_new_share/*.gz (and --only=launch_gaps).
D=/tmp/s19_${1:-a} NAME=s19 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
int8_2m() {  # TAG
  T=120 run $1 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8
}
case "$PART" in
  a)
    host
    echo "== pytest host share $(date +%T)"
    timeout 140 python3 -m pytest -q -m gpu tests/host_share_test.py tests/generate_test.py \
      -k "host_share or cuda" -p no:cacheprovider > $D/pytest_host_share.txt 2>&1
    rc=$?; tail -3 $D/pytest_host_share.txt; echo "pytest rc=$rc"; pack
    if [ $rc = 0 ]; then
      int8_2m 2m_int8_default1
      RKV_HOST_SHARE=1 int8_2m 2m_int8_share1
      int8_2m 2m_int8_default2
      RKV_HOST_SHARE=1 int8_2m 2m_int8_share2
      T=80 run 1m_default --configs=rkv_offload --budget=auto --contexts=1048576
      RKV_HOST_SHARE=1 T=80 run 1m_share --configs=rkv_offload --budget=auto --contexts=1048576
      T=70 run half128_default --configs=rkv_offload --contexts=131072
      RKV_HOST_SHARE=1 T=70 run half128_share --configs=rkv_offload --contexts=131072
    else
      int8_2m 2m_int8_default1
      RKV_NEXT_PUTS=1 RKV_EARLY_Q_COPY=1 RKV_TILES_ONE_PROGRAM=1 RKV_WORKER_FIRST=1 \
        int8_2m 2m_int8_all1
      int8_2m 2m_int8_default2
      RKV_NEXT_PUTS=1 RKV_EARLY_Q_COPY=1 RKV_TILES_ONE_PROGRAM=1 RKV_WORKER_FIRST=1 \
        int8_2m 2m_int8_all2
      RKV_NEXT_PUTS=1 int8_2m 2m_int8_next_puts
    fi
    ;;
  b)
    host
    RKV_HOST_SHARE=1 RKV_NEXT_PUTS=1 RKV_TILES_ONE_PROGRAM=1 int8_2m 2m_int8_share_puts_one
    RKV_HOST_SHARE=1 T=120 trace 2m_int8_share --configs=beyond:2097152 --kv_dtype=int8 \
      --warmup=2 --steps=4 --trace_steps=2
    T=120 trace 2m_int8_default --configs=beyond:2097152 --kv_dtype=int8 \
      --warmup=2 --steps=4 --trace_steps=2
    echo "== pytest -m gpu $(date +%T)"
    timeout 220 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > $D/pytest_gpu.txt 2>&1
    tail -3 $D/pytest_gpu.txt; pack
    ;;
  c)
    host
    SRC=ab_prev int8_2m 2m_int8_prev_default
    int8_2m 2m_int8_new_default1
    RKV_HOST_SHARE=1 SRC=ab_prev int8_2m 2m_int8_prev_share
    RKV_HOST_SHARE=1 int8_2m 2m_int8_new_share1
    RKV_HOST_SHARE=1 int8_2m 2m_int8_new_share2
    int8_2m 2m_int8_new_default2
    RKV_HOST_SHARE=1 T=100 trace 2m_int8_new_share --configs=beyond:2097152 --kv_dtype=int8 \
      --warmup=2 --steps=4 --trace_steps=2
    T=70 run 1m_new_default --configs=rkv_offload --budget=auto --contexts=1048576
    RKV_HOST_SHARE=1 T=70 run 1m_new_share --configs=rkv_offload --budget=auto --contexts=1048576
    ;;
  d)
    host
    for i in 1 2; do
      SRC=ab_prev T=70 run 2m_int8_prev_default$i --configs=rkv_offload --budget=auto \
        --contexts=2097152 --kv_dtype=int8
      T=70 run 2m_int8_new_default$i --configs=rkv_offload --budget=auto --contexts=2097152 \
        --kv_dtype=int8
    done
    ;;
esac
echo "== done $(date +%T)"
