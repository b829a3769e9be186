#!/usr/bin/env bash
# Prepared in session 12 for session 13; parts b, c and d ran in session 14 (2K / 32K only, see
# benchmarks/session14_h200.sh d and e; results in beyond_hbm/session14/), part a did not run.
# After session 12 the resident decode-attention call is three kernels (benchmarks/results/beyond_hbm/session12/c/ncu_summary.txt), and
# what stands between resident 2K / 32K and 1.15x is the step's GEMMs (~0.88 of the copy rate),
# ~14 us of small kernels a layer (norms, residual adds, RoPE, the cache writes; session 10's 2K
# trace) and, at short contexts, the decode kernel's latency: at 2K it reads 4 MB in 13.8 us
# (0.29 TB/s) with 32 programs of 8 iterations each, because no split is shorter than 512 keys
# (_MIN_KEYS_PER_SPLIT). Session 11's split sweep (session11/c/) found no faster split count, but
# then every extra split added work to the XLA merge; the merge kernel takes up to 128 splits in
# one masked load.
#   part a: decode attention as a step issues it (32 layers in one program) at 2K / 8K / 32K / 128K
#           for 8 / 16 / 33 / 66 splits against the default count; Nsight Compute on 2K with the
#           default and 16 splits. If more splits win at short contexts, lower _MIN_KEYS_PER_SPLIT
#           and A/B resident 2K / 32K against this commit (SRC=out/base, as session 12 part a).
#   part b: XLA's own fusion of the ~14 us of small kernels a layer (session 10's 2K trace: each
#           RMSNorm is a reduce and a multiply, the residual adds and RoPE their own loops, ~1.3 us
#           each). jaxlib 0.11.2 carries two flags that may fuse such normalization diamonds into
#           block-level Triton fusions: resident 2K / 32K / 128K with each, against the defaults,
#           alternating over two rounds; then a traced 2K step with the faster one (kernels a
#           step, their time). If one wins, rkv sets it beside the command-buffer flags
#           (rkv/_env.py).
#   part c: the model-level A/B for part a without a library knob: copies of this tree with
#           _MIN_KEYS_PER_SPLIT at 128 and 256 (sed on the copy in /tmp), resident 2K / 8K / 32K
#           alternating with this tree over two rounds (SRC=, as session 12 part a).
#   part d: the opt-in fused residual add + RMSNorm kernel (rkv/pallas/rms_norm.py, session 12:
#           tested against float64 and the models' tokens and logits, Triton IR verified, not
#           timed): resident 2K / 32K / 128K with RKV_FUSED_NORM=1 against the defaults,
#           alternating over two rounds. Run it beside part b: if XLA's flags fuse the norms
#           themselves, the kernel goes.
# Usage: bash benchmarks/session13_h200.sh a|b|c|d. Results: benchmarks/results/beyond_hbm/session13/.
D=/tmp/s13 NAME=s13 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
case "$PART" in
  a)
    echo "== kernel layers $(date +%T)"
    PYTHONPATH=$PWD timeout 300 python3 -m experiments.kernel_bench --layers=32 \
      --contexts=2048,8192,32768,131072 --out=$D/kernel_layers_splits.json --sweep_decode='[
        {"num_splits": 8}, {"num_splits": 16}, {"num_splits": 33}, {"num_splits": 66}]' \
      2>&1 | q | grep -E "S=|rror" | tail -30
    pack
    ncu_calls 120 '[[2048, {"kv_fill": true}], [2048, {"kv_fill": true, "num_splits": 16}]]'
    ;;
  b)
    BLR=--xla_gpu_experimental_enable_fusion_block_level_rewriter=true
    HPF=--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true
    res() { local tag=$1; shift; T=${T:-100} run res_$tag --configs=rkv_resident \
              --contexts=2048,32768,131072 "$@"; }
    for round in 1 2; do
      res base_$round
      XLA_FLAGS=$BLR res blr_$round
      XLA_FLAGS=$HPF res hpf_$round
    done
    T=120 trace res2k_base --configs=resident:2048
    XLA_FLAGS=$BLR T=120 trace res2k_blr --configs=resident:2048
    ;;
  c)
    for keys in 128 256; do
      rm -rf /tmp/min$keys && mkdir -p /tmp/min$keys/benchmarks/results
      cp -r rkv experiments lab /tmp/min$keys/ && cp $P /tmp/min$keys/benchmarks/results/
      sed -i "s/^_MIN_KEYS_PER_SPLIT = 512$/_MIN_KEYS_PER_SPLIT = $keys/" \
        /tmp/min$keys/rkv/pallas/decode_attention.py
      grep -q "^_MIN_KEYS_PER_SPLIT = $keys$" /tmp/min$keys/rkv/pallas/decode_attention.py \
        || { echo "the constant moved: fix the sed"; exit 1; }
    done
    res() { local tag=$1; shift; T=${T:-100} run res_$tag --configs=rkv_resident \
              --contexts=2048,8192,32768 "$@"; }
    for round in 1 2; do
      res min512_$round
      SRC=/tmp/min128 res min128_$round
      SRC=/tmp/min256 res min256_$round
    done
    ;;
  d)
    res() { local tag=$1; shift; T=${T:-100} run res_$tag --configs=rkv_resident \
              --contexts=2048,32768,131072 "$@"; }
    for round in 1 2; do
      res base_$round
      RKV_FUSED_NORM=1 res fusednorm_$round
    done
    ;;
esac
echo "== done $(date +%T)"
