"""Verifier isolation without sandboxes: the task-level setting and the carried-outputs filter."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

import pytest

from agentrl.sandbox.base import SandboxError
from envs.tbench2.carry import Carried, clean_archive
from envs.tbench2.loader import DEFAULT_TASKS_DIR, TaskFormatError, load_task


def task_with(tmp_path: Path, verifier_lines: str) -> Path:
    d = tmp_path / "t"
    shutil.copytree(DEFAULT_TASKS_DIR / "write-name", d)
    toml = d / "task.toml"
    toml.write_text(toml.read_text().replace("[verifier]\n", "[verifier]\n" + verifier_lines + "\n"))
    return d


def test_verifier_sandbox_setting(tmp_path):
    t = load_task(task_with(tmp_path, 'sandbox = "fresh"\noutputs = ["/app/name.txt", "/app/out/"]\noutputs_max_mb = 2'))
    assert (t.verifier_sandbox, t.verifier_outputs, t.verifier_outputs_max_mb) == (
        "fresh", ["/app/name.txt", "/app/out/"], 2.0,
    )  # fmt: skip
    assert load_task(DEFAULT_TASKS_DIR / "write-name").verifier_sandbox == "same"  # the default


@pytest.mark.parametrize(
    ("lines", "named"),
    [
        ('sandbox = "separate"', "[verifier].sandbox"),
        ('outputs = ["app/name.txt"]', "[verifier].outputs"),
        ('outputs = ["/app/../etc/passwd"]', "[verifier].outputs"),
        ('outputs = ["/tests/test.sh"]', "[verifier].outputs"),
        ('outputs = ["/logs/verifier"]', "[verifier].outputs"),
        ("outputs_max_mb = 0", "[verifier].outputs_max_mb"),
    ],
)
def test_bad_verifier_settings_name_the_field(tmp_path, lines, named):
    with pytest.raises(TaskFormatError, match=named.replace("[", r"\[").replace("]", r"\]")):
        load_task(task_with(tmp_path, lines))


def _tar(entries: list[tuple[str, bytes | None, str]]) -> bytes:
    """entries: (name, content or None for a folder, symlink target or "")."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:") as tf:
        for name, data, link in entries:
            info = tarfile.TarInfo(name)
            if link:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tf.addfile(info)
            elif data is None:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            else:
                info.size, info.mode = len(data), 0o755
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_clean_archive_keeps_only_declared_files_and_folders():
    raw = _tar([
        ("app/out", None, ""),
        ("app/out/result.txt", b"42\n", ""),
        ("app/out/link", None, "/usr/bin/python3"),  # a link could point the fresh sandbox anywhere
        ("app/out/../../usr/bin/python3", b"#!/bin/sh\nexit 0\n", ""),  # a forged tar smuggling a fake
        ("tests/test.sh", b"echo 1 > /logs/verifier/reward.txt\n", ""),
        ("app/name.txt", b"Ada Lovelace\n", ""),
        ("app/big.bin", b"x" * 2000, ""),
    ])  # fmt: skip
    carried = Carried()
    clean = clean_archive(raw, ["/app/out", "/app/name.txt", "/app/big.bin"], 1000, carried)
    with tarfile.open(fileobj=io.BytesIO(clean)) as tf:
        kept = {m.name: (m.type, tf.extractfile(m).read() if m.isreg() else None, m.mode) for m in tf}
    assert kept == {
        "app/out": (tarfile.DIRTYPE, None, 0o644),
        "app/out/result.txt": (tarfile.REGTYPE, b"42\n", 0o755),
        "app/name.txt": (tarfile.REGTYPE, b"Ada Lovelace\n", 0o755),
    }
    assert (carried.files, carried.bytes) == (2, len(b"42\n") + len(b"Ada Lovelace\n"))
    why = " | ".join(carried.skipped)
    assert "not a file or folder: /app/out/link" in why and "over the 1000 byte cap: /app/big.bin" in why
    assert why.count("outside the declared outputs") == 2  # the ../ smuggle and tests/test.sh
    with pytest.raises(SandboxError, match="not a readable tar"):
        clean_archive(b"not a tar at all" * 100, ["/app"], 1000, Carried())
