#!/usr/bin/env bash
# Build llama.cpp's own llama-server and llama-bench (CPU only) for the `llama-server*` bench methods.
#
# The source is the llama.cpp vendored in the llama-cpp-python sdist of the version installed in the
# venv (so both peers decode with the same llama.cpp), fetched from PyPI with pip; nothing else is
# downloaded (no curl, no OpenSSL, no prebuilt web UI). The binaries are statically linked against
# llama.cpp and go to ${ADAPTIVE_CACHE:-~/.cache/adaptive}/llama.cpp/<version>/bin/, where
# adaptive/bench/llama_server.py looks for them (or point ADAPTIVE_LLAMA_SERVER at a binary).
#
#   benchmarks/build_llama_server.sh            # the version in .venv (pip show llama-cpp-python)
#   benchmarks/build_llama_server.sh 0.3.36     # another version
#
# Idempotent (nothing to do when both binaries are there) and atomic (built in a temporary folder
# beside the destination, moved into place at the end). About 10-15 minutes on 2 cores.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
version=${1:-${LLAMA_CPP_PYTHON_VERSION:-}}
if [[ -z $version ]]; then
    version=$("$python" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null) || {
        echo "build_llama_server.sh: llama-cpp-python is not installed in $python; pass the version: $0 0.3.36" >&2
        exit 2
    }
fi
cache=${ADAPTIVE_CACHE:-$HOME/.cache/adaptive}
dest=$cache/llama.cpp/$version
if [[ -x $dest/bin/llama-server && -x $dest/bin/llama-bench ]]; then
    echo "already built: $dest/bin"
    exit 0
fi

mkdir -p "$cache/llama.cpp"
work=$(mktemp -d "$cache/llama.cpp/.build-$version.XXXXXX")  # same file system as $dest: the final mv is atomic
trap 'rm -rf "$work"' EXIT

if ! command -v ninja >/dev/null && [[ ! -x $(dirname "$python")/ninja ]]; then
    "$python" -m pip install --quiet ninja
fi
export PATH=$(dirname "$python"):$PATH  # ninja from the venv, when it came from pip

echo "fetching the llama-cpp-python $version sdist"
"$python" -m pip download --quiet --no-deps --no-binary :all: --dest "$work" "llama-cpp-python==$version"
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
[[ -f $src/CMakeLists.txt ]] || { echo "build_llama_server.sh: no vendored llama.cpp in the sdist" >&2; exit 1; }

echo "building llama-server and llama-bench in $work (CPU, native, static)"
start=$SECONDS
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >"$work/cmake.log"
cmake --build "$work/build" --target llama-server llama-bench -j "$(nproc)"

mkdir -p "$work/out/bin"
cp "$work/build/bin/llama-server" "$work/build/bin/llama-bench" "$work/out/bin/"
echo "llama-cpp-python $version (vendored llama.cpp), built in $((SECONDS - start)) s on $(date -u +%F)" \
    >"$work/out/BUILD_INFO"
rm -rf "$dest"
mv -T "$work/out" "$dest"
echo "installed: $dest/bin/llama-server, $dest/bin/llama-bench ($((SECONDS - start)) s)"
