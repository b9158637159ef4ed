"""Files in and out of a local sandbox, through a process inside it: paths (and symlinks the agent
planted) resolve in the sandbox's own mount namespace and can never reach a host file."""

from __future__ import annotations

import base64
from typing import Protocol

from agentrl.sandbox.base import ExecResult, SandboxError


class LocalSandbox(Protocol):
    """What these functions use of local_box.LocalSandbox (named here, not imported: no circle)."""

    id: str
    workdir: str

    async def _run(self, script: str, args: list[str], **kw) -> ExecResult: ...

MAX_DOWNLOAD_BYTES = 256 << 20
# Write to a temp file and rename over the target, so a symlink the agent planted at the target
# is replaced rather than followed.
_UPLOAD_SCRIPT = (
    'd=$(dirname -- "$1") && mkdir -p -- "$d" && t=$(mktemp -p "$d" .upload.XXXXXX) && '
    'cat > "$t" && chmod 644 -- "$t" && mv -fT -- "$t" "$1"'
)


async def upload_file(box: LocalSandbox, data: bytes, path: str) -> None:
    path = _abs(box, path)
    res = await box._run(
        _UPLOAD_SCRIPT, [path], cwd="/", env=None, timeout_s=120.0, max_output_bytes=4096, stdin=data
    )
    if res.exit_code != 0:
        raise SandboxError("exec", f"upload to {path} in sandbox {box.id} failed: {res.output.strip()[:500]}")


async def download_file(box: LocalSandbox, path: str) -> bytes:
    path = _abs(box, path)
    res = await box._run(
        'test -f "$1" || { echo "no such file: $1" >&2; exit 44; }; '
        'test "$(stat -c %s -- "$1")" -le "$2" || { echo "larger than $2 bytes" >&2; exit 45; }; '
        'base64 -w0 -- "$1"',
        [path, str(MAX_DOWNLOAD_BYTES)],
        cwd="/",
        env=None,
        timeout_s=120.0,
        max_output_bytes=MAX_DOWNLOAD_BYTES * 4 // 3 + 4096,
    )
    if res.exit_code == 44:
        raise FileNotFoundError(f"sandbox {box.id}: {path}")
    if res.exit_code != 0 or res.truncated:
        raise SandboxError(
            "exec", f"download of {path} from sandbox {box.id} failed: {res.output.strip()[:500]}"
        )
    return base64.b64decode(res.output)


def _abs(box: LocalSandbox, path: str) -> str:
    return path if path.startswith("/") else f"{box.workdir.rstrip('/')}/{path}"
