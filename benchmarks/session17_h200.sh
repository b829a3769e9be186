# Session 17 on the H200: int8 caches with bfloat16 scales (rkv.cache.DEFAULT_SCALE_DTYPE; 2084
# bytes a cell-layer at Llama-3-8B's shape instead of 2116), gated on the GPU and measured against
# float32 scales ($RKV_INT8_SCALE_DTYPE=float32, the old format: planner and caches alike) on one
# machine, alternating. Each part is one device call (10 minutes at most):
#   bash benchmarks/session17_h200.sh a   # the GPU-only tests (the int8 1M-layer gates with
#                                         # bfloat16 scales among them), then 2M int8 with
#                                         # bfloat16 scales, then float32
#   bash benchmarks/session17_h200.sh b   # the machine's host and a probe, then 2M int8 float32
#                                         # scales, then bfloat16 (the other order), then a
#                                         # traced 2M int8 step with bfloat16 scales
#   bash benchmarks/session17_h200.sh c   # 2M int8 (bfloat16 scales) on one machine: the
#                                         # default step, the fused decode step
#                                         # (RKV_FUSED_DECODE=1: the int8 append's quantization
#                                         # inside the layer's head program), each planned on
#                                         # v3 and on this machine's probe, the default again
#   bash benchmarks/session17_h200.sh d   # 2M int8 on one machine, alternating: this code
#                                         # (an int8 decode append is one program, the window
#                                         # and staging partials one dispatch) against
#                                         # 8e46316's (two each; its
#                                         # tree in ab_prev/, made by `git archive 8e46316 rkv
#                                         # lab experiments benchmarks/results/profile_h200_v3.json`,
#                                         # not committed), twice each; then the fused decode
#                                         # step (RKV_FUSED_DECODE=1) and the CPU kernel on 12
#                                         # threads (4 cores left to the dispatching threads)
#   part e (one command, not through this script): the GPU-only tests at this session's last
#   library code (0fa601c's: ae578a5's with two lines reflowed):
#   timeout 200 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider (36 passed in 146.2 s)
# Rows are planned on the shipped v3 profile, like the table's, unless named _probed. Results:
# benchmarks/results/beyond_hbm/session17/{a,b}/.
D=/tmp/s17 NAME=s17 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
int8_2m() {  # TAG SCALE_DTYPE
  RKV_INT8_SCALE_DTYPE=$2 T=150 run $1 --configs=rkv_offload --budget=auto --contexts=2097152 \
    --kv_dtype=int8
}
case "$PART" in
  a)
    echo "== pytest -m gpu $(date +%T)"
    timeout 250 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > $D/pytest_gpu.txt 2>&1
    tail -3 $D/pytest_gpu.txt; pack
    int8_2m 2m_int8_bf16 bfloat16
    int8_2m 2m_int8_f32 float32
    ;;
  b)
    { uptime; nproc; lscpu | grep -E "Model name|MHz"; } > $D/host_b.txt 2>&1
    echo "== probe $(date +%T)"
    PYTHONPATH=$PWD timeout 90 python3 -m experiments.probe --out=$D/profile_probe.json 2>&1 \
      | q | tail -1; pack
    int8_2m 2m_int8_f32 float32
    int8_2m 2m_int8_bf16 bfloat16
    T=170 trace 2m_int8_bf16 --configs=beyond:2097152 --kv_dtype=int8 --warmup=2 --steps=4 \
      --trace_steps=2
    ;;
  c)
    { uptime; nproc; lscpu | grep -E "Model name|MHz"; } > $D/host_c.txt 2>&1
    echo "== probe $(date +%T)"
    PYTHONPATH=$PWD timeout 90 python3 -m experiments.probe --out=$D/profile_probe.json 2>&1 \
      | q | tail -1; pack
    int8_2m 2m_int8_bf16 bfloat16
    RKV_FUSED_DECODE=1 int8_2m 2m_int8_bf16_fused bfloat16
    if [ -f $D/profile_probe.json ]; then
      P=$D/profile_probe.json int8_2m 2m_int8_bf16_probed bfloat16
      P=$D/profile_probe.json RKV_FUSED_DECODE=1 int8_2m 2m_int8_bf16_fused_probed bfloat16
    fi
    int8_2m 2m_int8_bf16_again bfloat16
    ;;
  d)
    { uptime; nproc; lscpu | grep -E "Model name|MHz"; } > $D/host_d.txt 2>&1
    int8_2m 2m_int8_new1 bfloat16
    SRC=ab_prev int8_2m 2m_int8_prev1 bfloat16
    int8_2m 2m_int8_new2 bfloat16
    SRC=ab_prev int8_2m 2m_int8_prev2 bfloat16
    RKV_FUSED_DECODE=1 int8_2m 2m_int8_fused bfloat16
    RKV_CPU_TAIL_THREADS=12 int8_2m 2m_int8_threads12 bfloat16
    ;;
esac
echo "== done $(date +%T)"
