"""Families that need a look before acting: what to act on is written in a file, or must be found
first. Each is two short commands (look, act) or one command with a substitution."""

from __future__ import annotations

from envs.tbench2.generate import words
from envs.tbench2.generate.family import Draw, Family, Task, q

_CONFIG_KEYS = ("port", "host", "user", "mode", "level", "timeout", "retries", "workers", "region", "theme")


def follow_pointer(d: Draw) -> Task:
    folder, pointer = d.dir_name(), f"{d.pick(('target', 'selected', 'chosen'))}.txt"
    names = [f"{s}.txt" for s in d.stems(d.int(3, 6))]
    chosen = d.pick(names)
    delete = bool(d.int(0, 1))
    if delete:
        text = d.phrase((
            "`/app/{p}` names one file in `/app/{f}`. Delete that file and nothing else.",
            "Read `/app/{p}`: it holds the name of a file in `/app/{f}` that must be removed. Remove it.",
        ), p=pointer, f=folder)
    else:
        text = d.phrase((
            "`/app/{p}` names one file in `/app/{f}`. Copy that file to `/app/picked.txt`.",
            "Look in `/app/{p}` for the name of a file in `/app/{f}`, then copy that file to `/app/picked.txt`.",
        ), p=pointer, f=folder)
    t = Task(text, difficulty="medium")
    t.file(pointer, chosen + "\n")
    for n in names:
        t.file(f"{folder}/{n}", d.text(d.int(1, 3)))
    others = [f"{folder}/{n}" for n in names if n != chosen]
    if delete:
        t.solve(f'rm "/app/{folder}/$(cat /app/{pointer})"')
        t.expect_absent(f"/app/{folder}/{chosen}")
        for p in others:
            t.expect_unchanged(p)
    else:
        t.solve(f'cp "/app/{folder}/$(cat /app/{pointer})" /app/picked.txt')
        t.expect_same_file("/app/picked.txt", t.app[f"{folder}/{chosen}"].content)
    return t


def config_value(d: Draw) -> Task:
    src, out = f"{d.pick(('app', 'server', 'service'))}.conf", f"{d.word()}_value.txt"
    keys = d.sample(_CONFIG_KEYS, d.int(4, 7))
    values = {k: str(d.int(2, 9000)) if d.int(0, 1) else d.word() for k in keys}
    key = d.pick(keys)
    t = Task(d.phrase((
        "`/app/{s}` has `key=value` lines. Write the value of `{k}` (only the value) to `/app/{o}`.",
        "What is `{k}` set to in `/app/{s}`? Write just its value into `/app/{o}`.",
    ), s=src, k=key, o=out), difficulty="medium")
    t.file(src, "".join(f"{k}={v}\n" for k, v in values.items()))
    t.solve(f"grep '^{key}=' /app/{src} | cut -d= -f2 > /app/{out}")
    t.expect_value(f"/app/{out}", values[key])
    return t


def find_then_copy(d: Draw) -> Task:
    root = d.dir_name()
    subdirs = [f"{root}/{a}" for a in d.words(3)]
    subdirs.append(f"{subdirs[0]}/{d.word()}")
    names = [f"{s}.{d.pick(words.KEEP_EXTENSIONS)}" for s in d.stems(d.int(3, 6))]
    paths = {n: f"{d.pick(subdirs)}/{n}" for n in names}
    name = d.pick(names)
    t = Task(d.phrase((
        "A file named `{n}` is somewhere under `/app/{r}`. Copy it into the folder `/app/found`.",
        "Find `{n}` (it is in some subfolder of `/app/{r}`) and put a copy of it in `/app/found/`.",
    ), n=name, r=root), difficulty="medium")
    for p in paths.values():
        t.file(p, d.text(d.int(1, 3)))
    t.dir("found")
    t.solve(f"cp \"$(find /app/{root} -name {name})\" /app/found/")
    t.expect_same_file(f"/app/found/{name}", t.app[paths[name]].content)
    t.expect_unchanged(paths[name])
    return t


def largest_file(d: Draw) -> Task:
    folder, out = d.dir_name(), f"{d.word()}_largest.txt"
    names = [f"{s}.dat" for s in d.stems(d.int(3, 6))]
    sizes = d.sample(range(10, 400), len(names))  # distinct sizes: one largest
    t = Task(d.phrase((
        "Which file in `/app/{f}` is the largest? Write its name (just the file name) to `/app/{o}`.",
        "Find the biggest file in the folder `/app/{f}` and write its file name (not the path) into `/app/{o}`.",
    ), f=folder, o=out), difficulty="medium")
    for n, size in zip(names, sizes):
        t.file(f"{folder}/{n}", ((d.word() + " ") * size)[:size])
    biggest = names[sizes.index(max(sizes))]
    t.solve(f"ls -S /app/{folder} | head -n 1 > /app/{out}")
    t.expect_value(f"/app/{out}", biggest)
    return t


def todo_file(d: Draw) -> Task:
    job = d.pick(("mkdir", "delete", "write"))
    t = Task(d.phrase((
        "Read `/app/TODO.txt` and do what it asks.",
        "Your job is written in `/app/TODO.txt`. Do it.",
    )), difficulty="medium")
    if job == "mkdir":
        path = f"/app/{d.dir_name()}/{d.word()}"
        t.file("TODO.txt", f"Create the directory {path}\n")
        t.solve(f"mkdir -p {path}")
        t.expect(f"[ -d {q(path)} ] && [ ! -L {q(path)} ]")
    elif job == "delete":
        folder = d.dir_name()
        doomed, kept = d.stems(2)
        t.file(f"{folder}/{doomed}.txt", d.text(2))
        t.file(f"{folder}/{kept}.txt", d.text(2))
        t.file("TODO.txt", f"Delete the file /app/{folder}/{doomed}.txt\n")
        t.solve(f"rm /app/{folder}/{doomed}.txt")
        t.expect_absent(f"/app/{folder}/{doomed}.txt")
        t.expect_unchanged(f"{folder}/{kept}.txt")
    else:
        path, line = f"/app/{d.stem()}.txt", d.sentence()
        t.file("TODO.txt", f"Write the line '{line}' into the file {path}\n")
        t.solve(f"echo '{line}' > {path}")
        t.expect_text(path, line + "\n")
    t.expect_unchanged("TODO.txt")
    return t


FAMILIES = (
    Family("follow-pointer", "lookup", "delete or copy the file another file names", follow_pointer),
    Family("config-value", "lookup", "write the value of one key of a key=value file", config_value),
    Family("find-then-copy", "lookup", "find a file by name in a tree, then copy it", find_then_copy),
    Family("largest-file", "lookup", "write the name of the largest file in a folder", largest_file),
    Family("todo-file", "lookup", "read a TODO file and do the one job it names", todo_file),
)
