#!/bin/bash
# Verifier: extracts the archive and compares the file list and contents.
mkdir -p /logs/verifier
out=$(mktemp -d)
ok=1
tar -xzf /app/backup.tar.gz -C "$out" 2>/dev/null || ok=0
got=$(cd "$out" && find . -type f | sed 's|^\./||' | sort | tr '\n' ' ')
[ "$got" = "README.md docs/guide.txt src/main.sh src/util.sh " ] || ok=0
cmp -s "$out/src/main.sh" /app/project/src/main.sh || ok=0
[ "$(tr -d '[:space:]' < /app/backup_count.txt 2>/dev/null)" = "4" ] || ok=0
rm -rf "$out"
echo $ok > /logs/verifier/reward.txt
