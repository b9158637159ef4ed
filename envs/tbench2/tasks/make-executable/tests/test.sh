#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when the task is done, else 0.
mkdir -p /logs/verifier

if [ -x /app/run.sh ] && [ "$(/app/run.sh)" = "ok" ] && cmp -s /app/run.sh /tests/run.sh.orig; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
