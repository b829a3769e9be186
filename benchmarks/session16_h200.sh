# Session 16 on the H200: the input embedding table in host RAM (rkv.models.embedding_to_host,
# decode_bench --embedding), and why today's machines ran the offloaded rows slower. Each part is
# one device call (10 minutes at most); a, b, c-f and g ran on three machines (c-f on one):
#   bash benchmarks/session16_h200.sh a   # GPU tests of HostEmbed; 1M device vs host vs host
#                                         # with 20480-cell tiles (3 a layer instead of 2)
#   bash benchmarks/session16_h200.sh b   # B=8 x 128K and 2M int8, device vs host
#   bash benchmarks/session16_h200.sh c   # part a's 1M rows again on another machine, device
#                                         # first and last (a's machine ran 7.04 tok/s device,
#                                         # its steps waited for 4.65: far slower than before)
#   bash benchmarks/session16_h200.sh d   # that machine's load and CPU, then a traced 1M step
#   bash benchmarks/session16_h200.sh e   # 1M planned with the shipped v3 profile (and every
#                                         # layer's CPU share 0, alternating, on the same fill),
#                                         # a probe of this machine, 1M planned with the probe's
#                                         # profile. Note: a-e ran with decode_bench's
#                                         # --embedding=auto of then (host RAM for these rows
#                                         # unless --embedding=device); the default is now device
#   bash benchmarks/session16_h200.sh f   # a probe, then 1M (embedding on the device, then on
#                                         # the host), B=8 x 128K and 2M int8 planned with it
#   bash benchmarks/session16_h200.sh g   # on a fresh machine: a probe, then 1M planned with
#                                         # the shipped v3 profile and with the probe's
#   part h (run as one command, not through this script): the GPU-only tests at this
#   session's code: timeout 280 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider
#   (33 passed in 159.4 s, h/pytest_gpu.txt)
# Results: benchmarks/results/beyond_hbm/session16/{a..h}/.
D=/tmp/s16 NAME=s16 PART=${1:-a}
source "$(dirname "$0")/h200_common.sh"
case "$PART" in
  a)
    echo "== pytest host_embed $(date +%T)"
    timeout 120 python3 -m pytest -q tests/host_embed_test.py -p no:cacheprovider \
      > $D/pytest_host_embed.txt 2>&1
    tail -1 $D/pytest_host_embed.txt; pack
    T=110 run 1m_dev --configs=rkv_offload --budget=auto --contexts=1048576 --embedding=device
    T=110 run 1m_host --configs=rkv_offload --budget=auto --contexts=1048576 --embedding=host
    T=110 run 1m_host_t20k --configs=rkv_offload --budget=auto --contexts=1048576 \
      --embedding=host --tile_cells=20480
    ;;
  b)
    T=110 run b8_host --configs=rkv_offload --budget=auto --contexts=131072 --batch=8 \
      --embedding=host
    T=110 run b8_dev --configs=rkv_offload --budget=auto --contexts=131072 --batch=8 \
      --embedding=device
    T=150 run 2m_int8_dev --configs=rkv_offload --budget=auto --contexts=2097152 \
      --kv_dtype=int8 --embedding=device
    T=150 run 2m_int8_host --configs=rkv_offload --budget=auto --contexts=2097152 \
      --kv_dtype=int8 --embedding=host
    ;;
  c)
    T=110 run 1m_dev --configs=rkv_offload --budget=auto --contexts=1048576 --embedding=device
    T=110 run 1m_host --configs=rkv_offload --budget=auto --contexts=1048576 --embedding=host
    T=110 run 1m_host_t20k --configs=rkv_offload --budget=auto --contexts=1048576 \
      --embedding=host --tile_cells=20480
    T=110 run 1m_dev2 --configs=rkv_offload --budget=auto --contexts=1048576 --embedding=device
    ;;
  d)
    { uptime; nproc; lscpu | grep -E "Model name|MHz|^CPU\(s\)|Thread|NUMA"; \
      top -bn1 | head -25; } > $D/host_load.txt 2>&1
    head -12 $D/host_load.txt; pack
    T=170 trace 1m --configs=beyond:1048576 --warmup=2 --steps=4 --trace_steps=2
    { uptime; top -bn1 | head -12; } > $D/host_load_after.txt 2>&1; pack
    ;;
  e)
    { uptime; lscpu | grep -E "Model name|MHz"; } > $D/host_e.txt 2>&1
    T=140 run 1m_v3 --configs=rkv_offload --budget=auto --contexts=1048576 --split_cpu_tiles=0
    echo "== probe $(date +%T)"
    PYTHONPATH=$PWD timeout 230 python3 -m experiments.probe --out=$D/profile_probe.json 2>&1 \
      | q | tail -2; pack
    [ -f $D/profile_probe.json ] && P=$D/profile_probe.json T=110 run 1m_probed \
      --configs=rkv_offload --budget=auto --contexts=1048576
    ;;
  f)
    echo "== probe $(date +%T)"
    PYTHONPATH=$PWD timeout 90 python3 -m experiments.probe --out=$D/profile_probe.json 2>&1 \
      | q | tail -1; pack
    if [ -f $D/profile_probe.json ]; then
      export P=$D/profile_probe.json
      T=110 run 1m_dev --configs=rkv_offload --budget=auto --contexts=1048576 --embedding=device
      T=110 run 1m_host --configs=rkv_offload --budget=auto --contexts=1048576 --embedding=host
      T=110 run b8 --configs=rkv_offload --budget=auto --contexts=131072 --batch=8 \
        --embedding=device
      T=150 run 2m_int8 --configs=rkv_offload --budget=auto --contexts=2097152 --kv_dtype=int8 \
        --embedding=device
    fi
    ;;
  g)
    { uptime; lscpu | grep -E "Model name|MHz"; } > $D/host_g.txt 2>&1
    echo "== probe $(date +%T)"
    PYTHONPATH=$PWD timeout 90 python3 -m experiments.probe --out=$D/profile_probe.json 2>&1 \
      | q | tail -1; pack
    T=110 run 1m_v3 --configs=rkv_offload --budget=auto --contexts=1048576
    [ -f $D/profile_probe.json ] && P=$D/profile_probe.json T=110 run 1m_probed \
      --configs=rkv_offload --budget=auto --contexts=1048576
    ;;
esac
echo "== done $(date +%T)"
