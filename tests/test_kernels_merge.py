"""bench/kernels_merge.py: GPU kernel reports merged into the one-card record, never mixing cards."""
import json

import pytest

from bench.kernels_merge import MergeError, main, merge

SHAPE_64K = {"tokens": 4096, "context": 65536}
SHAPE_8K = {"tokens": 4096, "context": 8192}


def report(gpu, entries, tuning=None):
    return {"machine": {"gpus": [{"name": gpu}], "cpu_count": 16}, "versions": {"torch": "2.11.0"},
            "kernels": entries, "tuning": tuning or {}}


def record():
    return report("NVIDIA H200", [{"name": "fwd", "shape": SHAPE_64K, "ms": 4.8, "correct": True},
                                  {"name": "fwd", "shape": SHAPE_8K, "ms": 4.3, "correct": True},
                                  {"name": "bwd", "shape": SHAPE_64K, "ms": 18.7, "correct": True}],
                  {"fwd": "old"})


def test_a_part_replaces_entries_of_the_same_name_and_shape_and_adds_new_ones():
    rec = record()
    part = report("NVIDIA H200", [{"name": "fwd", "shape": SHAPE_64K, "ms": 2.9, "correct": True},
                                  {"name": "fwd", "shape": {"tokens": 4096, "context": 131072}, "ms": 3.1,
                                   "correct": True}], {"fwd": "new"})
    out, lines = merge(rec, part, "h200_owed.sh mla", date="2026-12-06")
    by = {(e["name"], e["shape"]["context"]): e["ms"] for e in out["kernels"]}
    assert by == {("fwd", 65536): 2.9, ("fwd", 8192): 4.3, ("bwd", 65536): 18.7, ("fwd", 131072): 3.1}
    assert out["tuning"] == {"fwd": "new"} and rec["tuning"] == {"fwd": "old"}  # the input is not changed
    assert rec["kernels"][0]["ms"] == 4.8
    assert "2026-12-06 on NVIDIA H200" in out["runs"]["fwd"] and "h200_owed.sh mla" in out["runs"]["fwd"]
    assert any("4.8 -> 2.9" in line for line in lines)
    only_8k = report("NVIDIA H200", [{"name": "fwd", "shape": SHAPE_8K, "ms": 2.0, "correct": True}])
    again, _ = merge(out, only_8k, "n2")
    assert again["runs"]["fwd"].endswith("n2")  # one line a family list: the new run's
    both = report("NVIDIA H200", [{"name": "fwd", "shape": sh, "ms": 1.0, "correct": True}
                                  for sh in (SHAPE_64K, SHAPE_8K, {"tokens": 4096, "context": 131072})])
    partial = {**rec, "runs": {"bwd, fwd": "old"}}
    assert merge(partial, only_8k, "n3")[0]["runs"]["bwd, fwd"] == "old"  # fwd at 64K and bwd still from it
    both["kernels"].append({"name": "bwd", "shape": SHAPE_64K, "ms": 9.0, "correct": True})
    assert list(merge(partial, both, "n4")[0]["runs"]) == ["fwd, bwd"]  # every entry "bwd, fwd" named replaced


def test_a_part_from_another_card_or_without_a_gpu_is_refused():
    with pytest.raises(MergeError, match="NVIDIA H100.*NVIDIA H200"):
        merge(record(), report("NVIDIA H100 80GB HBM3", [{"name": "fwd", "shape": SHAPE_64K, "ms": 3.0}]), "n")
    cpu = report("x", [{"name": "fwd", "shape": SHAPE_64K, "ms": 1.0}]) | {"machine": {"gpus": []}}
    with pytest.raises(MergeError, match="no GPU"):
        merge(record(), cpu, "n")


def test_failed_or_wrong_entries_keep_the_records_own():
    part = report("NVIDIA H200", [{"name": "fwd", "shape": SHAPE_64K, "ms": 1.0, "correct": False},
                                  {"name": "bwd", "error": "RuntimeError: boom"},
                                  {"name": "fwd", "shape": SHAPE_8K, "ms": 2.7, "correct": True}])
    out, lines = merge(record(), part, "n")
    assert [e["ms"] for e in out["kernels"]] == [4.8, 2.7, 18.7]
    assert sum("kept the record's" in line for line in lines) == 2
    with pytest.raises(MergeError, match="no entry to merge"):
        merge(record(), report("NVIDIA H200", [{"name": "bwd", "error": "x"}]), "n")


def test_the_command_writes_all_parts_or_none(tmp_path, capsys):
    into = tmp_path / "kernels.json"
    into.write_text(json.dumps(record()))
    good = tmp_path / "mla.json"
    good.write_text(json.dumps(report("NVIDIA H200", [{"name": "bwd", "shape": SHAPE_64K, "ms": 13.0,
                                                        "correct": True}])))
    other = tmp_path / "h100.json"
    other.write_text(json.dumps(report("NVIDIA H100 80GB HBM3", [{"name": "fwd", "shape": SHAPE_64K, "ms": 3.0}])))
    before = into.read_text()
    assert main([str(good), str(other), "--into", str(into), "--note", "n"]) == 2
    assert into.read_text() == before and "h100.json ran on NVIDIA H100" in capsys.readouterr().err
    assert main([str(good), "--into", str(into), "--note", "n"]) == 0
    assert [e["ms"] for e in json.loads(into.read_text())["kernels"]] == [4.8, 4.3, 13.0]
