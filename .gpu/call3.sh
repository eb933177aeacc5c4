set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
DETJAX_TEST_GPU=1 timeout 150 python3 -m pytest -q tests/test_matmul.py tests/test_fp8.py::test_fused_swiglu_mlp_is_exact_and_its_amaxes_are_the_products tests/test_fp8.py::test_fp8_matmul_mosaic_path_matches_the_triton_path tests/test_fp8.py::test_fp8_matmul_uses_the_given_scales_and_returns_the_amaxes -k "fp8 or quantize or swiglu" 2>&1 | tail -6 | tee $OUT/tests.txt
timeout 200 python3 scripts/det_tax.py --config configs/gpu_dense.yaml --steps 10 --warmup 3 --rounds 1 --modes strict-kernels,strict-kernels+model.fp8.enabled=true run.tensorboard=false 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -6 | tee $OUT/dettax_dense.txt
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.25
( timeout 280 bash scripts/cold_start_l1.sh configs/gpu_dense.yaml /tmp/l1d determinism.strategy=kernels model.kernels=pallas model.fp8.enabled=true run.tensorboard=false train.steps=6 > $OUT/l1_dense_fp8.txt 2>&1; echo "rc $?" >> $OUT/l1_dense_fp8.txt ) &
for v in false true; do
  ( timeout 280 python3 -m detjax.train --config configs/gpu_dense.yaml --run-dir $OUT/curves/fp8_$v determinism.strategy=kernels model.kernels=pallas model.fp8.enabled=$v train.steps=300 ckpt.enabled=false run.save_final_params=false run.tensorboard=false run.log_every=1 > $OUT/curve_$v.log 2>&1; echo "rc $?" >> $OUT/curve_$v.log ) &
done
wait
tail -3 $OUT/l1_dense_fp8.txt; tail -2 $OUT/curve_false.log $OUT/curve_true.log; ls $OUT/curves/*; du -sh $OUT
