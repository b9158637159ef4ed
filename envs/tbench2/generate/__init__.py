"""Generated terminal-bench-2 tasks: parameterised families of everyday shell skills.

- family.py: Task (files, oracle, checks), Draw (seeded parameters), Family, the verifier helpers
- *_families.py: the families, a few per module, each one small function
- registry.py: families by name (an explicit table), render.py: Task -> task folder
- build.py: instances from a seed, sets and split sets; splits.py + SPLITS.json: held-out splits
- cache.py: sets built on demand into ~/.cache/agentrl/tasks/<hash>

CLI: `agentrl tasks generate OUT --families a,b --instances N --seed S` (agentrl/envs/tasks_generate.py).
"""
