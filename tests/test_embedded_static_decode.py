"""Static-shape decode (graphs.py; CUDA graphs on a GPU, the same steps uncaptured here): the same
greedy tokens and logprobs as eager decode through admissions, finishes, padded buckets and a
width past the static capacity; models it cannot serve decode eagerly."""

from __future__ import annotations

import time

import pytest

from agentrl.rollout.embedded.graphs import GraphCaptureFailed, StaticDecoder, buckets, unsupported_reason
from tests.engine_models import gemma3_model, glm_model, llama_model
from tests.test_embedded_prefill_groups import Harness, assert_same, ids

CAPACITY = 40  # small, so that the longest request below decodes past it


def run(static_len: int, prepare=None) -> tuple[dict, dict]:
    h = Harness(llama_model(), max_batch_size=8, static_decode_len=static_len)
    if prepare is not None:
        prepare(h.sched)
    try:
        h.alone({"prime": ids(12, 1)}, max_new=3)  # a prefix-cache entry the wave partly hits
        futs = {}
        for i in range(7):  # 7 rows: bucket 8, one padding row; different lengths finish at different steps
            prompt = (ids(12, 1) + ids(3 + 2 * i, 10 + i)) if i % 2 else ids(4 + 3 * i, 20 + i)
            futs[f"r{i}"] = h.submit(f"r{i}", prompt, max_new=4 + 3 * i)
        time.sleep(0.05)
        for i in range(7, 10):  # admitted into a running batch
            futs[f"r{i}"] = h.submit(f"r{i}", ids(6 + i, 30 + i), max_new=5)
        out = {rid: f.result(timeout=60) for rid, f in futs.items()}
        return out, h.sched.stats()
    finally:
        h.close()


def test_static_decode_gives_the_eager_tokens_and_logprobs():
    eager, _ = run(0)
    decoders = []

    def small_column_buckets(sched):  # 8, 16, 32, 40: the widths below cross every bucket
        sched._static.column_buckets = buckets(CAPACITY, 8)
        decoders.append(sched._static)

    static, stats = run(CAPACITY, small_column_buckets)
    assert_same(static, eager)
    # What the steps ran on (CPU: uncaptured, one cache per (rows, columns) bucket).
    assert {16, 32, 40} <= {columns for _, columns in decoders[0]._caches}
    assert stats["static_steps"] > 0 and stats["joins_in_place"] >= 2  # admissions written in place
    # r6: 22 prompt tokens + 22 new run past 40 columns, so some of its steps decoded eagerly.
    assert stats["decode_steps"] > stats["static_steps"]


def test_a_batch_changing_at_every_step_in_place_gives_the_eager_tokens(monkeypatch):
    """Requests arriving one by one and stopping at different lengths, as an agent's do: the static
    buffers take each admission in place (running rows shifted right when a longer prompt joins),
    fill finished rows' slots with the last rows and shift left over common padding."""
    import agentrl.rollout.embedded.graphs as graphs

    monkeypatch.setattr(graphs, "DROP_MIN_COLUMNS", 3)

    def play(static_len: int):
        # At most 3 rows: each finish lets a waiting request into the running batch.
        h = Harness(llama_model(), max_batch_size=3, static_decode_len=static_len)
        try:
            futs = {}
            for i in range(14):
                prompt = ids(3 + (7 * i) % 11 + (14 if i in (5, 9) else 0), 60 + i)  # 5 and 9: longer prompts
                futs[f"s{i}"] = h.submit(f"s{i}", prompt, max_new=2 + (5 * i) % 9)
            return {rid: f.result(timeout=60) for rid, f in futs.items()}, h.sched.stats()
        finally:
            h.close()

    eager, _ = play(0)
    static, stats = play(64)
    assert_same(static, eager)
    assert stats["adopts"] == 0  # never rebuilt by copy
    assert stats["joins_in_place"] >= 5 and stats["removes_in_place"] >= 5, stats
    assert stats["right_shifts"] >= 1 and stats["left_shifts"] >= 1, stats
    assert stats["static_steps"] == stats["decode_steps"]


def test_a_failed_graph_capture_turns_static_decode_off_and_loses_no_request():
    def capture_fails(sched):  # as on a GPU whose capture refuses an op of the model
        def refuse(key):
            raise GraphCaptureFailed(f"capturing the decode step of {key} failed: test")
        sched._static.use_graphs = True
        sched._static._graph = refuse

    eager, _ = run(0)
    static, stats = run(CAPACITY, capture_fails)
    assert_same(static, eager)
    assert stats["static_decode_failed"] == 1 and stats["static_steps"] == 0


def test_models_without_static_support_decode_eagerly():
    assert unsupported_reason(llama_model()) is None
    assert "DSA" in unsupported_reason(glm_model())
    assert "sliding" in unsupported_reason(gemma3_model())
    with pytest.raises(ValueError, match="sliding"):
        StaticDecoder(gemma3_model(), 4, 32)
    h = Harness(glm_model(), static_decode_len=64)
    try:
        assert h.sched._static is None
        assert h.alone({"a": ids(9, 3)})["a"].error is None
    finally:
        h.close()


def test_buckets_cover_every_batch_size():
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.gpu
def test_cuda_graphs_give_the_eager_tokens_and_see_weight_loads():
    """On the GPU machine: the captured path agrees with eager decode, and a weight load (copied
    into the same parameter tensors) reaches the captured graphs."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    outs = []
    for static_len in (0, CAPACITY):
        model = llama_model().cuda()
        h = Harness(model, max_batch_size=8, static_decode_len=static_len)
        try:
            first = h.alone({f"a{i}": ids(5 + 3 * i, 40 + i) for i in range(5)}, max_new=12)
            with torch.no_grad():  # a "weight update": same tensors, new values
                for p in model.parameters():
                    p.mul_(1.01)
            second = h.alone({f"b{i}": ids(6 + 2 * i, 50 + i) for i in range(5)}, max_new=12)
            outs.append(({**first, **second}, h.sched.stats()))
        finally:
            h.close()
    (eager, _), (graphed, stats) = outs
    assert stats["graphs_captured"] >= 1 and stats["static_steps"] > 0
    for rid, w in eager.items():
        assert graphed[rid].output_ids == w.output_ids, rid
        assert max(abs(a - b) for a, b in zip(graphed[rid].logprobs, w.logprobs)) < 1e-3, rid
