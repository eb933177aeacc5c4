set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv
python3 -c "import jax; print(jax.__version__, jax.devices())"
git log --oneline -1 2>/dev/null
timeout 560 python3 scripts/det_tax.py --config configs/gpu_small.yaml --steps 20 --warmup 4 --rounds 2 --modes strict-kernels,canonical+determinism.canonical_leaf=8 run.tensorboard=false 2>&1 | grep -v "^WARNING\|^I0\|^W0" | tail -40
