"""The collectives of one compiled train step: count and result bytes per kind, per device, next to the
parameters' bytes. A property of the compiled program (no timing), so it is read on CPU with virtual devices.

    python3 scripts/collective_bytes.py --config configs/tiny_mesh.yaml --cpu-devices 8 mesh.data=8 \
        determinism.numerics=canonical "model.pattern='-'" model.mtp.depth=0

Bytes are the sizes of each collective's result buffer on one device (an all-gather's whole result, an
all-to-all's whole receive buffer, a collective-permute's received partial), summed over the step; XLA's
async pairs (`-start`/`-done`) are counted once.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import sys
from pathlib import Path

KINDS = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}


def collective_bytes(hlo_text: str) -> dict[str, tuple[int, int]]:
    """{kind: (count, bytes)} over the HLO module text's collective instructions."""
    count: collections.Counter = collections.Counter()
    size: collections.Counter = collections.Counter()
    op = re.compile(r"=\s*(.*?)\s(" + "|".join(KINDS) + r")(-start)?\(")
    for line in hlo_text.splitlines():
        m = op.search(re.sub(r"/\*.*?\*/", "", line))
        if not m:
            continue
        shapes = re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]", m.group(1))
        if m.group(3):  # an async start's result tuple holds the operands too: count only the outputs' half
            shapes = shapes[len(shapes) // 2 :]
        nbytes = sum(BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in shapes)
        count[m.group(2)] += 1
        size[m.group(2)] += nbytes
    return {k: (count[k], size[k]) for k in KINDS if count[k]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--cpu-devices", type=int, default=0, help="run on N virtual CPU devices (0: the real devices)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        flag = f"--xla_force_host_platform_device_count={a.cpu_devices}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import jax
    import jax.numpy as jnp

    from detjax.config import ConfigError, load_config
    from detjax.sharding.mesh import build_layout
    from detjax.step import Trainer

    try:
        cfg = load_config(a.config, a.overrides)
        tr = Trainer(cfg, build_layout(cfg, jax.devices()[: cfg.mesh.devices or None]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len + 1), jnp.int32)
    step = jax.jit(tr.train_step, in_shardings=(tr.state_shardings(), tr.batch_sharding()))
    text = step.lower(tr.abstract_state(), batch).compile().as_text()
    params = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tr.abstract_state().params))
    print(f"parameters: {params} bytes (whole, float32)")
    print("| collective | count | result bytes per device | x parameter bytes |")
    print("|---|---|---|---|")
    for kind, (n, b) in collective_bytes(text).items():
        print(f"| {kind} | {n} | {b} | {b / params:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
