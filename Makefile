# The two commands of the README. Both set up .venv on first use.
.PHONY: serve test setup

setup:
	bash scripts/setup.sh

serve: setup
	.venv/bin/draftsmith serve

# two pytest-xdist workers (DRAFTSMITH_TEST_WORKERS=0 runs in one process); tests/conftest.py keeps the
# tests that start process trees of their own on one worker
test: setup
	.venv/bin/python -m pytest -q -n $${DRAFTSMITH_TEST_WORKERS:-2} --dist loadgroup --durations=15
