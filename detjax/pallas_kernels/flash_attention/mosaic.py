"""Causal GQA flash attention on Hopper through Pallas' Mosaic GPU backend: TMA loads into swizzled shared
memory, wgmma products, and warp specialization (two compute warpgroups and one memory warpgroup per CTA, the
memory one streaming blocks through a ring of STAGES shared-memory slots). Forward, dQ and dK/dV are three
kernels; none uses an atomic, and every output tile is written by one warpgroup that reduces in one fixed order:

- forward: a CTA owns 2 x BLOCK query rows of one head, one warpgroup per BLOCK rows. Each warpgroup runs the
  online softmax over kv blocks of FWD["block_kv"] keys (128: the CTA's rows share one diagonal block), 0 ..
  its diagonal block in ascending order (the diagonal block masked). The row log-sum-exp is kept in base 2 of
  the scaled scores (`lse2`), the form the backward uses.
- dQ: the same CTA shape; a warpgroup adds dS K over kv blocks 0 .. its diagonal in ascending order into one
  float32 accumulator.
- dK/dV: a CTA owns 2 x BLOCK keys of one kv head; a warpgroup owns BLOCK of them and adds P^T dO and dS^T Q
  over the G query heads of its group in ascending order, and within a head over the query blocks that see its
  keys in ascending order, into two float32 accumulators. The G heads are summed inside the kernel, in that
  order, not by a later reduction.
- Products overlap the elementwise work: in the forward the two warpgroups take turns (FWD["pingpong"]), one's
  products running while the other computes its softmax (with 64-key blocks and no turns, a warpgroup issues
  block j + 1's scores before block j's softmax instead); dQ and dK/dV issue a step's two independent products
  (S and dP) together and run the exp2 of the first while the second runs (dK/dV also queues dV behind them).
  Issue order changes time, not what is summed.
- Persistent kernels (PERSISTENT, each off): one CTA per SM walks its share of the kernel's (tile,
  head, batch) items, longest first, each computed as above; the memory warpgroup's ring runs on across items,
  so the next item's first blocks load while the last item finishes.

Tiles are pinned (BLOCK, FWD's block_kv), so the bits depend on the shape and the device, never on a
measurement; the ring depth (STAGES, `stages`) and the forward's pingpong change which slot holds a block and
when it is loaded or multiplied, not what is computed (tests compare the bytes). The products take bf16
operands and accumulate in float32; P and dS are rounded to bf16 before their products (as the Triton kernel,
cuDNN and FlashAttention do) and fed to wgmma from registers, and the forward's output accumulator stays in
wgmma's registers across kv blocks. Other arithmetic than kernel.py's (exp2 of pre-scaled scores), so other
bits: the two are separate backends, chosen by `model.flash_backend`, never mixed in one run.

On CPU the tests run these kernels under Pallas' Mosaic GPU interpreter, whose dot is not wgmma: that checks
the indexing, the masks, the order of the sums and, with the interpreter's happens-before race detector, the
barrier protocol, not the GPU's bits; and they lower them for CUDA (jax.export), which checks what the Mosaic
GPU lowering accepts.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 64  # query rows per compute warpgroup and keys per kv block (equal: each row block has one diagonal block)
WGS = 2  # compute warpgroups per CTA
# shared-memory ring depth of each kernel's streamed operands (fwd128: the forward with 128-key blocks, whose
# slots are twice the size)
STAGES = {"fwd": 4, "fwd128": 2, "dq": 3, "dkv": 3}
# the forward's keys per kv block (64 or 128: the bits) and whether its two warpgroups take turns on the tensor
# cores (time only; needs 128). 128 with turns: 0.51 ms against 0.77 ms for 64-key blocks with the next block's
# scores issued early (H100, 2 x 4096 x 16 heads x 128, scripts/attention_bench.py, docs/BENCHMARKS.md)
FWD = {"block_kv": 128, "pingpong": True, "fold_scale": True}
# "fold_scale": the forward takes each row's maximum of the unscaled scores and applies the scale inside exp2's
# argument (one multiply-add a score, as FlashAttention-3, instead of a multiply and a subtract). The maximum is
# the same number (rounding is monotonic and the scale positive); exp2's argument may round otherwise, so it is
# part of the bits. On: on an H100 at 1 x 8192 x 64 heads x 64 it took the forward from 1.556-1.576 ms to
# 1.413-1.451 ms (alternating processes; cuDNN 1.349 ms), at head_dim 128 2-4 % (docs/BENCHMARKS.md, "Flash
# attention").
# Whether each kernel runs persistent (time only): one CTA per SM walks its share of the kernel's (tile, head,
# batch) items, longest first, its memory warpgroup streaming the next item's blocks while the compute
# warpgroups finish the last one; every item is computed as a CTA of the grid computes it (tests compare the
# bytes, on the GPU too). Off: on an H100 they were 8-12 % faster alone at head_dim 128 (at head_dim 64 the
# forward 11 % faster, the backward 2.6 % slower), but whole dense steps showed no clear gain, -2.3 to +1.4 %
# in one round each (docs/BENCHMARKS.md, "Flash attention").
PERSISTENT = {"fwd": False, "dq": False, "dkv": False}
PERSISTENT_PROGRAMS = 132  # CTAs of a persistent kernel where the device does not say (an H100 SXM's SMs)
# head_dim 256 would hold 64 x 256 float32 accumulators, 128 registers a thread each (the forward two, dK/dV
# two), past a warpgroup's 232; it keeps the Triton kernel (a computed bound, not a measured one)
HEAD_DIMS = (64, 128)
MEMORY_REGISTERS = 40
COMPUTE_REGISTERS = 232  # (2 x 232 + 40) x 128 threads <= 64 Ki registers
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def available() -> bool:
    """Whether this process runs on a Hopper GPU with Pallas' Mosaic GPU backend (the matmul's test)."""
    from detjax.pallas_kernels.matmul import mosaic as mm

    return mm.available()


def fits(length: int, head_dim: int, dtype=jnp.bfloat16) -> bool:
    """Whether these kernels take a sequence of `length` at `head_dim`: whole CTA tiles of WGS x BLOCK rows, a
    head_dim in HEAD_DIMS and 16-bit operands."""
    return length % (WGS * BLOCK) == 0 and head_dim in HEAD_DIMS and jnp.dtype(dtype).itemsize == 2


def refusal(length: int, head_dim: int, dtype) -> str | None:
    """Why `fits` is False, in one line, or None."""
    if jnp.dtype(dtype).itemsize != 2:
        return f"the Mosaic GPU flash attention multiplies 16-bit operands (bf16); got {jnp.dtype(dtype).name}"
    if head_dim not in HEAD_DIMS:
        return (
            f"the Mosaic GPU flash attention takes head_dim {HEAD_DIMS}; got {head_dim} (larger heads' accumulators "
            "do not fit a warpgroup's registers): use model.flash_backend=triton"
        )
    if length % (WGS * BLOCK):
        return f"the Mosaic GPU flash attention needs seq_len a multiple of {WGS * BLOCK}; got {length}"
    return None


def _modules():
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return pl, plgpu


def _swizzled(plgpu):
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _launch(plgpu, kernel, out_type, heads: int, tiles: int, batch: int, interpret, programs: int | None = None):
    """The kernel over grid (heads, tiles, batch), or over `programs` CTAs on grid axis "sm" (a persistent
    kernel), with WGS compute warpgroups and one memory warpgroup: compiled (approximate exp2 / log /
    division, as FlashAttention-3), or under the interpreter (`interpret` True, or a plgpu.InterpretGPUParams of
    its own: the tests' race detector)."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        mode = {"interpret": interpret}
    elif interpret:
        mode = {"interpret": plgpu.InterpretGPUParams()}
    else:
        mode = {"compiler_params": plgpu.CompilerParams(approx_math=True)}
    grid = {"grid": (heads, tiles, batch), "grid_names": ("heads", "tile", "batch")}
    if programs is not None:
        grid = {"grid": (programs,), "grid_names": ("sm",)}
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        **grid,
        num_threads=WGS + 1,
        thread_name="wg",
        **mode,
    )


