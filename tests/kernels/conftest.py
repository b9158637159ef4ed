"""Kernel tests run on CUDA when there is one, else on CPU under Triton's interpreter.

TRITON_INTERPRET must be set before ``triton`` is first imported (triton.language's own helpers
are decorated then), which a shared pytest process cannot guarantee or undo. So on a machine
without CUDA the outer pytest runs every selected kernel test in ONE child pytest with
TRITON_INTERPRET=1 and reports each test's outcome from the child's JUnit XML: nothing leaks
into other test files. Inside the child, two fixes for Triton 3.6's interpreter are applied
(see InterpreterCompat).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
CHILD_TIMEOUT_S = 600


def _mode() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interpret"
    return "delegate"


class InterpreterCompat:
    """1. numpy >= 2.5 refuses ``int()`` of a one-element array, and the interpreter keeps every
    scalar as one, so ``range(0, n)`` over a runtime ``n`` fails: index with ``.item()``.
    2. The interpreter multiplies bf16 ``tl.dot`` operands as raw uint16 bit patterns: upcast
    them to fp32 first (what tensor cores do: exact products, fp32 accumulation)."""

    def __init__(self) -> None:
        from triton.runtime import interpreter
        self.interp = interpreter
        self.orig_patch_tensor = interpreter._patch_lang_tensor
        self.orig_dot = interpreter.InterpreterBuilder.create_dot

    def install(self) -> None:
        import triton.language as tl
        interp, orig_patch_tensor, orig_dot = self.interp, self.orig_patch_tensor, self.orig_dot

        def to_f32(handle):
            if handle.dtype != tl.bfloat16:
                return handle
            return interp.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

        def patch_tensor(tensor, scope):
            orig_patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

        def create_dot(builder, a, b, d, input_precision, max_num_imprecise_acc):
            return orig_dot(builder, to_f32(a), to_f32(b), d, input_precision, max_num_imprecise_acc)

        interp._patch_lang_tensor = patch_tensor
        interp.InterpreterBuilder.create_dot = create_dot

    def remove(self) -> None:
        self.interp._patch_lang_tensor = self.orig_patch_tensor
        self.interp.InterpreterBuilder.create_dot = self.orig_dot


class ChildRun:
    """Runs the given test ids once in a child pytest under the interpreter; caches outcomes."""

    def __init__(self, nodeids: list[str], rootdir: Path):
        self.nodeids, self.rootdir = nodeids, rootdir
        self.outcomes: dict[str, tuple[str, str]] | None = None

    def _run(self) -> dict[str, tuple[str, str]]:
        with tempfile.TemporaryDirectory() as tmp:
            xml_path = Path(tmp) / "kernels.xml"
            env = {**os.environ, "TRITON_INTERPRET": "1"}
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={xml_path}", *self.nodeids]
            proc = subprocess.run(cmd, check=False, cwd=self.rootdir, env=env, capture_output=True, text=True,
                                  timeout=CHILD_TIMEOUT_S)
            if not xml_path.exists():
                raise RuntimeError(f"child pytest wrote no report (rc={proc.returncode}):\n"
                                   f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            outcomes = {}
            for case in ET.parse(xml_path).getroot().iter("testcase"):
                key = f"{case.get('classname')}::{case.get('name')}"
                outcome, text = "passed", ""
                for tag in ("failure", "error", "skipped"):
                    node = case.find(tag)
                    if node is not None:
                        outcome, text = tag, f"{node.get('message', '')}\n{node.text or ''}"
                        break
                outcomes[key] = (outcome, text)
            return outcomes

    def check(self, nodeid: str) -> None:
        if self.outcomes is None:
            self.outcomes = self._run()
        path, _, name = nodeid.partition("::")
        key = f"{path.removesuffix('.py').replace('/', '.')}::{name}"
        outcome, text = self.outcomes.get(key, ("error", f"no result for {key} in the child run"))
        if outcome == "skipped":
            pytest.skip(text.strip())
        if outcome != "passed":
            pytest.fail(f"[interpreted child run] {outcome}:\n{text}", pytrace=False)


def pytest_collection_modifyitems(session, config, items):
    if _mode() != "delegate":
        return
    mine = [it for it in items if Path(str(it.fspath)).resolve().is_relative_to(HERE)]
    if not mine:
        return
    child = ChildRun([it.nodeid for it in mine], Path(str(config.rootpath)))
    for it in mine:
        it.runtest = functools.partial(child.check, it.nodeid)


@pytest.fixture(scope="package", autouse=True)
def triton_mode():
    """'cuda' (compiled kernels), 'interpret' (child process on CPU) or 'delegate' (outer CPU run)."""
    mode = _mode()
    if mode != "interpret":
        yield mode
        return
    compat = InterpreterCompat()
    compat.install()
    try:
        yield mode
    finally:
        compat.remove()


@pytest.fixture
def device(triton_mode) -> torch.device:
    return torch.device("cuda" if triton_mode == "cuda" else "cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
