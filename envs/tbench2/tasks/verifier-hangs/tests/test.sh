#!/bin/bash
# Deliberately broken verifier: hangs forever (with a child that also hangs) and never writes a reward.
mkdir -p /logs/verifier
sleep 100000 &
while :; do sleep 1; done
