#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when the task is done, else 0.
mkdir -p /logs/verifier

if [ "$(cat /app/todo.txt 2>/dev/null)" = "buy milk" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
