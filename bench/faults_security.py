"""Security: the local sandbox's isolation (network, files, processes, a process flood), a planted
DAYTONA_API_KEY that must never appear in plan output, logs, errors or checkpoints, and servers
that bind 127.0.0.1 unless configured. The scan of a whole local run (logs, Ray session files,
process command lines) is faults_run.secret_scan_of_a_run."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from pathlib import Path

from bench.faults_base import Checks, Outcome, Scenario
from bench.faults_sandbox import PLANTED_KEY, daytona, local_box, planted_env

ROOT = Path(__file__).resolve().parents[1]


def files_containing(root: Path, secret: str) -> list[str]:
    """Every file under `root` whose bytes contain `secret`."""
    needle = secret.encode()
    hits = []
    for f in sorted(Path(root).rglob("*")):
        try:
            if f.is_file() and not f.is_symlink() and needle in f.read_bytes():
                hits.append(str(f))
        except OSError:
            continue
    return hits


async def sandbox_isolation(tmp: Path) -> Outcome:
    from agentrl.sandbox.base import SandboxError
    from agentrl.sandbox.local_procs import pids_in_namespace

    c = Checks()
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    host_file = tmp / "host-owned.txt"
    host_file.write_text("original\n")
    try:
        async with local_box(tmp) as (_p, box):
            r = await box.exec(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected || echo refused", timeout_s=10)
            c("refused" in r.output, f"a listener on the host's 127.0.0.1:{port} is unreachable")
            r = await box.exec("exec 3<>/dev/tcp/1.1.1.1/53 && echo connected || echo unreachable", timeout_s=10)
            c("unreachable" in r.output, "the internet is unreachable")
            r = await box.exec("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' ' | sort | tr '\\n' ,")
            c(r.output.strip(",\n") == "lo", f"network interfaces inside: {r.output.strip(',')!r}")
            r = await box.exec(f"echo pwned > {host_file}; touch /usr/pwned /etc/pwned 2>&1; "
                               "cd /; ln -s ../../.. up 2>/dev/null; echo x > /up/escape 2>&1; ls /up/ | head -3")
            c(host_file.read_text() == "original\n", "a write to a host path lands inside the sandbox's own root")
            c(not Path("/usr/pwned").exists() and not Path("/etc/pwned").exists(), "/usr and /etc are read-only")
            c(not Path("/escape").exists(), "a ../ symlink does not leave the root")
            await box.exec("tmux new-session -d -s s 'sleep 1000'; (setsid nohup sleep 1001 >/dev/null 2>&1 &); "
                           "bash -c '(sleep 1002 &) &'")
            ns, host_dir = box._ns, box.host_dir
            n = len(pids_in_namespace(ns))
            await box.close()
            left = pids_in_namespace(ns)
            c(n >= 5 and left == [], f"{n} processes (tmux, setsid, double fork) ran; {len(left)} left after close")
            c(not host_dir.exists(), "its root folder is removed")
            try:
                await box.exec("true")
                c(False, "a closed sandbox refuses commands")
            except SandboxError as e:
                c(e.kind == "closed", "a closed sandbox refuses commands")
    finally:
        server.close()
    return c.outcome()


async def process_flood(tmp: Path) -> Outcome:
    from agentrl.sandbox.base import SandboxError
    from agentrl.sandbox.local_box import MAX_PIDS
    from agentrl.sandbox.local_procs import wait_namespace_empty

    c = Checks()
    flood = MAX_PIDS + 500  # bounded: even without a watchdog this could not exhaust the host
    async with local_box(tmp) as (_p, box):
        ns = box._ns
        t0 = time.monotonic()
        try:
            r = await box.exec(f"for i in $(seq {flood}); do sleep 300 & done; wait", timeout_s=60)
            c(False, f"the flood was stopped (exec returned {r.exit_code}, timed_out={r.timed_out})")
        except SandboxError as e:
            c(e.kind == "lost" and "limit" in str(e),
              f"{flood} processes started: after {time.monotonic() - t0:.1f} s the sandbox was killed: {e}")
        c(box.pids_exceeded > MAX_PIDS, f"the watchdog saw {box.pids_exceeded} processes (> {MAX_PIDS})")
        t1 = time.monotonic()
        gone = await asyncio.to_thread(wait_namespace_empty, ns, 30.0)
        c(gone, f"no process of the sandbox is left on the host ({time.monotonic() - t1:.1f} s after the kill)")
    return c.outcome()


def secret_in_plan_output(tmp: Path) -> Outcome:
    c = Checks()
    env = {"DAYTONA_API_KEY": PLANTED_KEY, "PATH": "/usr/bin:/bin"}
    outs = []
    for extra in (["--dry-run"], ["--dry-run", "--json"]):
        r = subprocess.run([sys.executable, str(ROOT / "launchers" / "run_glm5_2_daytona.py"), "train",
                            "--num-nodes", "16", "--sandbox", "daytona", *extra], capture_output=True, text=True,
                           cwd=ROOT, timeout=120, env=env, check=False)
        c(r.returncode == 0, f"train --num-nodes 16 --sandbox daytona {' '.join(extra)} printed the plan")
        outs.append(r.stdout + r.stderr)
    c(all(PLANTED_KEY not in o for o in outs), "the planted key appears in neither output")
    r = subprocess.run([sys.executable, str(ROOT / "launchers" / "run_glm5_2_daytona.py"), "train", "--num-nodes",
                        "16", "--dry-run", "--set", f"rollout.sglang.env.DAYTONA_API_KEY={PLANTED_KEY}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120, env=env, check=False)
    c(r.returncode == 2 and "DAYTONA_API_KEY" in r.stderr and PLANTED_KEY not in r.stdout + r.stderr,
      f"a key put into an engine's env is refused (exit {r.returncode}) and not echoed")
    return c.outcome()


async def secret_in_daytona_logs(tmp: Path) -> Outcome:
    from agentrl.sandbox.base import SandboxError

    c = Checks()
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    h = Keep(logging.DEBUG)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(h)
    root.setLevel(logging.DEBUG)
    try:
        texts = []
        async with daytona(exec_errors=1) as (p, stand):
            sb = await p.create(_spec())
            texts += [repr(p), str(p), repr(sb), p.config.model_dump_json(), repr(p.stats())]
            try:
                await sb.exec("echo hi")
            except SandboxError as e:
                texts.append(str(e))
            stand.faults.api_key = "another-key"  # the server now rejects ours: auth errors quote nothing
            try:
                await p.create(_spec())
            except SandboxError as e:
                c(e.kind == "auth", f"a rejected key: SandboxError(auth) {str(e)[:90]}")
                texts.append(str(e))
            await sb.close()
            await asyncio.sleep(0.1)
    finally:
        root.removeHandler(h)
        root.setLevel(old_level)
    c(records, f"{len(records)} log records at DEBUG captured (SDK and provider)")
    c(all(PLANTED_KEY not in t for t in texts + records), "the key is in no log record, repr, config dump or error")
    return c.outcome()


def _spec():
    from bench.faults_sandbox import _spec as spec

    return spec()


def secret_in_checkpoint(tmp: Path) -> Outcome:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentrl.config.schema import AlgorithmConfig, TrainConfig
    from agentrl.train.torch_backend import TorchBackend

    c = Checks()
    with planted_env(DAYTONA_API_KEY=PLANTED_KEY):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
        TorchBackend(model, TrainConfig(), AlgorithmConfig()).save_checkpoint(tmp / "ckpt", {"step": 1})
    files = [f for f in (tmp / "ckpt").rglob("*") if f.is_file()]
    c(files, f"checkpoint written ({len(files)} files)")
    c(files_containing(tmp / "ckpt", PLANTED_KEY) == [], "no checkpoint file contains the planted key")
    return c.outcome()


def bind_addresses(tmp: Path) -> Outcome:
    """The engines' command lines (as the dry run prints them; built where they run with the same
    host) bind cluster.host."""
    import shlex

    from agentrl.config.loader import load_config
    from agentrl.config.plan import resolve_plan
    from agentrl.config.show import engine_command_preview

    c = Checks()
    for sets, want in (([], "127.0.0.1"), (["cluster.host=0.0.0.0"], "0.0.0.0")):
        cfg = load_config("local", ["cluster.num_nodes=1", *sets], {"model": {"name": "tiny"}})
        plan = resolve_plan(cfg)
        argvs = [shlex.split(engine_command_preview(cfg, e)) for e in plan.engines]
        hosts = {argv[argv.index("--host") + 1] for argv in argvs}
        c(hosts == {want} and cfg.cluster.host == want,
          f"{' '.join(sets) or 'default'}: engines bind {sorted(hosts)}, dashboard/servers bind {cfg.cluster.host}")
    return c.outcome()


SCENARIOS = (
    Scenario("security_sandbox_isolation", "security",
             "the local sandbox reaches neither the host's 127.0.0.1 nor the internet, writes only inside its "
             "root, and close kills all its processes (tmux, setsid, double fork) and removes its folder",
             sandbox_isolation),
    Scenario("security_sandbox_process_flood", "security",
             "a sandbox that starts more than MAX_PIDS processes (a fork bomb) is killed whole by the pids "
             "watchdog: the command fails SandboxError(lost) naming the limit, no process is left", process_flood),
    Scenario("security_secret_plan_output", "security",
             "with DAYTONA_API_KEY planted, dry-run tables and JSON never contain it; a key put into an engine's "
             "env is refused without being echoed", secret_in_plan_output),
    Scenario("security_secret_daytona_logs", "security",
             "DEBUG logs of the SDK and provider, reprs, config dumps and errors (incl. a rejected key) never "
             "contain the planted key", secret_in_daytona_logs),
    Scenario("security_secret_checkpoint", "security",
             "a checkpoint written while the key is in the environment does not contain it", secret_in_checkpoint),
    Scenario("security_bind_addresses", "security",
             "engines and the dashboard bind 127.0.0.1 by default and the configured cluster.host otherwise",
             bind_addresses),
)
