"""Carry a task's declared outputs from the agent's sandbox to a fresh verifier sandbox.

The fresh-sandbox verifier (task.toml `[verifier] sandbox = "fresh"`, scorer.py) must see what the
agent produced and nothing else it left behind: no process, no replaced binary, no planted file
outside the declared outputs. So:
- in the agent's sandbox (its processes already killed) each declared path (file or folder) is
  measured, and those that fit the size cap, in the order declared, are packed with tar;
- on the host, the archive is read member by member and rebuilt with regular files and folders
  only, each under a declared path (a symlink, hard link, device or FIFO is dropped and named in the
  report), sizes counted as read, so a forged tar binary in the agent's sandbox cannot smuggle
  anything else in;
- in the fresh sandbox the clean archive is unpacked with the fresh image's own tar.
"""

from __future__ import annotations

import io
import posixpath
import shlex
import tarfile
from dataclasses import dataclass, field

from agentrl.sandbox.base import Sandbox, SandboxError

CARRY_ARCHIVE = "/tmp/.agentrl-outputs.tar"
_TAR_TIMEOUT_S = 300.0
# Per declared path: its size in bytes (du -sb counts links as links, never their targets) or
# "missing". One line each: "<size|missing>\t<path>".
_MEASURE = 'for p in "$@"; do if [ -e "$p" ] || [ -L "$p" ]; then printf "%s\\t%s\\n" "$(du -sb -- "$p" | cut -f1)" "$p"; else printf "missing\\t%s\\n" "$p"; fi; done'


@dataclass
class Carried:
    files: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # "why: path", for the verdict's detail

    def summary(self) -> str:
        text = f"carried {self.files} file(s), {self.bytes} bytes"
        return text + (f"; not carried: {'; '.join(self.skipped[:5])}" if self.skipped else "")


def _quoted(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


async def pack_outputs(sandbox: Sandbox, paths: list[str], max_bytes: int) -> tuple[bytes, Carried]:
    """The clean archive of the declared outputs in `sandbox` (see the module docstring)."""
    carried = Carried()
    if not paths:
        return b"", carried
    res = await sandbox.exec(f"sh -c {shlex.quote(_MEASURE)} sh {_quoted(paths)}", cwd="/", timeout_s=_TAR_TIMEOUT_S)
    chosen: list[str] = []
    budget = max_bytes
    for line in res.output.splitlines():
        size, _, path = line.partition("\t")
        if path not in paths:
            continue
        if size == "missing":
            carried.skipped.append(f"missing: {path}")
        elif not size.isdigit() or int(size) > budget:
            carried.skipped.append(f"over the {max_bytes} byte cap: {path}")
        else:
            budget -= int(size)
            chosen.append(path)
    if not chosen:
        return b"", carried
    rel = [p.lstrip("/") for p in chosen]
    res = await sandbox.exec(
        f"tar -C / -cf {CARRY_ARCHIVE} --ignore-failed-read -- {_quoted(rel)}", cwd="/", timeout_s=_TAR_TIMEOUT_S
    )
    if res.exit_code != 0:
        raise SandboxError("verifier", f"packing the outputs failed (exit {res.exit_code}): {res.output[-300:]}")
    try:
        raw = await sandbox.download(CARRY_ARCHIVE)
    except FileNotFoundError:
        raise SandboxError("verifier", f"tar wrote no {CARRY_ARCHIVE}") from None
    return clean_archive(raw, chosen, max_bytes, carried), carried


def clean_archive(raw: bytes, allowed: list[str], max_bytes: int, carried: Carried) -> bytes:
    """Rebuild `raw` with its regular files and folders under `allowed` only, at most `max_bytes`
    of file content; everything else is dropped and listed in `carried.skipped`."""
    roots = [posixpath.normpath(p) for p in allowed]
    out = io.BytesIO()
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as src, tarfile.open(fileobj=out, mode="w:") as dst:
            for m in src:
                _copy_member(src, dst, m, roots, max_bytes, carried)
    except tarfile.TarError as err:
        raise SandboxError("verifier", f"the outputs archive is not a readable tar file: {err}") from None
    return out.getvalue()


def _copy_member(src, dst, m: tarfile.TarInfo, roots: list[str], max_bytes: int, carried: Carried) -> None:
    name = posixpath.normpath("/" + m.name)
    if ".." in m.name.split("/") or not any(name == r or name.startswith(r + "/") for r in roots):
        carried.skipped.append(f"outside the declared outputs: {m.name[:200]}")
        return
    if not (m.isreg() or m.isdir()):
        carried.skipped.append(f"not a file or folder: {name}")
        return
    if m.isreg() and carried.bytes + m.size > max_bytes:
        carried.skipped.append(f"over the {max_bytes} byte cap: {name}")
        return
    clean = tarfile.TarInfo(name.lstrip("/"))
    clean.type, clean.mode, clean.mtime = m.type, m.mode & 0o777, m.mtime
    if m.isdir():
        dst.addfile(clean)
        return
    data = src.extractfile(m).read(m.size)
    clean.size = len(data)
    dst.addfile(clean, io.BytesIO(data))
    carried.files += 1
    carried.bytes += len(data)


async def unpack_outputs(sandbox: Sandbox, archive: bytes) -> None:
    """Unpack a clean archive at / of the fresh sandbox with its own tar."""
    if not archive:
        return
    await sandbox.upload(archive, CARRY_ARCHIVE)
    res = await sandbox.exec(
        f"tar -C / -xf {CARRY_ARCHIVE} --no-same-owner && rm -f {CARRY_ARCHIVE}", cwd="/", timeout_s=_TAR_TIMEOUT_S
    )
    if res.exit_code != 0:
        raise SandboxError("verifier", f"unpacking the outputs failed (exit {res.exit_code}): {res.output[-300:]}")
