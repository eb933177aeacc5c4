"""Is cuDNN's fused attention (jax.nn.dot_product_attention, implementation="cudnn") deterministic, forward
and backward, under XLA's deterministic-ops flag? Replays on identical inputs, quiet and under contention.

    python3 scripts/cudnn_attention_check.py --flag on  [--batch 4 --seq 2048 --heads 16 --kv-heads 4]
    python3 scripts/cudnn_attention_check.py --flag off   # the negative control: cuDNN's default backward

`--flag on` starts JAX with detjax's strict XLA flags (determinism.STRICT_XLA_FLAGS: XLA then asks cuDNN for
its deterministic flash-attention backward); `off` with none. Prints one JSON line: the number of replays
(of `--replays`) whose dQ/dK/dV/output bytes differ from the first, quiet and under a concurrent matmul
workload. GPU only (cuDNN).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(prog="python3 scripts/cudnn_attention_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--flag", choices=["on", "off"], required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--replays", type=int, default=20)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from detjax.determinism import STRICT_XLA_FLAGS

    if a.flag == "on":
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *STRICT_XLA_FLAGS]).strip()
    import jax
    import jax.numpy as jnp

    from detjax.pallas_kernels.harness import count_differing_replays, matmul_contention

    if jax.default_backend() != "gpu":
        print("error: needs a CUDA GPU (cuDNN)", file=sys.stderr)
        return 2
    b, length, h, kv, d = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, length, h, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, length, kv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, length, kv, d), jnp.bfloat16)
    w = jax.random.normal(ks[3], (b, length, h, d), jnp.bfloat16)

    def loss(q, k, v):
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(o.astype(jnp.float32) * w.astype(jnp.float32)), o

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    quiet = count_differing_replays(fn, (q, k, v), a.replays)
    busy = count_differing_replays(fn, (q, k, v), a.replays, contention=matmul_contention())
    print(
        json.dumps(
            {
                "flag": a.flag,
                "shape": [b, length, h, kv, d],
                "replays": a.replays,
                "differing_quiet": quiet,
                "differing_contention": busy,
                "jax": jax.__version__,
                "device": jax.devices()[0].device_kind,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
