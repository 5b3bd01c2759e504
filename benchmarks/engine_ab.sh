#!/usr/bin/env bash
# One device call that compares the training engine of two trees back to back on the same GPU (one adapter 8 x 512
# and the lone 1 x 512 step; the frozen base once, from this tree), then profiles this tree's graphed step: its
# device time by kind and where the device idles (profile_engine.py --gaps). Everything it prints lands in $OUT.
#   bash benchmarks/engine_ab.sh BASELINE_DIR [bench_engine args...]
# BASELINE_DIR: an older tree unpacked beside this one (ignored, carried), e.g.
#   mkdir .gl && git archive <commit> | tar -x -C .gl
# Env: AB_ROUNDS=N rounds of the pair (default 2, alternating, so the machine's drift shows between rounds).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
base=$(cd "${1:?usage: engine_ab.sh BASELINE_DIR [bench_engine args...]}" && pwd); shift
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--skip-peft --workloads one_adapter,lone --iters 5 --warmup 3)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/ab-gpu.txt"
for round in $(seq 1 "${AB_ROUNDS:-2}"); do
  for tree in "$base" "$PWD"; do
    name=$([ "$tree" = "$PWD" ] && echo head || echo base)
    frozen=$([ "$name" = head ] && [ "$round" = 1 ] || echo --skip-frozen)
    echo "== round $round: $name ($tree)" | tee -a "$OUT/ab.txt"
    (cd "$tree" && PYTHONPATH=$tree timeout 120 python3 benchmarks/bench_engine.py "${args[@]}" $frozen \
      --out "$OUT/ab-$name-$round.json" 2>&1 | grep -v "^Loading weights\|USDT" \
      | grep "^frozen base\|one adapter 8x" | tee -a "$OUT/ab.txt")
  done
done
# The device tool brings back at most 8 files from $OUT: the rounds' JSON go back as one archive.
tar -czf "$OUT/ab-json.tgz" -C "$OUT" $(cd "$OUT" && ls ab-*.json) && rm -f "$OUT"/ab-*.json
PYTHONPATH=$PWD timeout 90 python3 benchmarks/profile_engine.py --rows 8 --elementwise --graphs --gaps --kernels 20 \
  2>&1 | grep -v "^Loading weights\|USDT" > "$OUT/profile_graphs.txt"
grep -A 16 "step: device busy\|x512: fwd_bwd\|device ms by kind" "$OUT/profile_graphs.txt" | grep -v "^--$" | head -40
