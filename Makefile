# The two commands of the README. Both set up .venv on first use.
.PHONY: serve test setup

setup:
	bash scripts/setup.sh

serve: setup
	.venv/bin/draftsmith serve

test: setup
	.venv/bin/python -m pytest -q
