"""The embedded engine's admission gate: at once by default; with max_wait_steps, requests that
arrive while a batch decodes gather into one prefill forward, bounded by the wait."""

from __future__ import annotations

import time

import pytest

from agentrl.rollout.embedded.admission import AdmissionGate
from tests.engine_models import llama_model
from tests.test_embedded_prefill_groups import Harness, assert_same, ids


def test_off_admits_whenever_there_is_room():
    gate = AdmissionGate()
    assert gate.admit_now(waiting=1, running=5, max_batch=8, oldest_waited_steps=0)
    assert not gate.admit_now(waiting=1, running=8, max_batch=8, oldest_waited_steps=99)  # no room
    assert not gate.admit_now(waiting=0, running=0, max_batch=8, oldest_waited_steps=0)


def test_on_gathers_until_enough_wait_or_the_oldest_has_waited():
    gate = AdmissionGate(max_wait_steps=4)  # a quarter of 16 rows: 4 requests are enough
    assert gate.admit_now(waiting=1, running=0, max_batch=16, oldest_waited_steps=0)  # nothing to protect
    assert not gate.admit_now(waiting=3, running=5, max_batch=16, oldest_waited_steps=3)
    assert gate.admit_now(waiting=4, running=5, max_batch=16, oldest_waited_steps=0)
    assert gate.admit_now(waiting=1, running=5, max_batch=16, oldest_waited_steps=4)
    assert gate.admit_now(waiting=2, running=14, max_batch=16, oldest_waited_steps=0)  # fills every free row


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_wait_steps"):
        AdmissionGate(max_wait_steps=-1)
    with pytest.raises(ValueError, match="gather_fraction"):
        AdmissionGate(max_wait_steps=2, gather_fraction=0)


def arrivals(wait: int, n: int) -> tuple[dict, int, bool]:
    """A long request decoding, then n short ones arriving a few steps apart: outputs, the prefill
    forwards the short ones took, and whether they all ended while the long one still ran."""
    h = Harness(llama_model(), max_batch_size=16, admit_wait_steps=wait)
    try:
        long = h.submit("long", ids(10, 1), max_new=2000)
        while h.sched.stats()["decode_steps"] < 3:
            time.sleep(0.002)
        f0 = h.forwards()
        futs = {}
        for i in range(n):
            futs[f"s{i}"] = h.submit(f"s{i}", ids(8 + i, 10 + i), max_new=4)
            time.sleep(0.003)
        out = {rid: f.result(timeout=60) for rid, f in futs.items()}
        forwards, before_long = h.forwards() - f0, not long.done()
        h.sched.abort(rid="long")  # its tokens are not compared: only the arrivals are
        long.result(timeout=60)
        return out, forwards, before_long
    finally:
        h.close()


def test_arrivals_gather_into_one_prefill_with_the_same_outputs():
    at_once, _, _ = arrivals(0, 4)
    # A quarter of 16 rows: the 4th arrival ends the gathering; the wait bound never does.
    gathered, forwards, before_long = arrivals(10_000, 4)
    assert_same(gathered, at_once)
    assert forwards == 1 and before_long


def test_a_lone_arrival_waits_at_most_max_wait_steps():
    out, forwards, before_long = arrivals(5, 1)
    assert forwards == 1 and before_long and out["s0"].error is None
