#!/usr/bin/env bash
# The H200 benchmark runs of issue 5 (after `source .device/setup.sh`): the reference workload
# with Adam and with SGD (NONE pooling), Adam again with check_gradients=False (no NaN/inf check
# before the update, as the reference system has none), and the SUM-pooled variant with Adam.
# Writes JSON and logs into $1 (default: packages/demb-torchrec/benchmarks/results).
set -u
out=${1:-packages/demb-torchrec/benchmarks/results}
mkdir -p "$out"
for run in "adam none" "sgd none" "adam none unchecked" "adam sum"; do
  set -- $run
  name="bench_module_h200_$1_$2${3:+_$3}"
  python3 -m demb_torchrec.cli bench module --device cuda --optimizer "$1" --pooling "$2" \
    ${3:+--no-check-gradients} --out "$out/$name.json" 2>&1 | tr '\r' '\n' \
    | grep -v "it/s\]$" | tee "$out/$name.log"
done
