# The two commands of README.md:  `make report` (the main job) and `make test`.
# For a GPU node without network: `make wheelhouse` (where there is network), then `make node-report` on the node.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup browser report test wheelhouse node-report slurm-test

# Which notebooks a report runs: the ones named in ARGS, else all of them.
REPORT_WHAT = $(if $(filter %.ipynb,$(ARGS)),,--all)

# A CPU machine takes torch 2.13.0 (a CPU build). When $(PYTHON) already has torch (a GPU node's CUDA
# build), the venv sees $(PYTHON)'s site-packages after its own (a .pth file), so it measures with that torch.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if $(PYTHON) -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" 2>/dev/null; then \
	  pth="$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/zz_parent_site.pth"; \
	  $(PYTHON) -c "import sys; print(''.join(f'import site; site.addsitedir({p!r})\n' for p in sys.path \
	    if p.endswith(('site-packages', 'dist-packages'))), end='')" > "$$pth" && \
	  echo "make: $(PYTHON) has torch: $(VENV) sees its site-packages after its own ($$pth)"; fi
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,profile]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

setup: $(VENV)/.installed

# Debian's chromium and chromedriver, for the report and JupyterLab browser tests.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else echo "make: chromium missing and not root: browser tests will skip" >&2; fi; }

# A one-node Slurm cluster on this machine (munged, slurmctld, slurmd from a temporary folder; the
# cluster tests start the same one): try `--executor slurm` by hand; Ctrl-C stops it. As root, Debian's
# slurm-wlm and munge are installed first when missing.
slurm-test: setup
	$(BIN)/python tests/slurm_cluster.py --install

report: setup
	$(BIN)/workbench report $(REPORT_WHAT) $(ARGS)

test: setup browser
	$(BIN)/python -m pytest $(ARGS)

# --- a GPU node without network ------------------------------------------------------------------
# On a machine with network: the report stack's wheels (experiments/report_node_requirements.txt,
# exact versions, no dependency resolution) for Linux x86_64 and the node's Python version.
# NODE_EXTRA: more requirements to carry, e.g. NODE_EXTRA="pyarrow==26.0.1" for a node without it.
NODE_PY ?= 3.12
# 3.12 means any 3.12.x for the wheels' Python requirements (pip would read 3.12.0); the install on the node checks
# them against its real version.
NODE_PYV = $(if $(word 3,$(subst ., ,$(NODE_PY))),$(NODE_PY),$(NODE_PY).99)
WHEELHOUSE ?= wheelhouse
NODE_REQS := experiments/report_node_requirements.txt
NODE_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 \
  manylinux_2_5_x86_64 manylinux1_x86_64 linux_x86_64

wheelhouse:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(NODE_PYV) --implementation cp \
	  $(addprefix --platform ,$(NODE_PLATFORMS)) -d $(WHEELHOUSE) -r $(NODE_REQS) $(NODE_EXTRA)
	@$(PYTHON) -c "import pathlib, re, sys; \
	  norm = lambda s: re.sub(r'[-_.]+', '_', s).lower(); \
	  want = {norm(l.split('==')[0]): l.split('==')[1].split()[0] for l in open('$(NODE_REQS)') if '==' in l and not l.startswith('#')}; \
	  have = {norm(w.name.split('-')[0]): w.name.split('-')[1] for w in pathlib.Path('$(WHEELHOUSE)').glob('*.whl')}; \
	  bad = sorted(f'{n}=={v}' for n, v in want.items() if have.get(n) != v); \
	  mb = sum(w.stat().st_size for w in pathlib.Path('$(WHEELHOUSE)').glob('*.whl')) / 2**20; \
	  print(f'make: $(WHEELHOUSE)/: {len(have)} wheels, {mb:.1f} MB, for CPython $(NODE_PY) on Linux x86_64'); \
	  bad and sys.exit('make: missing from $(WHEELHOUSE)/: ' + ', '.join(bad))"

# On the node (repo and wheelhouse copied there): its python3 keeps its torch, triton, pandas and pyarrow;
# the wheels go to .node-site/ (first on PYTHONPATH, which the notebook kernels inherit). JUPYTER_PATH finds
# what they put in .node-site/share/jupyter (nbconvert's templates) and a python3 kernel spec for this very
# interpreter, written there.
PYTHON3 ?= python3
WHEELS ?= wheelhouse
NODE_SITE := $(CURDIR)/.node-site
NODE_ENV = PYTHONPATH="$(NODE_SITE):$(CURDIR)" JUPYTER_PATH="$(NODE_SITE)/share/jupyter"

node-report:
	@ls $(WHEELS)/*.whl >/dev/null 2>&1 || { echo "make: no wheels in $(WHEELS)/: run 'make wheelhouse" \
	  "NODE_PY=<the node's python3 version>' on a machine with network and copy $(WHEELS)/ here" >&2; exit 2; }
	@$(PYTHON3) -c "import torch, triton, pandas, pyarrow" || { echo "make: $(PYTHON3) lacks torch, triton," \
	  "pandas or pyarrow (carry the missing ones with make wheelhouse NODE_EXTRA=...)" >&2; exit 2; }
	rm -rf "$(NODE_SITE)"
	@$(PYTHON3) -m pip --version >/dev/null 2>&1 || { echo "make: $(PYTHON3) has no pip to install the wheels with" >&2; exit 2; }
	$(PYTHON3) -m pip install -q --no-index --no-deps --no-compile --target "$(NODE_SITE)" $(WHEELS)/*.whl
	$(NODE_ENV) $(PYTHON3) -m ipykernel install --prefix "$(NODE_SITE)" --name python3 >/dev/null
	$(NODE_ENV) $(PYTHON3) -m workbench.cli report $(REPORT_WHAT) $(ARGS)
