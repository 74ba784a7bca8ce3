# The two commands (see README): `make demo` and `make test`. Both set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines: the local CPU build (a bare `torch` requirement would pull a multi-GB CUDA build).
# GPU machines: `make setup TORCH_SPEC=torch` (or your CUDA build).
TORCH_SPEC ?= torch==2.13.0

# The browser tests drive Debian's Chromium (tests/test_ui_browser.py): installed once, as root or with sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup browser demo test test-fast clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# A fresh demo each time: its checkpoints go (else it would resume, with nothing left to do); earlier demo runs stay
# in runs/demo/mlflow.db, so the links their Prefect flow runs hold keep working.
demo: setup
	rm -rf runs/demo/checkpoints
	$(BIN)/rollflow train --config examples/demo.yaml

browser:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -q && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

test: setup browser
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache
