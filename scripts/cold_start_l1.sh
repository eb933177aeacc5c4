#!/usr/bin/env bash
# Cold-start L1 (the "fresh machine" check): run CONFIG twice, each in a fresh process with no persistent
# compilation cache and its own empty XLA state, then compare the fingerprints (exit 0 when identical).
#   bash scripts/cold_start_l1.sh configs/gpu_small.yaml OUTDIR [key=value ...]
# "{run}" in an override becomes the run's name (a, b): e.g. determinism.autotune_cache=/tmp/x/{run} gives
# each run of older code its own empty autotune cache (the negative control in docs/BENCHMARKS.md).
set -euo pipefail
cfg=$1; out=$2; shift 2
rm -rf "$out"
for r in a b; do
  args=()
  for o in "$@"; do args+=("${o//\{run\}/$r}"); done
  env -u JAX_COMPILATION_CACHE_DIR python3 -m detjax.train --config "$cfg" --run-dir "$out/$r" ckpt.enabled=false \
    "${args[@]}" > "$out.$r.log" 2>&1 || { tail -20 "$out.$r.log"; exit 3; }
done
python3 -m detjax.compare "$out/a" "$out/b"
