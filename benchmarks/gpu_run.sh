#!/usr/bin/env bash
# One call on the GPU machine: the gpu-marked correctness tests, then the engine benchmark. Results land in $OUT.
# Usage (device tool): bash benchmarks/gpu_run.sh [bench args...]
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD HF_HUB_OFFLINE=1 LORAPLEX_HOME=/tmp/loraplex
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)' | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu-tests.txt" | tail -n 5
python3 benchmarks/bench_engine.py --out "$OUT/bench_engine.json" "$@" 2>&1 | grep -v "^Loading weights" | tee "$OUT/bench.txt" | grep -v '^ \|^{\|^}'
