"""Families: files and directories, and paths (links, names)."""

from __future__ import annotations

from envs.tbench2.generate import words
from envs.tbench2.generate.family import Draw, Family, Task


def make_dir(d: Draw) -> Task:
    path = f"{d.dir_name()}/{d.word()}" if d.int(0, 1) else f"{d.word()}_{d.dir_name()}"
    t = Task(d.phrase((
        "Create the directory `/app/{p}`.",
        "Make a new folder at `/app/{p}`.",
        "Create a directory `/app/{p}` (create missing parent folders too).",
    ), p=path))
    t.file(f"{d.stem()}.txt", d.text(2))
    t.solve(f"mkdir -p /app/{path}")
    t.expect(f"[ -d /app/{path} ] && [ ! -L /app/{path} ]")
    return t


def write_line(d: Draw) -> Task:
    path, line = f"{d.stem()}.txt", d.sentence()
    t = Task(d.phrase((
        "Create the file `/app/{p}` containing exactly one line: `{line}`",
        "Write the line `{line}` into a new file `/app/{p}` (nothing else in it).",
        "Make `/app/{p}` hold exactly this one line: {line}",
    ), p=path, line=line))
    t.solve(f"echo '{line}' > /app/{path}")
    t.expect_text(f"/app/{path}", line + "\n")
    return t


def append_line(d: Draw) -> Task:
    path, start, line = f"{d.stem()}.txt", d.text(d.int(2, 5)), d.sentence()
    t = Task(d.phrase((
        "Add the line `{line}` to the end of `/app/{p}`, keeping what is already there.",
        "Append one line, `{line}`, to the file `/app/{p}`.",
    ), p=path, line=line))
    t.file(path, start)
    t.solve(f"echo '{line}' >> /app/{path}")
    t.expect_text(f"/app/{path}", start + line + "\n")
    return t


def copy_file(d: Draw) -> Task:
    stem, ext = d.stem(), d.pick(words.KEEP_EXTENSIONS)
    src = f"{stem}.{ext}"
    into_dir = d.int(0, 1)
    dest = f"{d.dir_name()}/{src}" if into_dir else f"{stem}_copy.{ext}"
    t = Task(d.phrase((
        "Copy `/app/{s}` to `/app/{t}`. Keep the original.",
        "Make a copy of the file `/app/{s}` at `/app/{t}`.",
    ), s=src, t=dest))
    content = d.text(d.int(2, 6))
    t.file(src, content)
    if into_dir:
        t.dir(dest.split("/")[0])
    t.solve(f"cp /app/{src} /app/{dest}")
    t.expect_same_file(f"/app/{dest}", content.encode())
    t.expect_unchanged(src)
    return t


def move_file(d: Draw) -> Task:
    src_dir, dest_dir = d.sample(words.DIRS, 2)
    stem, other = d.stems(2)
    name = f"{stem}.{d.pick(words.KEEP_EXTENSIONS)}"
    content = d.text(d.int(2, 6))
    t = Task(d.phrase((
        "Move the file `/app/{a}/{n}` into the folder `/app/{b}`.",
        "`/app/{a}/{n}` belongs in `/app/{b}`: move it there (it must no longer be in `/app/{a}`).",
    ), a=src_dir, b=dest_dir, n=name))
    t.file(f"{src_dir}/{name}", content)
    t.file(f"{src_dir}/{other}.txt", d.text(2))
    t.dir(dest_dir)
    t.solve(f"mv /app/{src_dir}/{name} /app/{dest_dir}/")
    t.expect_same_file(f"/app/{dest_dir}/{name}", content.encode())
    t.expect_absent(f"/app/{src_dir}/{name}")
    return t


def delete_by_extension(d: Draw) -> Task:
    folder, junk = d.dir_name(), d.pick(words.JUNK_EXTENSIONS)
    stems = d.words(d.int(4, 7))
    cut = d.int(2, len(stems) - 2)
    doomed, kept = stems[:cut], stems[cut:]
    t = Task(d.phrase((
        "Delete every file ending in `.{e}` in `/app/{f}`; keep all other files.",
        "Remove the `.{e}` files from the folder `/app/{f}`. Do not touch the other files.",
        "Clean up `/app/{f}`: delete all `*.{e}` files there and nothing else.",
    ), e=junk, f=folder))
    for s in doomed:
        t.file(f"{folder}/{s}.{junk}", d.sentence() + "\n")
    for s in kept:
        t.file(f"{folder}/{s}.{d.pick(words.KEEP_EXTENSIONS)}", d.sentence() + "\n")
    t.solve(f"rm /app/{folder}/*.{junk}")
    for s in doomed:
        t.expect_absent(f"/app/{folder}/{s}.{junk}")
    for path in [p for p in t.app if p.startswith(folder + "/") and not p.endswith("." + junk)]:
        t.expect_unchanged(path)
    return t


