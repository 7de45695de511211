# Two entry points matter: `make demo` and `make test` (see README.md). The rest are their steps.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
export PATH := $(CURDIR)/$(BIN):/usr/local/go/bin:$(PATH)
# Bytecode is written (__pycache__ is ignored by git): every agent a test starts imports vkubelet,
# which costs ~0.6 CPU-s more each time without it, and the test workers reuse the rewritten asserts.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo demo-down build lint test unit integration manifests image image-check \
  image-base-debian image-verify

# uv installs the same packages as pip in a fraction of the time (~1 CPU-s instead of ~18 with
# pip's cache warm); the venv keeps its own pip for `.venv/bin/pip install`.
install: $(STAMP)

# The libvirt binding (vkubelet[libvirt]: the vm provider's libvirt runtime and its tests) is an
# sdist only: it is built once against Debian's libvirt-dev into the vkubelet cache, since uv builds
# an sdist again whenever the index answers "modified" (here: every time, ~13-40 s). Without
# libvirt's headers it is left out (the demo needs none of it; its tests then skip, saying why).
WHEELS := $(or $(VKUBELET_CACHE_DIR),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/vkubelet)/wheels
LIBVIRT_PYTHON := $(shell sed -n 's/.*"libvirt-python==\([^"]*\)".*/\1/p' pyproject.toml)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "vkubelet needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	PIP_DISABLE_PIP_VERSION_CHECK=1 $(BIN)/pip install --quiet uv
	@mkdir -p $(WHEELS); extras=dev; \
	if ls $(WHEELS)/libvirt_python-$(LIBVIRT_PYTHON)-*.whl >/dev/null 2>&1; then extras=dev,libvirt; \
	elif pkg-config --exists libvirt 2>/dev/null; then \
	  PIP_DISABLE_PIP_VERSION_CHECK=1 $(BIN)/pip wheel --quiet --no-deps -w $(WHEELS) \
	    libvirt-python==$(LIBVIRT_PYTHON) || exit 1; extras=dev,libvirt; \
	else echo "note: without libvirt's headers the libvirt binding is left out (the libvirt" \
	  "runtime's tests skip); to have it: apt-get install libvirt-dev pkg-config, then" \
	  "rm $(VENV)/.installed-*; make install" >&2; fi; \
	echo "uv pip install -e '.[$$extras]'"; \
	$(BIN)/uv pip install --quiet --python $(BIN)/python --find-links $(WHEELS) -e ".[$$extras]"
	@rm -f $(VENV)/.installed-*; touch $@

# A local control plane (built once, then cached), a mock virtual node and an example Deployment.
demo: install
	examples/demo.sh up

demo-down: install
	examples/demo.sh down

build: install
	$(BIN)/vkubelet dev build --workers
	$(BIN)/python -c 'from vkubelet.devcluster import ensure_helm; ensure_helm()'  # the chart's tests

lint: install
	$(BIN)/ruff check src tests bench examples deploy
	$(BIN)/ruff format --check src tests bench examples deploy
	$(BIN)/mypy
	$(BIN)/lint-imports

# deploy/manifests/*.yaml from the Helm chart (helm is built from its Go module once, then cached).
manifests: install
	$(BIN)/python deploy/render.py

# The agent image (deploy/image/Containerfile), reproducible from the commit time; needs podman
# (deploy/image/build.py says which flags, docs/deploy.md what was verified). IMAGE_BASE=registry
# is the pinned python:3.11-slim-bookworm; IMAGE_BASE=local the Debian-packages base that
# `image-base-debian` makes with debootstrap (no registry needed). `image-verify` builds twice
# without cache and fails unless both are identical. `image-check` needs neither podman nor a
# registry: every locked file from PyPI, by hash.
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct)
IMAGE_BASE ?= registry
IMAGE_TARGET ?= agent
# vkubelet:0.1.0 is the agent; another target's tag says which (vkubelet:0.1.0-libvirt).
IMAGE_SUFFIX = $(if $(filter-out agent,$(IMAGE_TARGET)),-$(IMAGE_TARGET))
IMAGE_BUILD = SOURCE_DATE_EPOCH=$(SOURCE_DATE_EPOCH) $(PYTHON) deploy/image/build.py
image:
	$(IMAGE_BUILD) build --base $(IMAGE_BASE) --target $(IMAGE_TARGET) \
	  --tag vkubelet:$(shell grep -m1 '^version' pyproject.toml | cut -d'"' -f2)$(IMAGE_SUFFIX)

image-base-debian:
	$(PYTHON) deploy/image/build.py base

image-verify:
	$(IMAGE_BUILD) verify --base $(IMAGE_BASE) --target $(IMAGE_TARGET)

image-check: install
	d=$$(mktemp -d) && trap 'rm -rf $$d' EXIT && \
	for lock in deploy/image/requirements.lock deploy/image/build-requirements.lock \
	  deploy/image/libvirt-requirements.lock deploy/image/libvirt-build-requirements.lock; do \
	  $(BIN)/pip download --quiet --no-deps --require-hashes --dest $$d -r $$lock || exit 1; done

unit: install
	$(BIN)/pytest tests/unit

# Test processes in parallel (pytest-xdist; tests/parallel.py says how the suite is shared out):
# most of the suite waits rather than computes. `make test PARALLEL=0` runs it in one process.
PARALLEL ?= 4

# pytest exits 5 when it collects nothing; that is not a failure of the suite.
test: lint build
	$(BIN)/pytest -p no:cacheprovider -n $(PARALLEL) --durations=25; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc
