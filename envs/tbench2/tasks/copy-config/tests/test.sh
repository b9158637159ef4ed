#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when the task is done, else 0.
mkdir -p /logs/verifier

if [ -f /app/config.ini ] && cmp -s /app/config.ini /app/config.bak; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
