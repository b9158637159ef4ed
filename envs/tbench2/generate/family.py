"""What a task family is: a name, a kind, and a function from a seeded draw to one task.

A family function receives a `Draw` (a seeded random source with word pools) and returns a
`Task`: the instruction, the files under /app, the oracle's command lines and the verifier's
checks. `render.py` turns a Task into a terminal-bench-2 folder; the checks become
`tests/test.sh`, which writes 1 only when every check holds.

Checks are bash conditions built from the helpers in `VERIFIER_HELPERS` (the preamble of every
generated test.sh). Each helper is strict: outputs are regular files (a symlink planted at the
output path never passes), text must match byte for byte except for one missing final newline,
numbers must be alone in their file (surrounding whitespace allowed).
"""

from __future__ import annotations

import random
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from envs.tbench2.generate import words

# Every generated test.sh starts with these. Tools: coreutils, diffutils, sed, tar and gzip only,
# which both the host-backed local sandbox and a bare ubuntu:24.04 image have.
VERIFIER_HELPERS = r"""# A regular file whose text equals $2's (one missing final newline allowed).
same_text() { [ -f "$1" ] && [ ! -L "$1" ] && cmp -s <(sed -e '$a\' "$1") <(sed -e '$a\' "$2"); }
# The same lines in any order.
same_lines() { [ -f "$1" ] && [ ! -L "$1" ] && cmp -s <(sed -e '$a\' "$1" | LC_ALL=C sort) <(sed -e '$a\' "$2" | LC_ALL=C sort); }
# A regular file, byte-identical to $2.
same_file() { [ -f "$1" ] && [ ! -L "$1" ] && cmp -s "$1" "$2"; }
# A file holding just the value $2 (whitespace around it allowed).
value_is() {
  [ -f "$1" ] && [ ! -L "$1" ] || return 1
  local v; v=$(cat "$1"); v="${v#"${v%%[![:space:]]*}"}"; v="${v%"${v##*[![:space:]]}"}"
  [ "$v" = "$2" ]
}
# A real directory whose tree equals $2's (files, contents, links).
same_tree() { [ -d "$1" ] && [ ! -L "$1" ] && diff -r --no-dereference "$1" "$2" > /dev/null 2>&1; }
absent() { [ ! -e "$1" ] && [ ! -L "$1" ]; }
mode_is() { [ -e "$1" ] && [ ! -L "$1" ] && [ "$(stat -c %a "$1")" = "$2" ]; }
# Some of the permission bits $2 (octal) are set / none of them is set.
has_bits() { [ -e "$1" ] && [ ! -L "$1" ] && [ $(( 8#$(stat -c %a "$1") & 8#$2 )) -ne 0 ]; }
lacks_bits() { [ -e "$1" ] && [ ! -L "$1" ] && [ $(( 8#$(stat -c %a "$1") & 8#$2 )) -eq 0 ]; }
# A symbolic link that resolves to the existing path $2.
links_to() { [ -L "$1" ] && [ -e "$1" ] && [ "$(readlink -f "$1")" = "$(readlink -f "$2")" ]; }
# An executable script whose output (stdin closed, 5 s at most) equals $2's text.
prints() { [ -f "$1" ] && [ -x "$1" ] && cmp -s <(timeout -k 1 5 "$1" < /dev/null 2>/dev/null | sed -e '$a\') <(sed -e '$a\' "$2"); }
"""


def q(path: str) -> str:
    """A path or word quoted for bash (plain names stay as they are)."""
    return shlex.quote(path)


@dataclass(frozen=True)
class File:
    content: bytes
    mode: int = 0o644


@dataclass(frozen=True)
class Link:
    target: str  # as stored in the link (relative targets keep the folder relocatable)


@dataclass(frozen=True)
class Dir:
    mode: int = 0o755


Entry = File | Link | Dir


