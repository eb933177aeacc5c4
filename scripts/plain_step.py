"""The baseline a user would write in an afternoon: a plain-JAX train step of a dense config's shape.

    python scripts/plain_step.py --config configs/gpu_dense.yaml [--steps 20] [--warmup 5] [--attention cudnn]

No detjax model code: fp32 master params in a dict, bf16 compute with jnp.einsum matmuls, RMSNorm, RoPE,
SwiGLU, `jax.nn.dot_product_attention(implementation="cudnn")` (or "xla"), a logsumexp cross-entropy with
take_along_axis, optax AdamW with global-norm clipping and warm-up + cosine, and `lax.scan` over the
microbatches. Only dense patterns (`*` attention and `-` MLP blocks, MTP off) have a plain version.
scripts/det_tax.py runs it as its `plain` mode.

With model.fp8.enabled=true the projections (and the LM head with model.fp8.lm_head=true) are the fp8
recipe a Flax user reaches for: `flax.linen.fp8_ops.fp8_scaled_dot_general` (what Fp8DirectDotGeneralOp
calls; XLA's fp8 GEMMs, autotuned) with delayed scaling over model.fp8.amax_history_len steps. Its scales and
amax histories come back as the "gradient" of the fp8 metadata; each step keeps their elementwise maximum
over the microbatches (every microbatch starts from the same history, so this is the history with the
step's largest amax). detjax's margin is not applied. det_tax runs it as `plain+model.fp8.enabled=true`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

SMI_QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits"]


def parse_smi(lines: list[str]) -> dict | None:
    """nvidia-smi's "clock, power, temperature" CSV lines -> {sm_clock_mhz (median), power_w (median),
    temp_c_max, samples}; lines that are not three numbers are skipped; None when none is."""
    rows = []
    for line in lines:
        try:
            rows.append([float(x) for x in line.split(",")])
        except ValueError:
            continue
    rows = [r for r in rows if len(r) == 3]
    if not rows:
        return None
    return {
        "sm_clock_mhz": statistics.median(r[0] for r in rows),
        "power_w": statistics.median(r[1] for r in rows),
        "temp_c_max": max(r[2] for r in rows),
        "samples": len(rows),
    }


class GpuSampler:
    """Samples the GPU's SM clock, power draw and temperature (nvidia-smi, one query every `period_s`, from a
    thread) while the `with` block runs; `.summary` is then parse_smi's dict, or None where nvidia-smi is missing
    or fails (the CPU). A compute-bound kernel's time follows the SM clock, which the GPU lowers under a high
    power draw, so two modes' step times are compared knowing their clocks (docs/benchmarks-history.md set 34).
    The GPU queried is the first of CUDA_VISIBLE_DEVICES (else GPU 0): the device det_tax's workers use."""

    def __init__(self, period_s: float = 0.25, query: list[str] | None = None) -> None:
        self.period_s, self.summary = period_s, None
        self.query = list(query or SMI_QUERY)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        if query is None:
            self.query += ["-i", visible if visible.isdigit() else "0"]
        self._lines: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> bool:
        try:
            out = subprocess.run(self.query, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return False
        if out.returncode:
            return False
        self._lines += out.stdout.splitlines()
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._sample():
                return
            self._stop.wait(self.period_s)

    def __enter__(self) -> GpuSampler:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.summary = parse_smi(self._lines)


def build(cfg, attention: str = "cudnn"):
    """(init(key) -> (params, opt_state[, fp8 meta]), step(params, opt_state, batch[, fp8 meta]) ->
    (params, opt_state[, fp8 meta], loss)); the fp8 metadata with model.fp8.enabled."""
    import jax
    import jax.numpy as jnp
    import optax

    m, t = cfg.model, cfg.train
    if set(m.pattern) - {"*", "-"} or m.mtp.depth:
        raise SystemExit("error: the plain step covers dense patterns only ('*' and '-', model.mtp.depth=0)")
    d, h, kv, hd, f, v = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_dim, m.vocab_size
    bf = jnp.bfloat16
    fp8 = m.fp8.enabled

    def meta_init():
        """Each fp8 projection's Flax metadata: scales 1, empty amax histories."""
        one = jnp.ones((1,), jnp.float32)
        zero = jnp.zeros((m.fp8.amax_history_len,), jnp.float32)
        proj = {f"{s}_scale": one for s in ("lhs", "rhs", "grad")} | {
            f"{s}_amax_history": zero for s in ("lhs", "rhs", "grad")
        }
        names = {"*": ("q", "kv", "o"), "-": ("gate_up", "down")}
        out = {"blocks": [{n: proj for n in names[letter]} for letter in m.pattern]}
        return out | ({"head": proj} if m.fp8.lm_head else {})

    def mm(x, w, meta=None):
        """x @ w in bf16 with float32 accumulation; in fp8 with this projection's metadata when given."""
        if meta is None:
            return x @ w.astype(bf)
        from flax.linen import fp8_ops

        dims = (((x.ndim - 1,), (0,)), ((), ()))
        return fp8_ops.fp8_scaled_dot_general(
            x, w.astype(bf), dims, preferred_element_type=bf, quantize_compute_type=bf, **meta
        )

    def init(key):
        keys = iter(jax.random.split(key, 4 * len(m.pattern) + 2))

        def w(*shape):
            return m.init_std * jax.random.normal(next(keys), shape, jnp.float32)

        blocks = []
        for letter in m.pattern:
            if letter == "*":
                blocks.append({"norm": jnp.ones(d), "q": w(d, h * hd), "kv": w(d, 2 * kv * hd), "o": w(h * hd, d)})
            else:
                blocks.append({"norm": jnp.ones(d), "gate_up": w(d, 2 * f), "down": w(f, d)})
        return {"embed": w(v, d), "blocks": blocks, "final_norm": jnp.ones(d), "head": w(d, v)}

    def rms(x, s):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + m.norm_eps) * s).astype(bf)

    def rope(x):
        length = x.shape[1]
        inv = m.rope_theta ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
        ang = jnp.arange(length, dtype=jnp.float32)[:, None] * inv[None]
        cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(bf)

    def loss_fn(params, tokens, meta=None):
        ids, tgt = tokens[:, :-1], tokens[:, 1:]
        b, length = ids.shape
        x = params["embed"][ids]
        metas = meta["blocks"] if meta is not None else [{}] * len(m.pattern)
        for letter, p, mt in zip(m.pattern, params["blocks"], metas, strict=True):
            y = rms(x, p["norm"])
            if letter == "*":
                q = mm(y, p["q"], mt.get("q")).reshape(b, length, h, hd)
                k, vv = jnp.split(mm(y, p["kv"], mt.get("kv")).reshape(b, length, 2 * kv, hd), 2, axis=2)
                o = jax.nn.dot_product_attention(rope(q), rope(k), vv, is_causal=True, implementation=attention)
                x = x + mm(o.reshape(b, length, h * hd), p["o"], mt.get("o")).astype(jnp.float32)
            else:
                gate, up = jnp.split(mm(y, p["gate_up"], mt.get("gate_up")), 2, axis=-1)
                x = x + mm(jax.nn.silu(gate) * up, p["down"], mt.get("down")).astype(jnp.float32)
        head_meta = meta.get("head") if meta is not None else None
        logits = mm(rms(x, params["final_norm"]), params["head"], head_meta).astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, -1)
        return jnp.sum(lse - jnp.take_along_axis(logits, tgt[..., None], -1)[..., 0])

    schedule = optax.warmup_cosine_decay_schedule(0.0, t.lr, t.warmup_steps, t.steps, t.lr * t.min_lr_ratio)
    tx = optax.chain(
        optax.clip_by_global_norm(t.clip_norm),
        optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay),
    )
    n_tok = t.global_batch * t.seq_len

    def step(params, opt_state, batch, meta=None):
        micro = batch.reshape(t.n_micro, t.micro_batch, -1)

        def body(acc, tokens):
            if meta is None:
                loss, g = jax.value_and_grad(loss_fn)(params, tokens)
                return jax.tree.map(jnp.add, acc, (loss, g)), None
            loss, (g, new_meta) = jax.value_and_grad(loss_fn, argnums=(0, 2))(params, tokens, meta)
            (acc_loss, acc_g), acc_meta = acc
            acc_meta = jax.tree.map(jnp.maximum, acc_meta, new_meta)
            return ((acc_loss + loss, jax.tree.map(jnp.add, acc_g, g)), acc_meta), None

        zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
        if meta is not None:  # metadata: maxima over the microbatches (scales and histories are >= 0)
            zeros = (zeros, jax.tree.map(jnp.zeros_like, meta))
        acc, _ = jax.lax.scan(body, zeros, micro)
        (loss, g), meta = (acc, None) if meta is None else acc
        g = jax.tree.map(lambda x: x / n_tok, g)
        updates, opt_state = tx.update(g, opt_state, params)
        new = (optax.apply_updates(params, updates), opt_state) + (() if meta is None else (meta,))
        return (*new, loss / n_tok)

    def init_all(key):
        params = init(key)
        return (params, tx.init(params)) + ((meta_init(),) if fp8 else ())

    return jax.jit(init_all), jax.jit(step, donate_argnums=(0, 1, 3) if fp8 else (0, 1))