def _lhs(plgpu, value, scratch, *index):
    """wgmma's left operand: on the GPU straight from registers; Pallas' interpreter (jax 0.12) reads wgmma
    operands only from shared memory, so under it the value goes through scratch[0].at[index] (the same bf16
    values). `scratch` is what _scratch allocated: empty on the GPU."""
    if not scratch:
        return value
    ref = scratch[0].at[index]
    ref[...] = value
    plgpu.commit_smem()
    return ref


def _scratch(plgpu, interpret, shape, dtype):
    """The shared memory _lhs needs under the interpreter (none on the GPU), as a list of run_scoped args."""
    return [plgpu.SMEM(shape, dtype, transforms=_swizzled(plgpu))] if interpret else []


def _diagonal_mask(plgpu, s, offset=0, *, keys_on_rows: bool = False):
    """The causal mask of a diagonal block: query r sees key c iff r + offset >= c (queries on rows; on
    columns with `keys_on_rows`), where `offset` is the block's first query's position past its first key."""
    rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
    cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
    visible = cols + offset >= rows if keys_on_rows else rows + offset >= cols
    return jnp.where(visible, s, -jnp.inf)


def _wait_if(pl, plgpu, wait, barrier):
    """barrier_wait(barrier) where `wait`: a Python bool, or a traced one (then under pl.when)."""
    if wait is True:
        plgpu.barrier_wait(barrier)
    elif wait is not False:
        pl.when(wait)(lambda: plgpu.barrier_wait(barrier))


def _drain(pl, plgpu, steps, stages, releases):
    """The memory warpgroup's last wait: for the releases of the ring's last `stages` of `steps` steps
    (`releases`: functions of a slot giving its release barriers), so that it has seen every phase of every
    barrier it waits on (jax 0.11.2's interpreter checks that when the barriers go; on the GPU it only delays
    the warpgroup's exit)."""

    @pl.loop(jnp.maximum(steps - stages, 0), steps)
    def _(j):
        for barrier in releases:
            plgpu.barrier_wait(barrier(lax.rem(j, stages)))


