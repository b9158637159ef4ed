"""topk_filter.SelectPipeline: two sets of candidate lists taken in turn, each handed out again only
after the current stream is made to wait for the select that last read it.

CUDA streams and events cannot run on this CPU machine, so a recording stand-in plays the streams
(tests/ only); on a GPU, tests/kernels/test_kernels_indexer.py's own-stream test runs the real ones."""
from __future__ import annotations

import torch

from kernels import topk_filter as tf


class _Recorder:
    """Stands in for torch.cuda streams: records events and the waits on them."""

    def __init__(self):
        self.waits: list[str] = []
        self.events = 0

    def record_event(self):
        self.events += 1
        return f"event{self.events}"

    def wait_event(self, event):
        self.waits.append(event)


def test_the_two_sets_alternate_and_each_is_reused_only_after_its_select(monkeypatch):
    side, current = _Recorder(), _Recorder()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    pipe = tf.SelectPipeline(side)
    a = pipe.acquire(8, 16, "cpu")
    pipe.release()  # a's select queued: event1
    b = pipe.acquire(8, 16, "cpu")
    pipe.release()  # event2
    assert a.scores.data_ptr() != b.scores.data_ptr() and current.waits == []  # both new: nothing to wait for
    a2 = pipe.acquire(6, 16, "cpu")  # fewer rows: the same lists, after a's select
    assert a2.scores.data_ptr() == a.scores.data_ptr() and current.waits == ["event1"]
    pipe.release()  # event3
    b2 = pipe.acquire(12, 16, "cpu")  # more rows: new lists, still only after b's select (its old lists)
    assert b2.scores.shape == (12, 16) and b2.scores.data_ptr() != b.scores.data_ptr()
    assert current.waits == ["event1", "event2"]
    pipe.release()
    a3 = pipe.acquire(6, 32, "cpu")  # another CAP: new lists, after a2's select
    assert a3.scores.shape == (6, 32) and current.waits == ["event1", "event2", "event3"]
