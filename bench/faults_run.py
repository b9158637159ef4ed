"""Faults in full local training runs (the launcher as a subprocess: tiny GLM, embedded engine, local
sandboxes, a local Ray): the engine process, an EpisodeWorker actor or the trainer killed mid-run,
Ctrl-C of the launcher, and a scan of everything a run leaves for a planted DAYTONA_API_KEY.

Every run gets its own short TMPDIR, so its Ray session and its sandboxes live in one folder that is
scanned and then removed; processes are found as descendants of the launcher (by /proc ppid), never
by name across the machine, so other runs on the same host are left alone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.faults_base import Checks, Outcome, Scenario, lost_trajectories
from bench.faults_sandbox import PLANTED_KEY
from bench.faults_security import files_containing

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launchers" / "run_glm5_2_daytona.py"
SMALLEST = ["cluster.dashboard=false", "rollout.max_new_tokens=24", "agent.max_turns=2", "algorithm.group_size=2"]
RUN_TIMEOUT_S = 900


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> dict[int, str]:
    """Live descendants of `root` (and root itself) with their command lines."""
    parents = {int(n): _ppid(int(n)) for n in os.listdir("/proc") if n.isdigit()}
    tree, grew = {root}, True
    while grew:
        kids = {p for p, pp in parents.items() if pp in tree and p not in tree}
        tree |= kids
        grew = bool(kids)
    return {p: _cmdline(p) for p in tree if _alive(p)}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def listening(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of the TCP sockets these processes listen on."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = f[1].split(":")
            out.append((inodes[f[9]], _addr(addr_hex, v6), int(port_hex, 16)))
    return out


def _addr(h: str, v6: bool) -> str:
    if not v6:
        return ".".join(str(int(h[i:i + 2], 16)) for i in (6, 4, 2, 0))
    return "::" if set(h) == {"0"} else ("::1" if h == "00000000000000000000000001000000" else h)


class LauncherRun:
    """One `train` invocation of the launcher in its own session and TMPDIR, with the planted key in
    its environment. Iterate `lines()` for its stderr; `seen` keeps every process it ever had."""

    def __init__(self, run_dir: Path, tmpdir: Path, *sets: str):
        self.run_dir, self.tmpdir = run_dir, tmpdir
        args = [sys.executable, str(LAUNCHER), "train", "--model-name", "tiny", "--num-nodes", "1",
                "--run-dir", str(run_dir)]
        for s in (*SMALLEST, *sets):
            args += ["--set", s]
        env = {**os.environ, "TMPDIR": str(tmpdir), "DAYTONA_API_KEY": PLANTED_KEY, "RAY_USAGE_STATS_ENABLED": "0"}
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                                  start_new_session=True,
                                  preexec_fn=_as_in_a_terminal)  # noqa: PLW1509 - no threads start runs
        self.text: list[str] = []
        self.seen: dict[int, str] = {}
        self.started = time.monotonic()

    def sample(self) -> dict[int, str]:
        now = descendants(self.p.pid)
        self.seen.update(now)
        return now

    def lines(self):
        for line in self.p.stderr:
            self.text.append(line)
            if len(self.text) % 5 == 0:
                self.sample()
            yield line
            if time.monotonic() - self.started > RUN_TIMEOUT_S:
                self.kill_all()
                return

    def wait_until(self, prefix: str) -> bool:
        for line in self.lines():
            if line.startswith(prefix):
                self.sample()
                return True
        return False

    def finish(self, timeout_s: float = RUN_TIMEOUT_S) -> int:
        """Read to the end and wait; kills everything if it overruns. Returns the exit code."""
        deadline = time.monotonic() + timeout_s
        for _ in self.lines():
            if time.monotonic() > deadline:
                self.kill_all()
                break
        try:
            return self.p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill_all()
            return self.p.wait()

    @property
    def stderr(self) -> str:
        return "".join(self.text)

    def leftovers(self, grace_s: float = 20.0) -> dict[int, str]:
        """Processes this run ever had that are still alive `grace_s` after it exited."""
        deadline = time.monotonic() + grace_s
        while True:
            left = {p: c for p, c in self.seen.items() if _alive(p) and _cmdline(p) == c}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    def kill_all(self) -> None:
        for pid in list(descendants(self.p.pid)) + list(self.seen):
            if _alive(pid) and _cmdline(pid) == self.seen.get(pid, _cmdline(pid)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


def _as_in_a_terminal() -> None:
    """Ctrl-C works as in a terminal even when this suite runs in the background (`cmd &`), where
    the shell starts it with SIGINT ignored, and an ignored signal stays ignored across exec."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


