#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when the task is done, else 0.
mkdir -p /logs/verifier

if [ "$(bash /app/sum.sh 2 3)" = "5" ] && [ "$(bash /app/sum.sh 10 -4)" = "6" ] && [ "$(bash /app/sum.sh 0 0)" = "0" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
