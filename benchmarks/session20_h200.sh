# The next GPU session's plan (written in sessions 19-21; parts a-d have not run on an H200:
# sessions 19-20 had no device time left, and in session 21 no H200 could be had in five tries).
# Session 19 measured the host share (RKV_HOST_SHARE=1) on the H200: exact, no faster. Session 20
# read its traces again (lab.trace_summary.copies_in_kernels, benchmarks/results/beyond_hbm/
# session20/): its layers put their tiles after their kernel had begun, and those puts waited
# 0.5-2.5 ms for their first copy; the link idled 1.4-1.6 ms a layer. The share's layers now put
# their first tiles before their query is made. Expected, written before it ran: puts wait ~0.15
# ms, the link idles well under 1 ms a layer, 7.5-8.2 tok/s at 2M int8 against ~6.4.
# Session 21 checked the mechanism on H100s (parts h, h2, h3 below; results in
# benchmarks/results/beyond_hbm/session21/): at 1M int8 with a 10 GiB tail (hybrid layers, like
# 2M int8 on the H200) the puts now wait 0.17 ms (the first half holds), but the link still idled
# 1.65 ms of a 6.8 ms traced layer, whose main thread was busy throughout (4 tiles put early,
# then a program per tile). With every tile put early and attended in one program
# (RKV_EARLY_PUT_ALL=1 RKV_TILES_ONE_PROGRAM=1) the link was busy 4.46 of a 5.02 ms traced layer;
# untraced, neither moved (6.65 / 6.54 tok/s medians): there the layer was already near the
# H100 host's PCIe time (~55 GB/s). The fused step with the share ran 14-23% slower in both H100
# parts that ran it, so part a now measures the one-program share in its place. At 2M int8 on the H200
# a layer streams 3 tiles (the lookahead is 4), so RKV_TILES_ONE_PROGRAM=1 alone applies there.
# Session 22 (no H200 in ten tries, then one at its end): parts h4-h6 on H100s took two host
# hand-offs off the default path (RKV_DIRECT_PUTS, RKV_CPU_OUT_PINNED; both on by default), and
# part a2 (part a cut to ~430 s of device time, then three runs typed by hand on the same
# machine: benchmarks/results/beyond_hbm/session22/h200_a2/README.md) measured them at 2M int8:
# 6.85 / 5.94 / 6.95 / 6.63 tok/s against 5.90 / 6.23 / 5.74 with both off. Parts a-d are still
# unrun on an H200 with this code.
# What to look for in part b's traces if the link still idles: a tile's copy whose device
# memory is the previous layer's tile (the allocator reuses the block just freed; the reserve is
# lean) waits on the GPU for that tile's partial, which the compute stream runs after the
# window's ~1.8 ms int8 kernel: a wait on the device, not on the host (LocalDeviceState::WaitFor
# spans on PJRT's threads, then the copy's late start on the H2D stream).
# Also unmeasured on the GPU since session 19: the append's offset as a device scalar in the
# fused step's head program, the share's start / wait on jit's C++ dispatch (no FFI effect), the
# share inside the fused step (five dispatches a layer).
# Each part is one device call (10 minutes at most), in order of what they decide:
#   bash benchmarks/session20_h200.sh a   # the share's -m gpu tests (stops if they fail); 2M
#                                         # int8 alternating default / share / share in one
#                                         # program (RKV_TILES_ONE_PROGRAM=1), twice, and the share with its tiles put
#                                         # after its start (SRC=ab_prev: git archive 59e5fb1,
#                                         # the code before the reorder; see below)
#   bash benchmarks/session20_h200.sh h   # part a on an H100 at 1M int8 (a tail like 2M int8's
#                                         # on the H200), where no H200 can be had
#   bash benchmarks/session20_h200.sh b   # the mechanism: traced share and one-program share
#                                         # steps at 2M int8 (then, here:
#                                         # python -m lab.trace_summary --only=copies_in_kernels
#                                         # and --only=layer_chain over b/x/); the one-program
#                                         # share with the kernel on 14 threads, with command
#                                         # buffers off (each update and launch of a small
#                                         # program's graph took 50-130 us of host time in
#                                         # session 19's traces) and its CPU share swept 2-4 tiles
#   bash benchmarks/session20_h200.sh c   # 1M, 128K half and B=8 x 128K, default and the
#                                         # one-program share (or the winner of a); 2M int8 on
#                                         # 16K-cell tiles, all put early, its CPU share swept
#   bash benchmarks/session20_h200.sh d   # if time is left: the int8 decode kernel alone
#                                         # against bf16 (experiments.kernel_bench --layers
#                                         # --kv_dtype=int8), three int8 tilings
# ab_prev/: git archive 59e5fb1 rkv lab experiments benchmarks/results/profile_h200_v3.json |
# tar -x -C ab_prev (ignored by git; carry it).
# If a share form wins: on by default (RKV_HOST_SHARE, and RKV_TILES_ONE_PROGRAM if that form
# wins), the table's hybrid rows re-measured with it and decode_beyond_hbm_h200.json recomposed
# (benchmarks/compose_beyond_hbm.py). Rows record host_share_layers (layers that ran a share) and
# code (the library's fingerprint); python3 -m lab.ab_summary DIR gives the medians per side.
D=/tmp/s20_${1:-a} NAME=s20 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
int8_2m() {  # TAG [ARGS...]
  local tag=$1; shift
  T=${T:-90} run $tag --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8 "$@"
}
share() { RKV_HOST_SHARE=1 "$@"; }
fused_share() { RKV_FUSED_DECODE=1 RKV_HOST_SHARE=1 "$@"; }
share_one() { RKV_TILES_ONE_PROGRAM=1 RKV_HOST_SHARE=1 "$@"; }
# 1M int8 with a 10 GiB tail on an H100: 32 hybrid layers, like 2M int8's on the H200 (parts h2-h5).
int1m_t10() { local tag=$1; shift; T=${T:-90} run $tag --configs=rkv_offload --budget=fraction \
  --offload_fraction=0.155 --contexts=1048576 --kv_dtype=int8 "$@"; }
