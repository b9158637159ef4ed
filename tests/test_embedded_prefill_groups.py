"""Merged prefills in the embedded engine: rows with prefix-cache hits of any length share forwards,
give what they give one at a time, and a failing forward fails only its own rows."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest
import torch

from agentrl.rollout.embedded import kv as kvlib
from agentrl.rollout.embedded.prefill_groups import (
    MAX_CELLS_PER_BUDGET,
    MAX_PAD_RATIO,
    PAD_SLACK_TOKENS,
    PrefillRow,
    group_rows,
)
from agentrl.rollout.embedded.request import GenOutput, GenRequest, SeqState
from agentrl.rollout.embedded.sampling import RowParams
from agentrl.rollout.embedded.scheduler import Scheduler
from tests.engine_models import VOCAB, gemma3_model, glm_model, llama_model

GREEDY = RowParams(temperature=0.0, top_p=1.0, top_k=0)
MARK = VOCAB - 1  # a token no test prompt contains; the failing forward is recognised by it
LP_ATOL = 1e-5


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()


class Harness:
    """A started Scheduler and greedy requests submitted alone or in one admission."""

    def __init__(self, model, **kw) -> None:
        self.sched = Scheduler(model, **kw)
        self.sched.start()

    def submit(self, rid: str, prompt: list[int], max_new: int = 6, start: int = -1) -> Future:
        fut: Future = Future()
        self.sched.submit(GenRequest(rid=rid, input_ids=prompt, max_new_tokens=max_new, params=GREEDY,
                                     on_done=fut.set_result, ignore_eos=True, logprob_start_len=start))
        return fut

    def alone(self, specs: dict[str, list[int]], **kw) -> dict[str, GenOutput]:
        return {rid: self.submit(rid, p, **kw).result(timeout=30) for rid, p in specs.items()}

    def together(self, specs: dict[str, list[int]], starts: dict[str, int] | None = None) -> dict[str, GenOutput]:
        """All of specs queued while paused, so one _admit takes them all."""
        self.paused_with = self.sched.call(lambda: self.sched.pause("in_place")).result(timeout=30)
        futs = {rid: self.submit(rid, p, start=(starts or {}).get(rid, -1)) for rid, p in specs.items()}
        self.sched.call(self.sched.resume).result(timeout=30)
        return {rid: f.result(timeout=30) for rid, f in futs.items()}

    def forwards(self) -> int:
        return self.sched.stats()["prefill_forwards"]

    def close(self) -> None:
        self.sched.stop()


def assert_same(got: dict[str, GenOutput], want: dict[str, GenOutput]) -> None:
    for rid, w in want.items():
        g = got[rid]
        assert g.error is None and w.error is None, (g.error, w.error)
        assert g.output_ids == w.output_ids, rid
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < LP_ATOL, rid
        if w.input_logprobs is not None:
            assert max(abs(a - b) for a, b in zip(g.input_logprobs[1:], w.input_logprobs[1:])) < LP_ATOL, rid


def both(model_fn, primes: dict[str, list[int]], specs: dict[str, list[int]], **kw):
    """(outputs when specs arrive together, forwards that took; the same one at a time, forwards)."""
    results = []
    for together in (True, False):
        h = Harness(model_fn(), **kw)
        try:
            h.alone(primes, max_new=4)  # their KV goes into the prefix cache
            f0 = h.forwards()
            out = h.together(specs) if together else h.alone(specs)
            results += [out, h.forwards() - f0]
        finally:
            h.close()
    return results


def test_requests_sharing_a_cached_prefix_prefill_in_one_forward_and_match_solo():
    shared = ids(16, 1)
    same = shared + ids(5, 2)  # a GRPO group: one prompt, several samples
    specs = {f"same{i}": same for i in range(4)} | {f"tail{i}": shared + ids(5, 10 + i) for i in range(4)}
    grouped, n_grouped, solo, n_solo = both(llama_model, {"prime": shared}, specs)
    assert n_solo == len(specs) and n_grouped == 1
    assert_same(grouped, solo)
    assert all(o.cached_tokens == len(shared) for o in grouped.values())


def test_the_prefill_budget_counts_computed_tokens_not_cached_ones():
    """Turns of multi-turn episodes: each re-sends a context longer than the whole per-step budget
    and computes only its last few tokens; all of them are admitted and prefilled in one forward."""
    contexts = {f"c{i}": ids(40, 20 + i) for i in range(4)}
    specs = {rid: ctx + ids(3, 30 + i) for i, (rid, ctx) in enumerate(contexts.items())}
    grouped, n_grouped, solo, _ = both(llama_model, contexts, specs, prefill_tokens_per_step=32)
    assert n_grouped == 1
    assert_same(grouped, solo)
    assert all(o.cached_tokens == 40 for o in grouped.values())


@pytest.mark.parametrize("model_fn", [llama_model, glm_model, gemma3_model], ids=["llama", "glm", "gemma3"])
def test_rows_with_different_cached_prefixes_share_a_chunked_forward_and_match_solo(model_fn):
    a, b = ids(10, 3), ids(24, 4)
    specs = {"a": a + ids(3, 5), "b": b + ids(6, 6), "b_short": b[:15] + ids(8, 7),
             "fresh_short": ids(5, 8), "fresh": ids(12, 9)}  # new tokens 3, 6, 8, 5, 12
    # Chunks of 4 cross the 4-token sliding window of the Gemma 3 model; "fresh_short" is
    # left-padded inside the query columns, "a" and "b" recompute part of their cache hits.
    grouped, n_grouped, solo, n_solo = both(model_fn, {"a": a, "b": b}, specs, prefill_chunk_tokens=4)
    assert n_grouped == 3  # one group of 12 query columns in chunks of 4
    assert n_solo == 1 + 2 + 2 + 2 + 3
    assert_same(grouped, solo)


def test_a_failing_prefill_fails_only_its_group(monkeypatch):
    shared, running_prompt = ids(16, 11), ids(9, 12)
    poisoned = {f"bad{i}": shared + ids(1, 20 + i) + [MARK] for i in range(3)}  # one group: 2 new tokens each
    healthy = {"fresh": ids(40, 13)}  # 40 new tokens: too many to pad the others to
    with_input = {"inputs": shared + ids(2, 14)}  # wants input logprobs: alone
    ref = Harness(llama_model())
    try:
        ref.alone({"prime": shared}, max_new=4)
        want = ref.alone({"running": running_prompt}, max_new=30) | ref.alone(healthy)
        want |= {"inputs": ref.submit("inputs", with_input["inputs"], start=3).result(timeout=30)}
    finally:
        ref.close()

    model = llama_model()
    forward = model.forward

    def failing_forward(*args, input_ids=None, **kw):
        if input_ids is not None and input_ids.shape[1] > 1 and bool((input_ids == MARK).any()):
            raise RuntimeError("injected prefill failure")
        return forward(*args, input_ids=input_ids, **kw)

    monkeypatch.setattr(model, "forward", failing_forward)
    h = Harness(model)
    try:
        h.alone({"prime": shared}, max_new=4)
        running = h.submit("running", running_prompt, max_new=30)
        deadline = time.monotonic() + 30
        while h.sched.stats()["generated_tokens"] < 4 + 2:  # decoding when the others are admitted
            assert time.monotonic() < deadline, "the running request never started decoding"
            time.sleep(0.001)
        got = h.together(poisoned | healthy | with_input, starts={"inputs": 3})
        assert h.paused_with["running"] == 1
        got["running"] = running.result(timeout=30)
    finally:
        h.close()
    for rid in poisoned:
        assert got[rid].error == "engine error in prefill: RuntimeError: injected prefill failure"
        assert got[rid].finish_reason["type"] == "abort" and got[rid].output_ids == []
    assert_same(got, want)
    assert len(got["running"].output_ids) == 30


def _row(new: int, hit: int = 0, want_input: bool = False) -> PrefillRow:
    return PrefillRow(SeqState(None, [1] * (hit + new)), None, hit, want_input)


def test_grouping_merges_within_the_padding_bound_and_keeps_input_logprob_rows_alone():
    rows = [_row(5, 100), _row(7, 30), _row(6), _row(5, 3, want_input=True)]
    groups = group_rows(rows, max_tokens=8192)
    assert sorted(len(g) for g in groups) == [1, 3]
    assert next(g for g in groups if len(g) == 1)[0].want_input
    # Padding every row to the longest: allowed within MAX_PAD_RATIO of the real tokens or PAD_SLACK_TOKENS.
    long = 4 * PAD_SLACK_TOKENS
    short = [_row(1) for _ in range(3)]
    assert len(group_rows([*short, _row(long)], 8192)) == 2  # 4 * long columns for long + 3 real tokens
    assert 4 * long <= MAX_PAD_RATIO * (3 * long // 2 + long)  # so this one merges:
    assert len(group_rows([_row(long // 2) for _ in range(3)] + [_row(long)], 8192)) == 1
    # The per-step prefill budget bounds a merged forward's rows x width; a row alone may exceed it.
    assert [len(g) for g in group_rows([_row(100) for _ in range(5)], max_tokens=250)] == [2, 2, 1]
    assert [len(g) for g in group_rows([_row(300)], max_tokens=250)] == [1]
    # A GRPO group of fresh prompts and one continuation of a long context: few padded query columns,
    # but every fresh row would span the long row's width, so they stay apart.
    grpo = [_row(440) for _ in range(8)]
    assert sorted(len(g) for g in group_rows([*grpo, _row(5, 2000)], max_tokens=8192)) == [1, 8]
    assert len(group_rows([*grpo, _row(5, 400)], max_tokens=8192)) == 1
    # Continuations of similar long contexts merge (their cached columns are read, not computed),
    # up to MAX_CELLS_PER_BUDGET x the budget of rows x width.
    turns = [_row(40 + i, 2000 + 10 * i) for i in range(40)]
    sizes = [len(g) for g in group_rows(turns, max_tokens=8192)]
    cap, first = MAX_CELLS_PER_BUDGET * 8192, sizes[0]
    assert sum(sizes) == 40 and len(sizes) == 2
    assert first * len(turns[first - 1].seq.tokens) <= cap < (first + 1) * len(turns[first].seq.tokens)
    # ... but not a continuation with fresh prompts far shorter than it: they would all span its width.
    assert sorted(len(g) for g in group_rows([*turns[:4], *[_row(300) for _ in range(4)]], 8192)) == [4, 4]


def test_joining_rows_to_a_batch_cache_gives_the_stacked_cache():
    """kv.join (the running rows moved with one copy per tensor) equals stacking every row again."""
    model = glm_model()  # DSA layers: keys, values and indexer keys, with their own sequence dims
    caches = []
    for n in (5, 9, 3):
        cache = kvlib.new_cache(model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor([ids(n, n)]), cache=cache, use_cache=True)
        caches.append(kvlib.extract(cache, 0, 0, n))
    running = kvlib.stack(model.config, caches[:2], 9)
    new_rows = caches[2:] + [kvlib.extract(running, 0, 4, 5)]
    names = set()
    for width in (9, 12):
        joined = kvlib.join(model.config, running, 9, new_rows, width)
        want = kvlib.stack(model.config, caches[:2] + new_rows, width)
        for got_layer, want_layer in zip(joined.layers, want.layers):
            got, exp = kvlib._layer_tensors(got_layer), kvlib._layer_tensors(want_layer)
            assert got.keys() == exp.keys()
            names |= set(got)
            for name in got:
                assert torch.equal(got[name], exp[name]), (width, name)
    assert names == {"keys", "values", "indexer_keys"}
    with pytest.raises(ValueError, match="never cut"):
        kvlib.join(model.config, running, 9, new_rows, 8)


def test_layout_right_aligns_rows_and_recomputes_the_tail_of_shorter_hits():
    from agentrl.rollout.embedded.prefill_groups import PAD_TOKEN_ID, PrefillLayout

    rows = [PrefillRow(SeqState(None, list(range(100, 100 + n))), None, hit, False)
            for n, hit in ((13, 10), (30, 24), (5, 0))]  # new tokens 3, 6, 5
    lay = PrefillLayout(rows)
    assert (lay.new, lay.cached, lay.width) == (6, 24, 30)
    assert lay.reuse == [7, 24, 0]  # the first row recomputes 3 of its 10 cached positions
    assert lay.pads == [17, 0, 25]  # the last row is padded 1 column into the query part
    assert (lay.computed, lay.padding) == (6 + 6 + 5, 1)
    ids_, pos = lay.chunk(24, 4, "cpu")
    assert ids_.tolist() == [[107, 108, 109, 110], [124, 125, 126, 127], [PAD_TOKEN_ID, 100, 101, 102]]
    assert pos.tolist() == [[7, 8, 9, 10], [24, 25, 26, 27], [0, 0, 1, 2]]
