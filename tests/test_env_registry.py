"""Envs are found through `agentrl.envs` entry points of installed packages, or by an explicit
"package.module:ClassName" import path; nothing registers itself."""

from __future__ import annotations

import sys
import textwrap

import pytest

from agentrl.envs.base import Env
from agentrl.envs.registry import (
    ENTRY_POINT_GROUP,
    EnvRegistryError,
    available_envs,
    load_env_factory,
    make_env,
)


def _install_fake_distribution(
    root, dist: str, entry_points: dict[str, str], module: str, source: str
) -> None:
    """A real (if minimal) installed distribution: a dist-info folder with entry_points.txt,
    plus its module, under `root` (which the test puts on sys.path)."""
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "\n".join(f"{name} = {value}" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}\n")
    (root / f"{module}.py").write_text(textwrap.dedent(source))


FAKE_ENV_SOURCE = """
    from agentrl.envs.base import Observation, State

    class FakeEnv:
        def __init__(self, greeting="hi"):
            self.greeting = greeting

        async def reset(self, task_id, *, episode_id=None, seed=None):
            return Observation(text=self.greeting)

        async def step(self, action):
            return Observation(text="ok", done=True)

        async def score(self):
            return Observation(done=True, reward=1.0, status="scored")

        @property
        def state(self):
            return State()

        async def close(self):
            pass

        def task_ids(self):
            return ["t0"]

    class NotAnEnv:
        pass

    raise_on_import = False
"""


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    def install(entry_points: dict[str, str], dist: str = "fake-env-pkg", module: str = "fake_env_mod"):
        root = tmp_path / dist
        root.mkdir()
        _install_fake_distribution(root, dist, entry_points, module, FAKE_ENV_SOURCE)
        monkeypatch.syspath_prepend(str(root))
        monkeypatch.delitem(sys.modules, module, raising=False)

    yield install
    sys.modules.pop("fake_env_mod", None)


def test_installed_packages_are_found():
    envs = available_envs()
    assert envs["countdown"].value == "agentrl_countdown:CountdownEnv"  # packages/agentrl-countdown
    assert envs["tbench2"].value == "envs.tbench2.env:TB2Env"  # declared by agentrl itself
    assert all(ep.group == ENTRY_POINT_GROUP for ep in envs.values())


def test_make_env_builds_the_countdown_package_with_kwargs():
    env = make_env("countdown", num_tasks=3, seed=7)
    assert isinstance(env, Env)
    assert type(env).__module__ == "agentrl_countdown"
    assert env.task_ids() == ["countdown-7-0", "countdown-7-1", "countdown-7-2"]


async def test_a_faked_entry_point_is_found_and_built(fake_dist):
    assert "fake" not in available_envs()
    fake_dist({"fake": "fake_env_mod:FakeEnv"})
    assert available_envs()["fake"].value == "fake_env_mod:FakeEnv"
    env = make_env("fake", greeting="hello")
    assert (await env.reset("t0")).text == "hello"
    assert env.task_ids() == ["t0"]


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(EnvRegistryError) as info:
        make_env("no-such-env")
    msg = str(info.value)
    assert "'no-such-env'" in msg and "countdown" in msg and "tbench2" in msg
    assert ENTRY_POINT_GROUP in msg  # says how to register one


def test_bad_entry_points_fail_with_the_name_and_the_cause(fake_dist):
    fake_dist(
        {
            "missing-module": "no_such_module_xyz:Env",
            "missing-class": "fake_env_mod:NoSuchClass",
            "not-an-env": "fake_env_mod:NotAnEnv",
        }
    )
    with pytest.raises(EnvRegistryError, match=r"'missing-module'.*no_such_module_xyz.*ModuleNotFoundError"):
        make_env("missing-module")
    with pytest.raises(EnvRegistryError, match=r"'missing-class'.*NoSuchClass"):
        make_env("missing-class")
    with pytest.raises(EnvRegistryError, match=r"'not-an-env'.*lacks \['reset', 'step', 'score'"):
        make_env("not-an-env")


def test_wrong_kwargs_name_the_env_and_the_arguments(fake_dist):
    fake_dist({"fake": "fake_env_mod:FakeEnv"})
    with pytest.raises(EnvRegistryError, match=r"'fake'.*\['colour'\].*env.kwargs"):
        make_env("fake", colour="red")


def test_two_packages_claiming_one_name_is_an_error(fake_dist):
    fake_dist({"countdown": "fake_env_mod:FakeEnv"}, dist="other-countdown")
    with pytest.raises(EnvRegistryError, match=r"'countdown' is declared twice"):
        available_envs()


def test_nothing_is_registered_at_import():
    from agentrl.envs import registry

    module_state = {
        k: v for k, v in vars(registry).items() if not k.startswith("__") and isinstance(v, (dict, list, set))
    }
    assert module_state == {}


def test_an_import_path_builds_an_env_that_is_not_installed():
    from agentrl_countdown import CountdownEnv

    assert load_env_factory("agentrl_countdown:CountdownEnv") is CountdownEnv
    env = make_env("agentrl_countdown:CountdownEnv", num_tasks=2, seed=1)
    assert env.task_ids() == ["countdown-1-0", "countdown-1-1"]


def test_an_installed_entry_point_wins_over_the_import_path_of_its_name(fake_dist):
    fake_dist({"fake_env_mod:NotAnEnv": "fake_env_mod:FakeEnv"})
    assert type(make_env("fake_env_mod:NotAnEnv")).__name__ == "FakeEnv"


def test_an_import_path_that_does_not_resolve_names_env_name():
    with pytest.raises(EnvRegistryError, match=r"env.name 'no_such_module_xyz:Env' is no installed env "
                                               r"\(installed: .*countdown.*ModuleNotFoundError"):
        make_env("no_such_module_xyz:Env")
    with pytest.raises(EnvRegistryError, match=r"env.name 'agentrl_countdown:NoSuchEnv'.*AttributeError"):
        make_env("agentrl_countdown:NoSuchEnv")
    with pytest.raises(EnvRegistryError, match=r"unknown env.name 'not a path:X'.*package.module:ClassName"):
        make_env("not a path:X")


def test_env_kwargs_a_from_config_env_rejects_name_the_env_and_the_keys():
    from agentrl.config.loader import load_config
    from agentrl.envs.registry import make_run_env

    cfg = load_config("local", ["env.kwargs.colour=red"])
    with pytest.raises(EnvRegistryError, match=r"env 'tbench2': env.kwargs \['colour'\] rejected.*colour"):
        make_run_env(cfg)
