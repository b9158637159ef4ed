"""agentrl transcripts (RUN_DIR/transcripts/*.jsonl, agentrl/agent/runner.py) as ATIF trajectories
(Harbor's Agent Trajectory Interchange Format, harbor.models.trajectories), laid out as a Harbor
job folder so that `harbor view OUT` opens them.

A transcript row holds the decoded conversation after the first prompt (`text`: the model's
turns and the observations between them, with the chat template's tokens) and the episode's
summary. The turns are cut back apart at the template's observation turns: the text the run's
tokenizer renders between an assistant turn and the next one is known (agentrl.agent.chat builds
the conversation from exactly that delta), so each observation sits between its opening and the
next assistant opening. When the cut does not give the row's own turn count (a model that itself
wrote a whole observation turn), the episode is one agent step and its `extra` says so.
The first two steps (system prompt, task instruction) are not in transcripts: they are rebuilt
from the run's action format and the task folder, and marked as rebuilt.

Steps: system, user (instruction), then agent (a model turn, with the weight versions that
produced it) and user (the observation that followed) in turn. The trajectory's `extra` carries
the episode's outcome, reward, timings and info.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

ATIF_VERSION = "ATIF-v1.8"
AGENT_NAME = "agentrl"
_MARKER = "<<agentrl-atif-turn-5b2d>>"
_OBS = "<<agentrl-atif-observation-5b2d>>"


@dataclass(frozen=True)
class TurnCutter:
    """Where a chat template puts an observation turn between two assistant turns."""

    opening: str  # from the observation turn's role marker on (what the model cannot have produced)
    closing: str  # from the observation's end to the next assistant turn's content
    special: tuple[str, ...]

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> TurnCutter:
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"},
                    {"role": "assistant", "content": _MARKER}, {"role": "user", "content": _OBS}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        between, _, closing = rendered.split(_MARKER, 1)[1].partition(_OBS)
        special = tuple(sorted(tokenizer.all_special_tokens, key=len, reverse=True))
        # What closes the assistant turn (its end-of-turn token, even the next role token) may be
        # the model's own output in the transcript: cut from the last template token on (the
        # observation turn's role marker), which the delta always adds.
        last = max((between.rfind(tok) for tok in special), default=-1)
        return cls(between[last:] if last >= 0 else between, closing, special)

    def cut(self, text: str, turns: int) -> tuple[list[str], list[str]] | None:
        """(the model's turns, the observations between them), or None when the text does not
        hold `turns` turns."""
        pattern = re.compile(re.escape(self.opening) + "(.*?)" + re.escape(self.closing), re.DOTALL)
        matches = list(pattern.finditer(text))
        if len(matches) != turns - 1:
            return None
        replies, observations, start = [], [], 0
        for m in matches:
            replies.append(self.clean(text[start:m.start()]))
            observations.append(m.group(1))
            start = m.end()
        replies.append(self.clean(text[start:]))
        return replies, observations

    def clean(self, reply: str) -> str:
        """A model turn without the template tokens that end it."""
        changed = True
        while changed:
            changed = False
            reply = reply.rstrip("\n")
            for tok in self.special:
                if reply.endswith(tok):
                    reply, changed = reply[: -len(tok)], True
        return reply


def _iso(ts: float | None) -> str | None:
    return datetime.fromtimestamp(ts, UTC).isoformat() if isinstance(ts, (int, float)) else None


def transcript_to_atif(row: dict[str, Any], *, cutter: TurnCutter, model_name: str, system_prompt: str,
                       instruction: str | None, agent_version: str = "0.1.0") -> dict[str, Any]:
    """One transcript row -> an ATIF trajectory (a JSON-ready dict; see the module docstring)."""
    turns = int(row.get("turns") or 0)
    text = str(row.get("text") or "")
    cut = cutter.cut(text, turns) if turns >= 1 else None
    rebuilt = {"agentrl_rebuilt": "not in the transcript: from the run's action format and the task folder"}
    steps: list[dict[str, Any]] = [
        {"source": "system", "message": system_prompt, "extra": rebuilt},
        {"source": "user", "message": instruction if instruction is not None
         else f"(the instruction of task {row.get('task_id')!r} was not found)", "extra": rebuilt},
    ]
    versions = row.get("turn_versions") if isinstance(row.get("turn_versions"), list) else []
    if cut is None:
        steps.append({"source": "agent", "model_name": model_name, "message": cutter.clean(text),
                      "extra": {"agentrl_turns": turns, "agentrl_split": "the turns could not be told apart"}})
    else:
        replies, observations = cut
        for i, reply in enumerate(replies):
            extra = {"weight_versions": versions[i]} if i < len(versions) else None
            steps.append({"source": "agent", "model_name": model_name, "message": reply, "llm_call_count": 1,
                          **({"extra": extra} if extra else {})})
            if i < len(observations):
                steps.append({"source": "user", "message": observations[i]})
    for i, step in enumerate(steps):
        step["step_id"] = i + 1
    steps[-1]["timestamp"] = _iso(row.get("time"))
    if steps[-1]["timestamp"] is None:
        del steps[-1]["timestamp"]
    keep = ("episode_id", "task_id", "group_id", "outcome", "reward", "passed", "tokens", "generated", "turns",
            "oldest_version", "evaluate", "duration_s", "timings", "info", "versions")
    return {
        "schema_version": ATIF_VERSION, "session_id": str(row.get("episode_id")),
        "agent": {"name": AGENT_NAME, "version": agent_version, "model_name": model_name},
        "steps": steps,
        "final_metrics": {"total_completion_tokens": row.get("generated"), "total_steps": len(steps),
                          "extra": {"total_tokens": row.get("tokens")}},
        "extra": {k: row[k] for k in keep if k in row},
    }
