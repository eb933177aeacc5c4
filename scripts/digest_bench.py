"""Device time of the per-step fingerprint digests of a config's state, per digest version.

    python scripts/digest_bench.py --config configs/gpu_dense.yaml [--versions 1,2] [--per-leaf]
        [--alone-bytes 1M,4M] [--kernel] [--kernel-min-programs 16,64] [--reps 20]

The digests a step computes (detjax.step: the parameters with the non-finite count, the gradients and the
optimizer state) over random bits shaped like the config's state, jitted, each version timed alone: the
median of --reps synced calls after two warm-up calls. Reported in ms, with the bytes read. --per-leaf adds
each version with one reduction per leaf (`grouped=False`: the same bits) beside the stacked groups the step
uses; --alone-bytes adds, per size, the stacked groups with every leaf of at least that size digested alone
(fingerprint.ALONE_BYTES: a stacked group may copy its leaves). --kernel adds the stacked groups with the
leaves of at least fingerprint.KERNEL_MIN_PROGRAMS programs digested by the Pallas kernel
(pallas_kernels/digest), and --kernel-min-programs that threshold at other values. Every line prints the
digests' hex: variants of one version must agree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--versions", default="1,2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--per-leaf", action="store_true", help="also time one reduction per leaf")
    ap.add_argument("--alone-bytes", default="", help="comma list of sizes (bytes, or with K/M suffix)")
    ap.add_argument("--kernel", action="store_true", help="also time the Pallas digest kernel for large leaves")
    ap.add_argument("--kernel-min-programs", default="", help="comma list: the kernel at these thresholds")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from detjax import fingerprint as fp
    from detjax.config import load_config
    from detjax.step import Trainer

    cfg = load_config(a.config, a.overrides)
    abstract = Trainer(cfg).abstract_state()
    trees = {"params": abstract.params, "grads": abstract.params, "opt_state": abstract.opt_state}
    key = iter(jax.random.split(jax.random.key(0), 1 + len(jax.tree.leaves(trees))))

    def fill(s):
        if jnp.issubdtype(s.dtype, jnp.floating):
            return jax.random.normal(next(key), s.shape, s.dtype)
        return jnp.zeros(s.shape, s.dtype)

    state = jax.tree.map(fill, trees)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    shift = {"K": 10, "M": 20}
    sizes = [int(x[:-1]) << shift[x[-1]] if x[-1] in shift else int(x) for x in a.alone_bytes.split(",") if x]
    mins = {int(x) for x in a.kernel_min_programs.split(",") if x} | ({fp.KERNEL_MIN_PROGRAMS} if a.kernel else set())
    layouts = [(True, None, None)] + [(False, None, None)] * a.per_leaf + [(True, n, None) for n in sizes]
    layouts += [(True, None, m) for m in sorted(mins)]
    variants = [(int(v), *layout) for v in a.versions.split(",") for layout in layouts]
    for version, grouped, alone, min_programs in variants:
        fp.KERNEL_MIN_PROGRAMS = min_programs or fp.KERNEL_MIN_PROGRAMS

        @jax.jit
        def digests(state, version=version, grouped=grouped, alone=alone, kernel=min_programs is not None):
            def tree(t, finite):
                return fp.tree_digest_and_finite(t, finite, grouped, version, alone, kernel=kernel)

            p, finite = tree(state["params"], True)
            return p, finite, tree(state["grads"], False)[0], tree(state["opt_state"], False)[0]

        for _ in range(2):
            jax.block_until_ready(digests(state))
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(digests(state))
            times.append((time.perf_counter() - t0) * 1e3)
        how = ("grouped" if alone is None else f"grouped, leaves >= {alone} bytes alone") if grouped else "per leaf"
        if min_programs is not None:
            how += f", the kernel for leaves of >= {min_programs} programs"
        p, _, g, o = digests(state)
        print(
            f"digest version {version}, {how}: median {statistics.median(times):.3f} ms "
            f"(min {min(times):.3f}) over {nbytes / 2**30:.2f} GiB, {jax.devices()[0].device_kind}; "
            f"digests {fp.digest_hex(p)} {fp.digest_hex(g)} {fp.digest_hex(o)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
