# Shared by the H200 scripts from session 7 on (sourced, not run): after setting D (the results
# folder on the device), NAME (the $OUT archive's prefix) and PART, and optionally P (the profile).
#   host              the machine's load, cores, CPU model and clocks and GPU, at
#                     $D/host_$PART.txt (the share's speed follows the host: say which ran a row)
#   pack              archive $D as $OUT/${NAME}_$PART.tgz (after every step: a call cut short by
#                     its time limit still returns what finished)
#   run TAG ARGS...   one experiments.decode_bench call, its JSON at $D/TAG.json; with SRC=DIR
#                     the call runs from DIR (another tree of the code, e.g. the last commit's
#                     for an A/B in one machine; it must hold the profile $P)
#   trace TAG ARGS... one experiments.decode_trace call, $D/trace_TAG.json, raw trace in $D/x/TAG
#   ncu_calls SECONDS RUNS_JSON
#                     experiments.ncu_decode under Nsight Compute ($D/ncu_decode.csv), then its
#                     summary ($D/ncu_summary.txt); the device not preallocated (ncu saves what a
#                     replayed kernel writes) and command buffers off (ncu profiles kernels)
# ${T:-...} bounds each call's seconds.
set -uo pipefail
export PYTHONUNBUFFERED=1
P=${P:-benchmarks/results/profile_h200_v3.json}
mkdir -p $D/x
host() {
  { uptime; nproc; lscpu | grep -E "Model name|MHz"; nvidia-smi -L; } > $D/host_$PART.txt 2>&1
}
pack() { tar czf $OUT/${NAME}_$PART.tgz -C $D . 2>/dev/null; }
q() { grep -v -i warn | grep -v "residency.py.*layer [1-9]" | grep -v "^I1\|^W1"; }
trace() {
  local tag=$1; shift
  echo "== trace $tag $(date +%T)"
  PYTHONPATH=$PWD timeout ${T:-140} python3 -m experiments.decode_trace \
    --profile=$P --out=$D/trace_$tag.json --xplane_dir=$D/x/$tag "$@" 2>&1 | q | tail -3
  pack
}
run() {
  local tag=$1; shift
  echo "== $tag $(date +%T)"
  (cd ${SRC:-.} && PYTHONPATH=$PWD timeout ${T:-120} python3 -m experiments.decode_bench \
     --profile=$P --plot= --out=$D/$tag.json "$@" 2>&1) | q | grep -E "tok/s|Error|error" | tail -4
  pack
}
NCU_SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
  --section WarpStateStats --section LaunchStats --section SchedulerStats"
ncu_calls() {
  echo "== ncu $(date +%T)"
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 \
  XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=$PWD timeout $1 ncu --clock-control none \
    --profile-from-start off $NCU_SECTIONS --csv --page details python3 -m experiments.ncu_decode \
    --runs="$2" > $D/ncu_decode.csv 2> $D/ncu_decode.err
  echo "rc=$? $(grep -c '"Duration"' $D/ncu_decode.csv) kernels"; tail -3 $D/ncu_decode.err
  PYTHONPATH=$PWD python3 -m experiments.ncu_summary --csv=$D/ncu_decode.csv > $D/ncu_summary.txt
  grep -E "===|Duration|Memory Throughput|Shared Mem|Registers|Achieved Occ|Eligible Warps" \
    $D/ncu_summary.txt
  pack
}
