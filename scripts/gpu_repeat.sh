#!/usr/bin/env bash
# L1 on the GPU: run CONFIG twice in strict mode and compare fingerprints (exit 0 when identical).
#   bash scripts/gpu_repeat.sh configs/gpu_small.yaml [OUTDIR] [key=value ...]
set -euo pipefail
cfg=$1; out=${2:-/tmp/detjax_repeat}; shift $(( $# >= 2 ? 2 : 1 ))
for r in a b; do
  python3 -m detjax.train --config "$cfg" --run-dir "$out/$r" determinism.mode=strict "$@"
done
python3 -m detjax.compare "$out/a" "$out/b"
