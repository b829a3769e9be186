# The next GPU session's plan (written in session 19 after its device time was spent; nothing in
# it has run yet). Session 19 measured the host share (RKV_HOST_SHARE=1) on the H200: exact, no
# faster, and its trace put the layer on the main thread's dispatching (docs/DESIGN.md §6). Two
# changes since, neither measured on the GPU with the share on:
#   - the append's offset kept as a device scalar (rkv.cache.device_offset): the append's launch
#     waited 1.1 ms for its host transfer under the share, 28 us after (session19/c trace);
#     neutral without the share (session19/d)
#   - the share's start and wait without an FFI side effect, so jit dispatches them on its C++
#     path (~0.3 ms of Python dispatch each in session 19's trace; 70 -> 7 us on the dev box)
# Each part is one device call (10 minutes at most):
#   bash benchmarks/session20_h200.sh a   # the share's GPU tests; 2M int8 alternating default /
#                                         # share twice; the share with its CPU share swept over
#                                         # 2..4 tiles (decode_bench --split_cpu_tiles: the
#                                         # CPU share runs beside the main thread now, so the
#                                         # plan's split may no longer be the fastest); the
#                                         # share with XLA's command buffers off (the layer's
#                                         # small programs paid 30-100 us of graph update and
#                                         # launch each); the share with the staged tiles
#                                         # attended and merged in one program
#                                         # (RKV_TILES_ONE_PROGRAM: the main thread dispatches
#                                         # ~8 programs a layer under the share); the share's
#                                         # kernel on 12 threads (it runs beside the main
#                                         # thread's dispatching now, off the layer's chain:
#                                         # 15 threads left the dispatching threads one core)
#   bash benchmarks/session20_h200.sh b   # 1M, 128K half and B=8 x 128K, default and share;
#                                         # a traced 2M int8 share step; the full -m gpu suite
# If the share wins: RKV_HOST_SHARE on by default, the table's hybrid rows re-measured with it and
# decode_beyond_hbm_h200.json recomposed (benchmarks/compose_beyond_hbm.py).
D=/tmp/s20_${1:-a} NAME=s20 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
int8_2m() {  # TAG [ARGS...]
  local tag=$1; shift
  T=${T:-100} run $tag --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8 "$@"
}
host() { { uptime; nproc; lscpu | grep -E "Model name|MHz"; nvidia-smi -L; } > $D/host_$PART.txt 2>&1; }
case "$PART" in
  a)
    host
    timeout 120 python3 -m pytest -q -m gpu tests/host_share_test.py tests/generate_test.py \
      -k "host_share or cuda" -p no:cacheprovider > $D/pytest_host_share.txt 2>&1
    rc=$?; tail -2 $D/pytest_host_share.txt; echo "pytest rc=$rc"; pack
    [ $rc = 0 ] || exit 1  # no row runs a share whose GPU tests failed
    for i in 1 2; do
      int8_2m 2m_int8_default$i
      RKV_HOST_SHARE=1 int8_2m 2m_int8_share$i
    done
    RKV_HOST_SHARE=1 T=150 int8_2m 2m_int8_share_split --split_cpu_tiles=2,3,4 --sweep_rounds=1
    RKV_HOST_SHARE=1 XLA_FLAGS=--xla_gpu_enable_command_buffer= int8_2m 2m_int8_share_nocb
    RKV_HOST_SHARE=1 RKV_TILES_ONE_PROGRAM=1 int8_2m 2m_int8_share_one_program
    RKV_HOST_SHARE=1 RKV_CPU_TAIL_THREADS=12 int8_2m 2m_int8_share_threads12
    ;;
  b)
    host
    for side in default share; do
      if [ $side = share ]; then export RKV_HOST_SHARE=1; else unset RKV_HOST_SHARE; fi
      T=80 run 1m_$side --configs=rkv_offload --budget=auto --contexts=1048576
      T=70 run half128_$side --configs=rkv_offload --contexts=131072
      T=80 run b8_$side --configs=rkv_offload --budget=auto --contexts=131072 --batch=8
    done
    unset RKV_HOST_SHARE
    RKV_HOST_SHARE=1 T=100 trace 2m_int8_share --configs=beyond:2097152 --kv_dtype=int8 \
      --warmup=2 --steps=4 --trace_steps=2
    timeout 200 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > $D/pytest_gpu.txt 2>&1
    tail -2 $D/pytest_gpu.txt; pack
    ;;
esac
echo "== done $(date +%T)"
