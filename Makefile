# The README's commands. Each target installs what it needs into .venv first (scripts/install.sh).
PY := .venv/bin/python

.PHONY: install demo test test-fast bench-attention leaderboard clean

install:
	@bash scripts/install.sh

# The main job: train a small language model end to end on flashsys (CPU: 2 gloo processes).
demo: install
	$(PY) -m flashsys train

# The whole CPU test suite (Triton kernels run under TRITON_INTERPRET=1 when there is no GPU).
test: install
	$(PY) -m pytest -q

bench-attention: install
	$(PY) -m benchmarks.attention

leaderboard: install
	$(PY) -m benchmarks.leaderboard

clean:
	rm -rf .venv .pytest_cache .hypothesis
