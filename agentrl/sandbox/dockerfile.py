"""Read the parts of a task's Dockerfile that a sandbox without Docker can honour.

The local backend cannot build images. It honours WORKDIR, ENV, ARG defaults (for `$VAR`
substitution) and COPY / ADD of plain files from the build context (the task's environment/
folder). Every other instruction (FROM, RUN, USER, ADD of a URL or archive, COPY --from, ...) is
listed in `DockerfilePlan.unsupported` with its line number, so `agentrl tasks check` can show what
a local run leaves out; the task still runs against the host's read-only system instead.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

# The PATH a Debian/Ubuntu base image sets; `$PATH` in an ENV line expands against it.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
_VAR = re.compile(
    r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class DockerfileError(ValueError):
    """A Dockerfile the local backend cannot interpret; the message names file and line."""


@dataclass(frozen=True)
class CopyStep:
    sources: tuple[str, ...]  # relative to the build context; may hold glob patterns
    dest: str  # absolute path inside the sandbox
    dest_is_dir: bool  # ends with "/" or copies several sources
    chmod: int | None
    line: int


@dataclass
class DockerfilePlan:
    workdir: str | None = None  # last WORKDIR; None when the Dockerfile sets none
    env: dict[str, str] = field(default_factory=dict)  # ENV keys only, values expanded
    copies: list[CopyStep] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)  # "line N: INSTRUCTION args" for humans


def parse_dockerfile(text: str, *, source: str = "Dockerfile") -> DockerfilePlan:
    plan = DockerfilePlan()
    args: dict[str, str] = {}
    for lineno, instr, rest in _logical_lines(text):
        where = f"{source}:{lineno}"
        scope = {"PATH": DEFAULT_PATH, "HOME": "/root", **args, **plan.env}
        if instr == "ARG":
            name, _, default = rest.partition("=")
            if default:
                args[name.strip()] = _unquote(_expand(default.strip(), scope))
        elif instr == "ENV":
            plan.env.update(_parse_env(rest, scope, where))
        elif instr == "WORKDIR":
            path = _unquote(_expand(rest.strip(), scope))
            if not path:
                raise DockerfileError(f"{where}: WORKDIR needs a path")
            base = PurePosixPath(plan.workdir or "/")
            plan.workdir = str(base / path) if not path.startswith("/") else str(PurePosixPath(path))
        elif instr in ("COPY", "ADD"):
            step = _parse_copy(instr, _expand(rest, scope), plan.workdir or "/", lineno, where)
            if step is None:
                plan.unsupported.append(_describe(lineno, instr, rest))
            else:
                plan.copies.append(step)
        else:
            plan.unsupported.append(_describe(lineno, instr, rest))
    return plan


def apply_copies(
    plan: DockerfilePlan,
    context_dir: Path,
    root_dir: Path,
    *,
    source: str = "Dockerfile",
    read_only: tuple[str, ...] = (),
) -> list[str]:
    """Copy the plan's files from the build context into a sandbox root on the host. Symlinks are
    copied as links (never followed), so a task file cannot pull in host files. Steps whose
    destination lies under a `read_only` prefix (system folders the sandbox binds from the host)
    are skipped and returned as descriptions, for the caller's list of unsupported steps."""
    context = context_dir.resolve()
    skipped: list[str] = []
    for step in plan.copies:
        if any(step.dest == p or step.dest.startswith(p.rstrip("/") + "/") for p in read_only):
            skipped.append(f"line {step.line}: COPY into read-only system path {step.dest} (not copied)")
            continue
        matches: list[Path] = []
        for pattern in step.sources:
            found = sorted(context.glob(pattern)) if any(c in pattern for c in "*?[") else [context / pattern]
            for p in found:
                if not _inside(p, context):
                    raise DockerfileError(
                        f"{source}:{step.line}: COPY source {pattern!r} is outside the build context"
                    )
                if not p.exists() and not p.is_symlink():
                    raise DockerfileError(
                        f"{source}:{step.line}: COPY source {pattern!r} not found in {context_dir}"
                    )
                matches.append(p)
        if not matches:
            raise DockerfileError(f"{source}:{step.line}: COPY sources {list(step.sources)} match no file")
        dest = host_path(root_dir, step.dest)
        for src in matches:
            if src.is_dir() and not src.is_symlink():
                shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)
                if step.chmod is not None:
                    for p in [dest, *dest.rglob("*")]:
                        if not p.is_symlink():
                            p.chmod(step.chmod)
                continue
            target = dest / src.name if (step.dest_is_dir or dest.is_dir()) else dest
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target, follow_symlinks=False)
            if step.chmod is not None and not target.is_symlink():
                target.chmod(step.chmod)
    return skipped


