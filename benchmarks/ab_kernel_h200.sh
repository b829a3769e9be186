#!/usr/bin/env bash
# Same-run A/B of the kernel benchmark: the tree before this session (old_tree/: git archive 55a43bd
# | tar -x -C old_tree) against HEAD, twice, alternating. JSON in $OUT.
export PYTHONUNBUFFERED=1
kb() { (cd $1 && PYTHONPATH=$PWD timeout 120 python3 -m experiments.kernel_bench --out=$OUT/kb_$2.json 2>&1 | grep -E "^ *decode .*(rkv_pallas|cudnn) "); }
kb . new1; kb old_tree old1; kb . new2; kb old_tree old2
