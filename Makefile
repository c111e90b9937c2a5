# ds_omni: `make demo` trains the tiny demo model; `make test` runs the quick tier of the test
# suite, `make test-slow` its slow tier (tests marked `slow`), `make test-full` both; CI runs
# `make test` then `make test-slow` (.ci/run); `make bench` runs every CPU benchmark at quick
# settings (about 30 minutes) and regenerates BENCHMARKS.md's summary figures from the results
# (benchmarks/run_all.py). All set up a project-local virtualenv first (once; later runs skip it).

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch; skipped when the venv already imports a torch (e.g. a CUDA build).
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.ds_omni-setup-$(shell cat pyproject.toml constraints.txt Makefile | md5sum \
                                        | cut -c1-10)
# torchvision's Python side, OUTSIDE the venv's import path (ds_omni/coverage/torchvision_rows.py
# says why): only the coverage sweep's child process reads it; the release is the one of the venv's
# torch (2.x -> 0.(x+15)); none installable, or a torchvision already importable: skipped
TORCHVISION_DIR := $(VENV)/torchvision-py

export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export DS_OMNI_CACHE ?= $(CURDIR)/.cache/ds_omni
export HF_HUB_OFFLINE := 1
export PYTHONUNBUFFERED := 1

.PHONY: setup demo test test-slow test-full test-unit bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	@# reuse a torch the system Python already has (a CUDA box), else install the CPU pin
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else $(PYTHON) -m venv $(VENV); fi; fi
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	@# (DeepSpeed's CPU shared-memory op is not built: ds_omni starts without it, see parallel/dist.py)
	@rm -rf $(TORCHVISION_DIR)
	@$(PY) -c "import torchvision" 2>/dev/null || { \
	  tv=$$($(PY) -c "import torch; v = torch.__version__.split('+')[0].split('.'); \
	                  print(f'0.{int(v[1]) + 15}.*')"); \
	  $(PY) -m pip install -q --no-deps --target $(TORCHVISION_DIR) "torchvision==$$tv" \
	  || echo "note: no torchvision==$$tv to install; the coverage sweep says which types need it"; }
	@rm -f $(VENV)/.ds_omni-setup-*
	@touch $@

demo: setup
	@bash launch/demo.sh

# pytest exits 5 when a selection holds no test: a tier gone empty (a marker renamed or lost) is
# said so, and fails, instead of passing with nothing run. The slowest tests are listed at the end
# (what to weigh when a tier outgrows its time).
define pytest_tier
	@$(PY) -m pytest --durations=15 $(1) tests; rc=$$?; if [ $$rc -eq 5 ]; then \
	  echo "make $@: pytest selected no test: the tier is empty (a marker lost?), see README's Tests" >&2; fi; \
	exit $$rc
endef

test: setup
	$(call pytest_tier,-m "not slow")

test-slow: setup
	$(call pytest_tier,-m slow)

test-full: setup
	$(call pytest_tier,)

test-unit: setup
	$(PY) -m pytest tests/unit

# every measured CPU benchmark (not the GPU ones), progress per script, results/*.json + PNG,
# then BENCHMARKS.md's summary figures from the results files; BENCH_ARGS=--full adds the long runs
bench: setup
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf outputs .cache .pytest_cache
