# The two commands the README promises: `make demo` and `make test`.
# Each creates (or reuses) .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv bench clean crds dev-cluster control-plane

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/rolegate demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/pytest

# Regenerate the CRDs from the policy model (tests/policy/test_crds.py fails when stale).
crds: $(STAMP)
	$(BIN)/python -m rolegate_policy.crds deploy/crds

bench: $(STAMP)
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/outcome_emit.py
	$(BIN)/python bench/routing_decision.py

clean:
	rm -rf $(VENV)

# Build (once, cached under ~/.cache/rolegate) the real control plane the tests use.
control-plane:
	bash hack/build-control-plane.sh

dev-cluster: $(STAMP)
	$(BIN)/rolegate dev-cluster
