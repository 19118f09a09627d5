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
export CGO_CPPFLAGS := -I$(OLLAMA_DIR)/llama/llama.cpp/include -I$(OLLAMA_DIR)/ml/backend/ggml/ggml/include
# Native code generation: ggml's CPU kernels are several times faster with AVX2/FMA. AMX is
# left off: ollama's Go build of ggml-cpu does not compile its AMX sources.
export CGO_CFLAGS := -O3 -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
export CGO_CXXFLAGS := -O3 -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
export POLYKV_CACHE ?= $(HOME)/.cache/polykv
export POLYKV_MODEL ?= $(POLYKV_CACHE)/models/SmolLM2-135M-Instruct.Q4_1.gguf
VENV ?= $(POLYKV_CACHE)/venv

.PHONY: build model test test-go test-python demo bench venv clean env

build:
	go build -o bin/polykv ./cmd/polykv

model:
	./scripts/fetch-model.sh

venv:
	./scripts/venv.sh "$(VENV)"

test: build model venv test-go test-python

test-go:
	go vet ./...
	POLYKV_REQUIRE_MODEL=1 go test -count=1 -timeout 20m ./...

test-python:
	cd python && PYTHONPATH=$(CURDIR)/python POLYKV_BIN=$(CURDIR)/bin/polykv "$(VENV)/bin/python" -m pytest -q -p no:cacheprovider tests

demo: build model venv
	PYTHONPATH=$(CURDIR)/python POLYKV_BIN=$(CURDIR)/bin/polykv "$(VENV)/bin/python" scripts/demo.py
	@echo; echo "--- LangGraph fan-out (python/examples/fanout.py) ---"
	PYTHONPATH=$(CURDIR)/python POLYKV_BIN=$(CURDIR)/bin/polykv "$(VENV)/bin/python" python/examples/fanout.py --start-server --agents 4

bench: build model
	./bin/polykv bench -m "$(POLYKV_MODEL)"

clean:
	rm -rf bin

# `eval "$(make -s env)"` lets plain go build/test/vet find llama.h in this shell.
env:
	@echo 'export CGO_CPPFLAGS="$(CGO_CPPFLAGS)" CGO_CFLAGS="$(CGO_CFLAGS)" CGO_CXXFLAGS="$(CGO_CXXFLAGS)" POLYKV_MODEL="$(POLYKV_MODEL)"'

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
