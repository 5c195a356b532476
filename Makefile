# The two commands a new user runs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEMO_CHECKPOINT ?= .cache/demo-small-mixtral
CHECKPOINT ?=
# pytest processes for `make test`. A mesh test waits on its services as often as it computes:
# one pytest process keeps 2 cores 1.1 busy on average, and two finish the suite in 0.62 of the time.
TEST_WORKERS ?= 2

.PHONY: setup demo test protos bench clean gpu-wheels

$(STAMP): pyproject.toml constraints.txt tests/node/package.json tests/node/package-lock.json
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo '==> installing moe-mesh and its dependencies into $(VENV) (a few minutes the first time)' >&2
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,fastpath]'
	@# Only the Node.js interop test needs npm; without it that test is skipped, and the demo runs anyway.
	@if command -v npm >/dev/null; then npm ci --prefix tests/node --no-audit --no-fund; \
	else echo 'npm not found: tests/e2e/test_node_client.py will be skipped' >&2; fi
	touch $@

setup: $(STAMP)

# Every service process compiles moe-mesh's modules again unless their bytecode is on disk (~0.2 s
# each, and the suite starts hundreds), which PYTHONDONTWRITEBYTECODE=1 or a read-only tree
# prevents: compile them once up front (only what changed; __pycache__ is ignored by git).
BYTECODE = $(PY) -m compileall -q -j 0 moe_mesh common protos router_service expert_service gateway bench tests

demo: $(STAMP)
	@$(BYTECODE)
	$(PY) -m moe_mesh.local.demo $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT),--create $(DEMO_CHECKPOINT))

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	@# The docs site, offline, into an ignored folder: a broken link, anchor or page fails (mkdocs.yml).
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir .cache/site
	@$(BYTECODE)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

# Regenerates protos/moe_mesh/v1/*_pb2*.py(i); tests/unit/moe_mesh/dev/test_protogen.py fails when the committed copy is stale.
protos: $(STAMP)
	$(PY) -m moe_mesh.dev.protogen

bench: $(STAMP)
	$(PY) -m bench.engine_vs_transformers
	$(PY) -m bench.mesh_dispatch
	$(PY) -m bench.memory
	$(PY) -m bench.vs_llamacpp
	$(PY) -m bench.dispatch_profile
	$(PY) -m bench.tiering
	$(PY) -m bench.tracing
	$(PY) -m bench.chaos

# The Python 3.12 wheels a lent GPU machine lacks, into .gpu-wheels/ (ignored: a device run carries
# it); README.md's development section says how bench/gpu_check.py runs there. UCX=1 tries UCX too.
gpu-wheels: $(STAMP)
	$(PY) -m bench.gpu_wheels $(if $(UCX),--ucx)

clean:
	rm -rf $(VENV) .cache .pytest_cache bench/results
