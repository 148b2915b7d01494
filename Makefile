# One command each, on a fresh machine: `make demo`, `make test`. Everything installs into .venv/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install test lint demo bench gpu-check model peers clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@command -v clang >/dev/null 2>&1 || $(MAKE) --no-print-directory clang
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || $(MAKE) --no-print-directory chromium
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,ray]'
	$(BIN)/python -c "import tinygrad.llm.model, gguf, numpy, tokenizers, jinja2, starlette, uvicorn, openai, ray, selenium, prometheus_client"
	touch $(STAMP)

# tinygrad's CPU device compiles its kernels with clang; without it tinygrad finds "no usable devices".
.PHONY: clang chromium
clang:
	@echo "installing clang (tinygrad's CPU device needs it)"
	@if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq clang >/dev/null; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo apt-get update -qq && sudo apt-get install -y -qq clang >/dev/null; \
	else echo "error: clang is missing and cannot be installed without root; run: sudo apt-get install -y clang" >&2; exit 1; fi
	@command -v clang >/dev/null 2>&1 || { echo "error: clang still missing; install it (apt-get install -y clang)" >&2; exit 1; }

# The chat page's test (tests/test_serve_page.py) drives a real headless Chromium through Debian's chromedriver: the
# same package version as the browser, and nothing downloaded at test time.
chromium:
	@echo "installing chromium and chromium-driver (the chat page's browser test)"
	@if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo apt-get update -qq && sudo apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "error: chromium is missing and cannot be installed without root; run: sudo apt-get install -y chromium chromium-driver" >&2; exit 1; fi
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || { echo "error: chromium still missing; install it (apt-get install -y chromium chromium-driver)" >&2; exit 1; }

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .

demo: install
	$(BIN)/pp-pipeline --stages 3 --prompt "Beautiful is better than" --max-tokens 200

bench: install
	$(BIN)/python -m bench.run

# Exactness, decode speed vs one tinygrad process, per-hop overhead, TTFT on whatever DEV selects (DEV=CUDA make
# gpu-check); under 5 minutes on one GPU. GPU_CHECK_ARGS=--quick: the tiny model, a smoke test that runs anywhere.
gpu-check: install
	$(BIN)/python -m bench.gpu $(GPU_CHECK_ARGS)

# Optional: llama.cpp (llama-cpp-python, built from source into .venv-peers/, ~8 minutes) for make bench's peer
# rows. A native build crashes on these VMs: the instruction sets are named instead.
PEERS := .venv-peers
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.16
peers: $(PEERS)/.installed-stamp

$(PEERS)/.installed-stamp:
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet --upgrade pip
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
		$(PEERS)/bin/python -m pip install --quiet --no-binary llama-cpp-python "$(LLAMA_CPP_PYTHON)"
	$(PEERS)/bin/python -c "import llama_cpp"
	touch $@

# Rebuild the embedded demo model from the Zen of Python (deterministic; takes a few minutes).
model: install
	$(BIN)/python tools/train_demo.py --out pp_worker/data/zen.gguf

clean:
	rm -rf $(VENV) $(PEERS) build *.egg-info .pytest_cache .ruff_cache
