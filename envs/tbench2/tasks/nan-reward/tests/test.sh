#!/bin/bash
# Deliberately broken verifier: writes NaN.
mkdir -p /logs/verifier
echo nan > /logs/verifier/reward.txt
