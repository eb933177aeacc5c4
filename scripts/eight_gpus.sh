#!/usr/bin/env bash
# Issue #17's runs on one host of 8 GPUs, in the order they matter, each part's output under OUT (default
# /tmp/eight). Run from the repository root on a machine with 8 GPUs (device tool: nvidia-h200-x8):
#   bash scripts/eight_gpus.sh [OUT] [PART ...]      parts: sweep canonical tax twoproc (default: all four)
# - sweep:     every cell of configs/meshes.yaml (pattern (M*E-) x 4: splits into 2 and 4 identical stages),
#              default numerics, each mesh twice in separate processes, 20 steps -> repeat-identical per cell,
#              median step time and tokens/s per cell (scaling against `single`)
# - canonical: every cell under canonical numerics (max_tensor 8) -> all equal `single`; then single, dp8 and
#              fsdp8 with the Pallas kernels
# - tax:       on single, dp8 and fsdp8: strict (xla_flags strategy) and canonical numerics with the Pallas
#              kernels (the kernels strategy runs multi-device only under canonical numerics) against the
#              fastest nondeterministic recipe on the same mesh
# - twoproc:   2 processes x 4 GPUs through jax.distributed == 1 process x 8 GPUs (canonical numerics, data 8)
# Every device run passes run.tensorboard=false (the device image has no tensorboardX).
set -uo pipefail
OUT=${1:-/tmp/eight}; shift || true
PARTS=${*:-sweep canonical tax twoproc}
mkdir -p "$OUT"
CFG=configs/gpu_small.yaml
COMMON=("model.pattern='M*E-M*E-M*E-M*E-'" train.steps=20 run.tensorboard=false)
CELLS=single,dp8,tp4,tp8,ep2,tp2-ep2,tp2-ep4,fsdp8,fsdp8-ep4,pp2,pp4,tp2-pp2,pp2-vpp2,dp2-tp2-pp2,tp4-sp
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c; date -u
for part in $PARTS; do
  case $part in
    sweep)
      python3 scripts/mesh_sweep.py --config $CFG --meshes $CELLS --repeats 2 "${COMMON[@]}" \
        --out "$OUT/sweep" --json "$OUT/sweep.json" 2>&1 | tail -20 ;;
    canonical)
      # every cell, as the CPU sweep of docs/MESHES.md (2026-12-02): feature chunks for tensor 8, one-sequence
      # microbatches (a canonical pipeline's leaves)
      python3 scripts/mesh_sweep.py --config $CFG --meshes $CELLS --repeats 1 "${COMMON[@]}" \
        determinism.numerics=canonical determinism.max_tensor=8 model.n_kv_heads=8 train.micro_batch=1 \
        --out "$OUT/canonical" --json "$OUT/canonical.json" 2>&1 | tail -20
      python3 scripts/mesh_sweep.py --config $CFG --meshes single,dp8,fsdp8 --repeats 1 "${COMMON[@]}" \
        determinism.numerics=canonical determinism.strategy=kernels model.kernels=pallas determinism.canonical_leaf=2 \
        --out "$OUT/canonical_kernels" --json "$OUT/canonical_kernels.json" 2>&1 | tail -6 ;;
    tax)
      K="canonical+determinism.canonical_leaf=2"  # det_tax's canonical mode: strict, kernels strategy, Pallas
      for cell in "mesh.devices=1" "mesh.data=8" "mesh.fsdp=8 mesh.data=1"; do
        # shellcheck disable=SC2086  # $cell holds one or two overrides
        python3 scripts/det_tax.py --config $CFG --steps 12 --warmup 3 --rounds 1 --modes fastest,strict,$K \
          "${COMMON[@]}" $cell 2>&1 | tail -5
      done ;;
    twoproc)
      port=$((20000 + RANDOM % 20000))
      D=("${COMMON[@]}" determinism.numerics=canonical mesh.data=8 mesh.devices=0)
      python3 -m detjax.train --config $CFG --run-dir "$OUT/one" "${D[@]}" > "$OUT/one.log" 2>&1
      for i in 0 1; do
        CUDA_VISIBLE_DEVICES=$([ $i = 0 ] && echo 0,1,2,3 || echo 4,5,6,7) python3 -m detjax.train --config $CFG \
          --run-dir "$OUT/two" "${D[@]}" dist.coordinator=127.0.0.1:$port dist.num_processes=2 dist.process_id=$i \
          > "$OUT/two.$i.log" 2>&1 &
      done
      wait
      python3 -m detjax.compare "$OUT/one" "$OUT/two" ;;
    *) echo "unknown part $part (sweep canonical tax twoproc)"; exit 2 ;;
  esac
done
