# Session 25's GPU plan: the table's offloaded rows under today's default (the host share on a
# GPU, plans made with the profile's fitted fixed cost), each against the Python worker
# (RKV_HOST_SHARE=0) in the same process: the two share a plan, so --sweep_env alternates them.
# Expected, written before it ran: the share ahead of the worker by x1.0-1.4 at every row
# (session 24's H200 at the same splits: 2M int8 x1.39, 1M hybrid x1.04, 128K half x1.03); 2M
# int8 near its 7.95 tok/s bound on a host like the table's (the worker ran 6.63 there).
# Not run in session 25 (none of ten H200 starts and three H100 starts came) nor in session 26
# (none of ten H200 starts and two H100 starts came; four more asks met the 10-minute lock-out)
# nor in session 27 (none of ten H200 starts and four H100 starts came, nine asks met the
# lock-out; an H100 came at the end with 378 s left: the GPU tests and two short runs of part g's
# row, beyond_hbm/session27/) nor in session 28 (no H200 and no H100 start came) nor in session
# 29 (ten H200 asks failed or met the lock-out; an H100 came: part g, then part h's question and
# a trace, beyond_hbm/session29/) nor in session 30 (ten H200 starts failed, one ask met the
# lock-out, then no machine was lent) nor in session 31 (twelve H200 starts failed) nor in
# session 32 (nine H200 starts failed, then no machine was lent): the H200 parts are still to
# run; part a (or a2, a3, a1) first.
#   bash benchmarks/session25_h200.sh a   # 2M int8, 1M, 128K half: default against the worker;
#                                         # then pytest -m gpu in what is left of ten minutes
#   bash benchmarks/session25_h200.sh a1  # part a's 2M int8 row alone (one round)
#   bash benchmarks/session25_h200.sh a2  # a probe, part a's 2M int8 row, 2M int8 on the probe
#   bash benchmarks/session25_h200.sh a3  # a2 in one round each
#   bash benchmarks/session25_h200.sh b   # pytest -m gpu under the default; B=8; 512K half
#   bash benchmarks/session25_h200.sh c   # a fresh probe (the share's fixed cost); 2M int8 trace;
#                                         # 2M int8 planned on the probe, RKV_HOST_SHARE=1
#   bash benchmarks/session25_h200.sh g   # pytest -m gpu on any GPU, then 1M int8 (10 GiB tail)
#   bash benchmarks/session25_h200.sh h   # an H100: probe, 1M int8 planned on it, pytest -m gpu
D=/tmp/s25_${1:-a} NAME=s25 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
W0=RKV_HOST_SHARE=0
case "$PART" in
  a)
    host
    T=170 run 2m_int8 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8 \
      --sweep_env=$W0 --sweep_rounds=3
    T=110 run 1m --configs=rkv_offload --budget=auto --contexts=1048576 --split_cpu_tiles=2 \
      --sweep_env=$W0 --sweep_rounds=2
    T=100 run half128 --configs=rkv_offload --budget=fraction --contexts=131072 \
      --split_cpu_tiles=2 --sweep_env=$W0 --sweep_rounds=3
    # What is left of a ten-minute call goes to the GPU tests under the default (part b has them
    # whole).
    echo "== pytest -m gpu $(date +%T)"
    timeout $((570 - SECONDS)) python3 -m pytest -q -m gpu tests/ -p no:cacheprovider \
      > $D/pytest_gpu.txt 2>&1
    tail -3 $D/pytest_gpu.txt; pack
    ;;
  a1)
    # Part a's first row alone, for a call with little device time left.
    host
    T=120 run 2m_int8 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8 \
      --sweep_env=$W0 --sweep_rounds=1
    ;;
  a2|a3)
    # Session 29, for a call with ~8 (a2) or ~5 (a3: one round each) minutes left: a fresh probe
    # (~15 s on an H100), part a's 2M int8 row (the table's profile, the default against the
    # worker), then 2M int8 planned on the probe beside the next split. RKV_HOST_SHARE=1 plans
    # with the smaller of the probe's share cost and its worker cost; on an H100 in session 29
    # the probe's rates planned the fastest split, the table's profile one ~10% slower
    # (beyond_hbm/session29/).
    if [ $PART = a2 ]; then R=2 TP=120 T1=150 T2=170 S=2,3; else R=1 TP=90 T1=110 T2=110 S=3; fi
    host
    echo "== probe $(date +%T)"
    PYTHONPATH=$PWD timeout $TP python3 -m experiments.probe --out=$D/profile_h200_v4.json \
      2>&1 | q | tail -3; pack
    T=$T1 run 2m_int8 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8 \
      --sweep_env=$W0 --sweep_rounds=$R
    [ -f $D/profile_h200_v4.json ] && (export RKV_HOST_SHARE=1 P=$D/profile_h200_v4.json; \
      T=$T2 run 2m_int8_probed --configs=rkv_offload --budget=auto --contexts=2097152 \
      --kv_dtype=int8 --split_cpu_tiles=$S --sweep_rounds=$R)
    ;;
  b)
    host
    echo "== pytest -m gpu $(date +%T)"
    timeout 170 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > $D/pytest_gpu.txt 2>&1
    tail -3 $D/pytest_gpu.txt; pack
    T=110 run b8 --configs=rkv_offload --budget=auto --contexts=131072 --batch=8 \
      --sweep_env=$W0 --sweep_rounds=2
    T=150 run half512 --configs=rkv_offload --budget=fraction --contexts=524288 \
      --sweep_env=$W0 --sweep_rounds=2
    ;;
  c)
    host
    echo "== probe $(date +%T)"
    PYTHONPATH=$PWD timeout 200 python3 -m experiments.probe --out=$D/profile_h200_v4.json \
      2>&1 | q | tail -5; pack
    T=120 trace 2m_int8 --configs=beyond:2097152 --kv_dtype=int8 --warmup=2 --steps=4 \
      --trace_steps=2
    # 2M int8 planned on the fresh probe with RKV_HOST_SHARE=1 (the smaller of its share and
    # worker costs), beside the splits around it and the worker: the H200's half of part h's
    # question.
    [ -f $D/profile_h200_v4.json ] && (export RKV_HOST_SHARE=1 P=$D/profile_h200_v4.json; \
      T=170 run 2m_int8_probed --configs=rkv_offload --budget=auto --contexts=2097152 \
      --kv_dtype=int8 --split_cpu_tiles=2,3 --sweep_env=$W0 --sweep_rounds=2)
    ;;
  g)
    # The GPU tests under the default first, on whichever GPU comes (an H100 where no H200 does),
    # then part h's row in what is left.
    host
    echo "== pytest -m gpu $(date +%T)"
    timeout 200 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > $D/pytest_gpu.txt 2>&1
    tail -3 $D/pytest_gpu.txt; pack
    T=170 run 1m_int8_t10 --configs=rkv_offload --budget=fraction --offload_fraction=0.155 \
      --contexts=1048576 --kv_dtype=int8 --split_cpu_tiles=4 --sweep_env=$W0 --sweep_rounds=2
    ;;
  h)
    # Where no H200 comes, on one H100: a fresh probe (with the share's fixed cost,
    # share_overhead_us), then 1M int8 with a 10 GiB tail (32 hybrid layers, like 2M int8's on
    # the H200) planned on it with RKV_HOST_SHARE=1 (the smaller of the probed share and worker
    # costs), beside other splits and the Python worker: does the probe plan the split that runs
    # fastest? (Session 29: yes, by its rates; beyond_hbm/session29/.) Session 24's
    # H100 (estimated cost): 3 of 7 CPU tiles 8.13 tok/s, 4 9.30, the fitted cost's 2 6.63.
    host
    echo "== probe $(date +%T)"
    PYTHONPATH=$PWD timeout 200 python3 -m experiments.probe --out=$D/profile_probe.json 2>&1 \
      | q | tail -3; pack
    [ -f $D/profile_probe.json ] && export P=$D/profile_probe.json
    (export RKV_HOST_SHARE=1; T=170 run 1m_int8_t10 --configs=rkv_offload --budget=fraction \
      --offload_fraction=0.155 --contexts=1048576 --kv_dtype=int8 --split_cpu_tiles=2,4 \
      --sweep_env=$W0 --sweep_rounds=2)
    echo "== pytest -m gpu $(date +%T)"
    timeout $((570 - SECONDS)) python3 -m pytest -q -m gpu tests/ -p no:cacheprovider \
      > $D/pytest_gpu.txt 2>&1
    tail -3 $D/pytest_gpu.txt; pack
    ;;
esac
echo "== done $(date +%T)"
