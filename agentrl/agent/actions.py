"""The two action formats a model may answer in, and what each tells the model.

- `bash_block`: a fenced ```bash block per turn (its contents go to the env as one command), or
  the word TASK_COMPLETE to finish. This is the reference recipe's format. A reply with no
  labelled block may use one unlabeled ``` fence instead. Only the first labelled block runs:
  what follows it (more blocks, prose, a TASK_COMPLETE) is ignored, since small models keep
  writing after their command (SmolLM2-135M on generated tasks: 256 of 277 replies with a
  ```bash block go on after it, 25 with another block or "... reply TASK_COMPLETE", which the
  one-block rule refused). A `sudo` in command position is dropped: the agent already runs as
  root and sandbox images have no sudo (SmolLM2 starts 59 of those 277 blocks with it, each a
  sure failure otherwise).
- `terminus_json`: the Terminus-2 protocol: a JSON object {"analysis", "plan", "commands":
  [{"keystrokes", "duration"}], "task_complete"}; keystrokes go verbatim to the terminal, each
  duration is clamped to the command timeout (60 s by default, as Terminus does), and finishing
  takes `task_complete: true` in two consecutive turns, so a slip does not end an episode.

A format object is made per episode (`make_action_format`): the terminus one remembers whether
completion is awaiting confirmation. `parse` never raises on model text: anything malformed comes
back as `ParsedTurn.error`, which the agent feeds back to the model as the next observation.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from agentrl.envs.base import Action

TASK_COMPLETE = "TASK_COMPLETE"
# Terminus waits one second after keystrokes that name no duration.
DEFAULT_KEYSTROKE_DURATION_S = 1.0

_BASH_BLOCK = re.compile(r"```(?:bash|sh|shell)[ \t]*\n(.*?)```", re.DOTALL)
# A fence with no language tag: small models often drop the tag. Such blocks are the commands
# only when the reply has no labelled block (then an unlabeled block is usually shown output).
_PLAIN_BLOCK = re.compile(r"```[ \t]*\n(.*?)```", re.DOTALL)
_ANY_FENCE = re.compile(r"```")
_TASK_COMPLETE = re.compile(rf"\b{TASK_COMPLETE}\b")
# `sudo` (with its flags) where a command starts: a line start or after ; & | ( or `.
_SUDO = re.compile(r"(^[ \t]*|[;&|(`][ \t]*)sudo(?:[ \t]+-\S+)*[ \t]+", re.MULTILINE)

# Worked examples of training-family skills only (write, count, copy), never of a held-out family.
# SmolLM2-135M on 136 generated training tasks, 1 turn: 6 passed with this prompt (T 0.5, this
# parser), 1 at T 0.7 with the one-block parser; the earlier one-example prompt passed 0 (T 0.7).
BASH_BLOCK_SYSTEM_PROMPT = f"""\
You are a shell agent in a Linux terminal. Reply with one shell command in a ```bash block and nothing else.
You are root already: never use sudo. No comments, no explanations.

Examples:
Task: Write the line `good morning` into `/app/greet.txt`.
```bash
echo 'good morning' > /app/greet.txt
```
Task: Count the lines of `/app/data/list.txt` and write the number to `/app/n.txt`.
```bash
wc -l < /app/data/list.txt > /app/n.txt
```
Task: Copy `/app/a.conf` to `/app/backup/a.conf`.
```bash
cp /app/a.conf /app/backup/a.conf
```
When the task is done, reply {TASK_COMPLETE}."""

TERMINUS_SYSTEM_PROMPT = """\
You solve a task by typing into a Linux terminal (a tmux session), one reply per turn.
Each reply is one JSON object and nothing else:
{
  "analysis": "what the current terminal output tells you",
  "plan": "what you will do next and why",
  "commands": [{"keystrokes": "ls -la\\n", "duration": 0.5}],
  "task_complete": false
}
"keystrokes" are sent verbatim: end a command with "\\n" to run it; tmux key names such as C-c
are allowed. "duration" is how many seconds to wait for output (at most %(max_s)g).
The terminal output after your commands is the next message.
Set "task_complete": true when the task is done; you will be asked to confirm it with a second
reply that also has "task_complete": true."""

COMPLETION_CONFIRMATION = (
    'You set "task_complete": true. Your work will now be graded and cannot be changed. '
    'If the task is really done, reply again with "task_complete": true; otherwise continue with '
    '"task_complete": false.'
)


def strip_reasoning(text: str) -> str:
    """The reply without its reasoning: only what follows the last </think> (reasoning templates
    often open the think block in the prompt, so the reply has no <think>), and nothing from an
    unclosed <think> on. Commands written while thinking are never run."""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    return text.split("<think>", 1)[0]


def drop_sudo(command: str) -> str:
    """The command without `sudo` where a command starts (the agent is root already)."""
    return _SUDO.sub(r"\1", command)


class _BadReply(Exception):
    """A reply that does not follow the format; its message is fed back to the model."""


@dataclass
class ParsedTurn:
    """What one model reply asks for. `error` set: nothing runs, the text is fed back.
    `complete`: the agent ends the episode after running `actions`. `notice` is appended to the
    observation (e.g. the completion confirmation request)."""

    actions: list[Action] = field(default_factory=list)
    complete: bool = False
    error: str | None = None
    notice: str | None = None


class BashBlockFormat:
    name = "bash_block"

    def __init__(self, command_timeout_s: float):
        self.command_timeout_s = command_timeout_s
        self.system_prompt = BASH_BLOCK_SYSTEM_PROMPT

    def parse(self, text: str) -> ParsedTurn:
        visible = strip_reasoning(text)
        labelled = _BASH_BLOCK.search(visible)
        if labelled is not None:
            return self._run(labelled.group(1))
        done = bool(_TASK_COMPLETE.search(visible))
        plain = _PLAIN_BLOCK.findall(visible)
        if len(plain) == 1 and not done:
            return self._run(plain[0])
        if not plain and done:
            return ParsedTurn(complete=True)
        if plain and done:
            return ParsedTurn(
                error=f"Reply with either one ```bash block or {TASK_COMPLETE}, not both. " + self._reminder()
            )
        if len(plain) > 1:
            return ParsedTurn(
                error=f"Found {len(plain)} ``` blocks; send exactly one ```bash block per reply. " + self._reminder()
            )
        if _ANY_FENCE.search(visible):
            return ParsedTurn(
                error="No complete ```bash block found (a block opens with ```bash and a newline and closes with ```). "
                + self._reminder()
            )
        return ParsedTurn(error="No ```bash block found. " + self._reminder())

    def _run(self, block: str) -> ParsedTurn:
        command = drop_sudo(block).strip()
        if not command:
            return ParsedTurn(error="Your ```bash block is empty. " + self._reminder())
        return ParsedTurn(actions=[Action(command=command, duration_s=self.command_timeout_s)])

    @staticmethod
    def _reminder() -> str:
        return f"Reply with exactly one ```bash block containing one command, or {TASK_COMPLETE} when done."


