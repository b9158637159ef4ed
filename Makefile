# Two commands a newcomer needs: `make demo` (the main job on the local default) and `make test`.
.PHONY: setup demo test test-slow test-slow-lanes lint clean

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/python launchers/run_glm5_2_daytona.py train --num-nodes 1 --model-name smollm2-135m --sandbox local --run-dir runs/demo-$$(date +%Y%m%d-%H%M%S) $(ARGS)

test: setup
	.venv/bin/python -m pytest

test-slow: setup
	.venv/bin/python -m pytest -m slow -p no:cacheprovider

test-slow-lanes: setup
	bash scripts/test_slow.sh

lint: setup
	.venv/bin/ruff check agentrl bench envs launchers kernels tests

clean:
	rm -rf .venv .pytest_cache
