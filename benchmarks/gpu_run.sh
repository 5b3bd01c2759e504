#!/usr/bin/env bash
# One call on the GPU machine. Results land in $OUT.
#   bash benchmarks/gpu_run.sh engine [bench_engine args...]    the gpu-marked tests, then the engine benchmark
#   bash benchmarks/gpu_run.sh service [bench_service args...]  the whole service (needs .whl/ carried: gpu_wheels.sh)
#   bash benchmarks/gpu_run.sh tests                            the gpu-marked tests only
#   bash benchmarks/gpu_run.sh flood [bench_flood args...]      the gpu-marked tests, then bench_flood.py on the stack
#   bash benchmarks/gpu_run.sh sampler [bench_sampler args...]  the native sampler vs HF + PEFT generate
#   bash benchmarks/gpu_run.sh cost [bench_engine args...]      cost-model coalescing vs one by one (bench_engine --mode cost)
#   bash benchmarks/gpu_run.sh ragged [bench_engine args...]    ragged vs uniform lengths, packed and padded (--mode ragged)
#   bash benchmarks/gpu_run.sh rl [bench_rl args...]            RL iterations through the service (needs .whl/ carried too)
#   bash benchmarks/gpu_run.sh lora                             where one adapter's step loses to the frozen base: both
#                                                               profiled (profile_engine --frozen), and the LoRA layer
#                                                               and block candidates (bench_lora_layer)
#   bash benchmarks/gpu_run.sh moe [bench_engine args...]       the MoE tests (graphs included), one MoE layer's bank
#                                                               gradients two ways (probe_expert_grads), then the
#                                                               Qwen3-30B-A3B shape's lone step eager and on CUDA graphs (an H200: its
#                                                               base and 4 slots' fp32 state take ~115 GB)
#   bash benchmarks/gpu_run.sh h200                             an H200's targets in one call: 4 saturated tenants through
#                                                               the service (closed and pipelined), ours against the frozen
#                                                               base (one adapter 8x512), the MoE lone step (4 slots)
# With .whl/ present (benchmarks/gpu_wheels.sh, carried by the device tool) the service's wheels are installed into a
# temp folder and Debian's redis-server is unpacked beside them, so `loraplex serve --embedded` runs there too.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
mode=${1:-engine}
[ $# -gt 0 ] && shift
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD HF_HUB_OFFLINE=1 LORAPLEX_HOME=/tmp/loraplex
# The files holding gpu-marked tests: collecting all of tests/ would import the CPU suite's test-only packages
# (hypothesis, schemathesis, the tinker SDK's own dependencies), which the GPU image does not have.
GPU_TESTS=${GPU_TESTS:-tests/gpu}  # `GPU_TESTS="tests/gpu/a.py ..." gpu_run.sh tests`: a subset
if [ -d .whl ]; then
  site=/tmp/loraplex-site root=/tmp/loraplex-root
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  for deb in .whl/*.deb; do dpkg -x "$deb" "$root"; done
  export PYTHONPATH=$PWD:$site PATH=$root/usr/bin:$PATH LD_LIBRARY_PATH=$root/usr/lib/x86_64-linux-gnu
  redis-server --version | tee -a "$OUT/gpu.txt"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/gpu.txt"
python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)' | tee -a "$OUT/gpu.txt"
# bench_service.py under its own limit (seconds, below the device call's, so a run cut short still leaves its stacks'
# logs), its outputs and each stack's logs in the folder given; returns its status.
bench_service() {
  local limit=$1 out=$2; shift 2
  timeout "$limit" python3 benchmarks/bench_service.py --home /tmp/loraplex --out "$out/bench_service.json" "$@" 2>&1 \
    | tee "$out/bench_service.txt"
  local status=${PIPESTATUS[0]}
  # each stack's logs (one per --early-full-microbatches variant or world size: a folder of its own under the home)
  for log in $(find /tmp/loraplex -name pool.log -o -name api.log -o -name redis.log); do
    name=$(dirname "$(dirname "$log")"); name=${name#/tmp/loraplex}; name=${name//\//-}
    cp "$log" "$out/$(basename "$log" .log)${name}.log"
  done
  # plans and finishes over slow_plan_log_seconds, CUDA graphs declined for want of memory; redis-server's own
  # complaints about a slow disk
  grep -r "slow plan\|slow finish\|not captured" --include=pool.log /tmp/loraplex 2>/dev/null | cut -c1-900
  grep -r "fsync is taking too long\|Background AOF rewrite" --include=redis.log /tmp/loraplex 2>/dev/null | tail -n 20
  return "$status"
}
# The Qwen3-30B-A3B shape's MoE steps (rank 16, 4 slots; later arguments override), eager and on CUDA graphs, under a
# limit in seconds.
bench_moe() {
  local limit=$1; shift
  timeout "$limit" python3 benchmarks/bench_engine.py --model qwen3-30b-a3b-shape --rank 16 --slots 4 --cap 2048 \
    --skip-peft --skip-frozen --iters 3 --warmup 3 --workloads lone,underfilled --graphs off,on \
    --out "$OUT/bench_moe.json" "$@" 2>&1 | grep -v "^Loading weights" | tee "$OUT/bench_moe.txt" | grep -v '^ \|^{\|^}'
}
case $mode in
  tests)
    python3 -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS 2>&1 | tee "$OUT/gpu-tests.txt" | tail -n 5 ;;
  engine)
    python3 -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS 2>&1 | tee "$OUT/gpu-tests.txt" | tail -n 5
    python3 benchmarks/bench_engine.py --out "$OUT/bench_engine.json" "$@" 2>&1 | grep -v "^Loading weights" | tee "$OUT/bench.txt" | grep -v '^ \|^{\|^}' ;;
  service)
    bench_service "${SERVICE_LIMIT_S:-520}" "$OUT" "$@"
    exit "$?" ;;
  rl)
    python3 benchmarks/bench_rl.py --home /tmp/loraplex --out "$OUT/bench_rl.json" "$@" 2>&1 | grep -v "^Loading weights" | tee "$OUT/bench_rl.txt"
    status=${PIPESTATUS[0]}
    for log in $(find /tmp/loraplex -name pool.log -o -name api.log -o -name redis.log); do
      cp "$log" "$OUT/$(basename "$log")"
    done
    # plans and finishes over slow_plan_log_seconds, CUDA graphs declined for want of memory, the sampler's sizing
    grep -r "slow plan\|slow finish\|not captured\|native sampler" --include=pool.log /tmp/loraplex 2>/dev/null | cut -c1-900
    exit "$status" ;;
  flood)
    python3 -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS 2>&1 | tee "$OUT/gpu-tests.txt" | tail -n 5
    python3 benchmarks/bench_flood.py "$@" 2>&1 | tee "$OUT/bench_flood.txt" ;;
  sampler)
    python3 benchmarks/bench_sampler.py --out "$OUT/bench_sampler.json" "$@" 2>&1 | grep -v "^Loading weights" | tee "$OUT/bench_sampler.txt" ;;
  cost)
    python3 benchmarks/bench_engine.py --mode cost --out "$OUT/bench_cost.json" "$@" 2>&1 | grep -v "^Loading weights" | tee "$OUT/bench_cost.txt" | grep -v '^ \|^{\|^}' ;;
  ragged)
    python3 benchmarks/bench_engine.py --mode ragged --out "$OUT/bench_ragged.json" "$@" 2>&1 | grep -v "^Loading weights" | tee "$OUT/bench_ragged.txt" | grep -v '^ \|^{\|^}' ;;
  lora)
    python3 benchmarks/profile_engine.py --rows 8 --elementwise --frozen --kernels 30 --out "$OUT" 2>&1 \
      | grep -v "^Loading weights" > "$OUT/profile.txt"
    grep "frozen base\|fwd_bwd\|device ms by kind" "$OUT/profile.txt"
    python3 benchmarks/bench_lora_layer.py --variants base,graph1 --block-variants base,base_stacked,siblings,widened \
      --tables "$OUT/lora_layer_tables.txt" 2>&1 | tee "$OUT/lora_layer.txt" | tail -n 30 ;;
  moe)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_body_graphs_cuda.py tests/gpu/test_lora_experts_cuda.py \
      tests/gpu/test_sampler_moe_cuda.py -k "moe or experts" 2>&1 | tee "$OUT/gpu-tests.txt" | tail -n 5
    python3 benchmarks/probe_expert_grads.py --tokens 512 2>&1 | tee "$OUT/expert_grads.txt"
    bench_moe 600 "$@" ;;
  h200)
    start=$(date +%s)
    mkdir -p "$OUT/service"
    bench_service 270 "$OUT/service" --tenants 4 --workloads saturated --clients closed,pipelined --steps 6 --warmup 6 \
      > "$OUT/service.txt" 2>&1
    grep -A4 "^workload" "$OUT/service.txt" | head -n 12
    timeout 90 python3 benchmarks/bench_engine.py --skip-peft --workloads one_adapter --iters 5 --warmup 3 \
      --out "$OUT/bench_engine.json" 2>&1 | grep -v "^Loading weights" | tee "$OUT/bench.txt" | grep -v '^ \|^{\|^}'
    bench_moe $(( 560 - $(date +%s) + start )) --adapters 4 --workloads lone
    (cd "$OUT" && tar -czf service-logs.tgz service && rm -rf service) ;;
  *) echo "unknown mode $mode (engine | service | tests | flood | sampler | cost | ragged | rl | lora | moe | h200)"; exit 2 ;;
esac
