#!/usr/bin/env bash
# One device call that compares the native sampler of two trees back to back on the same GPU, then (optionally) the
# SkyRL peer and an RL iteration through the service. Everything it prints lands in $OUT.
#   bash benchmarks/sampler_ab.sh BASELINE_DIR [bench_sampler args...]
# BASELINE_DIR: an older tree unpacked beside this one (ignored, carried), e.g.
#   mkdir .gl && git archive <commit> | tar -x -C .gl
# Env: AB_PEER=1 runs ../shared/tools/skyrl_peer.sh copied to benchmarks/.skyrl_peer.sh (needs .peer/ and .whl/);
#      AB_RL=1 runs `gpu_run.sh rl --tenants 1,4 --iterations 1 --warmup 1` after;
#      AB_ROUNDS=N rounds of the pair (default 2; 0 skips the comparison, e.g. for the peer alone).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
base=$(cd "${1:?usage: sampler_ab.sh BASELINE_DIR [bench_sampler args...]}" && pwd); shift
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--prompts 256 --skip-hf --skip-copies --kv paged --variants base_only,four_mixed,shared_prompts --breakdown --repeats 3)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/ab-gpu.txt"
for round in $(seq 1 "${AB_ROUNDS:-2}"); do  # twice, alternating, so drift of the machine shows as a difference between rounds
  for tree in "$base" "$PWD"; do
    name=$([ "$tree" = "$PWD" ] && echo head || echo base)
    # the baseline tree may predate --kv / --variants / --skip-copies: it gets only the arguments it knows
    known=$(cd "$tree" && PYTHONPATH=$tree python3 benchmarks/bench_sampler.py --help 2>/dev/null)
    pass=()
    for a in "${args[@]}"; do
      if [[ $a == --* ]] && ! grep -q -- "${a%%=*}" <<<"$known"; then skip=1; continue; fi
      if [[ ${skip:-0} == 1 && $a != --* ]]; then skip=0; continue; fi
      skip=0; pass+=("$a")
    done
    echo "== round $round: $name ($tree): ${pass[*]}" | tee -a "$OUT/ab.txt"
    (cd "$tree" && PYTHONPATH=$tree timeout 240 python3 benchmarks/bench_sampler.py "${pass[@]}" \
      --out "$OUT/ab-$name-$round.json" 2>&1 | grep -v "^Loading weights\|USDT" | grep -E "^[a-z_:]+ \{|^breakdown|_paged_decode|CUDA time total" \
      | tee -a "$OUT/ab.txt")
  done
done
if [ "${AB_PEER:-0}" = 1 ] && [ -f benchmarks/.skyrl_peer.sh ]; then
  timeout 400 bash benchmarks/.skyrl_peer.sh 2>&1 | tail -20 | tee -a "$OUT/ab.txt"
fi
if [ "${AB_RL:-0}" = 1 ]; then
  timeout 400 bash benchmarks/gpu_run.sh rl --tenants 1,4 --iterations 1 --warmup 1 2>&1 | grep -v "^20" | tail -14 \
    | tee -a "$OUT/ab.txt"
fi
