# The two commands the README promises: `make demo` and `make test`.
# Each creates (or reuses) .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv bench bench-peers bench-machines bench-llama clean crds chart-crds dev-cluster control-plane lock

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,demo]'
	touch $(STAMP)

# Re-resolve every dependency from pyproject.toml's ranges into constraints.txt (the exact
# versions `make venv` and the Dockerfile install). Review the diff, then `make test`.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install --quiet --upgrade pip
	.venv-lock/bin/pip install --quiet '.[dev,demo]'
	{ sed -n '1,3p' constraints.txt; .venv-lock/bin/pip freeze --exclude-editable | grep -v '^rolegate'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf .venv-lock

venv: $(STAMP)

# The demo also writes every span it traced to demo-trace.jsonl and shows one request's.
demo: $(STAMP)
	$(BIN)/rolegate demo --trace-file demo-trace.jsonl

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy tests bench  # the tests and benchmarks are held to the same standard
	$(BIN)/lint-imports

# The control plane is built before pytest starts, as a step of its own: no test builds.
test: lint control-plane
	$(BIN)/pytest

# Regenerate the CRDs from the policy model (tests/policy/test_crds.py fails when stale),
# and refresh the Helm chart's copy of them.
crds: $(STAMP)
	$(BIN)/python -m rolegate_policy.crds deploy/crds
	$(MAKE) chart-crds

# The Helm chart's crds/ is a byte-for-byte copy of deploy/crds/ (tests/deploy/test_chart.py
# fails when it differs).
chart-crds:
	rm -f deploy/helm/rolegate/crds/*.yaml
	mkdir -p deploy/helm/rolegate/crds
	cp deploy/crds/*.yaml deploy/helm/rolegate/crds/

bench: $(STAMP)
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/outcome_emit.py
	$(BIN)/python bench/routing_decision.py

# rolegate beside LiteLLM's proxy and Portkey's gateway (bench/peers.py): about 14 minutes,
# not part of `make bench`. The first run installs the pinned peers under
# $${ROLEGATE_CACHE:-~/.cache/rolegate}/bench-peers (PyPI and npm), later runs reuse them.
# Quicker, rolegate alone: .venv/bin/python bench/peers.py --targets rolegate
bench-peers: $(STAMP)
	$(BIN)/python bench/peers.py

# rolegate's request path with one model on 1, 10, 100 and 1,000 aggregator machines
# (bench/machines.py): about a minute.
bench-machines: $(STAMP)
	$(BIN)/python bench/machines.py

# Exact handovers between two real llama-server processes (bench/llama_handover.py): tool
# calls and text rescued or moved mid-stream, about 2.5 minutes. Needs llama-server and the
# model under $${ROLEGATE_LLAMA_DIR:-$${ROLEGATE_CACHE:-~/.cache/rolegate}/llama}; without
# them it says how to install them (about 10 minutes, once) and exits 2.
bench-llama: $(STAMP)
	$(BIN)/python bench/llama_handover.py

clean:
	rm -rf $(VENV)

# The real Kubernetes control plane the tests use (kube-apiserver, kubectl, etcd, helm) and
# promtool, built from Go modules once per machine and cached under ~/.cache/rolegate
# ($ROLEGATE_CACHE): about 10 minutes the first time, printing what it is doing; instant
# afterwards.
control-plane:
	@bash hack/build-control-plane.sh >/dev/null

dev-cluster: $(STAMP) control-plane
	$(BIN)/rolegate dev-cluster
