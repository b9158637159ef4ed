"""Continuous batching around a transformers causal LM: one thread owns the model.

Each iteration the scheduler thread (1) runs control commands (pause, weight load, flush) and
aborts, (2) admits waiting requests up to `max_batch_size`, prefilling them (reusing a cached
prefix when one matches), and (3) runs ONE decode step for every running sequence together.
Requests join and leave between steps; no lock is held across a generation. The HTTP side only
enqueues work and receives results through a callback.

Prefill grouping (prefill_groups.py): the admitted sequences prefill in as few forwards as the
padding bound and prefill_tokens_per_step (rows x width per forward) allow, whatever their
cached-prefix lengths and new-token counts: prefix KVs of different lengths and contents are
stacked left-padded into one batch cache, each row gets its own position_ids and mask
(kv.prefill_mask), and a row with fewer new tokens recomputes the tail of its cached prefix. Only
rows wanting input logprobs prefill alone. Why: on the H200 the engine is host-bound (SmolLM2-135M:
11.7-15.6 forwards/s at any batch, ~37 ms of Python and launches each, 128/494/768 tokens/s at
8/32/64 clients), and while every prefix-cache hit (GRPO's later samples of a group, every
multi-turn continuation) got its own forward, an 8 s profile held 85 prefill forwards against 95
decode steps (bench/results/engine_profile_h200.json). stats()["prefill_forwards"] counts them.

Pause modes (SGLang's): `abort` ends every request with its partial output; `retract` frees the
running requests' KV and re-queues them, so after a weight update their KV is recomputed under
the new weights; `in_place` keeps KV and is the only mode in which old KV meets new weights.
A weight load while requests run (not paused in_place) retracts them first, for the same reason.
`flush_cache` follows SGLang 0.5.23: it succeeds only with no running request and, unless the
engine is paused, no waiting one (a paused engine's waiting requests hold no KV).

Failures stay with the request that caused them: a prefill that raises fails only the requests of
its prefill group; the running batch keeps decoding. Device-agnostic: every tensor the scheduler
makes lives on the model's device (CPU, or CUDA for an engine beside a GPU trainer).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from agentrl.rollout.embedded import kv as kvlib
from agentrl.rollout.embedded.admission import AdmissionGate
from agentrl.rollout.embedded.graphs import GraphCaptureFailed, StaticDecoder, UnsupportedModel
from agentrl.rollout.embedded.prefill_groups import PrefillLayout, PrefillRow, group_rows
from agentrl.rollout.embedded.prefix_cache import PrefixCache
from agentrl.rollout.embedded.request import GenOutput, GenRequest, SeqState
from agentrl.rollout.embedded.sampling import sample_rows, scaled_logprobs

log = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "retract", "in_place")


class Busy(RuntimeError):
    """The request conflicts with running generation (e.g. flush_cache while requests run)."""


class Scheduler:
    def __init__(self, model, *, max_batch_size: int = 32, prefill_tokens_per_step: int = 8192,
                 prefill_chunk_tokens: int = 1024, prefix_cache_tokens: int = 262144, eos_token_ids: tuple[int, ...] = (),
                 decode: Callable[[list[int]], str] | None = None, seed: int = 0,
                 weight_version: str = "0", static_decode_len: int = 0, admit_wait_steps: int = 0) -> None:
        """static_decode_len: KV columns of the static decode buffers (graphs.py; CUDA graphs on a
        GPU); 0 decodes eagerly. A model that cannot use them decodes eagerly (logged once).
        admit_wait_steps: how many decode steps waiting requests may gather before they are
        admitted together (admission.py); 0 admits at once."""
        if max_batch_size < 1 or prefill_chunk_tokens < 1:
            raise ValueError(f"max_batch_size ({max_batch_size}) and prefill_chunk_tokens ({prefill_chunk_tokens}) "
                             "must be >= 1")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.model = model.eval()
        if model.config._attn_implementation not in ("eager", "sdpa"):
            model.set_attn_implementation("sdpa")
        self._additive = model.dtype if model.config._attn_implementation == "eager" else None
        self.max_batch_size = max_batch_size
        # Positions beyond this are outside what the model was built for: generation stops there.
        self.context_len = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self._gate = AdmissionGate(admit_wait_steps)
        self.eos = frozenset(eos_token_ids)
        self.decode = decode
        self.prefix = PrefixCache(prefix_cache_tokens)
        self.device = next(model.parameters()).device
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self.weight_version = weight_version
        self.epoch = 0  # bumped by every weight load; prefix-cache entries of older epochs are dead
        self.paused, self.pause_mode = False, None
        self._cv = threading.Condition()
        self._inbox: deque[SeqState] = deque()
        self._commands: deque[tuple[Callable[[], object], Future]] = deque()
        self._abort_rids: set[str] = set()
        self._abort_all = False
        self._stopping = False
        self._waiting: deque[SeqState] = deque()
        self._running: list[SeqState] = []
        self._admitting: list[SeqState] = []
        self._cache = None
        self._width = 0
        self._stats = {"decode_steps": 0, "prefill_forwards": 0, "max_decode_batch_size": 0,
                       "last_decode_batch_size": 0, "generated_tokens": 0, "prefill_tokens": 0,
                       "prefill_pad_tokens": 0, "cached_tokens": 0, "requests_done": 0}
        self._static = None
        if static_decode_len:
            try:  # StaticDecoder says why a model cannot use it (DSA, sliding windows, eager attention)
                self._static = StaticDecoder(model, max_batch_size, static_decode_len)
                self._stats.update(self._static.stats)
            except UnsupportedModel as exc:
                log.warning("embedded engine: decoding eagerly: %s", exc)
        self._thread = threading.Thread(target=self._loop, name="embedded-engine-scheduler", daemon=True)

    # ---- thread-safe API -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, req: GenRequest) -> None:
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine is shutting down")
            self._inbox.append(SeqState(req, list(req.input_ids)))
            self._cv.notify()

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        with self._cv:
            if abort_all:
                self._abort_all = True
            elif rid:
                self._abort_rids.add(rid)
            self._cv.notify()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run fn on the scheduler thread between steps (no forward is in flight then)."""
        fut: Future = Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine is shutting down")
            self._commands.append((fn, fut))
            self._cv.notify()
        return fut

    def stats(self) -> dict:
        with self._cv:
            return {**self._stats, "num_running": len(self._running), "num_waiting": len(self._waiting),
                    "prefix_cache_tokens": self.prefix.tokens_held, "paused": self.paused,
                    "pause_mode": self.pause_mode, "weight_version": self.weight_version,
                    "max_batch_size": self.max_batch_size}

    # ---- commands (run on the scheduler thread via call) ---------------------------------
    def pause(self, mode: str) -> dict:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}; use one of {PAUSE_MODES}")
        n_running, n_waiting = len(self._running), len(self._waiting)
        if mode == "abort":
            self._finish_all("paused with mode=abort")
        elif mode == "retract":
            self._retract_running()
        self.paused, self.pause_mode = True, mode
        return {"running": n_running, "waiting": n_waiting}

    def resume(self) -> None:
        self.paused, self.pause_mode = False, None

    def load_weights(self, load: Callable[[], int], weight_version: str | None, flush_cache: bool = False) -> dict:
        """Apply `load` (which copies tensors into the model) with no forward in flight. Returns
        {"loaded": n, "flushed": bool}: with flush_cache, whether the cache could be flushed (not
        while requests keep KV, i.e. paused in_place with running requests), as SGLang reports it."""
        if self._running and not (self.paused and self.pause_mode == "in_place"):
            self._retract_running()
        n = load()
        self.epoch += 1
        self.prefix.clear()  # old-weight KV is never reused (the epoch guards it too)
        if weight_version is not None:
            self.weight_version = str(weight_version)
        return {"loaded": n, "flushed": not self._running if flush_cache else False}

    def set_weight_version(self, version: str, abort_all: bool) -> None:
        if abort_all:
            self._finish_all("aborted by update_weight_version")
        self.weight_version = str(version)

    def flush_cache(self) -> None:
        if self._running or (self._waiting and not self.paused):
            raise Busy(f"Cache not flushed because there are pending requests. #queue-req: {len(self._waiting)}, "
                       f"#running-req: {len(self._running)}")
        self.prefix.clear()

    # ---- the loop -----------------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self._inbox or self._commands or self._abort_rids or self._abort_all
                    or (not self.paused and (self._waiting or self._running)))

    def _loop(self) -> None:
        with torch.no_grad():
            while True:
                with self._cv:
                    while not (self._stopping or self._has_work()):
                        self._cv.wait()
                    if self._stopping:
                        break
                    for seq in self._inbox:
                        seq.queued_step = self._stats["decode_steps"]
                    self._waiting.extend(self._inbox)
                    self._inbox.clear()
                    commands = list(self._commands)
                    self._commands.clear()
                    rids, abort_all = self._abort_rids, self._abort_all
                    self._abort_rids, self._abort_all = set(), False
                for fn, fut in commands:
                    try:
                        fut.set_result(fn())
                    except Exception as exc:  # noqa: BLE001 - reported to the caller; the loop lives on
                        fut.set_exception(exc)
                if abort_all or rids:
                    self._abort(rids, abort_all)
                if self.paused:
                    continue
                try:
                    self._admit()
                    if self._running:
                        self._decode_step()
                except Exception as exc:
                    log.exception("embedded engine step failed")
                    self._fail_running(f"engine error: {type(exc).__name__}: {exc}")
            self._waiting.extend(self._inbox)
            self._finish_all("engine shutting down")
            for _, fut in self._commands:
                fut.set_exception(RuntimeError("engine shutting down"))

    def _admit(self) -> None:
        if not self._waiting or not self._gate.admit_now(len(self._waiting), len(self._running), self.max_batch_size,
                                                         self._stats["decode_steps"] - self._waiting[0].queued_step):
            return
        # The budget counts the tokens a prefill computes, not those the prefix cache holds: a turn
        # of a multi-turn episode re-sends its whole context (thousands of tokens) and computes only
        # the last observation. Counting the context would admit four 2K-token turns per step at the
        # default budget of 8,192, and prefill them in four forwards.
        room, budget, rows = self.max_batch_size - len(self._running), self.prefill_tokens_per_step, []
        while self._waiting and room > 0:
            row = self._prefill_row(self._waiting[0])
            if rows and budget < row.new:
                break
            self._waiting.popleft()
            budget -= row.new
            room -= 1
            rows.append(row)
        if not rows:
            return
        self._admitting = [r.seq for r in rows]  # so a failing prefill still answers every one of them
        joined = []
        for group in group_rows(rows, self.prefill_tokens_per_step):
            try:
                joined += self._prefill(PrefillLayout(group))
            except Exception as exc:  # only this group's requests fail; the running batch decodes on
                log.exception("embedded engine prefill failed")
                error = f"engine error in prefill: {type(exc).__name__}: {exc}"
                for row in group:
                    row.seq.kv_len = 0  # its KV (if any) belongs to a failed forward: never cached
                    self._finish(row.seq, {"type": "abort", "message": error}, error=error)
        if joined:
            width = max(self._width, *(s.kv_len for s in joined))
            kvs, cache = [s.kv for s in joined], None
            if self._static is not None:  # in place when the batch lives in the static buffers
                cache = self._static.join(self._cache, len(self._running), self._width, kvs, width)
            self._cache = cache or kvlib.join(self.model.config, self._cache, self._width, kvs, width)
            self._running, self._width = self._running + joined, width
            for s in joined:
                s.kv = None
        self._admitting = []

    def _prefill_row(self, seq: SeqState) -> PrefillRow:
        """The sequence with its prefix-cache hit (never the tokens whose input logprobs it wants)."""
        want_input = not seq.admitted and seq.req.logprob_start_len >= 0
        limit = len(seq.tokens) - 1
        if want_input:
            limit = min(limit, max(seq.req.logprob_start_len - 1, 0))
        prefix_kv, m = self.prefix.lookup(seq.tokens, self.epoch, limit)
        return PrefillRow(seq, prefix_kv, m, want_input)

    def _prefill(self, lay: PrefillLayout) -> list[SeqState]:
        """One merged prefill (prefill_groups.py has the layout); return the rows that keep running."""
        seqs = [r.seq for r in lay.rows]
        cache = lay.cache(self.model.config)
        want_input = lay.rows[0].want_input  # such a row is always alone
        # Chunks bound the activation memory of long prompts (GLM's indexer scores alone are
        # [S, heads, T] floats); each chunk attends to the cache plus itself.
        done, kept = 0, []
        while done < lay.new:
            c = min(self.prefill_chunk_tokens, lay.new - done)
            ids, pos = lay.chunk(lay.cached + done, c, self.device)
            out = self.model(
                input_ids=ids, attention_mask=self._masks(kvlib.prefill_mask, lay.pads, lay.cached + done, c),
                position_ids=pos, cache=cache, use_cache=True, logits_to_keep=c if want_input else 1,
            )
            with self._cv:
                self._stats["prefill_forwards"] += 1
            if want_input:
                kept.append(out.logits[0])
            done += c
        logits = out.logits[:, -1]
        for seq, m in zip(seqs, lay.reuse):
            if not seq.admitted:
                seq.cached_tokens = m  # KV actually reused (a merged row may recompute part of its hit)
        with self._cv:
            self._stats["prefill_tokens"] += lay.computed
            self._stats["prefill_pad_tokens"] += lay.padding
            self._stats["cached_tokens"] += sum(lay.reuse)
        if want_input:
            self._set_input_logprobs(seqs[0], torch.cat(kept), lay.reuse[0])
        running = []
        sampling = [s for s in seqs if len(s.out_ids) < s.req.max_new_tokens]
        if sampling:
            rows = [seqs.index(s) for s in sampling]
            toks, lps = sample_rows(logits[rows], [s.req.params for s in sampling], self._gen)
        for row, (seq, pad) in enumerate(zip(seqs, lay.pads)):
            seq.admitted = True
            seq.kv_len = lay.width - pad
            seq.kv = kvlib.extract(cache, row, pad, seq.kv_len)
            if seq not in sampling:
                self._finish(seq, {"type": "length", "length": seq.req.max_new_tokens}, keep_kv=seq.kv)
                continue
            i = sampling.index(seq)
            reason = self._append(seq, toks[i], lps[i])
            if reason:
                self._finish(seq, reason, keep_kv=seq.kv)
            else:
                running.append(seq)
        return running

    def _set_input_logprobs(self, seq: SeqState, logits: torch.Tensor, m: int) -> None:
        # logits[j] predicts token m + j + 1.
        start = seq.req.logprob_start_len
        lp = scaled_logprobs(logits[None], [seq.req.params.temperature])[0]
        out: list[float | None] = []
        for p in range(start, len(seq.req.input_ids)):
            out.append(None if p == 0 else float(lp[p - 1 - m, seq.tokens[p]]))
        seq.input_lps = out

    def _masks(self, build, *args):
        # Sliding-window layers (Gemma 3: 5 of every 6, 512 tokens) get their own windowed mask,
        # keyed by layer type as transformers expects; their cache keeps every position.
        cfg = self.model.config
        window = getattr(cfg, "sliding_window", None)
        full = build(*args, additive_dtype=self._additive, device=self.device)
        if not window or "sliding_attention" not in (getattr(cfg, "layer_types", None) or ()):
            return full
        return {"full_attention": full, "sliding_attention": build(*args, additive_dtype=self._additive,
                                                                   device=self.device, window=window)}

    def _decode_step(self) -> None:
        seqs = self._running
        pads = [self._width - s.kv_len for s in seqs]
        logits = None
        if self._static is not None and self._static.fits(len(seqs), self._width):
            try:
                logits = self._static.step(self._cache, [s.tokens[-1] for s in seqs], [s.kv_len for s in seqs],
                                           pads, self._width)
            except GraphCaptureFailed as exc:
                # The batch cache is untouched (capture writes only column `width`, past its view):
                # this step and all later ones decode eagerly instead of failing their requests.
                log.warning("embedded engine: static decode off, decoding eagerly: %s", exc)
                self._static = None
                with self._cv:
                    self._stats["static_decode_failed"] = 1
        if logits is None:
            logits = self.model(
                input_ids=torch.tensor([[s.tokens[-1]] for s in seqs], device=self.device),
                attention_mask=self._masks(kvlib.decode_mask, pads, self._width),
                position_ids=torch.tensor([[s.kv_len] for s in seqs], device=self.device),
                cache=self._cache, use_cache=True, logits_to_keep=1,
            ).logits[:, -1]
        self._width += 1
        toks, lps = sample_rows(logits, [s.req.params for s in seqs], self._gen)
        done = []
        for i, (seq, tok, lp) in enumerate(zip(seqs, toks, lps)):
            seq.kv_len += 1
            reason = self._append(seq, tok, lp)
            if reason:
                done.append((i, reason))
        with self._cv:
            st = self._stats
            if self._static is not None:
                st.update(self._static.stats)
            st["decode_steps"] += 1
            st["last_decode_batch_size"] = len(seqs)
            st["max_decode_batch_size"] = max(st["max_decode_batch_size"], len(seqs))
        if done:
            self._remove_rows(done)

    def _append(self, seq: SeqState, tok: int, lp: float) -> dict | None:
        seq.tokens.append(tok)
        seq.out_ids.append(tok)
        seq.out_lps.append(lp)
        seq.out_versions.append(self.weight_version)
        with self._cv:
            self._stats["generated_tokens"] += 1
        req = seq.req
        if tok in req.stop_token_ids or (not req.ignore_eos and tok in self.eos):
            return {"type": "stop", "matched": tok}
        if req.stop_strings and self.decode is not None:
            tail = self.decode(seq.out_ids[-64:])
            for s in req.stop_strings:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if len(seq.out_ids) >= req.max_new_tokens or len(seq.tokens) >= self.context_len:
            return {"type": "length", "length": len(seq.out_ids)}
        return None

    def _remove_rows(self, done: list[tuple[int, dict]]) -> None:
        """Finish the given rows of the running batch and shrink the batch cache."""
        gone = {i for i, _ in done}
        rows = len(self._running)
        for i, reason in done:
            seq = self._running[i]
            start = self._width - seq.kv_len
            owned = self._static.copy_row(self._cache, rows, i, start, seq.kv_len) if self._static else None
            kv = owned if owned is not None else kvlib.extract(self._cache, i, start, seq.kv_len)
            self._finish(seq, reason, keep_kv=kv, kv_owned=owned is not None)
        keep = [i for i in range(rows) if i not in gone]
        if not keep:
            self._running, self._cache, self._width = [], None, 0
            return
        drop = min(self._width - self._running[i].kv_len for i in keep)
        placed = None
        if self._static is not None:  # in place when the batch lives in the static buffers
            placed = self._static.remove(self._cache, rows, self._width, keep, drop)
        if placed is not None:
            order, self._width = placed
            self._running = [self._running[i] for i in order]
            return
        self._running = [self._running[i] for i in keep]
        kvlib.select_rows(self._cache, keep, drop)
        self._width -= drop

    def _retract_running(self) -> None:
        """Free running requests' KV and queue them first; they are re-prefilled when admitted."""
        for i, seq in enumerate(self._running):
            kv = kvlib.extract(self._cache, i, self._width - seq.kv_len, seq.kv_len)
            self.prefix.insert(seq.tokens[: seq.kv_len], _clone(kv), self.epoch)
            seq.kv_len = 0
        self._waiting.extendleft(reversed(self._running))
        self._running, self._cache, self._width = [], None, 0

    def _abort(self, rids: set[str], abort_all: bool) -> None:
        def hit(s: SeqState) -> bool:
            return abort_all or s.req.rid in rids

        for seq in [s for s in self._waiting if hit(s)]:
            self._waiting.remove(seq)
            self._finish(seq, {"type": "abort", "message": "aborted by request"})
        rows = [(i, {"type": "abort", "message": "aborted by request"}) for i, s in enumerate(self._running) if hit(s)]
        if rows:
            self._remove_rows(rows)

    def _finish_all(self, message: str) -> None:
        reason = {"type": "abort", "message": message}
        if self._running:
            self._remove_rows([(i, reason) for i in range(len(self._running))])
        while self._waiting:
            self._finish(self._waiting.popleft(), reason)

    def _fail_running(self, error: str) -> None:
        for seq in self._running + self._admitting:
            self._finish(seq, {"type": "abort", "message": error}, error=error)
        self._running, self._admitting, self._cache, self._width = [], [], None, 0

    def _finish(self, seq: SeqState, reason: dict, keep_kv: kvlib.SeqKV | None = None, error: str | None = None,
                kv_owned: bool = False) -> None:
        """`kv_owned`: keep_kv is already a copy of its own (else views, cloned here)."""
        if seq.done:
            return
        seq.done = True
        if keep_kv is not None and seq.kv_len > 0:
            # Cloned so the entry does not pin the whole batch tensor it was sliced from.
            self.prefix.insert(seq.tokens[: seq.kv_len], keep_kv if kv_owned else _clone(keep_kv), self.epoch)
        with self._cv:
            self._stats["requests_done"] += 1
        out = GenOutput(
            rid=seq.req.rid, output_ids=seq.out_ids, logprobs=seq.out_lps, weight_versions=seq.out_versions,
            finish_reason=reason, prompt_tokens=len(seq.req.input_ids), cached_tokens=seq.cached_tokens,
            weight_version=self.weight_version, input_logprobs=seq.input_lps, error=error,
        )
        try:
            seq.req.on_done(out)
        except Exception:
            log.exception("on_done callback failed for rid %s", seq.req.rid)


def _clone(kv: kvlib.SeqKV) -> kvlib.SeqKV:
    return [{name: t.clone() for name, t in layer.items()} for layer in kv]
