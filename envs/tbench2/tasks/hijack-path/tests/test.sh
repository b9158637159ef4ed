#!/bin/bash
# Verifier: trusts `sumcheck` from the image's PATH, which the agent could replace in its own
# sandbox; task.toml runs this in a fresh one.
mkdir -p /logs/verifier
if sumcheck /app/sum.txt 60; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