def _stream(pl, plgpu, n, stages, loads, releases, base=None):
    """The memory warpgroup's loop: step j (0 <= j < n, dynamic) goes to slot j % stages once every compute
    warpgroup released the step that used the slot before. `loads(j, slot, wait)` issues step j's copies,
    first waiting for the slot's releases where `wait` (a Python or traced bool). Then _drain.

    With `base` (a persistent kernel's item, whose ring runs on across the CTA's items), step j of the item is
    the ring's step base + j, and the caller drains once, after its last item."""
    if base is not None:

        @pl.loop(0, n)
        def _(j):
            loads(j, lax.rem(base + j, stages), base + j >= stages)

        return
    for j in range(stages):  # the first `stages` steps need no release
        pl.when(j < n)(functools.partial(loads, j, j, False))

    @pl.loop(stages, jnp.maximum(n, stages))
    def _(j):
        loads(j, lax.rem(j, stages), True)

    _drain(pl, plgpu, n, stages, releases)


def _skip_kv(pl, plgpu, start, end, stages, ring, base=0):
    """kv blocks start .. end-1 (the ring's steps base + start ..), which this warpgroup does not see (past its
    diagonal): wait for each and release its slot at once. ring: (k_smem, v_smem, k_bar, v_bar, k_free,
    v_free)."""
    _, _, k_bar, v_bar, k_free, v_free = ring

    @pl.loop(start, end)
    def _(j):
        slot = lax.rem(base + j, stages)
        for bar, free in ((k_bar, k_free), (v_bar, v_free)):
            plgpu.barrier_wait(bar.at[slot])
            plgpu.barrier_arrive(free.at[slot])


def _kv_releases(ring):
    return (lambda i: ring[4].at[i], lambda i: ring[5].at[i])


def _stream_kv(pl, plgpu, k_ref, v_ref, bi, kvh, n_kv, stages, ring, block=BLOCK, base=None):
    """The memory warpgroup of the forward and dQ: K and V blocks 0 .. n_kv-1 of `block` keys of (batch bi,
    kv head kvh) through the ring (see _skip_kv; `base`: see _stream)."""
    k_smem, v_smem, k_bar, v_bar, k_free, v_free = ring

    def loads(j, slot, wait):
        rows = pl.ds(j * block, block)
        for ref, smem, bar, free in ((k_ref, k_smem, k_bar, k_free), (v_ref, v_smem, v_bar, v_free)):
            _wait_if(pl, plgpu, wait, free.at[slot])
            plgpu.copy_gmem_to_smem(ref.at[bi, rows, kvh], smem.at[slot], bar.at[slot])

    _stream(pl, plgpu, n_kv, stages, loads, _kv_releases(ring), base)


