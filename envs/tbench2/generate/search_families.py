"""Families: searching (grep, find) and sorting / de-duplicating."""

from __future__ import annotations

from envs.tbench2.generate import words
from envs.tbench2.generate.family import Draw, Family, Task


def _join(lines: list[str]) -> str:
    return "".join(x + "\n" for x in lines)


def grep_lines(d: Draw) -> Task:
    src, out, word = f"{d.stem()}.log", f"{d.word()}_found.txt", d.word()
    lines = [d.sentence() for _ in range(d.int(6, 14))]
    for i in d.sample(range(len(lines)), d.int(1, 4)):
        lines[i] = f"{word} {lines[i]}"
    t = Task(d.phrase((
        "Write every line of `/app/{s}` that contains `{w}` to `/app/{o}`, in their original order.",
        "Save the lines of `/app/{s}` that mention `{w}` into `/app/{o}`.",
    ), s=src, w=word, o=out))
    t.file(src, _join(lines))
    t.solve(f"grep {word} /app/{src} > /app/{out}")
    t.expect_text(f"/app/{out}", _join([x for x in lines if word in x]))
    return t


def _tree(d: Draw, root: str, n_files: int) -> list[str]:
    """Paths (relative to /app) of n_files files spread over nested folders of `root`, all with
    distinct names."""
    subdirs = [root] + [f"{root}/{a}" for a in d.words(2)]
    subdirs.append(f"{subdirs[-1]}/{d.word()}")
    return [f"{d.pick(subdirs)}/{s}.{d.pick(words.KEEP_EXTENSIONS)}" for s in d.stems(n_files)]


def find_by_name(d: Draw) -> Task:
    root, out = d.dir_name(), f"{d.word()}_path.txt"
    paths = _tree(d, root, d.int(4, 8))
    target = d.pick(paths)
    name = target.rsplit("/", 1)[1]
    t = Task(d.phrase((
        "Somewhere under `/app/{r}` there is a file named `{n}`. Write its full path to `/app/{o}`.",
        ("Find the file called `{n}` inside `/app/{r}` (it may be in a subfolder) and write its absolute "
        "path into `/app/{o}`."),
    ), r=root, n=name, o=out))
    for p in paths:
        t.file(p, d.text(1))
    t.solve(f"find /app/{root} -name {name} > /app/{out}")
    t.expect_value(f"/app/{out}", f"/app/{target}")
    return t


def which_file_contains(d: Draw) -> Task:
    folder, out = d.dir_name(), f"{d.word()}_which.txt"
    token = f"{d.pick(('code', 'ticket', 'order', 'ref'))}-{d.int(1000, 9999)}"
    names = [f"{s}.txt" for s in d.stems(d.int(3, 6))]
    chosen = d.pick(names)
    t = Task(d.phrase((
        "Exactly one file in `/app/{f}` contains the text `{k}`. Write that file's full path to `/app/{o}`.",
        "Which file in the folder `/app/{f}` mentions `{k}`? Write its absolute path into `/app/{o}`.",
    ), f=folder, k=token, o=out))
    for n in names:
        lines = [d.sentence() for _ in range(d.int(2, 5))]
        if n == chosen:
            lines.insert(d.int(0, len(lines)), f"{d.sentence()} {token}")
        t.file(f"{folder}/{n}", _join(lines))
    t.solve(f"grep -l {token} /app/{folder}/* > /app/{out}")
    t.expect_value(f"/app/{out}", f"/app/{folder}/{chosen}")
    return t


def sort_lines(d: Draw) -> Task:
    src, out = f"{d.stem()}.txt", f"{d.word()}_sorted.txt"
    items = d.words(d.int(5, 12))
    t = Task(d.phrase((
        "Sort the lines of `/app/{s}` alphabetically and write the result to `/app/{o}`.",
        "Write the words of `/app/{s}` (one per line) in alphabetical order to `/app/{o}`.",
    ), s=src, o=out))
    t.file(src, _join(items))
    t.solve(f"sort /app/{src} > /app/{out}")
    t.expect_text(f"/app/{out}", _join(sorted(items)))
    return t