def host_path(root_dir: Path, sandbox_path: str) -> Path:
    """Where an absolute sandbox path lives under the sandbox root on the host (lexically; the
    caller must only use it on a root it populated itself, before any process ran in it)."""
    parts = [p for p in PurePosixPath(sandbox_path).parts if p not in ("/", ".")]
    if ".." in parts:
        raise DockerfileError(f"path {sandbox_path!r} must not contain '..'")
    return root_dir.joinpath(*parts)


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
        return True
    except ValueError:
        return False


def _logical_lines(text: str):
    """Yield (first line number, INSTRUCTION, arguments), joining backslash continuations and
    dropping comment lines, as Docker does."""
    pending: list[str] = []
    start = 0
    for lineno, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if not pending:
            start = lineno
        if stripped.endswith("\\"):
            pending.append(stripped[:-1])
            continue
        pending.append(stripped)
        line = " ".join(s.strip() for s in pending if s.strip())
        pending = []
        instr, _, rest = line.partition(" ")
        yield start, instr.upper(), rest.strip()
    if pending:
        line = " ".join(s.strip() for s in pending if s.strip())
        instr, _, rest = line.partition(" ")
        yield start, instr.upper(), rest.strip()


def _expand(value: str, scope: dict[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        name = m.group("braced") or m.group("bare")
        if name in scope:
            return scope[name]
        return m.group("default") or ""

    return _VAR.sub(repl, value)


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _parse_env(rest: str, scope: dict[str, str], where: str) -> dict[str, str]:
    first = rest.split(None, 1)[0] if rest.split() else ""
    if not first:
        raise DockerfileError(f"{where}: ENV needs KEY=VALUE")
    if "=" not in first:  # legacy form: ENV KEY the rest of the line
        key, _, value = rest.partition(" ")
        return {key: _expand(value.strip(), scope)}
    out: dict[str, str] = {}
    try:
        words = shlex.split(rest, posix=True)
    except ValueError as err:
        raise DockerfileError(f"{where}: ENV {rest!r}: {err}") from err
    for word in words:
        key, eq, value = word.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise DockerfileError(f"{where}: ENV word {word!r} is not KEY=VALUE")
        out[key] = _expand(value, {**scope, **out})
    return out


def _parse_copy(instr: str, rest: str, workdir: str, lineno: int, where: str) -> CopyStep | None:
    """None when the step needs a real image build (another stage, a URL, an archive)."""
    words = rest.split()
    chmod: int | None = None
    while words and words[0].startswith("--"):
        flag, _, value = words.pop(0).partition("=")
        if flag == "--from":
            return None
        if flag == "--chmod":
            try:
                chmod = int(value, 8)
            except ValueError:
                raise DockerfileError(f"{where}: {instr} --chmod={value!r} is not an octal mode") from None
        # --chown, --link, --parents: ownership is root either way; nothing else to do
    args_text = " ".join(words)
    if args_text.startswith("["):
        try:
            items = json.loads(args_text)
        except json.JSONDecodeError as err:
            raise DockerfileError(f"{where}: {instr} JSON form {args_text!r}: {err}") from err
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise DockerfileError(f"{where}: {instr} JSON form must be a list of strings")
    else:
        items = words
    if len(items) < 2:
        raise DockerfileError(f"{where}: {instr} needs at least one source and a destination")
    *sources, dest = items
    if instr == "ADD" and any(
        s.startswith(("http://", "https://", "git@")) or s.endswith(_ARCHIVE_SUFFIXES) for s in sources
    ):
        return None
    dest_is_dir = dest.endswith("/") or len(sources) > 1
    dest_abs = dest if dest.startswith("/") else str(PurePosixPath(workdir) / dest)
    return CopyStep(tuple(s.lstrip("/") or "." for s in sources), dest_abs, dest_is_dir, chmod, lineno)


def _describe(lineno: int, instr: str, rest: str) -> str:
    text = f"{instr} {rest}".strip()
    return f"line {lineno}: {text[:117] + '...' if len(text) > 120 else text}"
