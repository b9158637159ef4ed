"""Environments are found through package entry points, never through a registry filled at import.

An installed package registers an environment with one line of its pyproject.toml:

    [project.entry-points."agentrl.envs"]
    countdown = "agentrl_countdown:CountdownEnv"

`make_env("countdown", **kwargs)` then loads that class and constructs it. The metadata is read
on every call, so a package installed while the process runs is found, and nothing is imported
until an environment is asked for.

`env.name` may also be an import path, "package.module:ClassName", for an environment that is not
an installed package's entry point (a benchmark's env, an experiment): `make_env` imports that
module and takes that attribute. An installed entry point of the same name wins.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable
from importlib.metadata import EntryPoint
from typing import Any

from agentrl.envs.base import Env

ENTRY_POINT_GROUP = "agentrl.envs"
# "package.module:ClassName" (dotted names on both sides, as an entry point's value is written)
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

_HOW_TO_REGISTER = (
    f'register one with `[project.entry-points."{ENTRY_POINT_GROUP}"] NAME = "module:Class"` in its '
    "package's pyproject.toml and install that package, or give an import path \"package.module:ClassName\""
)


class EnvRegistryError(LookupError):
    """An environment name that is unknown, ambiguous, or whose entry point cannot be loaded."""


def available_envs() -> dict[str, EntryPoint]:
    """Every environment entry point installed in this interpreter, by name.

    Raises EnvRegistryError if two installed packages claim one name for different objects
    (silently picking one would make runs depend on install order).
    """
    found: dict[str, EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        other = found.get(ep.name)
        if other is not None and other.value != ep.value:
            raise EnvRegistryError(
                f"env {ep.name!r} is declared twice in group {ENTRY_POINT_GROUP!r}: {other.value!r} "
                f"(package {_dist_name(other)}) and {ep.value!r} (package {_dist_name(ep)}); uninstall one"
            )
        found[ep.name] = ep
    return dict(sorted(found.items()))


def env_entry_point(name: str) -> EntryPoint:
    """What `name` (an env.name) refers to: the installed entry point of that name, else, when
    `name` is written "package.module:ClassName", that import path. Raises EnvRegistryError naming
    `name` when it is neither."""
    envs = available_envs()
    ep = envs.get(name)
    if ep is not None:
        return ep
    if IMPORT_PATH.match(name):
        return EntryPoint(name=name, value=name, group=ENTRY_POINT_GROUP)
    known = ", ".join(envs) or "none installed"
    raise EnvRegistryError(f"unknown env.name {name!r} (installed: {known}); {_HOW_TO_REGISTER}")


def load_env_factory(name: str) -> Callable[..., Env]:
    """The class (or factory) `name` (an env.name) refers to, imported; errors name `name` and the cause."""
    return _load(env_entry_point(name), name)


def make_env(name: str, **kwargs: object) -> Env:
    """Construct the environment `name` refers to (entry point or import path) with `kwargs`."""
    ep = env_entry_point(name)
    factory, value = _load(ep, name), ep.value
    try:
        env = factory(**kwargs)
    except TypeError as err:
        raise EnvRegistryError(
            f"env {name!r}: {value!r} rejected arguments {sorted(kwargs)} (set them in env.kwargs): {err}"
        ) from err
    # What isinstance(env, Env) checks, but naming the members that are missing.
    missing = [m for m in ("reset", "step", "score", "state", "close", "task_ids") if not hasattr(env, m)]
    if missing:
        raise EnvRegistryError(
            f"env {name!r}: {value!r} built a {type(env).__name__}, which lacks {missing} of the "
            "Env protocol (agentrl/envs/base.py)"
        )
    return env


def _load(ep: EntryPoint, name: str) -> Callable[..., Env]:
    try:
        factory = ep.load()
    except Exception as err:  # an entry point's import can fail in any way; say which one
        if _is_import_path(ep, name):
            installed = ", ".join(available_envs()) or "none"
            raise EnvRegistryError(
                f"env.name {name!r} is no installed env (installed: {installed}) and cannot be imported "
                f"as \"package.module:ClassName\": {type(err).__name__}: {err}"
            ) from err
        raise EnvRegistryError(
            f"env {name!r}: cannot load entry point {ep.value!r} (package {_dist_name(ep)}): "
            f"{type(err).__name__}: {err}"
        ) from err
    if not callable(factory):
        raise EnvRegistryError(f"env {name!r}: {ep.value!r} is not a class or factory")
    return factory


def _is_import_path(ep: EntryPoint, name: str) -> bool:
    return ep.name == name == ep.value and getattr(ep, "dist", None) is None


def _dist_name(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else "unknown"


def make_run_env(cfg: Any, provider: Any = None) -> Env:
    """The env of a run config (`cfg.env.name`): built with the env class's own `from_config(cfg,
    provider)` when it declares one (agentrl.envs.base.ConfigurableEnvFactory), else with
    `cfg.env.kwargs`. The one way the run loop, `agentrl eval` and the benchmarks build an env."""
    from agentrl.envs.base import ConfigurableEnvFactory

    factory = load_env_factory(cfg.env.name)
    if isinstance(factory, ConfigurableEnvFactory):
        try:
            return factory.from_config(cfg, provider=provider)
        except TypeError as err:  # most often a key of env.kwargs the class does not take
            if not cfg.env.kwargs:
                raise
            raise EnvRegistryError(f"env {cfg.env.name!r}: env.kwargs {sorted(cfg.env.kwargs)} rejected (fix or "
                                   f"remove them): {err}") from err
    return make_env(cfg.env.name, **cfg.env.kwargs)