def _kv_memory(pl, plgpu, each_item, persistent, k_ref, v_ref, g, stages, ring, block, n_kv):
    """The memory warpgroup of the forward and dQ: each item's K and V blocks 0 .. n_kv(t)-1 of its kv head
    (query head // g) through the ring (_stream_kv), drained after the last item when persistent."""
    plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

    def one(bi, hi, t, base):
        _stream_kv(pl, plgpu, k_ref, v_ref, bi, hi // g, n_kv(t), stages, ring, block, base if persistent else None)

    steps = each_item(one)
    if persistent:
        _drain(pl, plgpu, steps, stages, _kv_releases(ring))


def _programs(items: int) -> int:
    """CTAs of a persistent kernel: one per SM of the device (PERSISTENT_PROGRAMS where it does not say, as on
    a machine that only lowers the kernel), at most one per item."""
    sms = getattr(jax.devices()[0], "core_count", None) if jax.default_backend() == "gpu" else None
    return max(1, min(items, sms or PERSISTENT_PROGRAMS))


def _persistent_ctas(kernel: str, persistent: bool | None, programs: int | None, items: int) -> int | None:
    """A kernel's CTA count when it runs persistent (`persistent`, PERSISTENT[kernel] unless given; `programs`,
    _programs unless given), or None for the grid."""
    on = PERSISTENT[kernel] if persistent is None else persistent
    return (programs or _programs(items)) if on else None


def dealt(k, cta, programs, where=lambda c, a, b: a if c else b):
    """The item position CTA `cta` of `programs` takes in round k of a persistent kernel: rounds of `programs`
    consecutive positions, dealt forwards in even rounds and backwards in odd ones (see _each_item)."""
    return k * programs + where(k % 2 == 0, cta, programs - 1 - cta)


def _each_item(pl, programs, grid, order, steps, body):
    """body(bi, hi, t, base) for each (batch, head, tile t) item of this CTA; returns the ring steps of all of
    them. `order(i)`: the tile of tile index i (the longest items first: order changes time, not bits);
    `steps(t)`: an item's ring steps.

    Not persistent (`programs` None): the CTA's own grid position (axes "tile", "heads", "batch"), base 0.
    Persistent (`programs` the CTA count P): the items, tile index outermost, are dealt in rounds of P, CTA i
    taking the i-th of an even round and the (P-1-i)-th of an odd one, so that a CTA that took a long item
    takes a short one next (dealt round-robin, the causal 2 x 4096 x 16-head forward gives the busiest of 132
    CTAs 12.5 % more than the mean; dealt this way, none); base is the ring steps of its items before."""
    if programs is None:
        t = order(lax.axis_index("tile"))
        body(lax.axis_index("batch"), lax.axis_index("heads"), t, 0)
        return steps(t)
    tiles, heads, batch = grid
    total, cta = tiles * heads * batch, lax.axis_index("sm")

    def deal(k, base):
        pos = dealt(k, cta, programs, jnp.where)
        tile, rest = pos // (heads * batch), pos % (heads * batch)
        t = order(tile)
        pl.when(pos < total)(lambda: body(rest % batch, rest // batch, t, base))
        return base + jnp.where(pos < total, steps(t), 0)

    return lax.fori_loop(0, -(-total // programs), deal, jnp.int32(0))


def _query_tiles(pl, programs, grid, per_tile: int):
    """_each_item over the forward's or dQ's query tiles (grid (tiles, heads, batch)), the last, longest rows
    first; a tile t streams (t + 1) * per_tile kv blocks."""
    n_t = grid[0]
    return functools.partial(_each_item, pl, programs, grid, lambda i: n_t - 1 - i, lambda t: (t + 1) * per_tile)


def _output_smem_free(plgpu, persistent: bool):
    """Before a persistent kernel's item loads into shared memory its last item stored from: wait until those
    stores have read it (none pending at the first item)."""
    if persistent:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _outputs_written(plgpu, persistent: bool, last: bool):
    """After an item's output stores (`last` False) or after the CTA's last item (`last` True): wait for the
    stores once, at the end of the CTA's work."""
    if persistent == last:
        plgpu.wait_smem_to_gmem(0)


def _fwd_call(
    q,
    k,
    v,
    *,
    interpret: bool,
    stages: int | None = None,
    block_kv: int | None = None,
    pingpong: bool | None = None,
    persistent: bool | None = None,
    programs: int | None = None,
    fold_scale: bool | None = None,
):
    """q (B, L, H, D), k/v (B, L, K, D) -> o (B, L, H, D), lse2 (B, H, L) float32. `block_kv` (keys per kv
    block, FWD["block_kv"] unless given) sets the online softmax's steps, so the bits; `pingpong`, `stages`,
    `persistent` and its `programs` (CTAs; default _programs) change when and where the products run, not what
    they sum; `fold_scale` (FWD's unless given) where the scale is applied."""
    pl, plgpu = _modules()
    b, length, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    bk = block_kv or FWD["block_kv"]
    pingpong = FWD["pingpong"] if pingpong is None else pingpong
    if pingpong and bk != WGS * BLOCK:
        raise ValueError(
            f"the forward's pingpong needs both warpgroups to see as many kv blocks: block_kv {WGS * BLOCK}"
        )
    fold = FWD["fold_scale"] if fold_scale is None else fold_scale
    prefetch = bk == BLOCK  # 64-key blocks: block j + 1's scores run under block j's softmax
    per_tile = WGS * BLOCK // bk  # kv blocks per CTA tile of query rows
    n_t = length // (WGS * BLOCK)
    programs = _persistent_ctas("fwd", persistent, programs, n_t * h * b)
    persistent = programs is not None
    stages = min(stages or STAGES["fwd" if bk == BLOCK else "fwd128"], length // bk)
    c = d**-0.5 * _LOG2E
    to_softmax = (lambda s: s) if fold else (lambda s: s * c)  # the scores as the softmax takes them
    dtype = q.dtype
    tiled = _swizzled(plgpu)

    def kernel(q_ref, k_ref, v_ref, o_ref, lse_ref):
        def scoped(q_smem, k_smem, v_smem, l_smem, q_bar, k_bar, v_bar, k_free, v_free, turn, *p_smem):
            ring = (k_smem, v_smem, k_bar, v_bar, k_free, v_free)
            wg = lax.axis_index("wg")
            each_item = _query_tiles(pl, programs, (n_t, h, b), per_tile)

            def take_turn():  # pingpong: the warpgroups alternate, one's products under the other's softmax
                if pingpong:
                    plgpu.barrier_arrive(turn)
                    plgpu.barrier_wait(turn)

            @pl.when(wg < WGS)
            def _compute():
                plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

                def one(bi, hi, t, base):
                    row0 = t * (WGS * BLOCK) + wg * BLOCK
                    diag = row0 // bk  # this warpgroup's diagonal kv block; it sees blocks 0 .. diag
                    offset = row0 - diag * bk  # its first row's position in the diagonal block
                    qs, ls = q_smem.at[wg], l_smem.at[wg]
                    _output_smem_free(plgpu, persistent)  # the last item's output and lse went from qs and ls
                    plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(row0, BLOCK), hi], qs, q_bar.at[wg])
                    plgpu.barrier_wait(q_bar.at[wg])

                    def scores(j):  # S_j = Q K_j^T (scaled unless fold), releases K_j's slot
                        slot = lax.rem(base + j, stages)
                        plgpu.barrier_wait(k_bar.at[slot])

                        def run(acc):
                            plgpu.wgmma(acc, qs, k_smem.at[slot].transpose((1, 0)))
                            take_turn()
                            return acc[...]

                        s = to_softmax(pl.run_scoped(run, plgpu.ACC((BLOCK, bk), jnp.float32)))
                        plgpu.barrier_arrive(k_free.at[slot])
                        return s

                    def softmax(s, m, l, masked):
                        if masked:
                            s = _diagonal_mask(plgpu, s, offset)
                        if fold:  # s unscaled: the scale in the row max and in exp2's multiply-add
                            m_new = jnp.maximum(m, s.max(axis=1) * c)
                            p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
                        else:
                            m_new = jnp.maximum(m, s.max(axis=1))
                            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                        alpha = jnp.exp2(m - m_new)
                        return m_new, l * alpha + p.sum(axis=1), alpha, p.astype(dtype)

                    def pv(acc, p16, slot):
                        """acc + P V_j: on the GPU wgmma accumulates into acc in place. Pallas' interpreter has no
                        pl.run_state (jax 0.12), so there the product goes to a fresh accumulator and is added."""
                        p = _lhs(plgpu, p16, p_smem, wg)
                        if interpret:
                            return acc + pl.run_scoped(
                                lambda r: (plgpu.wgmma(r, p, v_smem.at[slot]), r[...])[1],
                                plgpu.ACC((BLOCK, d), jnp.float32),
                            )
                        return pl.run_state(lambda r: plgpu.wgmma(r, p, v_smem.at[slot]))(plgpu.ACC.init(acc))

                    def step(j, carry, masked: bool):
                        """Block j: its scores, softmax and P V (pingpong: the other warpgroup's products run
                        between this one's scores and its P V)."""
                        m, l, acc = carry
                        slot = lax.rem(base + j, stages)
                        m, l, alpha, p16 = softmax(scores(j), m, l, masked)
                        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                        if pingpong:
                            plgpu.barrier_arrive(turn)
                        plgpu.barrier_wait(v_bar.at[slot])
                        if pingpong:
                            plgpu.barrier_wait(turn)
                        acc = pv(acc, p16, slot)
                        plgpu.barrier_arrive(v_free.at[slot])
                        return m, l, acc

                    def step_prefetch(j, carry, masked: bool, prefetch: bool):
                        """Block j, whose scores arrive in `carry`; with `prefetch`, block j + 1's scores are
                        issued first and computed while the softmax of j runs."""
                        m, l, acc, s = carry
                        slot, nslot = lax.rem(base + j, stages), lax.rem(base + j + 1, stages)

                        def products(s_acc):
                            if prefetch:
                                plgpu.barrier_wait(k_bar.at[nslot])
                                plgpu.wgmma(s_acc, qs, k_smem.at[nslot].transpose((1, 0)))
                            m_new, l_new, alpha, p16 = softmax(s, m, l, masked)
                            scaled = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                            plgpu.barrier_wait(v_bar.at[slot])
                            acc_new = pv(scaled, p16, slot)  # waits for both products
                            return m_new, l_new, acc_new, (to_softmax(s_acc[...]) if prefetch else s)

                        out = pl.run_scoped(products, plgpu.ACC((BLOCK, bk), jnp.float32))
                        plgpu.barrier_arrive(v_free.at[slot])
                        if prefetch:
                            plgpu.barrier_arrive(k_free.at[nslot])
                        return out

                    row = plgpu.Layout.WGMMA.reduce(1)
                    init = (
                        plgpu.layout_cast(jnp.full((BLOCK,), -jnp.inf, jnp.float32), row),
                        plgpu.layout_cast(jnp.zeros((BLOCK,), jnp.float32), row),
                        plgpu.layout_cast(jnp.zeros((BLOCK, d), jnp.float32), plgpu.Layout.WGMMA),
                    )
                    if prefetch:
                        carry = lax.fori_loop(
                            0, diag, functools.partial(step_prefetch, masked=False, prefetch=True), (*init, scores(0))
                        )
                        m, l, acc, _ = step_prefetch(diag, carry, masked=True, prefetch=False)
                    else:
                        if pingpong:  # warpgroup 1 starts one turn behind warpgroup 0
                            pl.when(wg == 1)(take_turn)
                        carry = lax.fori_loop(0, diag, functools.partial(step, masked=False), init)
                        m, l, acc = step(diag, carry, masked=True)
                        if pingpong:  # and warpgroup 0 ends one turn after it, so both see every phase
                            pl.when(wg == 0)(take_turn)

                    _skip_kv(pl, plgpu, diag + 1, (t + 1) * per_tile, stages, ring, base)  # 64-key blocks: wg 0's last

                    qs[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
                    ls[...] = m + jnp.log(l) * (1.0 / _LN2)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(qs, o_ref.at[bi, pl.ds(row0, BLOCK), hi])
                    plgpu.copy_smem_to_gmem(ls, lse_ref.at[bi, hi, pl.ds(row0, BLOCK)])
                    _outputs_written(plgpu, persistent, last=False)

                each_item(one)
                _outputs_written(plgpu, persistent, last=True)

            memory = (pl, plgpu, each_item, persistent, k_ref, v_ref, g, stages, ring, bk, lambda t: (t + 1) * per_tile)
            pl.when(wg == WGS)(functools.partial(_kv_memory, *memory))

        pl.run_scoped(
            scoped,
            plgpu.SMEM((WGS, BLOCK, d), dtype, transforms=tiled),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiled),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiled),
            plgpu.SMEM((WGS, BLOCK), jnp.float32),
            plgpu.Barrier(num_barriers=WGS),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=WGS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=WGS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=WGS),
            *_scratch(plgpu, interpret, (WGS, BLOCK, bk), dtype),
            collective_axes="wg",
        )

    out_type = [jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, h, length), jnp.float32)]
    return _launch(plgpu, kernel, out_type, h, n_t, b, interpret, programs)(q, k, v)


