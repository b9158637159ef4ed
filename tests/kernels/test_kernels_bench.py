"""The kernel benchmark harness: entries, error recording, JSON report (kernels stubbed out:
the real cases need an H200 and run there via `python -m bench.kernels`)."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json

import pytest
import torch

from bench import kernel_cases
from bench import kernels as kb
from kernels import sparse_mla_bwd, sparse_mla_bwd_keymajor


def test_make_entry_rates_and_fractions():
    e = kernel_cases.make_entry("gemm", {"n": 1}, 2.0, flops=2 * 799e9, reference_ms=8.0, correct=True)
    assert e["tflops"] == 799.0 and e["fraction_of_ceiling"] == 1.0 and e["speedup"] == 4.0
    e = kernel_cases.make_entry("copy", {"n": 1}, 1.0, nbytes=2.12e9, correct=None)
    assert e["gbps"] == 2120.0 and e["fraction_of_ceiling"] == 0.5 and e["speedup"] is None


def test_failures_are_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    def good(torch_mod, dev, shapes, timer):
        ms = timer(lambda: torch_mod.ones(4).sum(), warmup=1, min_iters=2, max_iters=2)
        yield kernel_cases.make_entry("good", {"n": 4}, ms, nbytes=16.0, correct=True)

    def bad(torch_mod, dev, shapes, timer):
        raise RuntimeError("out of resource: shared memory")
        yield  # pragma: no cover

    monkeypatch.setattr(kernel_cases, "CASES", {"bad": bad, "good": good, "skipped": bad})
    out = tmp_path / "r" / "kernels.json"
    report = kb.run_kernel_bench(out, kb.TINY, only={"bad", "good"}, device="cpu")
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    names = [k["name"] for k in saved["kernels"]]
    assert names == ["bad", "good"]
    assert "out of resource" in saved["kernels"][0]["error"] and "traceback" in saved["kernels"][0]
    assert saved["kernels"][1]["correct"] is True and saved["kernels"][1]["ms"] >= 0
    assert {"machine", "versions", "ceilings", "kernels", "tuning"} <= set(saved)
    # versions come from the installed distributions' metadata (bench/machine.py)
    assert saved["versions"]["torch"] == importlib.metadata.version("torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_each_entry_is_on_disk_before_the_next_is_measured(tmp_path, monkeypatch):
    """A device call cut short (its time limit kills the process) keeps every entry measured so far."""
    out = tmp_path / "r.json"
    seen = []

    def family(torch_mod, dev, shapes, timer):
        for i in range(3):
            if i:
                seen.append([e["ms"] for e in json.loads(out.read_text())["kernels"]])
            yield kernel_cases.make_entry(f"k{i}", {"n": i}, float(i + 1), nbytes=16.0, correct=True)

    monkeypatch.setattr(kernel_cases, "CASES", {"f": family})
    kb.run_kernel_bench(out, kb.TINY, device="cpu")
    assert seen == [[1.0], [1.0, 2.0]]
    assert not list(tmp_path.glob("*.tmp"))


def test_full_shapes_refuse_to_run_without_cuda(tmp_path, capsys):
    assert kb.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kb.main(["--out", str(tmp_path / "x.json"), "--only", "nonsense"])


def test_tiny_shapes_without_cuda_point_at_the_harness_tests(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(kb, "_has_cuda", lambda: False)  # a machine without a GPU, on any machine
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as a user runs it (the kernel tests' child sets it)
    assert kb.main(["--out", str(tmp_path / "x.json"), "--tiny"]) == 2
    assert "tests/kernels/test_kernels_bench.py" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_sparse_mla_bwd_case_times_every_variant_side_by_side(device):
    """The real case at tiny shapes (interpreted on CPU): one entry per variant, all correct, each
    with its speedup over the default; key-major with the inversion's time, split with its passes."""
    calls = []

    def once(fn, **_):  # one run per timing: the interpreter is slow and the times mean nothing here
        calls.append(fn)
        fn()
        return 1.0 + len(calls)

    shapes = dataclasses.replace(kb.TINY, mla_tokens=4, mla_context=40, topk=16)
    entries = list(kernel_cases.bench_sparse_mla_bwd(torch, device, shapes, once))
    assert [(e["name"], e["impl"]) for e in entries] == list(kernel_cases.BWD_VARIANTS)
    assert entries[0]["impl"] == sparse_mla_bwd.DEFAULT_BWD_IMPL
    assert all(e["correct"] is True and "tflops" in e for e in entries), entries
    default = entries[0]
    for e in entries:
        assert e["speedup_over_default"] == round(default["ms"] / e["ms"], 3)
    keymajor = next(e for e in entries if e["impl"] == "keymajor")
    assert keymajor["inversion_ms"] > 0
    assert keymajor["inversion_block_k"] in {c["BLOCK_K"] for c in sparse_mla_bwd_keymajor.DKV_CONFIGS}
    assert keymajor["key_block_token_pairs"] > 0
    split = next(e for e in entries if e["impl"] == "split")
    assert set(split["configs"]) == {"dq", "dkv"}
    assert set(split["pass_ms"]) == ({"dq", "dkv"} if device.type == "cuda" else set())
    assert split["delta_ms"] > 0
    assert set(kernel_cases.tuning_summary()) >= {"sparse_mla_bwd", "sparse_mla_bwd_dq",
                                                   "sparse_mla_bwd_dkv_keymajor", "sparse_mla_bwd_split_dq",
                                                   "sparse_mla_bwd_split_dkv"}