def copy_dir(d: Draw) -> Task:
    src, dest = d.sample(words.DIRS, 2)
    files = {f"{w}.txt": d.text(d.int(1, 3)) for w in d.words(d.int(2, 4))}
    sub = d.word()
    files[f"{sub}/{d.stem()}.md"] = d.text(2)
    t = Task(d.phrase((
        "Copy the directory `/app/{a}`, with everything in it, to `/app/{b}`.",
        "Make `/app/{b}` a full copy of the folder `/app/{a}` (subfolders included).",
    ), a=src, b=dest))
    for rel, content in files.items():
        t.file(f"{src}/{rel}", content)
    t.solve(f"cp -r /app/{src} /app/{dest}")
    t.expect_tree(f"/app/{dest}", files)
    t.expect_tree(f"/app/{src}", files)
    return t


def make_symlink(d: Draw) -> Task:
    folder, target = d.dir_name(), f"{d.stem()}.conf"
    link = f"{d.word()}.conf"
    t = Task(d.phrase((
        "Create a symbolic link `/app/{l}` that points to `/app/{f}/{t}`.",
        "Make `/app/{l}` a symlink to the file `/app/{f}/{t}`.",
    ), l=link, f=folder, t=target))
    t.file(f"{folder}/{target}", d.text(2))
    t.solve(f"ln -s /app/{folder}/{target} /app/{link}")
    t.expect(f"links_to /app/{link} /app/{folder}/{target}")
    t.expect_unchanged(f"{folder}/{target}")
    return t


def symlink_target(d: Draw) -> Task:
    folder, link, out = d.dir_name(), d.word(), f"{d.word()}_target.txt"
    names = [f"{w}.txt" for w in d.words(d.int(2, 4))]
    chosen = d.pick(names)
    t = Task(d.phrase((
        "`/app/{l}` is a symbolic link. Write the full path of the file it points to into `/app/{o}`.",
        "Find out which file the link `/app/{l}` leads to and write that file's absolute path to `/app/{o}`.",
    ), l=link, o=out))
    for n in names:
        t.file(f"{folder}/{n}", d.text(1))
    t.link(link, f"{folder}/{chosen}")
    t.solve(f"readlink -f /app/{link} > /app/{out}")
    t.expect_value(f"/app/{out}", f"/app/{folder}/{chosen}")
    return t


def path_parts(d: Draw) -> Task:
    path = f"/srv/{d.dir_name()}/{d.word()}/{d.stem()}.{d.pick(words.KEEP_EXTENSIONS)}"
    part = d.pick(("name", "directory"))
    answer = path.rsplit("/", 1)[1] if part == "name" else path.rsplit("/", 1)[0]
    what = "only the file name (without its directory)" if part == "name" else "only its directory part"
    out = f"{part}.txt"
    t = Task(d.phrase((
        "`/app/path.txt` holds a file path. Write {w} to `/app/{o}`.",
        "Read the path stored in `/app/path.txt` and write {w} into `/app/{o}`.",
    ), w=what, o=out))
    t.file("path.txt", path + "\n")
    tool = "basename" if part == "name" else "dirname"
    t.solve(f'{tool} "$(cat /app/path.txt)" > /app/{out}')
    t.expect_value(f"/app/{out}", answer)
    return t


FAMILIES = (
    Family("make-dir", "files", "create a (nested) directory", make_dir),
    Family("write-line", "files", "create a file holding one given line", write_line),
    Family("append-line", "files", "append a line to an existing file", append_line),
    Family("copy-file", "files", "copy a file to a new name or into a folder", copy_file),
    Family("move-file", "files", "move a file into another folder", move_file),
    Family("delete-by-extension", "files", "delete the files of one extension in a folder", delete_by_extension),
    Family("copy-dir", "files", "copy a directory tree", copy_dir),
    Family("make-symlink", "paths", "create a symbolic link to a file", make_symlink),
    Family("symlink-target", "paths", "write the absolute path a symlink resolves to", symlink_target),
    Family("path-parts", "paths", "write the file name or directory part of a stored path", path_parts),
)
