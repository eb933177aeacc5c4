set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
git log --oneline -1 2>/dev/null
F="grep -v ^WARNING\|^I0000\|^W0000"
DETJAX_TEST_GPU=1 timeout 170 python3 -m pytest -q tests/test_matmul.py tests/test_fp8.py::test_fused_swiglu_mlp_is_exact_and_its_amaxes_are_the_products tests/test_fp8.py::test_fp8_matmul_mosaic_path_matches_the_triton_path tests/test_fp8.py::test_fp8_matmul_uses_the_given_scales_and_returns_the_amaxes -k "fp8 or quantize or swiglu" 2>&1 | tail -15 | tee $OUT/tests.txt
timeout 250 python3 scripts/det_tax.py --config configs/gpu_dense.yaml --steps 10 --warmup 3 --rounds 1 --modes strict-kernels,strict-kernels+model.fp8.enabled=true run.tensorboard=false 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -25 | tee $OUT/dettax_dense.txt
timeout 150 python3 scripts/profile_step.py --config configs/gpu_dense.yaml --steps 3 --top 30 --out /tmp/prof determinism.strategy=kernels model.kernels=pallas model.fp8.enabled=true run.tensorboard=false 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee $OUT/profile_dense_fp8.txt | head -70