def sort_numbers(d: Draw) -> Task:
    src, out = f"{d.word()}_numbers.txt", f"{d.word()}_sorted.txt"
    numbers = [d.int(1, 5000) for _ in range(d.int(5, 12))]
    descending = bool(d.int(0, 1))
    order = "largest first" if descending else "smallest first"
    t = Task(d.phrase((
        "`/app/{s}` holds one number per line. Write them sorted numerically, {w}, to `/app/{o}`.",
        "Sort the numbers in `/app/{s}` by value ({w}) and save them, one per line, in `/app/{o}`.",
    ), s=src, w=order, o=out))
    t.file(src, _join([str(n) for n in numbers]))
    t.solve(f"sort -n{'r' if descending else ''} /app/{src} > /app/{out}")
    t.expect_text(f"/app/{out}", _join([str(n) for n in sorted(numbers, reverse=descending)]))
    return t


def _with_duplicates(d: Draw) -> list[str]:
    pool = d.words(d.int(3, 7))
    return [d.pick(pool) for _ in range(d.int(len(pool) + 3, 3 * len(pool)))]


def unique_lines(d: Draw) -> Task:
    src, out = f"{d.stem()}.txt", f"{d.word()}_unique.txt"
    items = _with_duplicates(d)
    t = Task(d.phrase((
        "Write the distinct lines of `/app/{s}` to `/app/{o}`, sorted alphabetically, each only once.",
        "`/app/{s}` has repeated lines. Save a sorted copy without duplicates as `/app/{o}`.",
    ), s=src, o=out))
    t.file(src, _join(items))
    t.solve(f"sort -u /app/{src} > /app/{out}")
    t.expect_text(f"/app/{out}", _join(sorted(set(items))))
    return t


def count_unique(d: Draw) -> Task:
    src, out = f"{d.stem()}.txt", f"{d.word()}_distinct.txt"
    items = _with_duplicates(d)
    t = Task(d.phrase((
        ("How many different lines does `/app/{s}` have (duplicates counted once)? Write just the number "
        "to `/app/{o}`."),
        "Count the distinct lines of `/app/{s}` and write the number to `/app/{o}`.",
    ), s=src, o=out))
    t.file(src, _join(items))
    t.solve(f"sort -u /app/{src} | wc -l > /app/{out}")
    t.expect_value(f"/app/{out}", len(set(items)))
    return t


def most_common(d: Draw) -> Task:
    src, out = f"{d.stem()}.txt", f"{d.word()}_top.txt"
    pool = d.words(d.int(3, 6))
    counts = d.sample(range(1, 9), len(pool))  # distinct counts: one clear winner
    items = d.shuffled([w for w, c in zip(pool, counts) for _ in range(c)])
    winner = pool[counts.index(max(counts))]
    t = Task(d.phrase((
        "Which line occurs most often in `/app/{s}`? Write that line (just the word) to `/app/{o}`.",
        "Find the most frequent word in `/app/{s}` (one word per line) and write it to `/app/{o}`.",
    ), s=src, o=out), difficulty="medium")
    t.file(src, _join(items))
    t.solve(f"sort /app/{src} | uniq -c | sort -rn | head -n 1 | awk '{{print $2}}' > /app/{out}")
    t.expect_value(f"/app/{out}", winner)
    return t


FAMILIES = (
    Family("grep-lines", "search", "write the lines that contain a word", grep_lines),
    Family("find-by-name", "search", "write the path of a file found by name in a tree", find_by_name),
    Family("which-file-contains", "search", "write the path of the one file holding a token", which_file_contains),
    Family("sort-lines", "sorting", "sort lines alphabetically", sort_lines),
    Family("sort-numbers", "sorting", "sort numbers ascending or descending", sort_numbers),
    Family("unique-lines", "sorting", "write the distinct lines, sorted", unique_lines),
    Family("count-unique", "sorting", "count the distinct lines", count_unique),
    Family("most-common", "sorting", "write the most frequent line", most_common),
)
