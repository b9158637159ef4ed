"""agentrl as a peer of Harbor (`pip install harbor`, the terminal-bench harness).

- environment.py: a Harbor environment backed by agentrl's local bubblewrap sandbox
  (`harbor run --env agentrl.harbor.environment:LocalSandboxEnvironment`): Harbor evaluations on
  one machine without Docker.
- jobs.py: run `harbor run` as a subprocess and summarise a Harbor job folder (pass rates).
- eval.py: `agentrl eval --harness harbor`: Harbor's Terminus-2 against agentrl's engine, beside
  agentrl's own eval of the same checkpoint.
- atif.py: agentrl transcripts -> ATIF trajectories in a folder `harbor view` opens.

Every module but atif's converter needs the optional `harbor` extra; importing this package
imports nothing.
"""
