# kvvmm: `make lab` opens the notebooks, `make test` runs every test. Both set up .venv first.
# Needs python3 (>= 3.11, with the venv module: Debian's python3-venv) and make.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Extra arguments, e.g. `make test PYTEST_ARGS="-k arena -x"`.
PYTEST_ARGS ?=
LAB_ARGS ?=
BENCH_ARGS ?=

# The stamp's name carries a hash of what the install depends on: a changed pyproject.toml,
# constraints.txt or C extension reinstalls (and rebuilds it); unchanged, `make venv` is a no-op.
DEPS_HASH := $(shell cat pyproject.toml constraints.txt kvvmm/driver/_cudafast.c 2>/dev/null | sha256sum | cut -c1-16)
STAMP := $(VENV)/.kvvmm-installed-$(DEPS_HASH)

# Notebooks run as tests under nbval, in the same pytest run as tests/.
NOTEBOOKS := $(wildcard notebooks/*.ipynb)
SANITIZE := $(wildcard notebooks/sanitize.cfg)
NBVAL_ARGS := $(if $(NOTEBOOKS),--nbval --nbval-current-env $(if $(SANITIZE),--nbval-sanitize-with $(SANITIZE)) notebooks)

.PHONY: venv test test-heavy lab lint bench bench-sim clean ext notebooks sglang

venv: $(STAMP)

$(STAMP):
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "kvvmm needs Python >= 3.11; $(PYTHON) is $$($(PYTHON) -V 2>&1). Try PYTHON=python3.11." >&2; exit 1; }
	@if [ ! -x $(PY) ]; then \
	  echo "creating $(VENV) with $$($(PYTHON) -V)"; \
	  $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); \
	    echo "could not create $(VENV): on Debian/Ubuntu, apt-get install python3-venv" >&2; exit 1; }; \
	fi
	$(PY) -m pip install --disable-pip-version-check -q -c constraints.txt -e '.[test]'
	@rm -f $(VENV)/.kvvmm-installed-*
	@touch $@

# The C extension in place, with gcc and Python's headers only (no pip, no setuptools): for a
# checkout used with PYTHONPATH=$PWD, as on a GPU machine. `make venv` builds it by itself.
EXT_INCLUDE = $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
ext:
	gcc -O2 -Wall -shared -fPIC -I$(EXT_INCLUDE) kvvmm/driver/_cudafast.c \
	  -o kvvmm/driver/_cudafast.abi3.so

# Notebook 06 runs Azure's real trace when ../shared holds it (kvvmm.workload.find_trace):
# the whole hour takes about 3 minutes on a 2-core machine, its first 10 minutes about 40 s,
# its first 5 (the span of the generated slice it runs without the trace) about 25 s, so
# the suite runs the first TRACE_MINUTES of it (empty: the whole hour). The browser test's
# Run All of 06 reads the same setting.
TRACE_MINUTES ?= 5
# The slowest tests, in every run's log.
TEST_DURATIONS ?= 25

test: venv sglang
	KVVMM_TRACE_MINUTES=$(TRACE_MINUTES) $(PY) -m pytest --durations=$(TEST_DURATIONS) tests \
	  $(NBVAL_ARGS) $(PYTEST_ARGS)

# Only the tests marked heavy (pyproject.toml: the browser test, mypy --strict), e.g. to run
# the browser test again and again. `make test` runs them too; to leave them out of it,
# `make test PYTEST_ARGS='-m "not heavy"'`.
test-heavy: venv
	KVVMM_TRACE_MINUTES=$(TRACE_MINUTES) $(PY) -m pytest --durations=$(TEST_DURATIONS) -m heavy \
	  tests $(PYTEST_ARGS)

# SGLang's own pool code for the conformance suite (tests/conformance): the released wheel,
# unpacked, never installed (its dependencies are the whole server; the suite stands in for
# its GPU stack). One download from PyPI, kept in .venv; offline, the suite is skipped.
SGLANG_VERSION := 0.5.23
SGLANG_DIR := $(VENV)/sglang-$(SGLANG_VERSION)
sglang: $(SGLANG_DIR)/.unpacked

$(SGLANG_DIR)/.unpacked: | venv
	@rm -rf $(SGLANG_DIR) && mkdir -p $(SGLANG_DIR)/wheel
	@$(PY) -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
	  --python-version 3.11 --implementation cp --platform manylinux_2_34_x86_64 \
	  -d $(SGLANG_DIR)/wheel sglang==$(SGLANG_VERSION) && \
	$(PY) -m zipfile -e $(SGLANG_DIR)/wheel/sglang-*.whl $(SGLANG_DIR) && \
	rm -rf $(SGLANG_DIR)/wheel && touch $@ || \
	echo "could not download sglang==$(SGLANG_VERSION): its conformance suite will be skipped"

# `kvvmm lab` picks the driver (CUDA when a GPU is usable, else the host or sim driver)
# and opens JupyterLab on notebooks/. Without kvvmm.cli (an old checkout), plain JupyterLab.
lab: venv
	@if $(PY) -c 'import kvvmm.cli' 2>/dev/null; then \
	  $(VENV)/bin/kvvmm lab $(LAB_ARGS); \
	else \
	  echo "kvvmm.cli is not there yet: starting plain JupyterLab on notebooks/"; \
	  $(PY) -m jupyter lab --notebook-dir=notebooks $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS); \
	fi

lint: venv
	$(PY) -m ruff check kvvmm tests notebooks
	$(PY) -m mypy --strict kvvmm

# Regenerate and execute the notebooks from their jupytext sources (notebooks/src/*.py), on
# the sim driver, e.g. `make notebooks NB=03_growth`. `notebooks/build.py --check` (and the
# test suite) fails when a saved notebook differs from its source.
NB ?=
notebooks: venv
	$(PY) notebooks/build.py $(NB)

# `kvvmm bench` wants a GPU; results land in bench/results/. bench-sim runs anywhere.
bench: venv
	@if $(PY) -c 'import kvvmm.cli' 2>/dev/null; then \
	  $(VENV)/bin/kvvmm bench $(BENCH_ARGS); \
	else \
	  $(PY) -c 'import sys; from kvvmm.measure.bench import main; sys.exit(main(sys.argv[1:]))' $(BENCH_ARGS); \
	fi

bench-sim: venv
	$(PY) bench/sim/bench_sim.py $(BENCH_ARGS)

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache .hypothesis build dist *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
