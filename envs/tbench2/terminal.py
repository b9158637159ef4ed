"""A tmux terminal inside the sandbox, driven the way the Terminus-2 agent drives one.

Keystrokes go to a tmux session (a lone tmux key name such as `C-c` or `Escape` is sent as that
key; other text is typed literally, each newline pressed as Enter; long text goes through a paste
buffer); the driver then waits the requested duration (clamped to `max_duration_s`) and returns
what appeared since the previous read: the scrollback from the line the cursor was on, to the
cursor now, cut to the first and last `max_output_bytes / 2` bytes.

The tmux server runs inside the sandbox on its own socket (`-L agentrl`), so a task that uses
tmux itself does not see it; it lives across execs because the sandbox keeps its processes.
"""

from __future__ import annotations

import asyncio
import re
import shlex

from agentrl.sandbox.base import Sandbox, SandboxError

_KEY_NAME = re.compile(
    r"^(?:[CM]-.|C-M-.|Enter|Escape|Tab|BTab|BSpace|Space|Up|Down|Left|Right|Home|End|PageUp|PageDown|PPage|NPage|DC|IC|F[1-9]|F1[0-2])$"
)
_PASTE_OVER_BYTES = 4096  # longer keystrokes go through a paste buffer (one upload, one tmux call)
_TMUX_TIMEOUT_S = 30.0
_NEW_SHELL_NOTE = "[the shell exited; a new one was started]\n"
_SHELL_GONE_NOTE = "[the shell exited; the next keystrokes start a new one]\n"


def cap_text(text: str, max_bytes: int) -> str:
    """Keep the first and last max_bytes/2 bytes of `text`, saying how much was dropped."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= max_bytes:
        return text
    head, tail = data[: max_bytes // 2], data[len(data) - (max_bytes - max_bytes // 2) :]
    omitted = len(data) - len(head) - len(tail)
    return (
        head.decode("utf-8", errors="ignore")
        + f"\n[... {omitted} bytes of output omitted ...]\n"
        + tail.decode("utf-8", errors="ignore")
    )


class TmuxTerminal:
    def __init__(
        self,
        sandbox: Sandbox,
        *,
        cwd: str = "/app",
        session: str = "agent",
        width: int = 160,
        height: int = 40,
        history_lines: int = 50_000,
        max_output_bytes: int = 10_000,
        max_duration_s: float = 60.0,
    ):
        self.sandbox = sandbox
        self.cwd = cwd
        self.session = session
        self.width, self.height, self.history_lines = width, height, history_lines
        self.max_output_bytes = max_output_bytes
        self.max_duration_s = max_duration_s
        self._read_from = 0  # absolute line (history + screen) where the next read starts
        self._tmux = "tmux -L agentrl"
        self._target = f"-t {shlex.quote(session)}"

    async def _sh(self, script: str, what: str, *, max_output_bytes: int = 1 << 20) -> str:
        res = await self.sandbox.exec(
            script, cwd="/", timeout_s=_TMUX_TIMEOUT_S, max_output_bytes=max_output_bytes
        )
        if res.timed_out or res.exit_code != 0:
            raise SandboxError(
                "terminal", f"tmux {what} failed (exit {res.exit_code}): {res.output.strip()[:300]}"
            )
        return res.output

    async def start(self) -> str:
        """Start the session; returns the first screen."""
        conf = f"/tmp/.agentrl-tmux-{self.session}.conf"
        await self._sh(
            f"command -v tmux >/dev/null || {{ echo 'tmux is not installed in this sandbox'; exit 1; }}; "
            f"printf 'set -g history-limit {int(self.history_lines)}\\nset -g status off\\n' > {conf} && "
            f"{self._tmux} -f {conf} new-session -d -s {shlex.quote(self.session)} -x {int(self.width)} "
            f"-y {int(self.height)} -c {shlex.quote(self.cwd)}",
            "start",
        )
        self._read_from = 0
        await asyncio.sleep(0.2)  # let the shell print its prompt
        return await self.read()

    async def alive(self) -> bool:
        res = await self.sandbox.exec(
            f"{self._tmux} has-session {self._target}", cwd="/", timeout_s=_TMUX_TIMEOUT_S
        )
        return res.exit_code == 0 and not res.timed_out

    async def send(self, keystrokes: str, duration_s: float | None = None) -> str:
        """Type `keystrokes`, wait, and return the new output."""
        note = ""
        if not await self.alive():
            await self.start()
            note = _NEW_SHELL_NOTE
        if _KEY_NAME.match(keystrokes):
            await self._sh(f"{self._tmux} send-keys {self._target} {keystrokes}", "send-keys")
        elif len(keystrokes.encode()) > _PASTE_OVER_BYTES:
            path = f"/tmp/.agentrl-paste-{self.session}"
            await self.sandbox.upload(keystrokes.encode(), path)
            # paste-buffer turns each LF into CR, i.e. Enter, as typing would.
            await self._sh(
                f"{self._tmux} load-buffer -b agentrl {path} && rm -f {path} && "
                f"{self._tmux} paste-buffer -d -b agentrl {self._target}",
                "paste",
            )
        elif keystrokes:
            steps = []
            for i, chunk in enumerate(keystrokes.split("\n")):
                if i:
                    steps.append(f"{self._tmux} send-keys {self._target} Enter")
                # A NUL (model output can decode to one) cannot travel in argv: it is typed as
                # C-@, the key that sends it, between the literal pieces around it.
                for j, piece in enumerate(chunk.split("\x00")):
                    if j:
                        steps.append(f"{self._tmux} send-keys {self._target} C-@")
                    if piece:
                        steps.append(f"{self._tmux} send-keys {self._target} -l -- {shlex.quote(piece)}")
            await self._sh(" && ".join(steps), "send-keys")
        wait = 1.0 if duration_s is None else duration_s
        await asyncio.sleep(min(max(wait, 0.0), self.max_duration_s))
        return note + await self.read()

    async def read(self) -> str:
        """The lines from where the last read stopped (the cursor's line then, so a command
        typed at the prompt shows) through the cursor's line now."""
        out = await self._sh(
            f"{self._tmux} has-session {self._target} 2>/dev/null || {{ echo gone; exit 0; }}; "
            f"h=$({self._tmux} display -p {self._target} '#{{history_size}}') && "
            f"c=$({self._tmux} display -p {self._target} '#{{cursor_y}}') && echo \"$h $c\" && "
            f"s=$(( {self._read_from} - h )); [ $s -lt -$h ] && s=-$h; "
            f"{self._tmux} capture-pane -p -J {self._target} -S $s -E $c",
            "capture-pane",
            max_output_bytes=8 << 20,
        )
        first, _, text = out.partition("\n")
        if first == "gone":
            return _SHELL_GONE_NOTE
        history, cursor = (int(x) for x in first.split())
        self._read_from = history + cursor
        return cap_text(text.rstrip("\n") + ("\n" if text.strip() else ""), self.max_output_bytes)

    async def screen(self) -> str:
        """The visible screen as it is now."""
        return (await self._sh(f"{self._tmux} capture-pane -p -J {self._target}", "capture-pane")).rstrip(
            "\n"
        )
