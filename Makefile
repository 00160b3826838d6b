# agentenv: `make run` (set-up, then the node server) and `make test` (set-up, then the suite).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
AENV_HOME ?= /var/lib/aenv
export AENV_HOME
# Python writes and reads back its compiled modules (__pycache__) in everything make
# starts. Container images often set PYTHONDONTWRITEBYTECODE, and this machine does:
# then every Python process (each node a test starts or restarts, each `aenv` call,
# each pytest worker's assertion rewriting) compiles all it imports anew, ~0.5 CPU-s
# a node start here.
unexport PYTHONDONTWRITEBYTECODE
UV_VERSION := 0.13.9
UV_INSTALL := $(VENV)/bin/uv pip install --quiet --python $(PY)
# pytest workers of `make test`'s parallel part. Three keep the two cores busy while
# tests wait on idle windows and sandboxes (fresh clones of one tree, 2026-12-04:
# parallel part two 921 s at 26 % CPU idle, three 793 s at 7 % beside other work and
# 686 s alone: 13:03 in all from the clone). Three were slower
# while every node burned a core on conntrack dumps (18:01 against 16:52).
TEST_WORKERS ?= 3
PYTHON ?= $(shell command -v python3.11 || command -v python3)

.PHONY: setup system venv template templates js ui run run-cluster test bench soak lint docs clean-state

setup: system venv template

system:
	@bash scripts/setup-system.sh

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.lock pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 is required"'
	$(PYTHON) -m venv $(VENV)
	@# uv (PyPI, pinned) installs the same pinned packages as pip would, downloading and
	@# unpacking them side by side: ~16 s from scratch here where pip took ~60 s (a
	@# quarter of `make test`'s set-up). pip does it if uv cannot.
	$(VENV)/bin/pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(UV_INSTALL) --compile-bytecode -r requirements.lock || \
	  $(VENV)/bin/pip install -q --disable-pip-version-check -r requirements.lock
	$(UV_INSTALL) --no-deps -e . || \
	  $(VENV)/bin/pip install -q --disable-pip-version-check --no-deps -e .
	@touch $@

template: system templates

# The two templates and the deployment image's base (tests/test_deploy_compose.py)
# build side by side (each mostly waits on downloads and dpkg).
templates:
	@bash scripts/build-base-template.sh & base=$$!; \
	bash scripts/build-deploy-base.sh & deploy=$$!; \
	bash scripts/build-code-interpreter-template.sh; ci=$$?; \
	wait $$base && wait $$deploy && exit $$ci

# The e2b JavaScript SDKs the suite runs (tests/js, pinned by its package-lock.json).
js: tests/js/node_modules/.package-lock.json

tests/js/node_modules/.package-lock.json: tests/js/package.json tests/js/package-lock.json
	cd tests/js && npm ci --no-audit --no-fund --loglevel=error

# The web console (/ui): npm packages pinned by ui/package-lock.json, built into ui/dist,
# which the node and the gateway serve (nothing is fetched from elsewhere at run time).
ui: ui/dist/index.html

ui/dist/index.html: ui/package.json ui/package-lock.json ui/vite.config.js ui/index.html $(wildcard ui/src/*)
	cd ui && npm ci --no-audit --no-fund --loglevel=error && npm run --silent build

run: setup ui
	$(VENV)/bin/aenv server

# Clustered on one machine: redis, scheduler :9090, gateway :8080, a node :8000.
run-cluster: setup ui
	@bash deploy/run-cluster.sh

# The JS SDKs install and the console builds while the venv installs; then the base
# template (every session node needs it; its build may use the venv's pip), then
# scripts/test-suite.sh: the other two templates build beside the tests that do not
# need them, and the lint beside the parallel part; the serial files last.
test: system
	@$(MAKE) --no-print-directory -j3 venv js ui
	@bash scripts/build-base-template.sh
	@TEST_WORKERS=$(TEST_WORKERS) bash scripts/test-suite.sh

# The headline benchmarks, each beside its floor, then one summary table (bench/README.md).
bench: setup
	$(PY) bench/run.py

# Ten minutes of sandboxes created and deleted in waves under load (not in `make test`).
soak: setup
	cd bench && ../$(PY) soak.py

# Style, types, the one-way rule between packages (docs/architecture.md), and the
# docs: the site built with --strict (a broken link or anchor between pages, or a
# page missing from mkdocs.yml's nav, fails it; not --quiet, which hides the warnings
# --strict counts) and the README's links into docs/.
lint: venv
	$(VENV)/bin/ruff check src tests bench examples scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	@site=$$(mktemp -d) && trap 'rm -rf "$$site"' EXIT && \
	$(VENV)/bin/mkdocs build --strict --site-dir "$$site"
	$(PY) scripts/check_readme_links.py

# The docs as a website, into site/ (mkdocs.yml).
docs: venv
	$(VENV)/bin/mkdocs build --strict --site-dir site
