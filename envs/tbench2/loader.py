"""terminal-bench-2 task folders -> TaskSpec.

A task folder holds `instruction.md`, `task.toml`, `environment/Dockerfile` (+ build files),
`solution/solve.sh` (the oracle, optional here) and `tests/test.sh` (+ test files). task.toml comes
in two schemas, both accepted:
- legacy `version = "1.0"`: `[environment] memory = "2G"`, `storage = "10G"` (sizes as strings);
- `schema_version = "1.1"`: `[task]` name/description, `[environment]` `memory_mb`/`storage_mb`,
  `docker_image`, `cpus`, `gpus`, `allow_internet`, `build_timeout_sec`, plus `[environment.env]`.
Both carry `[metadata]`, `[verifier] timeout_sec` (+ `[verifier.env]`) and `[agent] timeout_sec`.

Verifier isolation: Harbor's schema (1.3+) says `[verifier] environment_mode = "separate"` (or
gives a `[verifier.environment]`, which implies it) and lists the agent's outputs in the top-level
`artifacts = [...]`; agentrl's own spelling is `[verifier] sandbox = "fresh"` + `outputs = [...]`.
Both mean: the tests run in a fresh sandbox of the task's environment instead of the agent's, with
only those paths (absolute; files or folders) carried over, at most `[verifier] outputs_max_mb`
(default 64) of them. "shared" / "same" (the default) runs them in the agent's sandbox once every
agent process is gone. Harbor's defaults apply where a field is absent (verifier timeout 600 s).

Harbor fields agentrl cannot honour are refused with the field's name rather than ignored:
`[[steps]]`, `[[verifier.collect]]`, a non-root `user`, `network_mode = "allowlist"`, phase network
overrides, a verifier environment that differs from the task's, and the rest in `_UNSUPPORTED`.

Fixture conventions (this project's, ignored by other harnesses): `[metadata] expected_status`,
`expected_reward` and `expected_empty_status` tell `agentrl tasks check` what a deliberately
adversarial task must end with; a file `expected_error.txt` marks a deliberately invalid task.
Every error names the file and the field, and what would fix it.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentrl.sandbox.base import SandboxSpec
from agentrl.sandbox.dockerfile import DockerfileError, parse_dockerfile

DEFAULT_TASKS_DIR = Path(__file__).resolve().parent / "tasks"
DEFAULT_WORKDIR = "/app"  # what TB2 images use; Docker's own default would be "/"
EXPECTED_ERROR_FILE = "expected_error.txt"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)
_CANARY_LINE = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)
_UNIT_MB = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}  # a bare number means MB
VERIFIER_SANDBOXES = ("same", "fresh")
# Harbor's [verifier] environment_mode -> agentrl's verifier sandbox.
HARBOR_VERIFIER_MODES = {"shared": "same", "separate": "fresh"}
DEFAULT_OUTPUTS_MAX_MB = 64.0
DEFAULT_VERIFIER_TIMEOUT_S = 600.0  # Harbor's VerifierConfig.timeout_sec default
NETWORK_MODES = {"public": True, "no-network": False}  # Harbor's network_mode -> allow_internet
ROOT_USERS = ("root", "0", 0)
# Harbor task fields agentrl's env cannot honour: (table, key) -> why / what to do instead.
_UNSUPPORTED = {
    ("environment", "os"): "only linux tasks run here",
    ("environment", "tpu"): "no TPUs here",
    ("environment", "mcp_servers"): "agentrl's agents get no MCP servers; remove them",
    ("environment", "skills_dir"): "agentrl's agents load no skills; remove it",
    ("environment", "healthcheck"): "agentrl runs no healthcheck before the agent; remove it",
    ("environment", "allowed_hosts"): "network allowlists are not enforced here; use network_mode public or no-network",
    ("solution", "env"): "`agentrl tasks check` runs solve.sh without it; export the variables in solve.sh",
}
# Carried outputs may not land where the verifier keeps its own things or the kernel's.
_NOT_OUTPUTS = ("/tests", "/logs/verifier", "/solution", "/proc", "/sys", "/dev")


class TaskFormatError(ValueError):
    """A task folder that does not follow the format; says which file and which field."""

    def __init__(self, task_dir: Path, file: str, message: str):
        super().__init__(f"task {task_dir.name}: {file}: {message}")
        self.task_dir = task_dir
        self.file = file
        self.message = message

    def __reduce__(self):  # across Ray actors; the default would call __init__ with the whole text alone
        return type(self), (self.task_dir, self.file, self.message)


class TaskSpec(BaseModel):
    """Everything about one task that the env, the scorer and `tasks check` need."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Task id: the folder's name.")
    path: Path
    instruction: str
    schema_version: str = Field(description='"1.0" (legacy), "1.1", or a later 1.x (Harbor writes 1.4).')
    description: str = ""
    difficulty: str | None = None
    category: str | None = None
    tags: list[str] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    agent_timeout_s: float = 900.0
    verifier_timeout_s: float = 900.0
    build_timeout_s: float = 600.0
    docker_image: str | None = None
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int = 10240
    gpus: int = 0
    allow_internet: bool = True
    verifier_env: dict[str, str] = Field(default_factory=dict)
    verifier_sandbox: str = Field("same", description='"same": the agent\'s sandbox, agent processes killed; "fresh".')
    verifier_outputs: list[str] = Field(default_factory=list, description="Paths carried to a fresh verifier.")
    verifier_outputs_max_mb: float = DEFAULT_OUTPUTS_MAX_MB
    environment_env: dict[str, str] = Field(default_factory=dict)
    workdir: str = DEFAULT_WORKDIR
    unsupported_locally: list[str] = Field(
        default_factory=list, description="Dockerfile steps a local sandbox skips."
    )
    expected_status: str = "scored"
    expected_reward: float | None = 1.0
    expected_empty_status: str = "scored"

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution_path(self) -> Path | None:
        p = self.path / "solution" / "solve.sh"
        return p if p.is_file() else None

    @property
    def adversarial(self) -> bool:
        return self.expected_status != "scored" or self.expected_reward != 1.0

    def sandbox_spec(self, *, labels: dict[str, str] | None = None) -> SandboxSpec:
        return SandboxSpec(
            image=self.docker_image,
            files_dir=str(self.environment_dir),
            workdir=self.workdir,
            env=dict(self.environment_env),
            cpus=self.cpus,
            memory_mb=self.memory_mb,
            disk_mb=self.storage_mb,
            allow_network=self.allow_internet,
            labels={"task": self.name, **(labels or {})},
        )


