"""Tracer cost: step time with tracing off (the plain compiled step), and with module- and op-level capture
on every timed step (digests computed on device, records fetched to host each step).

    python scripts/trace_overhead.py --config configs/gpu_small.yaml --steps 20 --warmup 5 [--op-scope REGEX]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--op-scope", default="", help="op capture scope regex ('' = every op of the step)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from detjax import determinism
    from detjax.config import load_config

    cfg = load_config(a.config, a.overrides)
    determinism.apply_config_environment(cfg)
    import jax
    import numpy as np

    from detjax.data.pipeline import make_dataset
    from detjax.sharding.mesh import replicated, single_device_mesh
    from detjax.step import Trainer, compile_init, compile_train_step
    from detjax.trace import streams
    from detjax.trace.capture import instrumented_step
    from detjax.trace.opcapture import traced_step_fn

    rep = replicated(single_device_mesh())
    ds = make_dataset(cfg)
    batches = [jax.device_put(np.asarray(ds[i]), rep) for i in range(8)]
    plain_tr = Trainer(cfg)
    init = compile_init(plain_tr, rep)

    def bench(name, fn, post=None):
        state = init(jax.random.key(0))
        t0 = time.perf_counter()
        times = []
        for i in range(a.warmup + a.steps):
            t = time.perf_counter()
            out = fn(state, batches[i % 8])
            state = out[0][0] if post == "op" else out[0]
            if post is not None:
                post_fn(post, out)  # capture includes moving the records to the host
            jax.block_until_ready(state)
            if i == 0:
                first = time.perf_counter() - t0
            if i >= a.warmup:
                times.append(time.perf_counter() - t)
        med = 1e3 * statistics.median(times)
        print(f"{name:22s} median {med:8.2f} ms  (min {1e3 * min(times):.2f}, first call {first:.1f} s)", flush=True)
        return med

    def post_fn(kind, out):
        if kind == "op":
            (_, _), values = out
            streams.op_records(op_rec.meta, values, 0)
        else:
            streams.capture_records(out[2], 0, "module")

    plain = compile_train_step(plain_tr, rep, rep)
    res = {"plain": bench("tracing off (plain)", plain)}
    module_step = jax.jit(instrumented_step(plain_tr, "module"), donate_argnums=(0,))
    res["module"] = bench("module capture", module_step, post="module")
    st = init(jax.random.key(0))
    op_fn, op_rec = traced_step_fn(plain_tr.train_step, (st, batches[0]), a.op_scope)
    res["op"] = bench(f"op capture /{a.op_scope}/", op_fn, post="op")
    res["plain_again"] = bench("tracing off (again)", plain)
    base = statistics.median([res["plain"], res["plain_again"]])
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}; op records per step: {len(op_rec.meta)}")
    print("| mode | median step (ms) | overhead vs tracing off |\n|---|---|---|")
    for k in ("plain", "plain_again", "module", "op"):
        print(f"| {k} | {res[k]:.2f} | {100 * (res[k] / base - 1):+.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