def _dq_call(
    q,
    k,
    v,
    do,
    lse2,
    delta,
    *,
    interpret: bool,
    stages: int | None = None,
    persistent: bool | None = None,
    programs: int | None = None,
):
    """dQ (B, L, H, D) from q, do (B, L, H, D), k/v (B, L, K, D), lse2 and delta (B, H, L) float32.
    `persistent` (PERSISTENT["dq"] unless given) and its `programs` (default _programs) change time only."""
    pl, plgpu = _modules()
    b, length, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    n_t = length // (WGS * BLOCK)
    stages = min(stages or STAGES["dq"], length // BLOCK)
    scale = d**-0.5
    c = scale * _LOG2E
    dtype = q.dtype
    tiled = _swizzled(plgpu)
    programs = _persistent_ctas("dq", persistent, programs, n_t * h * b)
    persistent = programs is not None

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref):
        def scoped(q_smem, do_smem, r_smem, own_bar, k_smem, v_smem, k_bar, v_bar, k_free, v_free, *ds_smem):
            ring = (k_smem, v_smem, k_bar, v_bar, k_free, v_free)
            wg = lax.axis_index("wg")
            each_item = _query_tiles(pl, programs, (n_t, h, b), WGS)

            @pl.when(wg < WGS)
            def _compute():
                plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

                def one(bi, hi, t, base):
                    row0 = t * (WGS * BLOCK) + wg * BLOCK
                    diag = t * WGS + wg
                    qs, dos = q_smem.at[wg], do_smem.at[wg]
                    rows = pl.ds(row0, BLOCK)
                    _output_smem_free(plgpu, persistent)  # the last item's dQ went from qs
                    plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, hi], qs, own_bar.at[wg, 0])
                    plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, hi], dos, own_bar.at[wg, 1])
                    plgpu.copy_gmem_to_smem(lse_ref.at[bi, hi, rows], r_smem.at[wg, 0], own_bar.at[wg, 2])
                    plgpu.copy_gmem_to_smem(delta_ref.at[bi, hi, rows], r_smem.at[wg, 1], own_bar.at[wg, 3])
                    for i in range(4):
                        plgpu.barrier_wait(own_bar.at[wg, i])
                    lse = plgpu.load(r_smem.at[wg, 0], layout=plgpu.Layout.WGMMA.reduce(1))
                    delta = plgpu.load(r_smem.at[wg, 1], layout=plgpu.Layout.WGMMA.reduce(1))

                    def accumulate(dq_acc):
                        def step(j, masked: bool):
                            slot = lax.rem(base + j, stages)
                            plgpu.barrier_wait(k_bar.at[slot])
                            plgpu.barrier_wait(v_bar.at[slot])

                            def products(s_acc, dp_acc):  # S and dP issued together; P's exp2 runs while dP does
                                plgpu.wgmma(s_acc, qs, k_smem.at[slot].transpose((1, 0)))
                                plgpu.wgmma(dp_acc, dos, v_smem.at[slot].transpose((1, 0)))
                                s = plgpu.wgmma_accumulator_load(s_acc, wait_n=1) * c
                                if masked:
                                    s = _diagonal_mask(plgpu, s, keys_on_rows=False)
                                p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))
                                return p, plgpu.wgmma_accumulator_load(dp_acc, wait_n=0)

                            square = plgpu.ACC((BLOCK, BLOCK), jnp.float32)
                            p, dp = pl.run_scoped(products, square, square)
                            plgpu.barrier_arrive(v_free.at[slot])
                            ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
                            dsl = _lhs(plgpu, ds.astype(dtype), ds_smem, wg)
                            plgpu.wgmma(dq_acc, dsl, k_smem.at[slot])
                            plgpu.wgmma_wait(0)  # the slot is read: release it
                            plgpu.barrier_arrive(k_free.at[slot])

                        @pl.loop(0, diag)
                        def _(j):
                            step(j, masked=False)

                        step(diag, masked=True)

                        _skip_kv(pl, plgpu, diag + 1, (t + 1) * WGS, stages, ring, base)

                        return dq_acc[...]

                    dq = pl.run_scoped(accumulate, plgpu.ACC((BLOCK, d), jnp.float32))
                    qs[...] = (dq * scale).astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(qs, dq_ref.at[bi, rows, hi])
                    _outputs_written(plgpu, persistent, last=False)

                each_item(one)
                _outputs_written(plgpu, persistent, last=True)

            memory = (pl, plgpu, each_item, persistent, k_ref, v_ref, g, stages, ring, BLOCK, lambda t: (t + 1) * WGS)
            pl.when(wg == WGS)(functools.partial(_kv_memory, *memory))

        pl.run_scoped(
            scoped,
            plgpu.SMEM((WGS, BLOCK, d), dtype, transforms=tiled),
            plgpu.SMEM((WGS, BLOCK, d), dtype, transforms=tiled),
            plgpu.SMEM((WGS, 2, BLOCK), jnp.float32),
            plgpu.Barrier(num_barriers=(WGS, 4)),
            plgpu.SMEM((stages, BLOCK, d), dtype, transforms=tiled),
            plgpu.SMEM((stages, BLOCK, d), dtype, transforms=tiled),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=WGS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=WGS, num_barriers=stages),
            *_scratch(plgpu, interpret, (WGS, BLOCK, BLOCK), dtype),
            collective_axes="wg",
        )

    out_type = jax.ShapeDtypeStruct(q.shape, dtype)
    return _launch(plgpu, kernel, out_type, h, n_t, b, interpret, programs)(q, k, v, do, lse2, delta)