def time_steps(run, state, batches: list, steps: int, warmup: int, windows: int = 3) -> dict:
    """Step times of `run(state, batch) -> (state, out)` (det_tax reports each, for every mode):
    - synced: each step waited for (`block_until_ready`) before the next is dispatched; the median;
    - dispatch: in the synced steps, the time until the call returns (the host's share: argument handling
      and whatever part of the launches the runtime does on the calling thread); the median;
    - pipelined: `windows` windows of `steps` steps dispatched back to back, each window waited for once at
      its end; the median of the windows' per-step means. The host dispatches step t+1 while the device runs
      step t, as in detjax.train's loop (which reads step t-1's metrics after queueing step t) and in a plain
      training loop that does not fetch its loss every step.
    The first call (compilation) is timed alone as `first_step_s`. `gpu`: GpuSampler's summary over the timed
    steps (warm-up included; None on a machine without nvidia-smi). Returns (the timing fields, the last step's
    output)."""
    import jax

    t0 = time.perf_counter()
    state, out = run(state, batches[0])
    jax.block_until_ready((state, out))
    compile_s = time.perf_counter() - t0
    times, dispatch, means, i = [], [], [], 1
    with GpuSampler() as gpu:
        for n in range(warmup + steps - 1):
            t0 = time.perf_counter()
            state, out = run(state, batches[i % len(batches)])
            t1 = time.perf_counter()
            jax.block_until_ready((state, out))
            i += 1
            if n >= warmup - 1:
                times.append(time.perf_counter() - t0)
                dispatch.append(t1 - t0)
        for _ in range(windows):
            t0 = time.perf_counter()
            for _ in range(steps):
                state, out = run(state, batches[i % len(batches)])
                i += 1
            jax.block_until_ready((state, out))
            means.append((time.perf_counter() - t0) / steps)
    return {
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
        "max_ms": 1e3 * max(times),
        "pipelined_ms": 1e3 * statistics.median(means),
        "dispatch_ms": 1e3 * statistics.median(dispatch),
        "first_step_s": compile_s,
        "gpu": gpu.summary,
    }, out