RAY_START_TIMEOUT = "timed out during startup"  # Ray's fixed 30 s wait for its raylet, missed under heavy load


def started_run(c: Checks, run_dir: Path, tmpdir: Path, *sets: str, until: str | None = "step    1") -> LauncherRun:
    """Launch and read up to `until` (or to the end when None). A launch that failed only because
    Ray did not come up within its fixed 30 s (a loaded shared machine) is tried once more, and
    that is recorded: it is not the fault under test."""
    for attempt in (1, 2):
        run = LauncherRun(run_dir, tmpdir, *sets)
        ok = run.wait_until(until) if until else run.finish() == 0
        if ok or RAY_START_TIMEOUT not in run.stderr or attempt == 2:
            c(ok, f"reached {until!r}" if until else f"the run finished (exit {run.p.returncode})")
            return run
        run.finish(timeout_s=60)
        c.details.setdefault("ray_start_retries", []).append(str(run_dir))
    return run


class _Scratch:
    """A short TMPDIR (Ray's socket paths must stay under ~107 bytes), removed at the end."""

    def __enter__(self) -> Path:
        self.path = Path(tempfile.mkdtemp(prefix="fr", dir="/tmp"))
        return self.path

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _metrics(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def _traj_records(run_dir: Path) -> list[dict]:
    from agentrl.buffer.log import DurableLog
    from agentrl.buffer.replay import LOG_NAME

    return [r for r in DurableLog.read(run_dir / LOG_NAME) if r["type"] == "traj"]


def _check_training_record(c: Checks, run_dir: Path, steps: int) -> None:
    """Steps 1..steps each trained (a step trained again after a resume counts with its last record),
    weight version == step, no group in two steps, and no group with an infra error ever trained."""
    from agentrl.buffer.audit import audit_log

    audit = audit_log(run_dir)
    by_step = audit.groups_by_step
    c(sorted(by_step) == list(range(1, steps + 1)), f"optimizer steps in the log: {sorted(by_step)}")
    groups = [g for gs in by_step.values() for g in gs]
    c(not audit.groups_in_two_steps, f"{len(groups)} groups trained, none in two steps "
      f"(in two: {list(audit.groups_in_two_steps)[:3]})")
    last = {r["step"]: r for r in _metrics(run_dir)}
    c(all(r["weight_version"] == s for s, r in last.items()) and sorted(last) == list(range(1, steps + 1)),
      f"weight versions continuous: {[last[s]['weight_version'] for s in sorted(last)]}")
    infra = {r["group_id"] for r in _traj_records(run_dir) if r["outcome"].startswith("infra_error")}
    c(not infra & set(groups), f"{len(infra)} group(s) with an infra error, none trained")


def _lost(c: Checks, run_dir: Path, *runs: LauncherRun) -> int:
    for i, r in enumerate(runs):
        c.details[f"launcher_stderr_tail_{i}"] = r.stderr[-1500:]
    if not c(run_dir.joinpath("replay.log.jsonl").exists(), "the run wrote its replay log"):
        return 0
    lost, counts = lost_trajectories(run_dir)
    c.details["replay_log"] = counts
    return lost


def engine_killed(tmp: Path) -> Outcome:
    c = Checks()
    with _Scratch() as t:
        run = started_run(c, tmp / "run", t, "train.max_steps=3")
        engines = [p for p, cmd in run.sample().items() if "engine serve" in cmd and "agentrl" in cmd]
        c(engines, f"engine process found in the run's tree: {engines}")
        for pid in engines:
            os.kill(pid, signal.SIGKILL)
        rc = run.finish()
        c(rc == 0, f"the run finished (exit {rc})")
        c("engine 0 restarted; re-sending weights" in run.stderr, "the engine was restarted and re-sent the weights")
        bad = [r for r in _traj_records(tmp / "run") if r["outcome"] == "infra_error:engine"]
        c.details["engine_infra_errors"] = len(bad)
        c(True, f"{len(bad)} episode(s) that the dead engine held ended infra_error:engine")
        _check_training_record(c, tmp / "run", 3)
        c(not run.leftovers(), "no process left")
    return c.outcome(_lost(c, tmp / "run", run))


def worker_killed(tmp: Path) -> Outcome:
    c = Checks()
    with _Scratch() as t:
        run = started_run(c, tmp / "run", t, "train.max_steps=3")
        workers = [p for p, cmd in run.sample().items() if cmd.startswith("ray::EpisodeWorker")]
        c(len(workers) == 1, f"EpisodeWorker actor process found: {workers}")
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        rc = run.finish()
        c(rc == 0, f"the run finished (exit {rc})")
        c("episode worker 0 failed" in run.stderr and "re-admitting task" in run.stderr,
          "the orchestrator re-admitted the dead worker's groups")
        _check_training_record(c, tmp / "run", 3)
        c(not run.leftovers(), "no process left")
    return c.outcome(_lost(c, tmp / "run", run))


def trainer_killed_then_resumed(tmp: Path) -> Outcome:
    c = Checks()
    with _Scratch() as t:
        run = started_run(c, tmp / "run", t, "train.max_steps=3", "train.checkpoint_every=1")
        trainers = [p for p, cmd in run.sample().items() if cmd.startswith("ray::TrainerWorker")]
        c(len(trainers) == 1, "TrainerWorker actor process found")
        for pid in trainers:
            os.kill(pid, signal.SIGKILL)
        rc = run.finish()
        said = [ln for ln in run.text if ln.startswith("error: the run stopped")]
        c(rc == 1 and said and "TrainerWorker died" in said[0] and "Traceback" not in run.stderr,
          f"the run stopped with exit {rc}: {said[0].strip()[:200] if said else run.stderr[-200:]}")
        c(not run.leftovers(), "no process of the crashed run left")
        before = {r["episode_id"] for r in _traj_records(tmp / "run")}
        again = started_run(c, tmp / "run", t, "train.max_steps=3", "train.checkpoint_every=1", until=None)
        rc2 = again.p.returncode
        resumed = [ln for ln in again.text if "resumed from step" in ln]
        c(rc2 == 0 and resumed, f"resumed (exit {rc2}): {resumed[0].strip() if resumed else 'no resume line'}")
        after = {r["episode_id"] for r in _traj_records(tmp / "run")}
        c(before <= after, f"all {len(before)} trajectories accepted before the kill are still in the log")
        _check_training_record(c, tmp / "run", 3)
        c(not again.leftovers(), "no process left")
    return c.outcome(_lost(c, tmp / "run", run, again))


def sigint_launcher(tmp: Path) -> Outcome:
    # What a terminal's Ctrl-C does: SIGINT to the whole foreground process group.
    return _interrupt_launcher(tmp, lambda pid: os.killpg(pid, signal.SIGINT), "Ctrl-C", signal.SIGINT)


def sigterm_launcher(tmp: Path) -> Outcome:
    # What `kill PID` or a scheduler's stop does: SIGTERM to the launcher alone.
    return _interrupt_launcher(tmp, lambda pid: os.kill(pid, signal.SIGTERM), "SIGTERM", signal.SIGTERM)


def group_sigterm_launcher(tmp: Path) -> Outcome:
    # What GNU `timeout` does at its limit: SIGTERM to the command's pid, then to its process group.
    def send(pid: int) -> None:
        os.kill(pid, signal.SIGTERM)
        os.killpg(pid, signal.SIGTERM)
    return _interrupt_launcher(tmp, send, "SIGTERM", signal.SIGTERM)


def _interrupt_launcher(tmp: Path, send, what: str, sig: signal.Signals) -> Outcome:
    c = Checks()
    with _Scratch() as t:
        run = started_run(c, tmp / "run", t, "train.max_steps=50", "train.checkpoint_every=1000")
        tree = run.sample()
        boxes = [cmd for cmd in tree.values() if "bwrap" in cmd and "agentrl-sandboxes" in cmd]
        c.details["processes_at_interrupt"] = len(tree)
        send(run.p.pid)
        t0 = time.monotonic()
        rc = run.finish(timeout_s=180)
        took = time.monotonic() - t0
        said = f"stopped by {sig.name} at step"
        c(rc == 128 + sig and said in run.stderr, f"exit {rc} {took:.0f} s after {what}: "
          f"{run.stderr.strip().splitlines()[-1][:120]}")
        _check_stop_checkpoint(c, tmp / "run")
        left = run.leftovers()
        c(not left, f"{len(run.seen)} processes seen (incl. {len(boxes)} sandboxes at the interrupt); "
          f"{len(left)} left: {sorted(left.values())[:3]}")
        root = t / "agentrl-sandboxes"
        remaining = [p for p in root.rglob("sbx-*")] if root.exists() else []
        c(not remaining, f"every sandbox deleted ({len(remaining)} sandbox folders left)")
    return c.outcome(_lost(c, tmp / "run", run))


def _check_stop_checkpoint(c: Checks, run_dir: Path) -> None:
    """A clean stop checkpoints the last step it recorded (checkpoint_every or not)."""
    import torch

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last = rows[-1]["step"] if rows else 0
    try:
        step = torch.load(run_dir / "checkpoints" / "latest" / "state.pt", weights_only=True)["extra"]["step"]
    except (OSError, KeyError, RuntimeError) as err:
        step = f"none ({type(err).__name__})"
    c(last >= 1 and step == last, f"checkpoint at the stop holds step {step}; the last recorded step is {last}")


def secret_scan_of_a_run(tmp: Path) -> Outcome:
    from agentrl.cluster.engine_process import free_port

    c = Checks()
    port = free_port()
    with _Scratch() as t:
        run = started_run(c, tmp / "run", t, "train.max_steps=2", "cluster.dashboard=true",
                          f"cluster.dashboard_port={port}")
        tree = run.sample()
        socks = listening(set(tree))
        rc = run.finish()
        c(rc == 0, f"the run finished (exit {rc}) with the key planted in its environment")
        cmd_hits = [p for p, cmd in run.seen.items() if PLANTED_KEY in cmd]
        c(not cmd_hits, f"not in the command line of any of its {len(run.seen)} processes")
        c(files_containing(tmp / "run", PLANTED_KEY) == [],
          "not in the run dir (logs, engine logs, transcripts, metrics, config, checkpoints, replay log)")
        sessions = sorted(t.rglob("session_*"))
        hits = [h for s in sessions for h in files_containing(s, PLANTED_KEY)]
        c(sessions and not hits, f"not in Ray's session folder (logs, runtime_env, GCS files): {len(hits)} hits")
        engine_ports = {int(e.split(":")[-1]) for e in run.stderr.split() if e.startswith("http://127.0.0.1:")}
        ours = [(a, p) for _, a, p in socks if p == port or p in engine_ports or
                any("engine serve" in tree.get(pid, "") for pid, _, pp in socks if pp == p)]
        c(ours and all(a == "127.0.0.1" for a, _ in ours), f"dashboard and engines listen on {sorted(set(ours))}")
        c.details["other_listeners"] = sorted({(a, p, tree.get(pid, "")[:60]) for pid, a, p in socks
                                               if (a, p) not in ours})
    return c.outcome(_lost(c, tmp / "run", run))


DISK_FULL_CHILD = r"""
import json, sys
from agentrl.agent.trajectory import Trajectory
from agentrl.buffer.log import LogWriteError
from agentrl.buffer.audit import audit_log
from agentrl.buffer.replay import LOG_NAME, ReplayBuffer
from bench.faults_base import lost_trajectories
d = sys.argv[1]
buf = ReplayBuffer(d, group_size=2, max_staleness=10)
acked, error = [], None
for i in range(100000):
    gid = f"g{i // 2}"
    t = Trajectory(episode_id=f"{gid}-{i % 2}", task_id="t", group_id=gid, prompt_len=1, token_ids=[1, 2] * 200,
                   loss_mask=[0, 1] * 200, rollout_logprobs=[0.0] * 400, weight_versions=[0] * 400,
                   outcome="scored", reward=1.0)
    try:
        buf.add(t)
    except LogWriteError as e:
        error = str(e)
        break
    acked.append(t.episode_id)
lines = open(f"{d}/{LOG_NAME}", "rb").read().split(b"\n")
parsed = all(json.loads(x) for x in lines if x)
ReplayBuffer(d, group_size=2, max_staleness=10).close()  # a restart's reopen, on the full disk
logged = set(audit_log(d).accepted)
lost, counts = lost_trajectories(d)
print(json.dumps({"acked": len(acked), "error": error, "parsed": parsed, "ends_with_newline": lines[-1] == b"",
                  "missing": sorted(set(acked) - logged), "extra": sorted(logged - set(acked)), "lost": lost,
                  "back_in_buffer": counts["back_in_buffer"]}))
"""


def replay_log_disk_full(tmp: Path) -> Outcome:
    """The buffer writes its log on a real 256 KiB tmpfs (in a private mount namespace) until the disk
    is full; then the log is reopened as on a restart."""
    c = Checks()
    d = tmp / "full"
    d.mkdir()
    script = (f"mount -t tmpfs -o size=256k tmpfs {d} && exec {sys.executable} -c \"$0\" {d}")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, DISK_FULL_CHILD],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    if r.returncode != 0 or not r.stdout.strip():
        c(False, f"the disk-full child ran (exit {r.returncode}): {r.stderr.strip()[-300:]}")
        return c.outcome()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    c(out["error"] and "No space left on device" in out["error"] and "record not accepted" in out["error"],
      f"after {out['acked']} acknowledged trajectories: LogWriteError: {out['error']}")
    c(out["parsed"] and out["ends_with_newline"], "the log is whole (every line parses, no torn tail)")
    c(not out["missing"] and not out["extra"],
      f"the log holds all {out['acked']} acknowledged trajectories and nothing unacknowledged")
    c(out["lost"] == 0 and out["back_in_buffer"] == out["acked"],
      f"reopened: {out['back_in_buffer']} of them are back in the buffer")
    return c.outcome(len(out["missing"]) + out["lost"])