def _dkv_call(
    q,
    k,
    v,
    do,
    lse2,
    delta,
    *,
    interpret: bool,
    stages: int | None = None,
    persistent: bool | None = None,
    programs: int | None = None,
):
    """dK, dV (B, L, K, D): each warpgroup sums its keys' gradients over the group's G query heads ascending,
    then over the query blocks that see them ascending. `persistent` (PERSISTENT["dkv"] unless given) and its
    `programs` (default _programs) change time only."""
    pl, plgpu = _modules()
    b, length, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    n_t = length // (WGS * BLOCK)
    n_q = length // BLOCK
    stages = stages or STAGES["dkv"]
    scale = d**-0.5
    c = scale * _LOG2E
    dtype = q.dtype
    tiled = _swizzled(plgpu)
    programs = _persistent_ctas("dkv", persistent, programs, n_t * kh * b)
    persistent = programs is not None

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref):
        def scoped(k_smem, v_smem, own_bar, q_smem, do_smem, r_smem, ready, free, *lhs_smem):
            wg = lax.axis_index("wg")
            # tile 0 has the most query blocks and starts first; an item streams its group's G heads' query
            # blocks from its first, t * WGS, the first that sees its keys
            each_item = functools.partial(
                _each_item, pl, programs, (n_t, kh, b), lambda i: i, lambda t: g * (n_q - t * WGS)
            )

            @pl.when(wg < WGS)
            def _compute():
                plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

                def one(bi, kvh, t, base):
                    per_head = n_q - t * WGS  # query blocks streamed per query head
                    key0 = t * (WGS * BLOCK) + wg * BLOCK
                    ks, vs = k_smem.at[wg], v_smem.at[wg]
                    keys = pl.ds(key0, BLOCK)
                    _output_smem_free(plgpu, persistent)  # the last item's dK, dV went from ks, vs
                    plgpu.copy_gmem_to_smem(k_ref.at[bi, keys, kvh], ks, own_bar.at[wg, 0])
                    plgpu.copy_gmem_to_smem(v_ref.at[bi, keys, kvh], vs, own_bar.at[wg, 1])
                    plgpu.barrier_wait(own_bar.at[wg, 0])
                    plgpu.barrier_wait(own_bar.at[wg, 1])

                    def wait_all(slot):  # the slot's four copies arrive on one barrier
                        plgpu.barrier_wait(ready.at[slot])

                    def release(slot):
                        plgpu.barrier_arrive(free.at[slot])

                    def accumulate(dk_acc, dv_acc):
                        def visit(s, masked: bool):
                            slot = lax.rem(base + s, stages)
                            wait_all(slot)
                            qb, dob = q_smem.at[slot], do_smem.at[slot]

                            def products(st_acc, dpt_acc):  # S^T and dP^T issued together, dV behind them
                                plgpu.wgmma(st_acc, ks, qb.transpose((1, 0)))
                                plgpu.wgmma(dpt_acc, vs, dob.transpose((1, 0)))
                                st = plgpu.wgmma_accumulator_load(st_acc, wait_n=1) * c  # dP^T may still run
                                if masked:
                                    st = _diagonal_mask(plgpu, st, keys_on_rows=True)
                                lse = plgpu.load(r_smem.at[0, slot], layout=plgpu.Layout.WGMMA.reduce(0))
                                pt = jnp.exp2(st - lax.broadcast_in_dim(lse, st.shape, [1]))
                                ptl = _lhs(plgpu, pt.astype(dtype), lhs_smem, wg, 0)
                                plgpu.wgmma(dv_acc, ptl, dob)  # dV += P^T dO
                                return pt, plgpu.wgmma_accumulator_load(dpt_acc, wait_n=1)  # dV may still run

                            square = plgpu.ACC((BLOCK, BLOCK), jnp.float32)
                            pt, dpt = pl.run_scoped(products, square, square)
                            delta = plgpu.load(r_smem.at[1, slot], layout=plgpu.Layout.WGMMA.reduce(0))
                            dst = pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))
                            dstl = _lhs(plgpu, dst.astype(dtype), lhs_smem, wg, 1)
                            plgpu.wgmma(dk_acc, dstl, qb)  # dK += dS^T Q (scaled once at the end)
                            plgpu.wgmma_wait(0)
                            release(slot)

                        @pl.loop(0, g)  # the group's query heads in ascending order
                        def _(hh):
                            head0 = hh * per_head  # the head's first step in the item

                            @pl.loop(0, wg)  # warpgroup 1 does not see the CTA's first query block
                            def _(i):
                                slot = lax.rem(base + head0 + i, stages)
                                wait_all(slot)
                                release(slot)

                            visit(head0 + wg, masked=True)

                            @pl.loop(wg + 1, per_head)
                            def _(i):
                                visit(head0 + i, masked=False)

                        return dk_acc[...], dv_acc[...]

                    dk, dv = pl.run_scoped(
                        accumulate, plgpu.ACC((BLOCK, d), jnp.float32), plgpu.ACC((BLOCK, d), jnp.float32)
                    )
                    ks[...] = (dk * scale).astype(dtype)
                    vs[...] = dv.astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(ks, dk_ref.at[bi, keys, kvh])
                    plgpu.copy_smem_to_gmem(vs, dv_ref.at[bi, keys, kvh])
                    _outputs_written(plgpu, persistent, last=False)

                each_item(one)
                _outputs_written(plgpu, persistent, last=True)

            @pl.when(wg == WGS)
            def _memory():
                plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

                def one(bi, kvh, t, base):
                    first = t * WGS
                    per_head = n_q - first

                    def loads(s, slot, wait):
                        hh = s // per_head
                        qh = kvh * g + hh
                        rows = pl.ds((first + s % per_head) * BLOCK, BLOCK)
                        srcs = (
                            q_ref.at[bi, rows, qh],
                            do_ref.at[bi, rows, qh],
                            lse_ref.at[bi, qh, rows],
                            delta_ref.at[bi, qh, rows],
                        )
                        dsts = (q_smem.at[slot], do_smem.at[slot], r_smem.at[0, slot], r_smem.at[1, slot])
                        _wait_if(pl, plgpu, wait, free.at[slot])
                        for src, dst in zip(srcs, dsts, strict=True):
                            plgpu.copy_gmem_to_smem(src, dst, ready.at[slot])

                    _stream(pl, plgpu, g * per_head, stages, loads, releases, base if persistent else None)

                releases = (lambda slot: free.at[slot],)
                steps = each_item(one)
                if persistent:
                    _drain(pl, plgpu, steps, stages, releases)

        pl.run_scoped(
            scoped,
            plgpu.SMEM((WGS, BLOCK, d), dtype, transforms=tiled),
            plgpu.SMEM((WGS, BLOCK, d), dtype, transforms=tiled),
            plgpu.Barrier(num_barriers=(WGS, 2)),
            plgpu.SMEM((stages, BLOCK, d), dtype, transforms=tiled),
            plgpu.SMEM((stages, BLOCK, d), dtype, transforms=tiled),
            plgpu.SMEM((2, stages, BLOCK), jnp.float32),
            plgpu.Barrier(num_arrivals=4, num_barriers=stages),
            plgpu.Barrier(num_arrivals=WGS, num_barriers=stages),
            *_scratch(plgpu, interpret, (WGS, 2, BLOCK, BLOCK), dtype),
            collective_axes="wg",
        )

    out = jax.ShapeDtypeStruct(k.shape, dtype)
    return _launch(plgpu, kernel, [out, out], kh, n_t, b, interpret, programs)(q, k, v, do, lse2, delta)


@functools.partial(jax.jit, static_argnames=("interpret",))
def flash_fwd(q, k, v, *, interpret: bool = False):
    """o (B, L, H, D) and lse2 (B, H, L): log2 of the row sums of exp2 of the scores scaled by log2(e)/sqrt(D)."""
    return _fwd_call(q, k, v, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def flash_bwd(q, k, v, o, lse2, do, *, interpret: bool = False):
    """dq, dk, dv in the layouts of q, k, v. delta = rowsum(dO * O) per (batch, head, row), in float32."""
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    dq = _dq_call(q, k, v, do, lse2, delta, interpret=interpret)
    dk, dv = _dkv_call(q, k, v, do, lse2, delta, interpret=interpret)
    return dq, dk, dv
