"""Optional experiment trackers: every metrics.jsonl row also goes to TensorBoard and/or W&B.

Turned on by `logging.tensorboard` (scalars under RUN_DIR/tensorboard) and
`logging.wandb_project` (with `logging.wandb_entity` / `logging.wandb_mode`). Only the process
that runs the orchestrator opens them. Keys come from the environment alone: wandb reads
WANDB_API_KEY (or `wandb login`'s ~/.netrc) itself; nothing here reads, stores or prints it, and
the config sent to W&B and every error message pass through `redact`.

Opening fails loudly (a missing package or a refused login is a clear error before the run
starts); logging a row never raises (a tracker outage must not take a run down: the first
failure of each sink is reported, later ones are dropped). `close` is idempotent and is called
on success and on errors (W&B then marks the run failed).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from agentrl.config.schema import LoggingConfig
from agentrl.secrets import redact

log = logging.getLogger(__name__)

# Row fields that are not per-step measurements: the x axis itself and a wall-clock timestamp.
SKIP_KEYS = frozenset({"step", "time"})


class Sink(Protocol):
    name: str

    def log(self, step: int, scalars: dict[str, float], row: dict) -> None: ...

    def close(self, failed: bool) -> None: ...


def scalars_of(row: dict) -> dict[str, float]:
    """The row's finite numbers, nested dicts flattened as `outcomes/scored`; lists, text and
    missing values are left out (staleness lists go to a histogram instead)."""
    out: dict[str, float] = {}

    def add(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                add(f"{key}/{k}", v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)

    for key, value in row.items():
        if key not in SKIP_KEYS:
            add(key, value)
    return out


class TensorboardSink:
    name = "tensorboard"

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise RuntimeError(
                "logging.tensorboard is true but the tensorboard package is not installed: "
                "pip install tensorboard, or set logging.tensorboard=false") from e
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, scalars: dict[str, float], row: dict) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)
        lags = row.get("staleness")
        if lags:
            import numpy as np

            self._writer.add_histogram("staleness", np.asarray(lags, dtype=np.float64), global_step=step)
        self._writer.flush()  # once per optimizer step: TensorBoard sees each step as it lands

    def close(self, failed: bool) -> None:
        self._writer.close()


class WandbSink:
    name = "wandb"

    def __init__(self, cfg: LoggingConfig, run_dir: Path, run_id: str, config: dict):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError(
                f"logging.wandb_project is set ({cfg.wandb_project!r}) but the wandb package is not "
                "installed: pip install wandb (or pip install 'agentrl[wandb]'), or unset "
                "logging.wandb_project") from e
        clean_config = json.loads(redact(json.dumps(config, default=str)))
        try:
            # console="off": wandb must not wrap stdout/stderr (the launcher's live panel owns them).
            self._run = wandb.init(
                project=cfg.wandb_project, entity=cfg.wandb_entity, mode=cfg.wandb_mode, name=run_id,
                dir=str(run_dir), config=clean_config, reinit="create_new",
                settings=wandb.Settings(console="off", silent=True))
        except Exception as e:
            raise RuntimeError(redact(
                f"wandb.init failed for logging.wandb_project={cfg.wandb_project!r} "
                f"(mode {cfg.wandb_mode or 'from WANDB_MODE, else online'}): {type(e).__name__}: {e}. "
                "Online mode needs WANDB_API_KEY in the launcher's environment (or `wandb login`); "
                "logging.wandb_mode=offline logs to RUN_DIR/wandb for a later `wandb sync`.")) from e

    @property
    def where(self) -> str:
        if getattr(self._run, "disabled", False):
            return "disabled (logging.wandb_mode or WANDB_MODE)"
        if self._run.offline:
            return f"offline, in {Path(self._run.dir).parent} (upload later with `wandb sync` on that folder)"
        return str(self._run.url)

    def log(self, step: int, scalars: dict[str, float], row: dict) -> None:
        self._run.log(scalars, step=step)

    def close(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)


class RunLoggers:
    """The sinks a run's config asks for; with none configured every call is a no-op."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = list(sinks)
        self._failed_sinks: set[str] = set()
        self._closed = False

    @classmethod
    def open(cls, cfg: LoggingConfig, run_dir: Path, run_id: str, config: dict,
             note: Callable[[str], None] | None = None) -> RunLoggers:
        """Open every configured sink; if one fails, those already open are closed first."""
        sinks: list[Sink] = []
        try:
            if cfg.tensorboard:
                tb = TensorboardSink(Path(run_dir) / "tensorboard")
                sinks.append(tb)
                if note:
                    note(f"tensorboard scalars in {tb.log_dir} (tensorboard --logdir {tb.log_dir})")
            if cfg.wandb_project:
                wb = WandbSink(cfg, Path(run_dir), run_id, config)
                sinks.append(wb)
                if note:
                    note(f"wandb run {run_id}: {wb.where}")
        except BaseException:
            cls(sinks).close(failed=True)
            raise
        return cls(sinks)

    def log(self, row: dict) -> None:
        """One metrics.jsonl row to every sink; never raises."""
        if not self.sinks or self._closed:
            return
        step, scalars = int(row["step"]), scalars_of(row)
        for sink in self.sinks:
            try:
                sink.log(step, scalars, row)
            except Exception as e:  # noqa: BLE001 - a tracker outage must not stop training
                if sink.name not in self._failed_sinks:
                    self._failed_sinks.add(sink.name)
                    log.warning(redact(f"{sink.name} logging failed at step {step} ({type(e).__name__}: {e}); "
                                       "later failures of it are not reported"))

    def close(self, failed: bool = False) -> None:
        """Flush and close every sink once; a sink that fails to close does not stop the others."""
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks:
            try:
                sink.close(failed)
            except Exception as e:  # noqa: BLE001 - closing must reach every sink
                log.warning(redact(f"closing {sink.name} failed: {type(e).__name__}: {e}"))
