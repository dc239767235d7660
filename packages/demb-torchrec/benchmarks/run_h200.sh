#!/usr/bin/env bash
# The H200 benchmark runs of issue 5 (after `source .device/setup.sh`): the reference workload
# with Adam and with SGD (NONE pooling), and the SUM-pooled variant with Adam. Writes JSON and
# logs into $1 (default: packages/demb-torchrec/benchmarks/results).
set -u
out=${1:-packages/demb-torchrec/benchmarks/results}
mkdir -p "$out"
for run in "adam none" "sgd none" "adam sum"; do
  set -- $run
  python3 -m demb_torchrec.cli bench module --device cuda --optimizer "$1" --pooling "$2" \
    --out "$out/bench_module_h200_$1_$2.json" 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" \
    | tee "$out/bench_module_h200_$1_$2.log"
done
