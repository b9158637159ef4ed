"""Live progress of a run: one line per step on a terminal (rich), plain lines otherwise."""

from __future__ import annotations

import sys

from rich.console import Console

from agentrl.secrets import redact


class Progress:
    def __init__(self, quiet: bool = False):
        self.console = Console(stderr=True, highlight=False)
        self.quiet = quiet

    def note(self, text: str) -> None:
        if not self.quiet:
            self.console.print(f"[dim]agentrl:[/dim] {redact(text)}")

    def step(self, row: dict) -> None:
        if self.quiet:
            return
        ev = row.get("eval_pass_rate")
        parts = [
            f"step {row['step']:>4}",
            f"reward {row['reward_mean']:.3f}",
            f"eval {ev:.2f}" if ev is not None else "eval   - ",
            f"stale max {row['staleness_max']}",
            f"v{row['weight_version']}",
            f"{row['episodes_per_s']:.2f} ep/s",
            f"{row['gen_tokens_per_s']:.0f} tok/s",
            f"infra {row['episodes_infra_error']}",
            f"idle {row['trainer_idle_ratio']:.2f}",
        ]
        line = " | ".join(parts)
        if self.console.is_terminal:
            self.console.print(line)
        else:
            print(line, file=sys.stderr, flush=True)