SCENARIOS = (
    Scenario("worker_replay_log_disk_full", "worker",
             "when the replay log's disk fills, add() raises LogWriteError naming the file and 'No space left on "
             "device'; nothing unacknowledged is kept, the log stays parseable and every acknowledged trajectory "
             "is recovered", replay_log_disk_full),
    Scenario("engine_killed_mid_generation", "engine",
             "the engine process SIGKILLed mid-run is restarted and re-sent the current weights; episodes it held "
             "end infra_error:engine and are never trained; the run finishes all steps", engine_killed, slow=True),
    Scenario("worker_episode_worker_killed", "worker",
             "an EpisodeWorker actor SIGKILLed mid-run is restarted by Ray; its groups are re-admitted and what it "
             "had sent of them is retired with a reason; the run finishes, nothing accepted is lost",
             worker_killed, slow=True),
    Scenario("worker_trainer_killed_then_resumed", "worker",
             "the TrainerWorker SIGKILLed after step 1 stops the run with an error and no leftover process; the "
             "same command resumes from the checkpoint: no accepted trajectory lost, no group trained in two "
             "steps, weight versions continuous", trainer_killed_then_resumed, slow=True),
    Scenario("worker_launcher_ctrl_c", "worker",
             "Ctrl-C (SIGINT to the launcher's process group) mid-run: a clean stop, exit 130 with a message, the "
             "last step checkpointed, every process of the run stops and every sandbox is deleted", sigint_launcher, slow=True),
    Scenario("worker_launcher_sigterm", "worker",
             "SIGTERM to the launcher alone mid-run (a scheduler's stop): the same clean stop as Ctrl-C, exit 143, "
             "the last step checkpointed, every process of the run stops and every sandbox is deleted", sigterm_launcher, slow=True),
    Scenario("worker_launcher_group_sigterm", "worker",
             "SIGTERM to the launcher's pid and then its whole process group (GNU timeout's stop) mid-run: the same "
             "clean stop, exit 143, the last step checkpointed (the local Ray runs in the driver's own session, out "
             "of the group's reach), every process of the run stops and every sandbox is deleted",
             group_sigterm_launcher, slow=True),
    Scenario("security_secret_scan_of_a_run", "security",
             "a run with DAYTONA_API_KEY planted leaves it in no process command line, run-dir file (logs, "
             "checkpoints, transcripts) or Ray session file (runtime_env, logs); dashboard and engines listen on "
             "127.0.0.1", secret_scan_of_a_run, slow=True),
)
