"""Every exception agentrl and its envs raise survives pickling, as it must to cross a Ray actor boundary:
Exception's default pickling rebuilds a class from its message alone, so a class whose __init__
takes other arguments came back to the driver as Ray's UnserializableException (a SandboxError
"DAYTONA_API_KEY is not set" raised in an episode worker printed a traceback, not its message)."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
from pathlib import Path

import pytest

import agentrl
import envs
from agentrl.rollout.client import EngineError
from agentrl.sandbox.base import SandboxError
from envs.tbench2.loader import TaskFormatError

# Arguments for the classes whose __init__ is their own; every other class takes a message.
_ARGS = {
    SandboxError: (("auth", "DAYTONA_API_KEY is not set"), {"retryable": True}),
    EngineError: (("http://127.0.0.1:1", "/generate", 503, "busy"), {}),
    TaskFormatError: ((Path("/tasks/t"), "task.toml", "[verifier].timeout_sec: must be a number"), {}),
}
_PRIVATE_OK = {"_InfraFailure", "_Retry", "_BadReply"}  # never leave the process that raises them


def _exception_classes() -> list[type[BaseException]]:
    found = set()
    infos = [*pkgutil.walk_packages(agentrl.__path__, "agentrl."), *pkgutil.walk_packages(envs.__path__, "envs.")]
    for info in infos:
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # optional extras (harbor, ...) are not this test's concern
            continue
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.startswith(("agentrl.", "envs.")):
                found.add(obj)
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def test_every_agentrl_exception_survives_pickling():
    classes = [c for c in _exception_classes() if c.__name__ not in _PRIVATE_OK]
    assert {SandboxError, EngineError, TaskFormatError} <= set(classes)  # the walk found both packages
    for cls in classes:
        args, kwargs = next((_ARGS[c] for c in cls.__mro__ if c in _ARGS), (("what went wrong",), {}))
        try:
            err = cls(*args, **kwargs)
        except TypeError as e:
            pytest.fail(f"{cls.__qualname__} takes other arguments than a message ({e}): add them to _ARGS")
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and str(back) == str(err), cls
        assert vars(back) == vars(err), cls


def test_a_sandbox_error_keeps_its_kind_and_retry_flag():
    back = pickle.loads(pickle.dumps(SandboxError("throttled", "429 from the API", retryable=True)))
    assert (back.kind, back.retryable, str(back)) == ("throttled", True, "429 from the API")
