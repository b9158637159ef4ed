#!/usr/bin/env bash
# [K2] what is owed on an H200 (the goals are for one H200), in one device call: exits at once on
# any other card so that a call that gets an H100 costs only the machine's start. Writes under $OUT:
# kernels_indexer.json (indexer family: the top-k's share of the copy rate), kernels_mla.json (sparse MLA
# forward, the default with the other Gluon kernels timed beside it at 64K and 8K, and every backward impl), dq_pass_gluon.json and dkv_pass_gluon.json (the Gluon dq and dkv passes'
# schedules against the Triton passes; on the H200 the dkv pass's best band count may differ).
# Merge the bench.kernels parts into the record with `python -m bench.kernels_merge --into
# bench/results/kernels.json kernels_mla.json kernels_indexer.json --note '...'` (it refuses a part from another card).
# Arguments name the parts (default: all, about 700 s: more than one call), run in this order: `mla` (bench.kernels'
# sparse MLA forward, every Gluon kernel beside the default, and backward, about 170 s: session 29's defaults, q
# copied by the producer in the paired forward and the Gluon dq pass, have not been timed on an H200; this is the
# issue's 400 TFLOP/s measurement), `fwd` (the paired forward with q loaded by the producer, Q_ROWS 32 and 16,
# against q loaded before the producer starts, Q_ROWS 0, each also with the evict-first q / out policy, every
# check case for each, and out's stores staged through a free slot half, STAGE_OUT, never yet run on a GPU; then
# timed in interleaved rounds: fwd_gpu.json, about 120 s on an H100), `indexer` (its
# indexer family, about 280 s), `dq` (the Gluon dq pass's schedules: Q_ROWS, the evict-first scratch stores), `dkv`.
set -u
PARTS=" ${*:-mla fwd indexer dq dkv} "
OUT=${OUT:?set OUT}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $GPU"
case "$GPU" in *H200*) ;; *) echo "not an H200: nothing run"; exit 0 ;; esac
bash bench/gpu/pending.sh stage > "$OUT/stage.log" 2>&1
export PYTHONPATH=$PWD:/tmp/site2:/tmp/site PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout -k 20 "$t" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc $?"; tail -3 "$OUT/$name.log"; }
want() { case "$PARTS" in *" $1 "*) return 0 ;; esac; return 1; }
want mla && run kernels_mla 200 python3 -m bench.kernels --only sparse_mla,sparse_mla_bwd --out "$OUT/kernels_mla.json"
want fwd && run fwd 300 python3 bench/gpu/sparse_mla_gluon_check.py --out "$OUT/fwd_gpu.json" --check-all \
  --parts check,time --rounds 3 --tokens 4096 --schedules '[{"kernel":"pair","Q_ROWS":0},{"kernel":"pair","Q_ROWS":32},
  {"kernel":"pair","Q_ROWS":16},{"kernel":"pair","Q_ROWS":32,"IO_EVICT":"evict_first"},
  {"kernel":"pair","Q_ROWS":0,"IO_EVICT":"evict_first"},{"kernel":"pair","STAGE_OUT":true}]'
want indexer && run kernels_indexer 280 python3 -m bench.kernels --only indexer --out "$OUT/kernels_indexer.json"
want dq && run dq_gluon 120 python3 bench/gpu/dq_pass_gluon.py --out "$OUT/dq_pass_gluon.json"
want dkv && run dkv_gluon 250 python3 bench/gpu/dkv_pass_gluon.py --out "$OUT/dkv_pass_gluon.json"
