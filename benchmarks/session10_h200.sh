#!/usr/bin/env bash
# Issue 10, tenth session, on one H200: the resident rows' GPU time. Every file goes to /tmp/s10
# and is packed into $OUT/s10_<part>.tgz after each step.
#   part a: decode attention as a step runs it (32 calls over distinct K/V in one program,
#           experiments.kernel_bench --layers) at 2K / 8K / 32K / 128K: the default BlockSizes,
#           a sweep of splits, block_k, stages, the chain merge with the in-kernel query pack,
#           against cuDNN and XLA; a trace of a resident 32K step; resident 2K / 32K with XLA's
#           Triton GEMMs off (cuBLAS) against the default, alternating.
#   part b: XLA's command buffers (CUDA graphs) with custom calls (the Pallas kernels) captured
#           too, against rkv's default (off): resident 2K / 32K / 128K, alternating; one traced
#           resident 2K step with them (the host's launch time).
#   part c: B=8 x 128K under the default budget as one batch against the same rows as two
#           caches of 4, decoded one after the other and at once in two threads (the second
#           with 7 CPU-kernel threads each), two rounds (experiments.microbatch_probe).
#   part d: resident 2K / 32K / 128K: command buffers (as part b) with the decode step donating
#           its tokens and positions too ($RKV_DONATE_STEP_IO=1: every buffer the step writes is
#           one it was given, so a captured graph need not be updated between steps), against
#           command buffers alone, donation alone and neither.
#   part e (ran first thing in the eleventh session, at 5a40c2e; results in session10/e/): the
#           shipped code (command buffers with custom calls on by default, the decode step
#           donating its tokens and positions; part d's "cbdon" rows are its resident figures):
#           128K half-offloaded with command buffers on (the default) and off; the GPU-only
#           tests (33 passed).
# Parts a, b and d compare against the defaults of their time (command buffers off, the step's
# tokens not donated; $RKV_DONATE_STEP_IO an A/B switch since removed): to reproduce them run the
# script at the commit that ran them (a, b: e2d015d; d: 578f2a7). At later commits both are the
# defaults, so their "base"/"off" rows would need XLA_FLAGS=--xla_gpu_enable_command_buffer= and
# "don"/"cb" rows cannot be separated. Parts c and e run as they are.
# Usage: bash benchmarks/session10_h200.sh a|b|c|d|e
D=/tmp/s10 NAME=s10 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
SWEEP='[{"num_splits": 8}, {"num_splits": 16}, {"num_splits": 33}, {"num_splits": 66},
        {"num_splits": 132}, {"block_k": 128}, {"num_stages": 4},
        {"split_merge": "chain", "query_pack": "kernel"}]'
res() { local tag=$1; shift; T=${T:-100} run res_$tag --configs=rkv_resident \
          --contexts=2048,32768 "$@"; }
case "$PART" in
  a)
    echo "== kernel layers $(date +%T)"
    PYTHONPATH=$PWD timeout 300 python3 -m experiments.kernel_bench --layers=32 \
      --contexts=2048,8192,32768,131072 --sweep_decode="$SWEEP" --out=$D/kernel_layers.json \
      2>&1 | q | grep -E "S=|rror" | tail -60
    pack
    T=120 trace res32k --configs=resident:32768
    res base_1
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false res cublas_1
    res base_2
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false res cublas_2
    ;;
  b)
    CB=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN
    res3() { local tag=$1; shift; T=${T:-100} run res_$tag --configs=rkv_resident \
               --contexts=2048,32768,131072 "$@"; }
    res3 off_1
    XLA_FLAGS=$CB res3 cb_1
    res3 off_2
    XLA_FLAGS=$CB res3 cb_2
    XLA_FLAGS=$CB T=120 trace res2k_cb --configs=resident:2048
    ;;
  d)
    CB=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN
    res3() { local tag=$1; shift; T=${T:-100} run res_$tag --configs=rkv_resident \
               --contexts=2048,32768,131072 "$@"; }
    XLA_FLAGS=$CB RKV_DONATE_STEP_IO=1 res3 cbdon_1
    XLA_FLAGS=$CB res3 cb_1
    RKV_DONATE_STEP_IO=1 res3 don_1
    res3 off_1
    XLA_FLAGS=$CB RKV_DONATE_STEP_IO=1 res3 cbdon_2
    res3 off_2
    ;;
  e)
    OFF=--xla_gpu_enable_command_buffer=
    T=70 run half128_on --configs=rkv_offload --contexts=131072
    XLA_FLAGS=$OFF T=70 run half128_off --configs=rkv_offload --contexts=131072
    echo "== pytest -m gpu $(date +%T)"
    timeout 160 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > $D/pytest_gpu.txt 2>&1
    tail -3 $D/pytest_gpu.txt
    pack
    ;;
  c)
    echo "== microbatch $(date +%T)"
    PYTHONPATH=$PWD timeout 480 python3 -m experiments.microbatch_probe --batch=8 \
      --microbatches=2 --context=131072 --profile=$P --cpu_threads=7 --repeats=2 \
      --out=$D/microbatch.json 2>&1 | q | grep -E "tok/s|rror|Trace" | tail -30
    pack
    ;;
esac
echo "== done $(date +%T)"
