"""Optional trackers: TensorBoard scalars read back from the event file, W&B offline records read
back from the run file, clear errors for missing packages, secrets never leave, clean closing."""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import sys
import time
import types
from pathlib import Path

import pytest

from agentrl.config.loader import load_config
from agentrl.config.plan import resolve_plan
from agentrl.config.schema import LoggingConfig
from agentrl.loggers import RunLoggers, scalars_of

SECRET = "wandb_secret_abcdef0123456789"


def _row(step: int, reward: float) -> dict:
    return {"step": step, "weight_version": step, "reward_mean": reward, "staleness_max": 1,
            "staleness": [0, 1, 1], "outcomes": {"scored": 4 * step, "infra_error:engine": 1},
            "eval_pass_rate": None, "time": 1.7e9, "converged": True, "note": "text", "loss": float("nan")}


def test_scalars_flatten_numbers_only():
    s = scalars_of(_row(2, 0.5))
    assert s == {"weight_version": 2.0, "reward_mean": 0.5, "staleness_max": 1.0,
                 "outcomes/scored": 8.0, "outcomes/infra_error:engine": 1.0}


def test_nothing_configured_is_a_no_op(tmp_path):
    loggers = RunLoggers.open(LoggingConfig(run_dir=tmp_path), tmp_path, "r", {})
    loggers.log(_row(1, 0.0))
    loggers.close()
    assert loggers.sinks == [] and list(tmp_path.iterdir()) == []


def test_tensorboard_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    notes: list[str] = []
    loggers = RunLoggers.open(LoggingConfig(run_dir=tmp_path, tensorboard=True), tmp_path, "r", {},
                              note=notes.append)
    loggers.log(_row(1, 0.25))
    loggers.log(_row(2, 0.75))
    loggers.close()
    loggers.close()  # idempotent
    assert any(str(tmp_path / "tensorboard") in n for n in notes)

    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"reward_mean", "weight_version", "outcomes/scored"} <= set(tags["scalars"])
    assert "time" not in tags["scalars"] and "step" not in tags["scalars"] and "loss" not in tags["scalars"]
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.25), (2, 0.75)]
    assert [e.value for e in acc.Scalars("outcomes/scored")] == [4.0, 8.0]
    hist = acc.Histograms("staleness")
    assert [h.step for h in hist] == [1, 2] and hist[0].histogram_value.num == 3


def test_missing_packages_name_the_field_and_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(RuntimeError, match=r"logging\.wandb_project.*pip install wandb"):
        RunLoggers.open(LoggingConfig(run_dir=tmp_path, wandb_project="p"), tmp_path, "r", {})
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(RuntimeError, match=r"logging\.tensorboard.*pip install tensorboard"):
        RunLoggers.open(LoggingConfig(run_dir=tmp_path, tensorboard=True), tmp_path, "r", {})


def test_a_failed_open_closes_what_was_opened(tmp_path, monkeypatch):
    from agentrl import loggers as mod

    closed: list[bool] = []
    monkeypatch.setattr(mod.TensorboardSink, "close", lambda self, failed: closed.append(failed))
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(RuntimeError):
        RunLoggers.open(LoggingConfig(run_dir=tmp_path, tensorboard=True, wandb_project="p"), tmp_path, "r", {})
    assert closed == [True]


def test_wandb_init_failure_is_clear_and_redacted(tmp_path, monkeypatch):
    """Stand-in for W&B's server refusing a key (this machine cannot reach it)."""
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    fake = types.ModuleType("wandb")
    fake.Settings = lambda **kw: kw

    def init(**kwargs):
        raise PermissionError(f"401: key {SECRET} rejected")

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with pytest.raises(RuntimeError) as err:
        RunLoggers.open(LoggingConfig(run_dir=tmp_path, wandb_project="proj"), tmp_path, "r", {})
    msg = str(err.value)
    assert SECRET not in msg and "***" in msg
    assert "logging.wandb_project='proj'" in msg and "WANDB_API_KEY" in msg and "wandb_mode=offline" in msg


def test_a_sink_failing_mid_run_never_raises_and_warns_once(caplog):
    class Broken:
        name = "broken"

        def __init__(self):
            self.closed = None

        def log(self, step, scalars, row):
            raise OSError("disk full")

        def close(self, failed):
            self.closed = failed
            raise OSError("still full")

    sink = Broken()
    loggers = RunLoggers([sink])
    with caplog.at_level(logging.WARNING, logger="agentrl.loggers"):
        for step in (1, 2, 3):
            loggers.log(_row(step, 0.0))
        loggers.close(failed=True)
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("broken logging failed" in w for w in warnings) == 1
    assert any("closing broken failed" in w for w in warnings) and sink.closed is True


# -- W&B for real, offline ---------------------------------------------------------------------
def _wandb_records(run_file: Path) -> list:
    """The protobuf records of a .wandb file: a 7-byte W&B header, then LevelDB-log-format
    records (4-byte CRC, 2-byte length, 1-byte type; FULL=1, FIRST=2, MIDDLE=3, LAST=4) in
    32 KiB blocks whose tails shorter than a record header are padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos = run_file.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, parts = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            records.append(rec)
    return records


def _finished_wandb_records(run_dir: Path, timeout_s: float = 60.0) -> list:
    """The records of the run's .wandb file once its exit record is on disk. wandb-core writes
    the file from its own service process, and under a loaded CI machine `finish()` has returned
    before the history records reached the file (CI saw an empty history once); a reader waits
    for the exit record, which is written last."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
        records = _wandb_records(files[0]) if len(files) == 1 else []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            assert len(files) == 1, files
            return records
        time.sleep(0.2)


def test_wandb_offline_logs_every_row_and_no_secret(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is in the [dev] extra")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    cfg = LoggingConfig(run_dir=tmp_path, wandb_project="agentrl-test", wandb_mode="offline")
    notes: list[str] = []
    # A secret that slipped into a config value is masked before the config leaves the process.
    loggers = RunLoggers.open(cfg, tmp_path, "local-abc", {"recipe": "local", "oops": SECRET}, note=notes.append)
    loggers.log(_row(1, 0.25))
    loggers.log(_row(2, 0.75))
    loggers.close(failed=True)

    assert any("offline" in n and "wandb sync" in n for n in notes)
    records = _finished_wandb_records(tmp_path)
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["reward_mean"], h["outcomes/scored"]) for h in history] == [(1, 0.25, 4.0), (2, 0.75, 8.0)]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "agentrl-test" and run.display_name == "local-abc"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["oops"] == "***" and config["recipe"] == "local"
    (exit_rec,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_rec.exit_code == 1  # closed because the run failed
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == []


# -- wiring: the orchestrator opens the sinks before anything starts and closes them on errors --
def test_orchestrator_fails_fast_on_a_missing_tracker_and_cleans_up(tmp_path, monkeypatch):
    from agentrl.orchestrator import Orchestrator
    from agentrl.progress import Progress

    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = load_config("local", [f"logging.run_dir={tmp_path}", "logging.tensorboard=true",
                                "logging.wandb_project=agentrl-test"])
    ended: list[bool] = []

    class Recording(Progress):
        def end(self):
            ended.append(True)
            super().end()

    orch = Orchestrator(cfg, resolve_plan(cfg), progress=Recording(quiet=True))
    with pytest.raises(RuntimeError, match="pip install wandb"):
        asyncio.run(orch.run())
    assert ended == [True]
    assert orch.ray is None  # failed before Ray was started
    assert (tmp_path / "tensorboard").is_dir()  # opened, then closed by the failure
