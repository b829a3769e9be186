#!/usr/bin/env bash
# Same-run A/B of the tree before this session (old_tree/: git archive 55a43bd) against HEAD on the
# rows issue 11 must not slow: the CPU tail kernel (tactics_bench, cpu tactic) and decode
# (resident and half-offloaded, 2K/128K). JSON in $OUT.
export PYTHONUNBUFFERED=1
P=benchmarks/results/profile_h200_v3.json
q() { grep -v -i warn | grep -v "^I1\|^W1"; }
tb() { (cd $1 && PYTHONPATH=$PWD timeout 100 python3 -m experiments.tactics_bench --contexts=262144,1048576 --tactics=cpu --profile=$P --out=$OUT/tb_$2.json 2>&1 | q | grep -A6 "CPU kernel read"); }
db() { (cd $1 && PYTHONPATH=$PWD timeout 150 python3 -m experiments.decode_bench --configs=rkv_resident,rkv_offload --contexts=2048,131072 --profile=$P --plot= --out=$OUT/db_$2.json 2>&1 | q | grep "tok/s" | tail -4); }
tb . new1; tb old_tree old; tb . new2
db old_tree old; db . new
