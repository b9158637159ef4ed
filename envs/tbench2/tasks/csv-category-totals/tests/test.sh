#!/bin/bash
# Verifier: partial credit in reward.json; "reward" is 1 only when both outputs are right.
mkdir -p /logs/verifier
report=0; top=0
cmp -s /app/report.txt /tests/expected_report.txt && report=1
[ "$(tr -d '[:space:]' < /app/top.txt 2>/dev/null)" = "books" ] && top=1
reward=$(( report * top ))
printf '{"reward": %d, "report": %d, "top": %d}\n' "$reward" "$report" "$top" > /logs/verifier/reward.json
