#!/usr/bin/env bash
# Build llama.cpp's llama-server from the llama.cpp that the llama-cpp-python sdist vendors,
# for benchmarks/cpu_vs_llamacpp.py (the peer on the same GGUF and cores).
#
#   bash benchmarks/build_llama_server.sh [BUILD_DIR]     # default: ~/.cache/spark/llama.cpp
#
# Prints the binary's path last. Needs cmake and a C++ compiler (apt-get install -y cmake g++);
# the build is niced, on two jobs, for a shared machine.
#
# For this CPU's instruction set, as GGML_NATIVE=ON would build it, but without AMX: on the
# 2-core VM this was measured on (Sapphire Rapids, amx_int8 in /proc/cpuinfo) llama.cpp's AMX
# kernels, which take Q4_1, crash at their first ldtilecfg. So each x86 feature /proc/cpuinfo
# lists is switched on by name (GGML_NATIVE=OFF); LLAMA_NATIVE=1 builds with -march=native.
set -euo pipefail

BUILD_DIR="${1:-$HOME/.cache/spark/llama.cpp}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-}"   # empty: the newest sdist on PyPI
mkdir -p "$BUILD_DIR"
cd "$BUILD_DIR"

if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
  echo "cmake and g++ are needed: apt-get install -y cmake g++" >&2
  exit 1
fi

if ! ls llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  python -m pip download --no-binary :all: --no-deps -d . \
    "llama-cpp-python${VERSION:+==$VERSION}"
fi
SDIST=$(ls llama_cpp_python-*.tar.gz | sort -V | tail -1)
SRC="${SDIST%.tar.gz}"
[ -d "$SRC" ] || tar xzf "$SDIST"

ARCH=(-DGGML_NATIVE=ON)
if [ "${LLAMA_NATIVE:-0}" != 1 ] && [ "$(uname -m)" = x86_64 ]; then
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  has() { for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
  ARCH=(-DGGML_NATIVE=OFF)
  for pair in sse4_2:SSE42 f16c:F16C fma:FMA bmi2:BMI2 avx:AVX avx2:AVX2 avx_vnni:AVX_VNNI \
              "avx512f avx512cd avx512vl avx512dq avx512bw:AVX512" avx512vbmi:AVX512_VBMI \
              avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if has ${pair%%:*}; then ARCH+=("-DGGML_${pair##*:}=ON"); else ARCH+=("-DGGML_${pair##*:}=OFF"); fi
  done
fi
echo "llama.cpp CPU flags: ${ARCH[*]}" >&2

nice -n 10 cmake -S "$SRC/vendor/llama.cpp" -B build -DCMAKE_BUILD_TYPE=Release "${ARCH[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
nice -n 10 cmake --build build -j2 --target llama-server >/dev/null
echo "$BUILD_DIR/build/bin/llama-server"
