# The two commands (see README): `make demo` and `make test`. Both set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines: the local CPU build (a bare `torch` requirement would pull a multi-GB CUDA build).
# GPU machines: `make setup TORCH_SPEC=torch` (or your CUDA build).
TORCH_SPEC ?= torch==2.13.0

# The browser tests drive Debian's Chromium (tests/test_ui_browser.py): installed once, as root or with sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup bytecode browser demo test test-fast clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev]'
	# megatron-core without its dependencies (their torch is the build above): the Megatron backend needs CUDA, but
	# its model, mapping and (with CUDA's calls stood in for) whole backend also run on CPU processes over gloo,
	# which tests/test_megatron_cpu_*.py check (expert parallelism included, which no one-GPU machine can run)
	$(BIN)/pip install -q --no-deps "megatron-core==0.16.1"
	touch $@

# Bytecode for rollflow's own modules, which an editable install leaves out (pip compiles every other package's):
# written even where PYTHONDONTWRITEBYTECODE is set, since each process that imports them (the driver, each Ray
# worker and engine, each test's subprocess) compiles them again otherwise (~0.2 s of CPU each; start-up of the CPU
# demo shorter in 9 of 10 interleaved pairs, bench/results/trl_race.md). compileall skips what is up to date.
bytecode: setup
	$(BIN)/python -m compileall -q engine flows plumbing tasks

# A fresh demo each time: its checkpoints go (else it would resume, with nothing left to do); earlier demo runs stay
# in runs/demo/mlflow.db, so the links their Prefect flow runs hold keep working.
demo: bytecode
	rm -rf runs/demo/checkpoints
	$(BIN)/rollflow train --config examples/demo.yaml

browser:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -q && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

# Two pytest workers, a whole file each (module fixtures such as a shared Ray cluster or a baseline run stay in one
# process): a serial run keeps the 2-core machine busy only ~56% of the time (single-threaded imports and process
# start-ups, waits for servers and deadlines), two workers ~90%. Files go out longest first (tests/conftest.py's
# LONGEST_FIRST; xdist's own order is by number of tests). TEST_WORKERS=0 runs serially, in one process.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: bytecode browser
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL)

test-fast: bytecode
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_PARALLEL)

clean:
	rm -rf $(VENV) runs .pytest_cache
