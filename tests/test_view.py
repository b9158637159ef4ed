"""`agentrl view`: the report's content, its escaping of untrusted text, the CLI, and (when
chromium is installed) that a browser renders it into a non-blank page."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from fixtures_run import HOSTILE_TASK, write_fake_run
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.view import render_report, turn_versions, write_report
from agentrl.view.svg import nice_ticks
from agentrl.view.turns import lane_turns, row_versions


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += [name for name, _ in attrs]


def _tags(html: str) -> _Tags:
    p = _Tags()
    p.feed(html)
    return p


@pytest.fixture
def run(tmp_path) -> Path:
    return write_fake_run(tmp_path / "run")


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _transcripts(run: Path) -> list[dict]:
    return [json.loads(line) for p in sorted((run / "transcripts").glob("*.jsonl")) for line in p.open()]


def test_report_has_header_curves_steps_episodes_and_lanes(run):
    html = render_report(run)
    rows, episodes = _metrics(run), _transcripts(run)
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert "local-smollm2" in html and "smollm2-135m" in html
    assert "12 / 12" in html  # steps done / train.max_steps
    assert f"{rows[-1]['reward_mean']:.3f}" in html
    assert "0.75 @ v10" in html or f"{rows[-1]['eval_pass_rate']:.2f} @ v{rows[-1]['eval_version']}" in html
    for title in (
        "Reward and eval pass rate",
        "Staleness (versions behind the trainer)",
        "Staleness swimlane",
        "Steps",
        "Episodes",
        "Outcomes",
        "full config.json",
    ):
        assert title in html, title
    tags = _tags(html)
    assert tags.tags.count("svg") == 5  # four charts and the swimlane
    assert tags.tags.count("details") == len(episodes) + 1  # every episode, plus the full config
    steps_table = html.split("<h2>Steps</h2>")[1].split("</table>")[0]
    assert steps_table.count("<tr>") == len(rows) + 1  # header row + one per step
    # every episode's per-turn version is drawn as a titled cell of its lane
    with_turns = [e for e in episodes if "turn_versions" in e]
    e = with_turns[-1]
    for i, vs in enumerate(e["turn_versions"]):
        assert f"turn {i + 1}: version {vs[0]}" in html
    assert "per-turn versions not recorded" in html  # some fixture rows are in the older format


def test_untrusted_text_is_escaped(run):
    html = render_report(run)
    tags = _tags(html)
    assert "script" not in tags.tags and "img" not in tags.tags
    assert not any(a.startswith("on") for a in tags.attrs)  # no event handlers anywhere
    assert "<script" not in html.lower()
    assert "&lt;script&gt;alert(&quot;pwned&quot;)&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=alert(2)&gt;" in html and HOSTILE_TASK not in html
    assert "&lt;/pre&gt;&lt;script&gt;alert(3)&lt;/script&gt;" in html  # the episode's error
    assert html.count("<details") == html.count("</details>")  # the text's </details> did not close one


def test_a_run_still_writing_renders(tmp_path):
    run = write_fake_run(tmp_path / "run", steps=3, finished=False, hostile=False)
    with open(run / "transcripts" / "worker_1.jsonl", "a") as f:
        f.write('{"episode_id": "g-half", "task_id": "hel')  # torn line of a worker mid-write
    html = render_report(run)
    assert "running or stopped early" in html
    assert "worker_1.jsonl: 1" in html


def test_a_run_with_config_only_says_no_data(tmp_path):
    run = write_fake_run(tmp_path / "run", steps=2)
    (run / "metrics.jsonl").unlink()
    shutil.rmtree(run / "transcripts")
    (run / "summary.json").unlink()
    html = render_report(run)
    assert html.count("no data yet") == 4
    assert "No transcripts" in html


def test_not_a_run_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an agentrl run dir"):
        render_report(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        render_report(tmp_path / "nope")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file, not a folder"):
        render_report(tmp_path / "a_file")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        render_report(tmp_path)


def test_cli_writes_report_html_and_prints_its_path(run, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["view", str(run)])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == str(run / "report.html")
    assert "Staleness swimlane" in (run / "report.html").read_text()
    out = tmp_path / "elsewhere.html"
    res = runner.invoke(app, ["view", str(run), "--out", str(out), "--max-episodes", "5"])
    assert res.exit_code == 0 and out.exists()
    assert out.read_text().count("<details class='ep'>") == 5
    res = runner.invoke(app, ["view", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_turn_versions_from_a_trajectory():
    #             prompt    turn 1      obs   turn 2 (update mid-turn)  obs  turn 3
    mask = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1]
    vers = [-1, -1, -1, 3, 3, 3, -1, -1, 3, 3, 4, 4, -1, 5]
    assert turn_versions(mask, vers) == [[3], [3, 4], [5]]
    with pytest.raises(ValueError, match="loss_mask has 2 entries"):
        turn_versions([0, 1], [1])
    assert lane_turns({"turn_versions": [[3], [3, 4], 5]}) == [[3], [3, 4], [5]]
    assert lane_turns({"turn_versions": [["x"]]}) is None  # malformed: fall back, do not guess
    assert row_versions({"versions": [4, 2, 2, -1]}) == [2, 4]


def test_nice_ticks_are_round_and_cover_the_range():
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(1, 12, 8)[0] >= 1 and nice_ticks(1, 12, 8)[-1] <= 12


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="chromium is not installed (apt-get install chromium)"
)
def test_chromium_renders_the_report(run, tmp_path):
    from PIL import Image

    page = write_report(run)
    png = tmp_path / "viewer.png"
    cmd = [
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium'}",
        f"--screenshot={png}",
        "--window-size=1280,2000",
        page.resolve().as_uri(),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:  # e.g. a script's alert() dialog blocks the screenshot
        os.killpg(proc.pid, signal.SIGKILL)  # chromium's own process group: its renderers too
        proc.wait()
        pytest.fail("chromium did not finish the screenshot in 90 s")
    assert png.exists(), "chromium wrote no screenshot"
    img = Image.open(png).convert("RGB")
    assert img.size == (1280, 2000)
    colors = img.resize((320, 500)).getcolors(maxcolors=1 << 16)
    assert colors is None or len(colors) > 200  # charts, badges and text, not a blank or error page
    out = os.environ.get("AGENTRL_VIEWER_PNG")  # set to refresh docs/viewer.png
    if out:
        img.quantize(colors=128).save(out, optimize=True)


def test_transcripts_are_streamed_keeping_only_the_newest(run):
    from agentrl.view.load import load_run

    everything = _transcripts(run)
    data = load_run(run, keep_episodes=10)
    assert len(data.episodes) == 10 and data.episodes_total == len(everything)
    assert sum(data.transcript_outcomes.values()) == len(everything)
    newest = max(max(e["versions"], default=-1) for e in everything)
    assert max(data.episodes[-1]["versions"]) == newest  # oldest first, the newest last


def test_episodes_are_ordered_by_end_time_when_rows_have_one(tmp_path):
    from agentrl.view.load import load_run

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "transcripts").mkdir()
    rows = {0: [("a", 30.0), ("b", 10.0)], 1: [("c", 20.0)]}
    for w, eps in rows.items():
        with open(tmp_path / "transcripts" / f"worker_{w}.jsonl", "w") as f:
            for eid, t in eps:
                f.write(json.dumps({"episode_id": eid, "time": t, "versions": [0], "outcome": "scored"}) + "\n")
    data = load_run(tmp_path)
    assert [e["episode_id"] for e in data.episodes] == ["b", "c", "a"]
    assert [e["worker"] for e in data.episodes] == [0, 1, 0]
