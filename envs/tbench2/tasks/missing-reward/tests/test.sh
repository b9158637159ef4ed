#!/bin/bash
# Deliberately broken verifier: checks the file but never writes a reward file.
if [ "$(cat /app/hello.txt 2>/dev/null)" = "hello" ]; then echo "looks right"; else echo "looks wrong"; fi
exit 0