class TerminusJsonFormat:
    name = "terminus_json"

    def __init__(self, command_timeout_s: float):
        self.max_duration_s = command_timeout_s
        self.system_prompt = TERMINUS_SYSTEM_PROMPT % {"max_s": command_timeout_s}
        self._completion_pending = False

    def parse(self, text: str) -> ParsedTurn:
        try:
            reply = _json_object(strip_reasoning(text))
            actions = [self._action(i, c) for i, c in enumerate(_commands(reply))]
            wants_complete = reply.get("task_complete", False)
            if not isinstance(wants_complete, bool):
                raise _BadReply(f'"task_complete" must be true or false, got {wants_complete!r}')
        except _BadReply as err:
            # A malformed reply breaks the confirmation chain: completion needs consecutive trues.
            self._completion_pending = False
            return ParsedTurn(
                error=f"Your reply could not be used: {err}. Reply with one JSON object as described."
            )
        if not wants_complete:
            self._completion_pending = False
            return ParsedTurn(actions=actions)
        if self._completion_pending:
            return ParsedTurn(actions=actions, complete=True)
        self._completion_pending = True
        return ParsedTurn(actions=actions, notice=COMPLETION_CONFIRMATION)

    def _action(self, index: int, command: object) -> Action:
        if not isinstance(command, dict):
            raise _BadReply(f"commands[{index}] must be an object with keystrokes and duration")
        keystrokes = command.get("keystrokes")
        if not isinstance(keystrokes, str):
            raise _BadReply(f"commands[{index}].keystrokes must be a string, got {type(keystrokes).__name__}")
        duration = command.get("duration", DEFAULT_KEYSTROKE_DURATION_S)
        if isinstance(duration, bool) or not isinstance(duration, int | float) or not math.isfinite(duration):
            raise _BadReply(f"commands[{index}].duration must be a number of seconds, got {duration!r}")
        return Action(keystrokes=keystrokes, duration_s=min(max(float(duration), 0.0), self.max_duration_s))


def _json_object(text: str) -> dict:
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise _BadReply("no JSON object found")
    try:
        reply = json.loads(text[start : end + 1])
    except json.JSONDecodeError as err:
        raise _BadReply(f"invalid JSON ({err.msg} at character {err.pos})") from None
    if not isinstance(reply, dict):
        raise _BadReply("the reply must be a JSON object")
    return reply


def _commands(reply: dict) -> list:
    if "commands" not in reply:
        raise _BadReply('missing "commands" (a list, possibly empty)')
    commands = reply["commands"]
    if not isinstance(commands, list):
        raise _BadReply(f'"commands" must be a list, got {type(commands).__name__}')
    return commands


class TextFormat:
    """The whole visible reply is one action's `text` (envs that judge an answer, not a shell
    command: countdown, lognormal). A reply is never malformed; the env decides when it is done."""

    name = "text"
    system_prompt = "You solve a task by replying to the environment; your whole reply is sent to it."

    def __init__(self, command_timeout_s: float):
        self.command_timeout_s = command_timeout_s

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(actions=[Action(text=strip_reasoning(text).strip())])


ActionFormat = BashBlockFormat | TerminusJsonFormat | TextFormat


def make_action_format(name: str, command_timeout_s: float = 60.0) -> ActionFormat:
    """A fresh (per-episode) parser for the named format."""
    formats = {"bash_block": BashBlockFormat, "terminus_json": TerminusJsonFormat, "text": TextFormat}
    if name not in formats:
        raise ValueError(f"agent.action_format {name!r} is unknown; use one of {sorted(formats)}")
    return formats[name](command_timeout_s)