# pytest on the device, $D/pytest_gpu.txt; the part stops at a failure (no rows after one).
gpu_tests() {
  timeout ${T:-150} python3 -m pytest -q -p no:cacheprovider "$@" > $D/pytest_gpu.txt 2>&1
  local rc=$?; tail -2 $D/pytest_gpu.txt; echo "pytest rc=$rc"; pack
  grep -E "^FAILED" $D/pytest_gpu.txt && exit 1
}
case "$PART" in
  a)
    host
    # The share's GPU tests only (the code changed since the last full -m gpu run, session 19,
    # is the share's put order): the full suite takes 150 s of a 10-minute call.
    T=120 gpu_tests -m gpu tests/ -k "host_share or fused or direct_put"
    # (tests/pinned_outputs_test.py and direct_put_test.py passed on an H100 in part h5)
    # Session 22: the tiles' direct put and the CPU share's pinned partial (both on by default;
    # RKV_DIRECT_PUTS=0 RKV_CPU_OUT_PINNED=0 is the code before them), alternating with the
    # one-program share (on both). On H100s (parts h4, h5) each shortened the main thread's
    # layer (put 0.31 vs ~0.7 ms, join 0.39 vs 0.54 ms), and those layers were held by the link.
    for i in 1 2; do
      int8_2m 2m_int8_default$i
      RKV_DIRECT_PUTS=0 RKV_CPU_OUT_PINNED=0 int8_2m 2m_int8_before$i
      RKV_TILES_ONE_PROGRAM=1 share int8_2m 2m_int8_share_one$i
    done
    share int8_2m 2m_int8_share
    # The kernel's team at nice 5 (last: cut first if the call runs out; no effect on the H100
    # in session 21, part h2): PJRT's threads take a core from it at once.
    RKV_CPU_KERNEL_NICE=5 share int8_2m 2m_int8_share_nice5
    ;;
  a2)
    # Part a cut to what ~430 s of device time holds (session 22's last): the two hand-offs
    # (both on, the default) against both off at 2M int8, alternating; no tests (parts h4/h5
    # ran tests/direct_put_test.py, tests/pinned_outputs_test.py and the share's on an H100).
    host
    for i in 1 2; do
      int8_2m 2m_int8_default$i
      RKV_DIRECT_PUTS=0 RKV_CPU_OUT_PINNED=0 int8_2m 2m_int8_before$i
    done
    ;;
  a3)
    # The runs typed by hand after part a2 on the same machine, as a part: two defaults (the
    # first was tagged 2m_int8_before3 by a slip, without the variables: its env says so, and
    # the results name it 2m_int8_default3a), then one with both hand-offs off.
    host
    int8_2m 2m_int8_default3a
    int8_2m 2m_int8_default3b
    RKV_DIRECT_PUTS=0 RKV_CPU_OUT_PINNED=0 int8_2m 2m_int8_before4
    ;;
  h)
    # Part a's A/B where no H200 could be had (session 21: three tries refused): on one H100
    # (80 GB), 1M int8 leaves a tail like 2M int8's on the H200 (~8 GiB against ~10-14), so the
    # layers are the same kind (window kernel + tail over PCIe and the CPU). A check of the
    # mechanism, not a row of the table (the profile's rates are the H200's).
    host
    T=200 gpu_tests -m gpu tests/ -k "host_share or fused"
    int1m() { local tag=$1; shift; T=${T:-90} run $tag --configs=rkv_offload --budget=auto \
      --contexts=1048576 --kv_dtype=int8 "$@"; }
    for i in 1 2; do
      int1m 1m_int8_default$i
      share int1m 1m_int8_share$i
      fused_share int1m 1m_int8_fused_share$i
    done
    SRC=ab_prev share int1m 1m_int8_share_s19
    RKV_CPU_KERNEL_NICE=5 share int1m 1m_int8_share_nice5
    ;;
  h2)
    # Part h ran every layer as a stream (a 4 GiB tail: no CPU share). Here the tail is set to
    # 2M int8's on the H200 (~10 GiB, 15.5% of 1M int8's 65 GiB), so the plan's layers are
    # hybrid and the share runs.
    host
    int1m_t10 1m_int8_t10_default1
    share int1m_t10 1m_int8_t10_share1
    SRC=ab_prev share int1m_t10 1m_int8_t10_share_s19
    RKV_CPU_KERNEL_NICE=5 share int1m_t10 1m_int8_t10_share_nice5
    int1m_t10 1m_int8_t10_default2
    share int1m_t10 1m_int8_t10_share2
    RKV_CPU_TAIL_THREADS=14 share int1m_t10 1m_int8_t10_share_threads14
    fused_share int1m_t10 1m_int8_t10_fused_share
    T=100 share trace 1m_int8_t10_share --configs=offload:1048576:0.155 --kv_dtype=int8 \
      --warmup=2 --steps=4 --trace_steps=2
    ;;
  h3)
    # Part h2's trace (H100, the main thread busy for the whole layer: 4 tiles put early, then a
    # program per tile) names the lever: every streamed tile put early and attended in one
    # program ($RKV_EARLY_PUT_ALL=1 RKV_TILES_ONE_PROGRAM=1), two programs a layer for its device
    # side instead of ~9. Expected: the layer's main thread ~2 ms shorter, ~6 ms -> ~4 ms, near
    # the link's ~4-5 ms a layer: 5.8 -> 7-7.5 tok/s.
    host
    one() { RKV_EARLY_PUT_ALL=1 RKV_TILES_ONE_PROGRAM=1 "$@"; }
    share int1m_t10 1m_int8_t10_share1
    one share int1m_t10 1m_int8_t10_share_one1
    one int1m_t10 1m_int8_t10_default_one
    share int1m_t10 1m_int8_t10_share2
    one share int1m_t10 1m_int8_t10_share_one2
    T=100 one share trace 1m_int8_t10_share_one --configs=offload:1048576:0.155 --kv_dtype=int8 \
      --warmup=2 --steps=4 --trace_steps=2
    ;;
  h4)
    # Session 22 (no H200 in three tries): the tiles' direct put on an H100, part h2's hybrid
    # layers (1M int8, a 10 GiB tail). Expected: the early put of 16 arrays ~1.5 -> ~0.4 ms of
    # the main thread (trace); untraced little, as h3's steps already sat at that host's link.
    host
    gpu_tests -m gpu tests/ -k "host_share or fused or direct_put"
    for i in 1 2; do
      int1m_t10 1m_int8_t10_default$i
      RKV_DIRECT_PUTS=0 int1m_t10 1m_int8_t10_dp0_$i
    done
    for dp in 1 0; do
      T=100 RKV_DIRECT_PUTS=$dp trace 1m_int8_t10_dp$dp --configs=offload:1048576:0.155 \
        --kv_dtype=int8 --warmup=2 --steps=4 --trace_steps=2
    done
    ;;
  h5)
    # Session 22: the CPU share's partial written into fresh pinned_host arrays (on by default;
    # RKV_CPU_OUT_PINNED=0 is the numpy partial). Part h4's trace: the join's launch blocked ~0.47
    # ms a layer until PJRT's thread had enqueued the numpy partial's transfer. Expected: that
    # wait gone from the trace (main_join ~0.5 -> ~0.2 ms); untraced little on this host, whose
    # layers are held by the link (busy 4.4 of 4.9 ms).
    host
    gpu_tests tests/pinned_outputs_test.py tests/direct_put_test.py
    for i in 1 2; do
      int1m_t10 1m_int8_t10_pinned$i
      RKV_CPU_OUT_PINNED=0 int1m_t10 1m_int8_t10_numpy$i
    done
    T=100 trace 1m_int8_t10_pinned --configs=offload:1048576:0.155 --kv_dtype=int8 \
      --warmup=2 --steps=4 --trace_steps=2
    ;;
  h6)
    # Session 22: the two hand-offs (direct put, pinned partial) on bf16 hybrid plans, that they
    # cost nothing there: 128K half-offloaded (an 8 GiB tail) and B=4 x 128K with 15.5% on the
    # host; "before" is both switched off.
    host
    before() { RKV_DIRECT_PUTS=0 RKV_CPU_OUT_PINNED=0 "$@"; }
    for i in 1 2; do
      T=70 run half128_default$i --configs=rkv_offload --contexts=131072
      T=70 before run half128_before$i --configs=rkv_offload --contexts=131072
    done
    T=80 run b4_default --configs=rkv_offload --contexts=131072 --batch=4 --budget=fraction \
      --offload_fraction=0.155
    T=80 before run b4_before --configs=rkv_offload --contexts=131072 --batch=4 \
      --budget=fraction --offload_fraction=0.155
    ;;
  b)
    host
    T=110 share trace 2m_int8_share --configs=beyond:2097152 --kv_dtype=int8 \
      --warmup=2 --steps=4 --trace_steps=2
    T=110 share_one trace 2m_int8_share_one --configs=beyond:2097152 --kv_dtype=int8 \
      --warmup=2 --steps=4 --trace_steps=2
    RKV_CPU_TAIL_THREADS=14 share_one int8_2m 2m_int8_share_one_threads14
    XLA_FLAGS=--xla_gpu_enable_command_buffer= share_one int8_2m 2m_int8_share_one_nocb
    T=150 share_one int8_2m 2m_int8_share_one_split --split_cpu_tiles=2,3,4 --sweep_rounds=1
    ;;
  c)
    host
    for form in default share_one; do
      pre=""; [ $form = default ] || pre=$form
      T=80 $pre run 1m_$form --configs=rkv_offload --budget=auto --contexts=1048576
      T=70 $pre run half128_$form --configs=rkv_offload --contexts=131072
      T=80 $pre run b8_$form --configs=rkv_offload --budget=auto --contexts=131072 --batch=8
    done
    # Finer tiles, every one put early and attended in one program: 16K-cell tiles (~6 streamed
    # a layer, past the lookahead of 4), the CPU share at the plan's count, 4 and 5.
    T=150 RKV_EARLY_PUT_ALL=1 share_one int8_2m 2m_int8_share_one_tile16k --tile_cells=16384 \
      --split_cpu_tiles=4,5 --sweep_rounds=1
    ;;
  d)
    # The int8 decode kernel alone (32 layers in one program, each over its own K/V), against
    # the bf16 kernel at the same contexts, and three int8 tilings: in the 2M int8 traces the
    # int8 window read 2.16 TB/s against bf16's 4.31 at the same cells (docs/DESIGN.md §7).
    host
    for kv in native int8; do
      echo "== kernel $kv $(date +%T)"
      PYTHONPATH=$PWD timeout 150 python3 -m experiments.kernel_bench --layers=32 \
        --contexts=131072,524288 --kv_dtype=$kv --out=$D/kernel_layers_$kv.json \
        --sweep_decode='[{"block_k": 64}, {"block_k": 64, "num_warps": 8}, {"num_warps": 8}]' \
        2>&1 | grep -E "TB/s|Error" | tail -12
      pack
    done
    ;;
esac
echo "== done $(date +%T)"
