"""Test doubles: stand-ins for what cannot run on this machine (the Daytona cloud). They live here,
not in the agentrl package; benchmarks reach them through bench/doubles.py."""
