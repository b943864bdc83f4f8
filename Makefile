# The two commands of README.md:  `make report` (the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup browser report test

# A CPU machine takes torch 2.13.0 (a CPU build); a GPU node keeps the torch it has.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

setup: $(VENV)/.installed

# Debian's chromium and chromedriver, for the report and JupyterLab browser tests.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else echo "make: chromium missing and not root: browser tests will skip" >&2; fi; }

report: setup
	$(BIN)/workbench report --all $(ARGS)

test: setup browser
	$(BIN)/python -m pytest $(ARGS)
