#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when the task is done, else 0.
mkdir -p /logs/verifier
cd /app/logs || exit 0
if [ "$(cat alpha.txt beta.txt gamma.txt 2>/dev/null)" = "$(printf 'first\nsecond\nthird')" ] \
  && [ -z "$(ls *.log 2>/dev/null)" ] && [ -f notes.md ] && [ "$(ls | wc -l)" -eq 4 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
