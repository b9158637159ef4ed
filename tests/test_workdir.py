"""sandbox/workdir.py's fix-up, run where it matters: by a root that cannot enter a folder its owner's
x bit is off on (no CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH), as the local sandbox's root was before
session 29 and a stricter sandbox's may be. The local sandbox and Daytona enter every folder now, so
their tests no longer reach the chmod branch; this one does."""

from __future__ import annotations

import os
import stat
import subprocess

from agentrl.sandbox.workdir import enter_workdir_command

# Root with an empty bounding set has no capabilities after exec; anyone else has none to drop.
# setpriv (util-linux) is one of the local sandbox's own required tools, so it is here wherever that runs.
_NO_DAC = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--"] if os.geteuid() == 0 else []


def _sh(command: str, cwd: str = "/") -> subprocess.CompletedProcess:
    return subprocess.run([*_NO_DAC, "sh", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=30)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_locked_folders_on_the_way_get_their_search_bit_back_and_nothing_else(tmp_path):
    workdir = tmp_path / "a" / "we ird*" / "app"
    workdir.mkdir(parents=True)
    (workdir / "name.txt").write_text("Ada\n")
    open_folder = tmp_path / "a"
    open_folder.chmod(0o711)
    (tmp_path / "a" / "we ird*").chmod(0o000)
    workdir.chmod(0o444)
    try:
        assert _sh(f"cd '{workdir}'").returncode != 0  # the premise: this root cannot enter it
        done = _sh(enter_workdir_command(str(workdir)))
        assert done.returncode == 0, done.stderr
        assert _sh(f"cd '{workdir}' && cat name.txt").stdout == "Ada\n"
        assert (_mode(open_folder), _mode(open_folder / "we ird*"), _mode(workdir)) == (0o711, 0o100, 0o544)
    finally:
        for p in (tmp_path / "a" / "we ird*", workdir):
            p.chmod(0o755)


def test_a_file_where_a_folder_goes_is_replaced_and_the_path_made(tmp_path):
    (tmp_path / "a").write_text("in the way\n")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for workdir in (tmp_path / "a" / "app", tmp_path / "dangling" / "app"):
        done = _sh(enter_workdir_command(str(workdir)))
        assert done.returncode == 0, done.stderr
        assert workdir.is_dir() and not workdir.parent.is_symlink()
    assert not (tmp_path / "nowhere").exists()  # the link was removed, not followed


def test_a_folder_it_can_enter_keeps_the_agents_mode(tmp_path):
    workdir = tmp_path / "app"
    workdir.mkdir()
    workdir.chmod(0o311)  # no read bit, but enterable
    try:
        assert _sh(enter_workdir_command(str(workdir))).returncode == 0
        assert _mode(workdir) == 0o311
    finally:
        workdir.chmod(0o755)
