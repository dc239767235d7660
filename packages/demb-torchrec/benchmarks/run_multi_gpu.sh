#!/usr/bin/env bash
# Issue 8's multi-GPU benchmark runs (after `source .device/setup.sh`) on every visible GPU:
# keys per rank under roundrobin vs hash_roundrobin at the full world size, and the DLRM-like
# DMP train step at world sizes 1, 2, 4, 8 (as many as there are GPUs) with its scaling
# efficiency against 1 GPU. Writes JSON and logs into $1 (default: benchmarks/results).
# NVLink multicast stays off (the machine's NCCL_NVLS_ENABLE=0 etc. are inherited).
set -u
out=${1:-packages/demb-torchrec/benchmarks/results}
mkdir -p "$out"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
tag="h200x$gpus"
python3 -m demb_torchrec.cli bench balance --world-size "$gpus" \
  --out "$out/bench_balance_$tag.json" 2>&1 | grep -v "^WARNING\|33m\|compat\|determine" \
  | tee "$out/bench_balance_$tag.log"
reports=()
for w in 1 2 4 8; do
  [ "$w" -le "$gpus" ] || break
  json="$out/bench_dlrm_${tag}_w$w.json"
  python3 -m demb_torchrec.cli bench dlrm --world-size "$w" --out "$json" 2>&1 \
    | grep -v "^WARNING\|33m\|compat\|determine" | tee "$out/bench_dlrm_${tag}_w$w.log"
  reports+=("$json")
done
python3 packages/demb-torchrec/benchmarks/dlrm_scaling.py "$out/bench_dlrm_${tag}_scaling.json" \
  "${reports[@]}" | tee "$out/bench_dlrm_${tag}_scaling.log"
