"""Families: text processing (pick lines, rewrite, columns) and counting."""

from __future__ import annotations

from envs.tbench2.generate import words
from envs.tbench2.generate.family import Draw, Family, Task


def _lines(d: Draw, low: int, high: int) -> list[str]:
    return [d.sentence() for _ in range(d.int(low, high))]


def _join(lines: list[str]) -> str:
    return "".join(x + "\n" for x in lines)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def head_lines(d: Draw) -> Task:
    src, out, lines = f"{d.dir_name()}/{d.stem()}.txt", f"{d.word()}_head.txt", _lines(d, 8, 16)
    n = d.int(2, 5)
    t = Task(d.phrase((
        "Write the first {n} lines of `/app/{s}` to `/app/{o}`.",
        "Put the top {n} lines of the file `/app/{s}` into `/app/{o}`.",
    ), n=n, s=src, o=out))
    t.file(src, _join(lines))
    t.solve(f"head -n {n} /app/{src} > /app/{out}")
    t.expect_text(f"/app/{out}", _join(lines[:n]))
    return t


def tail_lines(d: Draw) -> Task:
    src, out, lines = f"{d.dir_name()}/{d.stem()}.txt", f"{d.word()}_tail.txt", _lines(d, 8, 16)
    n = d.int(2, 5)
    t = Task(d.phrase((
        "Write the last {n} lines of `/app/{s}` to `/app/{o}`.",
        "Put the final {n} lines of the file `/app/{s}` into `/app/{o}`.",
    ), n=n, s=src, o=out))
    t.file(src, _join(lines))
    t.solve(f"tail -n {n} /app/{src} > /app/{out}")
    t.expect_text(f"/app/{out}", _join(lines[-n:]))
    return t


def nth_line(d: Draw) -> Task:
    src, out, lines = f"{d.stem()}.txt", f"line_{d.word()}.txt", _lines(d, 6, 14)
    n = d.int(2, len(lines) - 1)
    t = Task(d.phrase((
        "Write line number {n} of `/app/{s}` (counting from 1) to `/app/{o}`.",
        "Copy just the {nth} line of `/app/{s}` into `/app/{o}` (the first line is line 1).",
    ), n=n, nth=_ordinal(n), s=src, o=out))
    t.file(src, _join(lines))
    t.solve(f"sed -n '{n}p' /app/{src} > /app/{out}")
    t.expect_text(f"/app/{out}", lines[n - 1] + "\n")
    return t


def replace_word(d: Draw) -> Task:
    src = f"{d.stem()}.txt"
    old, new = d.words(2)
    lines = _lines(d, 4, 9)
    for i in d.sample(range(len(lines)), d.int(2, min(4, len(lines)))):
        ws = lines[i].split()
        ws.insert(d.int(0, len(ws)), old)
        lines[i] = " ".join(ws)
    text = _join(lines)
    t = Task(d.phrase((
        "In `/app/{s}`, replace every occurrence of the word `{a}` with `{b}` (edit the file in place).",
        "Edit `/app/{s}` so that each `{a}` becomes `{b}`; change nothing else.",
    ), s=src, a=old, b=new))
    t.file(src, text)
    t.solve(f"sed -i 's/{old}/{new}/g' /app/{src}")
    t.expect_text(f"/app/{src}", text.replace(old, new))
    return t


def upper_case(d: Draw) -> Task:
    src, out, lines = f"{d.stem()}.txt", f"{d.word()}_upper.txt", _lines(d, 2, 6)
    t = Task(d.phrase((
        "Write the contents of `/app/{s}` converted to upper case into `/app/{o}`.",
        "Make `/app/{o}` an all-capitals version of `/app/{s}`.",
    ), s=src, o=out))
    t.file(src, _join(lines))
    t.solve(f"tr 'a-z' 'A-Z' < /app/{src} > /app/{out}")
    t.expect_text(f"/app/{out}", _join(lines).upper())
    return t


def csv_column(d: Draw) -> Task:
    src, out = f"{d.word()}_{d.pick(('people', 'staff', 'members'))}.csv", f"{d.word()}_column.txt"
    header = ("name", "city", "score")
    rows = [(d.pick(words.FIRST_NAMES), d.pick(words.CITIES), str(d.int(1, 99))) for _ in range(d.int(4, 9))]
    col = d.int(0, 2)
    t = Task(d.phrase((
        ("`/app/{s}` is a CSV file with a header line. Write the values of its `{c}` column, one per line "
        "and without the header, to `/app/{o}`."),
        ("Extract the `{c}` column of the comma-separated file `/app/{s}` (skip the header row) into "
        "`/app/{o}`, keeping the row order."),
    ), s=src, c=header[col], o=out))
    t.file(src, _join([",".join(header)] + [",".join(r) for r in rows]))
    t.solve(f"tail -n +2 /app/{src} | cut -d, -f{col + 1} > /app/{out}")
    t.expect_text(f"/app/{out}", _join([r[col] for r in rows]))
    return t