def result(timing: dict, cfg, final_loss: float) -> dict:
    """One worker's result line (plain_step.measure and det_tax's workers): timing fields plus the run's facts."""
    import jax

    from detjax.runlog import peak_memory_bytes

    return {
        **timing,
        "final_loss": final_loss,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "tokens_per_step": cfg.train.global_batch * cfg.train.seq_len,
        "peak_mem_bytes": peak_memory_bytes(jax.devices()[:1]),
    }


def measure(cfg, steps: int, warmup: int, attention: str = "cudnn") -> dict:
    """Step times of the plain step on one device (the same result fields as det_tax's workers)."""
    import jax
    import numpy as np

    from detjax.data.pipeline import make_dataset

    init, step = build(cfg, attention)
    state = init(jax.random.key(cfg.train.seed))  # (params, opt_state[, fp8 metadata])
    ds = make_dataset(cfg)
    batches = [jax.device_put(np.asarray(ds[i])) for i in range(8)]

    def run(state, batch):
        *new, loss = step(*state[:2], batch, *state[2:])
        return tuple(new), loss

    timing, loss = time_steps(run, state, batches, steps, warmup)
    return result(timing, cfg, float(loss))


def main() -> int:
    ap = argparse.ArgumentParser(prog="python scripts/plain_step.py", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--attention", default="cudnn", choices=["cudnn", "xla"])
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from detjax.config import load_config

    cfg = load_config(a.config, a.overrides + ["determinism.mode=off"])
    print(json.dumps(measure(cfg, a.steps, a.warmup, a.attention)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
