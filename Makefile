# One command each, on a fresh machine: `make demo`, `make test`. Everything installs into .venv/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install system test lint demo bench gpu-check device-run model peers clean

install: system $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,ray]'
	$(BIN)/python -c "import tinygrad.llm.model, xdist, gguf, numpy, tokenizers, jinja2, llguidance, jsonschema, starlette, uvicorn, openai, ray, selenium, prometheus_client"
	touch $(STAMP)

# What the system needs, checked at every install (quick) and installed with apt where missing.
system:
	@command -v clang >/dev/null 2>&1 || $(MAKE) --no-print-directory clang
	@$(ARM64_READY) || $(MAKE) --no-print-directory arm64
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || $(MAKE) --no-print-directory chromium

# $(call apt_install,packages): apt-get as root, or with passwordless sudo, else an error naming the command to run
apt_install = if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1) >/dev/null; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
	sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1) >/dev/null; \
	else echo "error: $(1) missing and cannot be installed without root; run: sudo apt-get install -y $(1)" >&2; exit 1; fi

# tinygrad's CPU device compiles its kernels with clang; without it tinygrad finds "no usable devices".
.PHONY: clang chromium
clang:
	@echo "installing clang (tinygrad's CPU device needs it)"
	@$(call apt_install,clang)
	@command -v clang >/dev/null 2>&1 || { echo "error: clang still missing; install it (apt-get install -y clang)" >&2; exit 1; }

# The chat page's test (tests/test_serve_web.py) drives a real headless Chromium through Debian's chromedriver: the
# same package version as the browser, and nothing downloaded at test time.
chromium:
	@echo "installing chromium and chromium-driver (the chat page's browser test)"
	@$(call apt_install,chromium chromium-driver)
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || { echo "error: chromium still missing; install it (apt-get install -y chromium chromium-driver)" >&2; exit 1; }

# The aarch64 kernel tests (tests/test_kernel_arches.py) build for arm64 with clang and run under qemu-user: a static
# test program needs the arm64 C library, libgcc (crt files) and the cross linker. Ready when one links.
ARM64_PACKAGES := qemu-user-static libc6-dev-arm64-cross libgcc-12-dev-arm64-cross binutils-aarch64-linux-gnu
ARM64_READY := command -v qemu-aarch64-static >/dev/null 2>&1 && echo 'int main(void) { return 0; }' | \
	clang --target=aarch64-linux-gnu -static -x c - -o /dev/null >/dev/null 2>&1

.PHONY: arm64
arm64:
	@echo "installing qemu-user and the arm64 cross C library (the aarch64 kernel tests need them)"
	@$(call apt_install,$(ARM64_PACKAGES))
	@$(ARM64_READY) || { echo "error: clang still cannot build for aarch64; install $(ARM64_PACKAGES)" >&2; exit 1; }

# The suite's test files on parallel pytest workers (a file's tests stay on one worker: they share its real
# pipelines). Most of a test's time is its worker processes' start, load and compile, about one core's worth, so two
# workers on two cores took the suite from 16 to about N minutes; more than 4 only crowd the cores (every stage
# spreads its kernels over all of them). TEST_JOBS=0 runs them in this one process, one after another.
TEST_JOBS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
test: install
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile

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

# Issue 56's GPU measurements in one command on a borrowed GPU machine without a .venv (docs/gpus.md): F16, Q8_0,
# Q4_K_M, with and without BEAM, JSON and a log under $$OUT. Wheels first, here: bash bench/device_run.sh --wheels.
device-run:
	bash bench/device_run.sh $(DEVICE_RUN_ARGS)

# Optional: llama.cpp (llama-cpp-python, built from source, ~8 minutes a build) for make bench's peer rows. A native
# build crashes on these VMs: the instruction sets are named instead, and never AMX. .venv-peers is the AVX2 build
# (for the AVX2 rows, and the only one on a CPU without AVX-512); where /proc/cpuinfo has AVX-512 F/CD/BW/DQ/VL,
# .venv-peers-avx512 is built beside it with the extensions this CPU has of VBMI, VNNI, BF16 and AVX-VNNI (an Ice Lake
# Xeon has no BF16: what llama.cpp built for it is still its AVX-512 build). pip's wheel cache ignores CMAKE_ARGS,
# so each build is --no-cache-dir: a cached AVX2 wheel would otherwise be reused for the AVX-512 venv.
PEERS := .venv-peers
PEERS_AVX512 := .venv-peers-avx512
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.16
PEERS_AVX2_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
on = $(if $(filter $(1),$(CPU_FLAGS)),ON,OFF)
HAS_AVX512 := $(and $(filter avx512f,$(CPU_FLAGS)),$(filter avx512bw,$(CPU_FLAGS)),$(filter avx512vl,$(CPU_FLAGS)),$(filter avx512dq,$(CPU_FLAGS)),$(filter avx512cd,$(CPU_FLAGS)))
PEERS_AVX512_ARGS := $(PEERS_AVX2_ARGS) -DGGML_AVX512=ON -DGGML_AVX512_VBMI=$(call on,avx512vbmi) \
	-DGGML_AVX512_VNNI=$(call on,avx512_vnni) -DGGML_AVX512_BF16=$(call on,avx512_bf16) -DGGML_AVX_VNNI=$(call on,avx_vnni) \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
peers: $(PEERS)/.installed-stamp $(if $(HAS_AVX512),$(PEERS_AVX512)/.installed-stamp)

# $(call peer_build,venv,cmake args)
peer_build = test -x $(1)/bin/python || $(PYTHON) -m venv $(1); \
	$(1)/bin/python -m pip install --quiet --upgrade pip && \
	CMAKE_ARGS="$(2)" $(1)/bin/python -m pip install --quiet --no-cache-dir --force-reinstall --no-deps \
		--no-binary llama-cpp-python "$(LLAMA_CPP_PYTHON)" && \
	$(1)/bin/python -m pip install --quiet "$(LLAMA_CPP_PYTHON)" && \
	$(1)/bin/python -c "import llama_cpp" && echo "$(2)" > $(1)/.cmake-args

$(PEERS)/.installed-stamp:
	$(call peer_build,$(PEERS),$(PEERS_AVX2_ARGS))
	touch $@

$(PEERS_AVX512)/.installed-stamp:
	$(call peer_build,$(PEERS_AVX512),$(PEERS_AVX512_ARGS))
	touch $@

# Rebuild the embedded demo model from the Zen of Python (deterministic; takes a few minutes).
model: install
	$(BIN)/python tools/train_demo.py --out pp_worker/data/zen.gguf

clean:
	rm -rf $(VENV) $(PEERS) $(PEERS_AVX512) build *.egg-info .pytest_cache .ruff_cache