def strip_comments(d: Draw) -> Task:
    src, out = f"{d.word()}.conf", f"{d.word()}_clean.conf"
    settings = [f"{k}={d.int(1, 999)}" for k in d.words(d.int(3, 6))]
    lines, comments = list(settings), [f"# {d.sentence()}" for _ in range(d.int(2, 4))]
    for c in comments:
        lines.insert(d.int(0, len(lines)), c)
    t = Task(d.phrase((
        "Write `/app/{s}` without its comment lines (the lines that start with `#`) to `/app/{o}`.",
        "Copy `/app/{s}` to `/app/{o}`, leaving out every line beginning with `#`.",
    ), s=src, o=out))
    t.file(src, _join(lines))
    t.solve(f"grep -v '^#' /app/{src} > /app/{out}")
    t.expect_text(f"/app/{out}", _join([x for x in lines if not x.startswith("#")]))
    return t


def count_lines(d: Draw) -> Task:
    src, out, lines = f"{d.dir_name()}/{d.stem()}.txt", f"{d.word()}_count.txt", _lines(d, 5, 40)
    t = Task(d.phrase((
        "Count the lines of `/app/{s}` and write just the number to `/app/{o}`.",
        "How many lines does `/app/{s}` have? Write only the number into `/app/{o}`.",
    ), s=src, o=out))
    t.file(src, _join(lines))
    t.solve(f"wc -l < /app/{src} > /app/{out}")
    t.expect_value(f"/app/{out}", len(lines))
    return t


def count_words(d: Draw) -> Task:
    src, out, lines = f"{d.dir_name()}/{d.stem()}.txt", f"{d.word()}_words.txt", _lines(d, 3, 12)
    t = Task(d.phrase((
        "Count the words in `/app/{s}` and write just the number to `/app/{o}`.",
        "How many words are in the file `/app/{s}`? Write only the number into `/app/{o}`.",
    ), s=src, o=out))
    t.file(src, _join(lines))
    t.solve(f"wc -w < /app/{src} > /app/{out}")
    t.expect_value(f"/app/{out}", sum(len(x.split()) for x in lines))
    return t


def count_matches(d: Draw) -> Task:
    src, out, word = f"{d.stem()}.log", f"{d.word()}_matches.txt", d.word()
    lines = [d.sentence() for _ in range(d.int(6, 15))]
    for i in d.sample(range(len(lines)), d.int(1, 5)):
        lines[i] = f"{lines[i]} {word}"
    t = Task(d.phrase((
        "How many lines of `/app/{s}` contain the word `{w}`? Write just the number to `/app/{o}`.",
        "Count the lines in `/app/{s}` that mention `{w}` and write the count (only the number) to `/app/{o}`.",
    ), s=src, w=word, o=out))
    t.file(src, _join(lines))
    t.solve(f"grep -c {word} /app/{src} > /app/{out}")
    t.expect_value(f"/app/{out}", sum(word in x for x in lines))
    return t


def count_files(d: Draw) -> Task:
    folder, ext, out = d.dir_name(), d.pick(words.KEEP_EXTENSIONS), f"{d.word()}_files.txt"
    stems = d.words(d.int(4, 10))
    n = d.int(1, len(stems) - 1)
    t = Task(d.phrase((
        "How many `.{e}` files are in `/app/{f}`? Write just the number to `/app/{o}`.",
        "Count the files ending in `.{e}` in the folder `/app/{f}` and write the count to `/app/{o}`.",
    ), e=ext, f=folder, o=out))
    others = [x for x in words.KEEP_EXTENSIONS + words.JUNK_EXTENSIONS if x != ext]
    for i, s in enumerate(stems):
        t.file(f"{folder}/{s}.{ext if i < n else d.pick(others)}", d.sentence() + "\n")
    t.solve(f"ls /app/{folder}/*.{ext} | wc -l > /app/{out}")
    t.expect_value(f"/app/{out}", n)
    return t


FAMILIES = (
    Family("head-lines", "text", "write the first N lines of a file", head_lines),
    Family("tail-lines", "text", "write the last N lines of a file", tail_lines),
    Family("nth-line", "text", "write line N of a file", nth_line),
    Family("replace-word", "text", "replace a word everywhere in a file, in place", replace_word),
    Family("upper-case", "text", "write a file in upper case", upper_case),
    Family("csv-column", "text", "extract one column of a CSV file", csv_column),
    Family("strip-comments", "text", "write a config file without its # lines", strip_comments),
    Family("count-lines", "counting", "count the lines of a file", count_lines),
    Family("count-words", "counting", "count the words of a file", count_words),
    Family("count-matches", "counting", "count the lines that contain a word", count_matches),
    Family("count-files", "counting", "count the files of one extension in a folder", count_files),
)
