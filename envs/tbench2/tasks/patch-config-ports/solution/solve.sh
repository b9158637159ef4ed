#!/bin/bash
cd /app/etc
grep -rl --include='*.conf' '^port=8080$' . | sed 's|^\./||' | sort > /app/changed.txt
while read -r f; do sed -i 's/^port=8080$/port=9090/' "$f"; done < /app/changed.txt
