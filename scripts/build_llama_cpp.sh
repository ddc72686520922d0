#!/usr/bin/env bash
# Builds llama.cpp's own llama-bench, llama-server and llama-quantize from the sources that the
# llama-cpp-python 0.3.36 sdist carries (PyPI only; about 10 minutes on 2 cores), into
# ${1:-build/llama.cpp}/bin, for `ddspec bench --methods ...,llama.cpp --llama-server PATH`
# (docs/benchmarks.md). Optional: nothing in `make test` needs it.
set -euo pipefail
out="$(realpath -m "${1:-build/llama.cpp}")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for tool in cmake ninja; do
    command -v "$tool" >/dev/null || { echo "build_llama_cpp: $tool is missing (Debian: apt-get install cmake ninja-build)" >&2; exit 2; }
done
python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$work"
tar xzf "$work"/llama_cpp_python-0.3.36.tar.gz -C "$work"
cmake -S "$work"/llama_cpp_python-0.3.36/vendor/llama.cpp -B "$out" -G Ninja -DGGML_NATIVE=ON \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$out" --target llama-bench llama-server llama-quantize
echo "built: $out/bin/llama-server, llama-bench, llama-quantize"
