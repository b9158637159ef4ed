#!/usr/bin/env bash
# [K2] the paired Gluon kernels (kernels/sparse_mla_gluon_pair.py, kernels/sparse_mla_bwd_dq_pair.py) in one
# device call, on any sm_90 card: the forward checked against the fp32 definition and timed beside the current
# Gluon forward and the Triton kernel (pair_fwd.json); the dq pass checked against the Triton pass and timed
# beside it and the current Gluon pass (pair_dq.json). Then on an H200, where the paired forward checked out,
# bench.kernels' sparse MLA entries (bench/gpu/h200_owed.sh mla: kernels_mla.json, the goals' numbers, every
# forward impl timed beside the default); on any other card the GPU tests of both kernels' files.
# Each part is bounded by its own timeout: a kernel that hangs costs its part, not the call.
set -u
OUT=${OUT:?set OUT}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $GPU"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc $?"; tail -12 "$OUT/$name.log"; }
run pair_fwd 170 python3 bench/gpu/sparse_mla_gluon_check.py --out "$OUT/pair_fwd.json" \
  --schedules '[{}, {"kernel": "pair"}, {"kernel": "pair", "CONSUMER_REGS": 208}, {"kernel": "pair", "ROW_GROUP": 16}]'
# the paired forward checked out: every check row of its schedules ok, and timed
fwd_ok=$(python3 -c "
import json, sys
try:
    r = json.load(open('$OUT/pair_fwd.json'))
except (OSError, ValueError):
    print(0); sys.exit()
rows = [x for x in r.get('check', []) if x['schedule'].get('kernel') == 'pair']
print(int(bool(rows) and all(x.get('ok') for x in rows) and bool(r.get('time'))))")
echo "paired forward checked out: $fwd_ok"
run pair_dq 120 python3 bench/gpu/dq_pass_gluon.py --out "$OUT/pair_dq.json" \
  --schedules '[{}, {"kernel": "pair"}, {"kernel": "pair", "ROW_GROUP": 16}]'
case "$GPU" in
  *H200*) [ "$fwd_ok" = 1 ] && bash bench/gpu/h200_owed.sh mla ;;
  *) bash bench/gpu/pending.sh stage > "$OUT/stage.log" 2>&1
     export PYTHONPATH=$PWD:/tmp/site2:/tmp/site
     run gpu_tests 250 python3 -m pytest -q -m gpu tests/kernels/test_kernels_sparse_mla.py \
       tests/kernels/test_kernels_sparse_mla_bwd_split.py ;;
esac