@dataclass
class Task:
    """One task instance. Paths of `app` are relative to /app; `tests` to /tests."""

    instruction: str
    difficulty: str = "easy"
    app: dict[str, Entry] = field(default_factory=dict)
    solution: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    tests: dict[str, bytes] = field(default_factory=dict)

    # -- the starting state ------------------------------------------------------------------
    def _put(self, path: str, entry: Entry) -> str:
        # Two entries at one path would silently change the task: a family bug, never redrawn.
        if path in self.app:
            raise ValueError(f"task entry {path!r} is defined twice")
        self.app[path] = entry
        return f"/app/{path}"

    def file(self, path: str, content: str | bytes, mode: int = 0o644) -> str:
        """Put a file at /app/<path>; returns its absolute path."""
        return self._put(path, File(content.encode() if isinstance(content, str) else content, mode))

    def link(self, path: str, target: str) -> str:
        return self._put(path, Link(target))

    def dir(self, path: str, mode: int = 0o755) -> str:
        return self._put(path, Dir(mode))

    # -- the oracle ---------------------------------------------------------------------------
    def solve(self, *lines: str) -> None:
        self.solution.extend(lines)

    # -- the verifier -------------------------------------------------------------------------
    def reference(self, content: str | bytes) -> str:
        """A reference file under /tests for a check to compare against; returns its path."""
        name = f"expected/{len(self.tests)}"
        self.tests[name] = content.encode() if isinstance(content, str) else content
        return f"/tests/{name}"

    def expect(self, condition: str) -> None:
        """A raw bash condition (exit status 0 = holds)."""
        self.checks.append(condition)

    def expect_text(self, path: str, text: str) -> None:
        self.expect(f"same_text {q(path)} {self.reference(text)}")

    def expect_lines(self, path: str, lines: Sequence[str]) -> None:
        """`path` holds exactly these lines, in any order."""
        body = "".join(f"{line}\n" for line in lines)
        self.expect(f"same_lines {q(path)} {self.reference(body)}")

    def expect_value(self, path: str, value: object) -> None:
        self.expect(f"value_is {q(path)} {q(str(value))}")

    def expect_unchanged(self, app_path: str) -> None:
        """/app/<app_path> still holds the file it started with."""
        entry = self.app[app_path]
        assert isinstance(entry, File), app_path
        self.expect(f"same_file {q('/app/' + app_path)} {self.reference(entry.content)}")

    def expect_same_file(self, path: str, content: bytes) -> None:
        self.expect(f"same_file {q(path)} {self.reference(content)}")

    def tree(self, files: dict[str, str | bytes]) -> str:
        """A reference tree under /tests (relative paths -> contents); returns its path."""
        root = f"tree{len(self.tests)}"
        for rel, content in files.items():
            self.tests[f"{root}/{rel}"] = content.encode() if isinstance(content, str) else content
        return f"/tests/{root}"

    def expect_tree(self, path: str, files: dict[str, str | bytes]) -> None:
        """`path` is a directory holding exactly `files` (relative paths -> contents)."""
        self.expect(f"same_tree {q(path)} {self.tree(files)}")

    def expect_absent(self, path: str) -> None:
        self.expect(f"absent {q(path)}")

    def expect_mode(self, path: str, mode: int) -> None:
        self.expect(f"mode_is {q(path)} {mode:o}")


@dataclass(frozen=True)
class Family:
    """A parameterised task family. `kind` is its skill category (files, text, counting, search,
    sorting, permissions, archives, paths, scripts, lookup)."""

    name: str
    kind: str
    summary: str
    make: Callable[[Draw], Task]


class Draw:
    """The seeded random source a family draws its parameters from."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def int(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def pick(self, items: Sequence):
        return self.rng.choice(items)

    def sample(self, items: Sequence, k: int) -> list:
        return self.rng.sample(list(items), k)

    def shuffled(self, items: Sequence) -> list:
        out = list(items)
        self.rng.shuffle(out)
        return out

    def phrase(self, templates: Sequence[str], **values: object) -> str:
        """One of a family's phrasings, filled in."""
        return self.pick(templates).format(**values)

    def word(self) -> str:
        return self.pick(words.NOUNS)

    def words(self, k: int) -> list[str]:
        """k distinct nouns."""
        return self.sample(words.NOUNS, k)

    def dir_name(self) -> str:
        return self.pick(words.DIRS)

    def stem(self) -> str:
        """A file name stem such as `river_notes`."""
        return f"{self.word()}_{self.pick(words.STEM_SUFFIXES)}"

    def stems(self, k: int) -> list[str]:
        """k stems with distinct words."""
        return [f"{w}_{self.pick(words.STEM_SUFFIXES)}" for w in self.words(k)]

    def sentence(self) -> str:
        """A short line of lowercase words (3 to 7)."""
        return " ".join(self.pick(words.NOUNS + words.VERBS) for _ in range(self.int(3, 7)))

    def text(self, lines: int) -> str:
        return "".join(self.sentence() + "\n" for _ in range(lines))
