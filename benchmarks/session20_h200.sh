# The next GPU session's plan (written in session 19 after its device time was spent; nothing in
# it has run yet). Session 19 measured the host share (RKV_HOST_SHARE=1) on the H200: exact, no
# faster, and its trace put the layer on the main thread's dispatching, ~9 programs a layer
# (docs/DESIGN.md §6). Since then, none measured on the GPU:
#   - the append's offset kept as a device scalar (rkv.cache.device_offset): the append's launch
#     waited 1.1 ms for its host transfer under the share, 28 us after (session19/c trace);
#     neutral without the share (session19/d). The fused decode step's head program had the same
#     per-layer host offset (it measured slower than the general path in session 17: 4.99 vs
#     6.54 tok/s at 2M int8); it takes the device scalar now too
#   - the share's start and wait without an FFI side effect, so jit dispatches them on its C++
#     path (~0.3 ms of Python dispatch each in session 19's trace; 70 -> 7 us on the dev box)
#   - the share in the fused decode step (RKV_FUSED_DECODE=1 RKV_HOST_SHARE=1): puts, head,
#     share start, device partials, share wait: five dispatches a layer, no Python worker
# Each part is one device call (10 minutes at most), in order of what they decide:
#   bash benchmarks/session20_h200.sh a   # the share's GPU tests (general and fused chains);
#                                         # 2M int8 alternating default / share / fused / fused
#                                         # + share, twice
#   bash benchmarks/session20_h200.sh b   # 2M int8 variants of the share (general and fused):
#                                         # its CPU share swept over 2..4 tiles (decode_bench
#                                         # --split_cpu_tiles: it runs beside the main thread
#                                         # now, so the plan's split may not be the fastest),
#                                         # XLA's command buffers off (30-100 us of graph update
#                                         # and launch a small program), one-program tiles
#                                         # (RKV_TILES_ONE_PROGRAM), the kernel on 12 threads
#                                         # (15 left the dispatching threads one core); a traced
#                                         # 2M int8 fused + share step
#   bash benchmarks/session20_h200.sh c   # 1M and 128K half: default, share, fused + share;
#                                         # B=8 x 128K default and fused + share; the full -m
#                                         # gpu suite
# If a share form wins: on by default (RKV_HOST_SHARE, and RKV_FUSED_DECODE if the fused form
# wins), the table's hybrid rows re-measured with it and decode_beyond_hbm_h200.json recomposed
# (benchmarks/compose_beyond_hbm.py). Rows record host_share_layers (layers that ran a share) and
# code (the library's fingerprint); python3 -m lab.ab_summary DIR gives the medians per side.
D=/tmp/s20_${1:-a} NAME=s20 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
int8_2m() {  # TAG [ARGS...]
  local tag=$1; shift
  T=${T:-90} run $tag --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8 "$@"
}
host() { { uptime; nproc; lscpu | grep -E "Model name|MHz"; nvidia-smi -L; } > $D/host_$PART.txt 2>&1; }
share() { RKV_HOST_SHARE=1 "$@"; }
fused_share() { RKV_FUSED_DECODE=1 RKV_HOST_SHARE=1 "$@"; }
case "$PART" in
  a)
    host
    timeout 150 python3 -m pytest -q -m gpu tests/host_share_test.py tests/generate_test.py \
      tests/fused_decode_test.py -k "host_share or cuda" -p no:cacheprovider \
      > $D/pytest_host_share.txt 2>&1
    rc=$?; tail -2 $D/pytest_host_share.txt; echo "pytest rc=$rc"; pack
    [ $rc = 0 ] || exit 1  # no row runs a share whose GPU tests failed
    for i in 1 2; do
      int8_2m 2m_int8_default$i
      share int8_2m 2m_int8_share$i
      RKV_FUSED_DECODE=1 int8_2m 2m_int8_fused$i
      fused_share int8_2m 2m_int8_fused_share$i
    done
    ;;
  b)
    host
    for form in share fused_share; do
      T=150 $form int8_2m 2m_int8_${form}_split --split_cpu_tiles=2,3,4 --sweep_rounds=1
      XLA_FLAGS=--xla_gpu_enable_command_buffer= $form int8_2m 2m_int8_${form}_nocb
      RKV_CPU_TAIL_THREADS=12 $form int8_2m 2m_int8_${form}_threads12
    done
    RKV_TILES_ONE_PROGRAM=1 share int8_2m 2m_int8_share_one_program
    T=100 fused_share trace 2m_int8_fused_share --configs=beyond:2097152 --kv_dtype=int8 \
      --warmup=2 --steps=4 --trace_steps=2
    ;;
  c)
    host
    for form in default share fused_share; do
      pre=""; [ $form = default ] || pre=$form
      T=80 $pre run 1m_$form --configs=rkv_offload --budget=auto --contexts=1048576
      T=70 $pre run half128_$form --configs=rkv_offload --contexts=131072
      [ $form = share ] || T=80 $pre run b8_$form --configs=rkv_offload --budget=auto \
        --contexts=131072 --batch=8
    done
    timeout 200 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > $D/pytest_gpu.txt 2>&1
    tail -2 $D/pytest_gpu.txt; pack
    ;;
esac
echo "== done $(date +%T)"
