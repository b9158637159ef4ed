"""`agentrl bench` comes from the bench/ package through entry point group `agentrl.commands`:
every benchmark is listed, and a missing or broken entry point answers with a one-line error
that says how to get it."""

from importlib.metadata import EntryPoint

import typer
from typer.testing import CliRunner

from agentrl.cli import COMMANDS_GROUP, add_entry_point_commands, app

BENCHMARKS = ("engine", "kernels", "offload", "faults", "async-vs-sync", "weight-sync", "buffer", "sandbox",
              "capacity", "learning", "megatron")


def test_bench_help_lists_every_benchmark():
    r = CliRunner().invoke(app, ["bench", "--help"])
    assert r.exit_code == 0, r.output
    for name in BENCHMARKS:
        assert f" {name} " in r.output, name


def test_the_installed_entry_point_is_the_bench_package():
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group=COMMANDS_GROUP) if ep.name == "bench"]
    assert ep.value == "bench.cli:app"


def _fresh_app(found):
    target = typer.Typer(no_args_is_help=True)
    target.command("noop")(lambda: None)  # a second command keeps `bench` a sub-command
    add_entry_point_commands(target, found)
    return target


def _one_line_error(found, *args):
    r = CliRunner().invoke(_fresh_app(found), ["bench", *args])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1, r.output
    return lines[0]


def test_a_broken_entry_point_says_what_failed_and_how_to_get_it():
    broken = [EntryPoint("bench", "no_such_bench_pkg.cli:app", COMMANDS_GROUP)]
    for args in ((), ("capacity", "--out", "x.json"), ("--help",)):
        line = _one_line_error(broken, *args)
        assert "no_such_bench_pkg.cli:app" in line and "ModuleNotFoundError" in line
        assert "pip install -e ." in line


def test_a_missing_entry_point_says_how_to_get_it():
    line = _one_line_error([])
    assert f"no '{COMMANDS_GROUP}' entry point named 'bench'" in line and "pip install -e ." in line


def test_a_plan_the_capacity_model_cannot_use_is_a_one_line_error(tmp_path):
    r = CliRunner().invoke(app, ["bench", "capacity", "--config", "local", "--out", str(tmp_path / "c.json")])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and "no hardware numbers for 'cpu'" in lines[0], r.output
    assert not (tmp_path / "c.json").exists()


def test_bench_kernels_without_cuda_refuses_and_leaves_the_report(tmp_path, monkeypatch):
    import bench.kernels
    monkeypatch.setattr(bench.kernels, "_has_cuda", lambda: False)  # a machine without a GPU, on any machine
    out = tmp_path / "kernels.json"
    out.write_text('{"recorded": "on an H200"}')
    r = CliRunner().invoke(app, ["bench", "kernels", "--out", str(out), "--only", "fp8"])
    assert r.exit_code == 2, r.output
    assert "no CUDA device" in r.stderr
    assert out.read_text() == '{"recorded": "on an H200"}'


def test_bench_megatron_small_never_replaces_the_recorded_report(tmp_path, monkeypatch):
    import subprocess
    from pathlib import Path

    def fake_script(cmd, check=False):  # stands in for bench/gpu/megatron_gpu.py (Megatron, minutes)
        out_dir = Path(cmd[cmd.index("--out-dir") + 1])
        (out_dir / "megatron.json").write_text('{"smoke": true}')
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_script)
    monkeypatch.chdir(tmp_path)  # RESULTS is bench/results under the working directory
    (tmp_path / "bench/results").mkdir(parents=True)
    recorded = tmp_path / "bench/results/megatron.json"
    recorded.write_text('{"recorded": "on two H200s"}')
    r = CliRunner().invoke(app, ["bench", "megatron", "--small"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "runs/bench/megatron_small.json").read_text() == '{"smoke": true}'
    assert recorded.read_text() == '{"recorded": "on two H200s"}'
    r = CliRunner().invoke(app, ["bench", "megatron"])  # the full run writes the recorded report
    assert r.exit_code == 0 and recorded.read_text() == '{"smoke": true}', r.output
