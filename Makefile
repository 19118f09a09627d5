# PolyKV build. llama.cpp and ggml compile from the github.com/ollama/ollama module
# through cgo; our binding (internal/llama) finds llama.h via CGO_CPPFLAGS below.
SHELL := /bin/bash
export GOFLAGS ?= -mod=mod
# `go list -m -f {{.Dir}}` prints an empty line (exit 0) while the module is not yet in the
# module cache, so download it first, always: a no-op once it is there.
OLLAMA_DIR := $(shell go mod download github.com/ollama/ollama >/dev/null 2>&1; go list -m -f '{{.Dir}}' github.com/ollama/ollama 2>/dev/null)
ifeq ($(strip $(OLLAMA_DIR)),)
$(error cannot locate the github.com/ollama/ollama module (go mod download github.com/ollama/ollama failed); check the Go module proxy settings)
endif
export CGO_CPPFLAGS := -I$(OLLAMA_DIR)/llama/llama.cpp/include -I$(OLLAMA_DIR)/ml/backend/ggml/ggml/include -I$(OLLAMA_DIR)/ml/backend/ggml/ggml/src
# Native code generation: ggml's CPU kernels are several times faster with AVX2/FMA. AMX is
# left off: ollama's Go build of ggml-cpu does not compile its AMX sources.
export CGO_CFLAGS := -O3 -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
# -Wno-stringop-overflow: GCC 12 reports a false "writing 64 bytes into a region of size 0"
# in the vendored ggml-cpu/repack.cpp on every fresh build; it is not our code, and a
# newcomer's first `make demo` should not print a warning they cannot act on.
export CGO_CXXFLAGS := -O3 -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -Wno-stringop-overflow
export POLYKV_CACHE ?= $(HOME)/.cache/polykv
export POLYKV_MODEL ?= $(POLYKV_CACHE)/models/SmolLM2-135M-Instruct.Q4_1.gguf
# Second model family (Gemma 3 270M, sliding-window attention): real-model tests that
# run on both models read it from here and skip it (or fail under make test) when absent.
export POLYKV_MODEL_GEMMA ?= $(POLYKV_CACHE)/models/gemma-3-270m-q4_k_m.gguf
VENV ?= $(POLYKV_CACHE)/venv

.PHONY: build model templates test test-go test-python demo bench venv browser clean env

build:
	go build -o bin/polykv ./cmd/polykv

model:
	./scripts/fetch-model.sh

# The second test model (Gemma 3 270M, no chat template in its GGUF) for the template tests.
# llama.cpp's chat templates for the template corpus test (internal/chat/corpus_test.go).
templates:
	./scripts/fetch-templates.sh

venv:
	./scripts/venv.sh "$(VENV)"

# Headless Chromium for the dashboard's browser test (no-op once installed).
browser:
	./scripts/install-browser.sh

test: build model templates venv browser test-go test-python

test-go:
	go vet ./...
	POLYKV_REQUIRE_MODEL=1 go test -count=1 -timeout 40m ./...
	./scripts/fuzz.sh

# polykv-langgraph as a langchain partner package: lint (ruff), types (mypy), unit tests
# with sockets disabled (no network), then the integration tests against live servers.
test-python:
	cd python && "$(VENV)/bin/ruff" check --no-cache . && "$(VENV)/bin/mypy" --no-incremental --cache-dir=/dev/null \
	  && PYTHONPATH=$(CURDIR)/python "$(VENV)/bin/python" -m pytest -q -p no:cacheprovider tests/unit_tests --disable-socket --allow-unix-socket \
	  && PYTHONPATH=$(CURDIR)/python POLYKV_BIN=$(CURDIR)/bin/polykv POLYKV_REQUIRE_BROWSER=1 "$(VENV)/bin/python" -m pytest -q -p no:cacheprovider tests/integration_tests

demo: build model venv
	PYTHONPATH=$(CURDIR)/python POLYKV_BIN=$(CURDIR)/bin/polykv "$(VENV)/bin/python" scripts/demo.py
	@echo; echo "--- LangGraph fan-out (python/examples/fanout.py) ---"
	PYTHONPATH=$(CURDIR)/python POLYKV_BIN=$(CURDIR)/bin/polykv "$(VENV)/bin/python" python/examples/fanout.py --start-server --agents 4

# LLAMA_BENCH=/path/to/llama-bench (built from llama.cpp by you, outside this repo) adds
# llama-bench's figure and the ratio to every prefill row, measured alternately in one run.
bench: build model
	./bin/polykv bench -m "$(POLYKV_MODEL)" --prefill-models "$(POLYKV_MODEL),$(POLYKV_MODEL_GEMMA)" --prefill-decode 64 --prefill-decode-depth 512 $(if $(LLAMA_BENCH),--prefill-baseline "$(LLAMA_BENCH)")

clean:
	rm -rf bin

# `eval "$(make -s env)"` lets plain go build/test/vet find llama.h in this shell.
env:
	@echo 'export CGO_CPPFLAGS="$(CGO_CPPFLAGS)" CGO_CFLAGS="$(CGO_CFLAGS)" CGO_CXXFLAGS="$(CGO_CXXFLAGS)" POLYKV_MODEL="$(POLYKV_MODEL)" POLYKV_MODEL_GEMMA="$(POLYKV_MODEL_GEMMA)"'

# GPU backends (README "GPU"): ggml's CUDA or Vulkan backend, built with CMake from the
# ollama module's sources into lib/ beside bin/ and loaded by bin/polykv at run time; the Go
# build above is unchanged. CUDA_ARCHS is CMake's architecture list (one arch builds much
# faster: make build-cuda CUDA_ARCHS=90); GPU_JOBS is the compile parallelism.
CUDA_ARCHS ?= 80;86;89;90
GPU_JOBS ?= 2

.PHONY: build-cuda build-vulkan clean-gpu

build-cuda:
	CUDA_ARCHS='$(CUDA_ARCHS)' GPU_JOBS='$(GPU_JOBS)' OLLAMA_DIR='$(OLLAMA_DIR)' ./scripts/build-gpu.sh cuda

build-vulkan:
	GPU_JOBS='$(GPU_JOBS)' OLLAMA_DIR='$(OLLAMA_DIR)' ./scripts/build-gpu.sh vulkan

clean-gpu:
	rm -rf build lib
