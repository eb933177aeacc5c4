set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
git log --oneline -1 2>/dev/null
timeout 330 python3 scripts/gemm_bench.py --mosaic-variants --no-table --reps 10 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee $OUT/variants.txt
timeout 220 python3 scripts/profile_step.py --config configs/gpu_dense.yaml --steps 3 --top 60 --hlo $OUT/dense_fp8.hlo.gz --out /tmp/prof determinism.strategy=kernels model.kernels=pallas model.fp8.enabled=true run.tensorboard=false 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee $OUT/profile_dense_fp8.txt