def strip_canary(text: str) -> str:
    """The instruction without its leading canary lines (an HTML or # comment naming a "canary",
    then blank lines): data-provenance markers that TB2 tasks carry and that Harbor does not
    show the agent either (harbor.models.task.task.strip_canary, the same rule)."""
    lines = text.split("\n")
    i = 0
    while i < len(lines) and _CANARY_LINE.match(lines[i].strip()):
        i += 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    return "\n".join(lines[i:])


def list_task_dirs(tasks_dir: Path) -> list[Path]:
    """Folders of `tasks_dir` that contain a task.toml, sorted by name."""
    if not tasks_dir.is_dir():
        raise FileNotFoundError(
            f"tasks dir {tasks_dir} does not exist (set env.tasks_dir to a folder of task folders)"
        )
    return sorted(p for p in tasks_dir.iterdir() if p.is_dir() and (p / "task.toml").is_file())


def load_task(task_dir: str | Path) -> TaskSpec:
    d = Path(task_dir).resolve()
    if not d.is_dir():
        raise TaskFormatError(d, ".", "is not a folder")
    for rel in ("instruction.md", "task.toml", "environment/Dockerfile", "tests/test.sh"):
        if not (d / rel).is_file():
            raise TaskFormatError(
                d,
                rel,
                "missing (every task needs instruction.md, task.toml, environment/Dockerfile, tests/test.sh)",
            )
    instruction = strip_canary((d / "instruction.md").read_text(encoding="utf-8", errors="replace")).strip()
    if not instruction:
        raise TaskFormatError(d, "instruction.md", "is empty")
    try:
        raw = tomllib.loads((d / "task.toml").read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise TaskFormatError(d, "task.toml", f"not valid TOML: {err}") from err
    fields = _TomlFields(d, raw)
    fields.refuse_unsupported()
    dockerfile = d / "environment" / "Dockerfile"
    try:
        plan = parse_dockerfile(dockerfile.read_text(encoding="utf-8"), source="environment/Dockerfile")
    except (DockerfileError, UnicodeDecodeError) as err:
        raise TaskFormatError(d, "environment/Dockerfile", str(err)) from err
    meta = fields.table("metadata")
    spec = {
        "name": d.name,
        "path": d,
        "instruction": instruction,
        "schema_version": fields.schema_version(),
        "description": fields.string("task", "description") or "",
        "difficulty": fields.string("metadata", "difficulty"),
        "category": fields.string("metadata", "category"),
        "tags": fields.string_list("metadata", "tags"),
        "metadata": meta,
        "agent_timeout_s": fields.seconds("agent", "timeout_sec", 900.0),
        "verifier_timeout_s": fields.seconds("verifier", "timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S),
        "build_timeout_s": fields.seconds("environment", "build_timeout_sec", 600.0),
        "docker_image": fields.string("environment", "docker_image"),
        "cpus": fields.number("environment", "cpus", 1.0),
        "memory_mb": fields.size_mb("memory", "memory_mb", 2048),
        "storage_mb": fields.size_mb("storage", "storage_mb", 10240),
        "gpus": int(fields.number("environment", "gpus", 0)),
        "allow_internet": fields.network(),
        "verifier_env": fields.env("verifier"),
        **fields.verifier_isolation(),
        "environment_env": fields.env("environment"),
        "workdir": fields.workdir(plan.workdir or DEFAULT_WORKDIR),
        "unsupported_locally": plan.unsupported,
        "expected_status": fields.string("metadata", "expected_status") or "scored",
        "expected_empty_status": fields.string("metadata", "expected_empty_status") or "",
    }
    reward = meta.get("expected_reward", 1.0 if spec["expected_status"] == "scored" else None)
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise TaskFormatError(d, "task.toml", f"[metadata].expected_reward = {reward!r}: must be a number")
    spec["expected_reward"] = None if reward is None else float(reward)
    if not spec["expected_empty_status"]:  # an infra error of the verifier hits empty attempts too
        spec["expected_empty_status"] = (
            spec["expected_status"] if spec["expected_status"] != "scored" else "scored"
        )
    return TaskSpec(**spec)


def expected_error(task_dir: Path) -> str | None:
    """The text a deliberately invalid fixture's validation error must contain, if it is one."""
    p = task_dir / EXPECTED_ERROR_FILE
    return p.read_text().strip() if p.is_file() else None


def load_splits(tasks_dir: Path) -> dict[str, list[str]]:
    """SPLITS.json of a tasks dir: {"train": [...], "eval": [...]}; {} when there is none."""
    p = tasks_dir / "SPLITS.json"
    if not p.is_file():
        return {}
    data = json.loads(p.read_text())
    if not isinstance(data, dict) or not all(
        isinstance(v, list) for k, v in data.items() if not k.startswith("_")
    ):
        raise ValueError(
            f'{p}: expected an object of task-name lists, e.g. {{"train": [...], "eval": [...]}}'
        )
    return {k: [str(x) for x in v] for k, v in data.items() if not k.startswith("_")}


class _TomlFields:
    """Typed reads of task.toml with errors that name the field."""

    def __init__(self, task_dir: Path, raw: dict[str, Any]):
        self.d, self.raw = task_dir, raw

    def _fail(self, where: str, msg: str) -> TaskFormatError:
        return TaskFormatError(self.d, "task.toml", f"{where}: {msg}")

    def schema_version(self) -> str:
        if "schema_version" in self.raw:
            v = str(self.raw["schema_version"])
        elif "version" in self.raw:
            v = str(self.raw["version"])
        else:
            raise self._fail("top level", 'needs `version = "1.0"` (legacy) or `schema_version = "1.1"`')
        if v.split(".")[0] != "1":
            raise self._fail("schema_version", f"{v!r} is not a known schema (1.0 or 1.1)")
        return v

    def table(self, name: str) -> dict[str, Any]:
        t = self.raw.get(name, {})
        if not isinstance(t, dict):
            raise self._fail(f"[{name}]", f"must be a table, got {type(t).__name__}")
        return t

    def _get(self, table: str, key: str) -> Any:
        return self.table(table).get(key)

    def string(self, table: str, key: str) -> str | None:
        v = self._get(table, key)
        if v is not None and not isinstance(v, str):
            raise self._fail(f"[{table}].{key}", f"must be a string, got {v!r}")
        return v

    def string_list(self, table: str, key: str) -> list[str]:
        v = self._get(table, key)
        if v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self._fail(f"[{table}].{key}", f"must be a list of strings, got {v!r}")
        return v

    def number(self, table: str, key: str, default: float) -> float:
        v = self._get(table, key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise self._fail(f"[{table}].{key}", f"must be a non-negative number, got {v!r}")
        return float(v)

    def seconds(self, table: str, key: str, default: float) -> float:
        v = self.number(table, key, default)
        if v <= 0:
            raise self._fail(f"[{table}].{key}", f"must be > 0 seconds, got {v!r}")
        return v

    def boolean(self, table: str, key: str, default: bool) -> bool:
        v = self._get(table, key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self._fail(f"[{table}].{key}", f"must be true or false, got {v!r}")
        return v

    def size_mb(self, legacy_key: str, mb_key: str, default: int) -> int:
        """`memory_mb = 2048` (1.1) or `memory = "2G"` (1.0); either schema may use either."""
        env = self.table("environment")
        if mb_key in env:
            v = env[mb_key]
            if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
                raise self._fail(f"[environment].{mb_key}", f"must be a positive number of MB, got {v!r}")
            return int(v)
        if legacy_key in env:
            v = env[legacy_key]
            m = _SIZE.match(str(v)) if isinstance(v, str | int) and not isinstance(v, bool) else None
            if m is None:
                raise self._fail(f"[environment].{legacy_key}", f'{v!r} is not a size like "2G" or "512M"')
            mb = float(m.group(1)) * _UNIT_MB[m.group(2).upper()]
            if mb <= 0:
                raise self._fail(f"[environment].{legacy_key}", f"{v!r} must be positive")
            return max(1, int(mb))
        return default

    def refuse_unsupported(self) -> None:
        """A Harbor field whose meaning agentrl cannot honour is an error naming it, never ignored."""
        if "steps" in self.raw:
            raise self._fail("[[steps]]", "multi-step tasks are not supported by agentrl's TB2 env; make one task per step")
        if self.table("verifier").get("collect"):
            raise self._fail("[[verifier.collect]]", "collect hooks are not run here (agentrl starts no compose "
                             "services); remove them")
        for table in ("agent", "verifier"):
            user = self._get(table, "user")
            if user is not None and user not in ROOT_USERS:
                raise self._fail(f"[{table}].user", f"{user!r}: agentrl's sandboxes run every command as their own "
                                 "root; remove the field")
        for (table, key), why in _UNSUPPORTED.items():
            v = self._get(table, key)
            if v in (None, [], {}) or (key == "os" and str(v).lower() == "linux"):
                continue
            raise self._fail(f"[{table}].{key}", why)

    def network(self) -> bool:
        """Whether the task may use the network: `[environment] network_mode` (Harbor; wins, as in
        Harbor) or `allow_internet` (older schemas). A phase override ([agent] / [verifier]
        network_mode) must agree with it: one sandbox has one network here."""
        mode = self.string("environment", "network_mode")
        if mode is None:
            allowed = self.boolean("environment", "allow_internet", True)
        elif mode in NETWORK_MODES:
            allowed = NETWORK_MODES[mode]
        else:
            raise self._fail("[environment].network_mode", f"{mode!r}: use public or no-network (allowlists are "
                             "not enforced here)")
        for table in ("agent", "verifier"):
            phase = self.string(table, "network_mode")
            if self._get(table, "allowed_hosts") is not None or (phase is not None and NETWORK_MODES.get(phase) != allowed):
                raise self._fail(f"[{table}].network_mode", f"{phase!r}: a phase's network must equal the "
                                 "environment's here; remove the override")
        return allowed

    def workdir(self, dockerfile_workdir: str) -> str:
        """Harbor's `[environment] workdir` must be the Dockerfile's: agentrl's sandboxes start there."""
        w = self.string("environment", "workdir")
        if w is not None and w.rstrip("/") != dockerfile_workdir.rstrip("/"):
            raise self._fail("[environment].workdir", f"{w!r} differs from the Dockerfile's WORKDIR "
                             f"{dockerfile_workdir!r}; make them equal or drop workdir")
        return dockerfile_workdir

    def _output_paths(self, where: str, paths: list[str]) -> list[str]:
        for path in paths:
            parts = path.split("/")
            if not path.startswith("/") or ".." in parts or path.rstrip("/") == "":
                raise self._fail(where, f"{path!r}: give absolute paths without '..', e.g. /app/out.txt")
            if any(path == p or path.startswith(p + "/") for p in _NOT_OUTPUTS):
                raise self._fail(where, f"{path!r}: not under {', '.join(_NOT_OUTPUTS)}")
        return paths

    def artifact_sources(self) -> list[str]:
        """The `source` of every top-level `artifacts` entry (Harbor: a path, or a table with
        source / destination / exclude / service). `destination` names a host path and does not
        matter to the verifier; `exclude` and other services cannot be honoured here."""
        entries = self.raw.get("artifacts", [])
        if not isinstance(entries, list):
            raise self._fail("artifacts", 'must be a list of paths, e.g. artifacts = ["/app/out.txt"]')
        sources = []
        for i, e in enumerate(entries):
            where = f"artifacts[{i}]"
            if isinstance(e, dict):
                if e.get("exclude"):
                    raise self._fail(f"{where}.exclude", "excluding part of a carried folder is not supported; "
                                     "declare the files to carry instead")
                if e.get("service") not in (None, "main"):
                    raise self._fail(f"{where}.service", f"{e['service']!r}: only the main service exists here")
                e = e.get("source")
            if not isinstance(e, str):
                raise self._fail(where, f"{e!r}: give an absolute path, or a table with source = \"/path\"")
            sources.append(e)
        return self._output_paths("artifacts", sources)

    def _verifier_environment(self) -> bool:
        """True when `[verifier.environment]` is given. agentrl's fresh verifier sandbox is made
        from the task's own environment, so every key set there must equal the task's value."""
        venv = self.table("verifier").get("environment")
        if venv is None:
            return False
        if not isinstance(venv, dict):
            raise self._fail("[verifier.environment]", f"must be a table, got {type(venv).__name__}")
        task_env = self.table("environment")
        for key, value in venv.items():
            if task_env.get(key) != value:
                raise self._fail(f"[verifier.environment].{key}", f"{value!r} differs from [environment].{key} = "
                                 f"{task_env.get(key)!r}; agentrl's verifier sandbox is the task's own environment")
        return True

    def verifier_isolation(self) -> dict[str, Any]:
        """Where the tests run and what is carried there (see the module docstring)."""
        own = self.string("verifier", "sandbox")
        if own is not None and own not in VERIFIER_SANDBOXES:
            raise self._fail("[verifier].sandbox", f"{own!r}: use one of {', '.join(VERIFIER_SANDBOXES)}")
        harbor = self.string("verifier", "environment_mode")
        if harbor is not None and harbor not in HARBOR_VERIFIER_MODES:
            raise self._fail("[verifier].environment_mode", f"{harbor!r}: use one of {', '.join(HARBOR_VERIFIER_MODES)}")
        if self._verifier_environment():
            if harbor == "shared":
                raise self._fail("[verifier].environment_mode", "'shared' contradicts [verifier.environment]; drop "
                                 "one of them")
            harbor = "separate"  # as in Harbor: an environment implies a separate verifier
        mode = HARBOR_VERIFIER_MODES[harbor] if harbor else None
        if own is not None and mode is not None and own != mode:
            raise self._fail("[verifier].sandbox", f"{own!r} contradicts environment_mode = {harbor!r}; keep one")
        mode = mode or own or "same"
        if mode == "fresh" and any((self.d / "tests" / f).is_file() for f in ("Dockerfile", "docker-compose.yaml")):
            raise self._fail("[verifier].environment_mode", "tests/ holds a verifier image of its own (Dockerfile or "
                             "docker-compose.yaml), which agentrl does not build; remove it")
        declared = self._output_paths("[verifier].outputs", self.string_list("verifier", "outputs"))
        outputs = list(dict.fromkeys(declared + self.artifact_sources()))
        max_mb = self.number("verifier", "outputs_max_mb", DEFAULT_OUTPUTS_MAX_MB)
        if max_mb <= 0:
            raise self._fail("[verifier].outputs_max_mb", f"must be > 0, got {max_mb!r}")
        return {"verifier_sandbox": mode, "verifier_outputs": outputs, "verifier_outputs_max_mb": max_mb}

    def env(self, table: str) -> dict[str, str]:
        v = self.table(table).get("env", {})
        if not isinstance(v, dict) or not all(
            isinstance(k, str) and isinstance(x, str | int | float | bool) for k, x in v.items()
        ):
            raise self._fail(f"[{table}.env]", 'must be a table of KEY = "value" strings')
        return {k: str(x).lower() if isinstance(x, bool) else str(x) for k, x in v.items()}
