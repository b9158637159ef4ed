"""Families: permissions, archives (tar + gzip, which a bare ubuntu:24.04 image has; zip is not
there) and small scripts."""

from __future__ import annotations

import gzip
import io
import tarfile

from envs.tbench2.generate.family import Draw, Family, Task, q

# Archives are built in Python with fixed metadata, so that a generated .tar.gz is the same bytes
# on every run (gzip header mtime 0; tar entries owned by root at this date, 2023-11-14).
ARCHIVE_MTIME = 1_700_000_000


def tar_gz(files: dict[str, bytes]) -> bytes:
    """A gzip-compressed ustar archive of `files` (relative paths -> contents), parents included."""
    dirs = sorted({"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path, data in [(x, None) for x in dirs] + sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.mtime, info.uname, info.gname = ARCHIVE_MTIME, "root", "root"
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue(), mtime=0)


def make_executable(d: Draw) -> Task:
    script, word = f"{d.word()}.sh", d.word()
    t = Task(d.phrase((
        "Make the script `/app/{s}` executable.",
        "`/app/{s}` cannot be run because it lacks the execute permission. Fix that.",
    ), s=script))
    t.file(script, f"#!/bin/bash\necho {word}\n", mode=0o644)
    t.solve(f"chmod +x /app/{script}")
    t.expect(f"has_bits /app/{script} 100")
    t.expect_unchanged(script)
    return t


def set_mode(d: Draw) -> Task:
    path = f"{d.dir_name()}/{d.stem()}.{d.pick(('txt', 'conf', 'key', 'db'))}"
    mode = d.pick((0o600, 0o640, 0o700, 0o750, 0o444, 0o400, 0o664, 0o755))
    t = Task(d.phrase((
        "Set the permissions of `/app/{p}` to exactly `{m:o}` (octal).",
        "Change the mode of the file `/app/{p}` to {m:o}.",
    ), p=path, m=mode))
    t.file(path, d.text(2), mode=0o644)
    t.solve(f"chmod {mode:o} /app/{path}")
    t.expect_mode(f"/app/{path}", mode)
    t.expect_unchanged(path)
    return t


def read_only(d: Draw) -> Task:
    path = f"{d.dir_name()}/{d.stem()}.txt"
    start = d.pick((0o644, 0o664, 0o666, 0o755, 0o775))
    t = Task(d.phrase((
        ("Make `/app/{p}` read-only for everyone: remove every write permission and keep the other "
        "permissions as they are."),
        ("Nobody should be able to write to `/app/{p}` any more. Take away all its write permissions "
        "(leave the read and execute permissions alone)."),
    ), p=path))
    t.file(path, d.text(2), mode=start)
    t.solve(f"chmod a-w /app/{path}")
    t.expect_mode(f"/app/{path}", start & ~0o222)
    t.expect_unchanged(path)
    return t


def tar_create(d: Draw) -> Task:
    folder, name = d.dir_name(), f"{d.word()}_backup.tar.gz"
    files = {f"{s}.txt": d.text(d.int(1, 3)) for s in d.stems(d.int(2, 4))}
    t = Task(d.phrase((
        ("Create a gzip-compressed tar archive `/app/{n}` of the folder `/app/{f}`. Extracting it must "
        "give a folder named `{f}`."),
        ("Pack the directory `/app/{f}` into `/app/{n}` (tar + gzip), with `{f}/` as the top folder "
        "inside the archive."),
    ), n=name, f=folder))
    for rel, content in files.items():
        t.file(f"{folder}/{rel}", content)
    t.solve(f"tar -czf /app/{name} -C /app {folder}")
    ref = t.tree(files)
    t.expect(f'v=$(mktemp -d) && tar -xzf /app/{name} -C "$v" 2>/dev/null && [ "$(ls -A "$v")" = {folder} ] '
             f'&& same_tree "$v/{folder}" {ref}')
    return t


def tar_extract(d: Draw) -> Task:
    bundle = f"{d.word()}_{d.pick(('bundle', 'release', 'export'))}"
    files = {f"{s}.txt": d.text(d.int(1, 3)) for s in d.stems(d.int(2, 4))}
    files[f"{d.word()}/{d.stem()}.md"] = d.text(1)
    t = Task(d.phrase((
        "Extract the archive `/app/{b}.tar.gz` in `/app`, so that its files end up under `/app/{b}/`.",
        "Unpack `/app/{b}.tar.gz` into `/app` (it holds a folder named `{b}`).",
    ), b=bundle))
    t.file(f"{bundle}.tar.gz", tar_gz({f"{bundle}/{k}": v.encode() for k, v in files.items()}))
    t.solve(f"tar -xzf /app/{bundle}.tar.gz -C /app")
    t.expect_tree(f"/app/{bundle}", files)
    return t


def gzip_file(d: Draw) -> Task:
    folder, name = d.dir_name(), f"{d.stem()}.log"
    content = d.text(d.int(3, 8))
    t = Task(d.phrase((
        "Compress `/app/{f}/{n}` with gzip, so that it is replaced by `/app/{f}/{n}.gz`.",
        "gzip the file `/app/{f}/{n}` (the result is `/app/{f}/{n}.gz`; the uncompressed file goes away).",
    ), f=folder, n=name))
    t.file(f"{folder}/{name}", content)
    t.solve(f"gzip /app/{folder}/{name}")
    gz = q(f"/app/{folder}/{name}.gz")
    t.expect_absent(f"/app/{folder}/{name}")
    t.expect(f"[ -f {gz} ] && gzip -t {gz} 2>/dev/null && cmp -s <(gzip -dc {gz}) {t.reference(content)}")
    return t


def gunzip_file(d: Draw) -> Task:
    folder, name = d.dir_name(), f"{d.stem()}.txt"
    content = d.text(d.int(3, 8))
    t = Task(d.phrase((
        "Decompress `/app/{f}/{n}.gz` so that `/app/{f}/{n}` holds its contents.",
        "`/app/{f}/{n}.gz` is gzip-compressed. Unpack it to `/app/{f}/{n}`.",
    ), f=folder, n=name))
    t.file(f"{folder}/{name}.gz", gzip.compress(content.encode(), mtime=0))
    t.solve(f"gunzip /app/{folder}/{name}.gz")
    t.expect_same_file(f"/app/{folder}/{name}", content.encode())
    return t


def write_script(d: Draw) -> Task:
    script, line = f"{d.word()}.sh", d.sentence()
    t = Task(d.phrase((
        "Create an executable shell script `/app/{s}` that prints exactly this line: {l}",
        "Write a bash script at `/app/{s}` that outputs `{l}` when run, and make it executable.",
    ), s=script, l=line), difficulty="medium")
    t.solve(f"printf '#!/bin/bash\\necho \"%s\"\\n' '{line}' > /app/{script}", f"chmod +x /app/{script}")
    t.expect(f"prints /app/{script} {t.reference(line + chr(10))}")
    return t


def sum_numbers(d: Draw) -> Task:
    src, out = f"{d.word()}_amounts.txt", f"{d.word()}_total.txt"
    numbers = [d.int(1, 500) for _ in range(d.int(3, 10))]
    t = Task(d.phrase((
        "`/app/{s}` has one number per line. Write their sum to `/app/{o}` (just the number).",
        "Add up the numbers in `/app/{s}` and write the total into `/app/{o}`.",
    ), s=src, o=out))
    t.file(src, "".join(f"{n}\n" for n in numbers))
    t.solve(f"awk '{{s += $1}} END {{print s}}' /app/{src} > /app/{out}")
    t.expect_value(f"/app/{out}", sum(numbers))
    return t


def numbered_files(d: Draw) -> Task:
    folder, stem, n = d.dir_name(), d.word(), d.int(3, 9)
    t = Task(d.phrase((
        ("Create the files `/app/{f}/{s}1.txt` to `/app/{f}/{s}{n}.txt`; each holds its own number "
        "(`{s}2.txt` holds the line `2`)."),
        ("In `/app/{f}`, make {n} files named {s}1.txt, {s}2.txt, ... {s}{n}.txt, where file number i "
        "contains just the line i."),
    ), n=n, f=folder, s=stem), difficulty="medium")
    t.dir(folder)
    t.solve(f"for i in $(seq 1 {n}); do echo $i > /app/{folder}/{stem}$i.txt; done")
    for i in range(1, n + 1):
        t.expect_text(f"/app/{folder}/{stem}{i}.txt", f"{i}\n")
    t.expect(f'[ "$(ls -A /app/{folder} | wc -l)" = {n} ]')
    return t


FAMILIES = (
    Family("make-executable", "permissions", "give a script the execute permission", make_executable),
    Family("set-mode", "permissions", "set a file's mode to a given octal value", set_mode),
    Family("read-only", "permissions", "remove every write permission of a file", read_only),
    Family("tar-create", "archives", "pack a folder into a .tar.gz", tar_create),
    Family("tar-extract", "archives", "unpack a .tar.gz", tar_extract),
    Family("gzip-file", "archives", "compress a file with gzip", gzip_file),
    Family("gunzip-file", "archives", "decompress a .gz file", gunzip_file),
    Family("write-script", "scripts", "write an executable script that prints a line", write_script),
    Family("sum-numbers", "scripts", "write the sum of a column of numbers", sum_numbers),
    Family("numbered-files", "scripts", "create numbered files holding their numbers (a loop)", numbered_files),
)
