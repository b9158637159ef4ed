"""agentrl as a peer of Harbor (`pip install harbor`, the terminal-bench harness).

- environment.py: a Harbor environment backed by agentrl's local bubblewrap sandbox
  (`harbor run --env agentrl.harbor.environment:LocalSandboxEnvironment`): Harbor evaluations on
  one machine without Docker.
- jobs.py: run `harbor run` as a subprocess and read a Harbor job folder as agentrl outcomes.
- parity.py: Harbor's oracle and nop agents on agentrl's tasks vs agentrl's expectations.
- eval.py: `agentrl eval --harness harbor`: Harbor's Terminus-2 against agentrl's engine, beside
  agentrl's own eval of the same checkpoint.
- atif.py: agentrl transcripts -> ATIF trajectories (no Harbor import); viewer_job.py lays them
  out as a Harbor job folder that `harbor view` opens.
- cli.py: `agentrl harbor atif|parity`.

Every module but atif.py and cli.py needs the optional `harbor` extra at use; importing this
package imports nothing.
"""
