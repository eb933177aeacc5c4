"""The matmul's three products on Hopper through Pallas' Mosaic GPU backend: TMA loads into swizzled shared
memory, wgmma from shared memory, a warp-specialized pipeline (one memory warpgroup, two compute
warpgroups) and a persistent grid of one CTA per SM. The pipeline is streamed (STREAM): one ring of
shared-memory slots over all of an SM's tiles, so the memory warpgroup loads the next tile's blocks while the
compute warpgroups write a tile; the older form, one pipeline per tile that fills and drains each time, gives
the same bits and stays for comparison (stream=False; on the H200 the streamed one made gpu_dense's step
0.5-1.7 % faster, docs/benchmarks-history.md set 28).

The reduction rule is the Triton kernel's (kernel.py): every output tile is owned by ONE warpgroup, which
reduces R by one ascending loop over blocks of BLOCK_R = 64 into a float32 accumulator that starts at zero
(wgmma, k = 16 per instruction, issued in order) -- no split-K, no stream-K, no atomics; the weight gradient
of a weight under DW_UNCHUNKED_SIZE elements sums `dw_row_chunk(k, n)`-row token chunks, each chunk its own
(chunk, tile) work item writing a float32 partial sum, the partials added in ascending chunk order after the
kernel. Which SM takes which tile, and in which order, changes when a tile is written, never what it holds.
The tile shape comes from the product kind alone (never from M), and operands are zero-padded to whole
tiles, so the batch invariance of kernel.py holds here by the same argument (tests/test_matmul.py, GPU).

Transposed operands (dx reads w transposed, dw reads x transposed) are loaded in their stored layout and
handed to wgmma as a transposed shared-memory view, which Hopper's bf16 wgmma reads directly. fp8 wgmma
reads no transposed view: fp8 operands come as the "nt" product a @ b^T, both with the reduced dimension
contiguous (the caller lays them out), in 128-element reduction blocks (one 128-byte swizzled row).

Used by kernel.matmul_kernel for bfloat16 products of weights of at least kernel.MOSAIC_MIN_SIZE elements on
Hopper GPUs (compute capability 9.0), where it gives the Triton kernel's bits (byte-equal on the H200 for
every product of gpu_dense and gpu_medium) at up to 1.17 x its speed; smaller weights, float32 products (the
MoE router) and every other device use the Triton kernel (docs/benchmarks-history.md set 16). model.fp8's
products of weights of at least kernel.MOSAIC_FP8_MIN_SIZE elements use it through kernel.fp8_nt (2026-12-02;
other bits than the Triton kernel's fp8 products, whose backward multiplies in bf16), and the MoE experts' fp8
grouped products through its grouped modes (gmm/mosaic.py, 2026-12-02). On CPU the tests run it
under Pallas' Mosaic GPU interpreter, whose dot is not wgmma: that checks the indexing and the chunk rule,
not the GPU's bits.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax

BLOCK_R = 64  # bf16 reduction block (block_r): four k = 16 wgmma steps per pipeline stage; fp8 takes 128
TILE = 128  # each compute warpgroup's output tile is TILE x TILE; a CTA's two warpgroups sit side by side
SWIZZLE = 128  # bytes: a 64-element bf16 row, the widest swizzle
STAGES = 4  # pipeline depth (4 x (128 x 64 + 64 x 256) bf16 = 192 KiB of shared memory)
FP8_DELAY = 1  # fp8 products keep one wgmma in flight (same bits; 0.98-1.09 x per product of gpu_dense, 2026-12-02)
SNAKE_WIDTH = 8  # tiles per band of the persistent loop's order (L2 locality; no effect on bits)
STREAM = True  # the streamed pipeline (streamed_body) by default; False: tiled_body, one pipeline per tile
INTERPRET_SMS = 2  # "SMs" under Pallas' interpreter (CPU): few, so small tests give an SM several tiles
MEMORY_REGISTERS = 40  # per-thread registers of the memory warpgroup (the compute ones share the rest)


def available() -> bool:
    """Whether this process runs on a Hopper GPU with Pallas' Mosaic GPU backend importable."""
    if jax.default_backend() != "gpu":
        return False
    try:
        dev = jax.devices()[0]
        if getattr(dev, "compute_capability", "") != "9.0":
            return False
        importlib.import_module("jax.experimental.pallas.mosaic_gpu")
    except Exception:  # no CUDA device details or no Mosaic GPU in this jax
        return False
    return True


def cta_tile(kind: str, wg_n: int = TILE) -> tuple[int, int]:
    """(rows, columns) of one CTA's output: the two warpgroups split columns for fwd/dw, rows for dx and nt
    (the split is always along the operand that is NOT read transposed, so neither warpgroup slices a
    transposed view); "nt" warpgroups are TILE x wg_n."""
    if kind == "nt":
        return 2 * TILE, wg_n
    if wg_n != TILE:
        raise ValueError(f"mosaic matmul {kind}: warpgroup tiles are {TILE} x {TILE} (wg_n={wg_n} is for nt)")
    return (2 * TILE, TILE) if kind == "dx" else (TILE, 2 * TILE)


def block_r(dtype) -> int:
    """The reduction block: one 128-byte swizzled row of the operand (64 bf16 or 128 fp8 elements)."""
    return SWIZZLE // jnp.dtype(dtype).itemsize


def is_fp8(dtype) -> bool:
    """e4m3 or e5m2 (model.fp8's operand types)."""
    return jnp.dtype(dtype).name in ("float8_e4m3fn", "float8_e5m2")


@functools.cache
def mixed_fp8() -> bool:
    """Whether this jax's Mosaic GPU wgmma takes an e5m2 operand beside an e4m3 one (PTX allows the pair; older
    jax versions refuse it). Decided once per process by compiling the smallest such product, so it depends on
    the jax version and the device, never on a run-time measurement."""
    if not available():
        return False
    a = jax.ShapeDtypeStruct((2 * TILE, block_r(jnp.float8_e5m2)), jnp.float8_e5m2)
    b = jax.ShapeDtypeStruct((TILE, block_r(jnp.float8_e4m3fn)), jnp.float8_e4m3fn)
    try:
        jax.jit(functools.partial(mosaic_matmul, kind="nt", out_dtype=jnp.float32, r_chunk=0)).lower(a, b).compile()
    except Exception:  # the lowering or PTX assembly refuses the mixed pair
        return False
    return True


def _compute_registers() -> int:
    """Per-thread registers of each of the two compute warpgroups: the SM's 64 Ki shared with the memory
    warpgroup's MEMORY_REGISTERS, rounded down to a multiple of 8, at most 255 (emit_pipeline_warp_specialized's
    rule)."""
    return int(min(256, (512 - MEMORY_REGISTERS) / 2) // 8 * 8)


def _num_sms() -> int:
    return jax.devices()[0].core_count


def mosaic_matmul(
    a,
    b,
    scale=None,
    *,
    kind: str,
    out_dtype,
    r_chunk: int,
    stages: int = STAGES,
    wg_n: int = TILE,
    delay: int = 0,
    stream: bool | None = None,
    interpret: bool = False,
    tile_groups=None,
    group_blocks=None,
    acc_ref=None,
    acc_round=None,
) -> jax.Array | None:
    """The product `kind` of kernel.py, or "nt" (a @ b^T: a (m, R), b (n, R)), on operands already padded:
    the output's rows and columns whole multiples of cta_tile(kind) and R a multiple of block_r (and of
    r_chunk when r_chunk > 0). a, b bf16, or fp8 (e4m3 / e5m2) for "nt" only: Hopper's fp8 wgmma reads both
    operands with R contiguous, so the caller lays them out that way. r_chunk > 0 (dw or nt): float32
    partial sums per chunk, returned as (R / r_chunk, m, n) for the caller to add in ascending order;
    otherwise the (m, n) product in out_dtype. `scale` (float32, shape (1,); not with r_chunk): the float32
    sums are multiplied by scale[0] before the rounding to out_dtype (fp8's dequantization, in the epilogue).
    Speed only (the wgmmas of a tile are issued in the same order into one accumulator): `wg_n`, each
    warpgroup's tile columns for "nt" (TILE or 2 * TILE); `delay` 1 keeps one wgmma in flight while the next
    stage is issued (its shared-memory slot is released one step later; only with two or more reduction
    steps per tile, except when streaming); `stream` (None: STREAM), the streamed pipeline (_streamed_body):
    the memory warpgroup loads the next tile's blocks while the compute warpgroups finish a tile and write
    it, instead of one pipeline per tile that fills and drains.

    Grouped "nt" products (the MoE experts' fp8 products, detjax.pallas_kernels.gmm.mosaic), whose rows are laid
    out in groups padded to whole tiles, so no tile mixes groups:
    - `tile_groups` (int32, one per row tile of cta_tile("nt")[0] rows): b is (G, n, R), a stack of G
      operands, and row tile i multiplies b[tile_groups[i]]. Out (m, n).
    - `group_blocks` (int32 (2, G): first block and number of blocks, in block_r units of R): item g reduces
      R's blocks first..first+count-1 of a (m, R) and b (n, R) in ascending order (count 0: the item writes
      zeros, an empty expert; with stream=False and delay > 0, count must not be 1). Out (G * m, n): group
      g's product in rows g*m..(g+1)*m-1. Also for bf16 "dw" products (a (R, m) and b (R, n) as stored, a
      read through a transposed view), so that the experts' weight gradient needs no transposed copies.
    Either way every output tile is still one ascending loop into one accumulator.

    `acc_ref` (dw only, float32, no r_chunk or scale; a jax Ref of the output's shape, `jax.new_ref`): the
    product is added to it in place and nothing is returned. The epilogue loads each piece of the Ref's tile
    into shared memory, adds the tile's float32 sums to it (one float32 add per element: the bits of
    `acc + product`) and writes the piece back (the gradient accumulation fusion: a weight gradient summed
    over microbatches without a separate pass over it). With `group_blocks` the Ref is (G * m, n), group g's
    sum in rows g*m..(g+1)*m-1. `acc_round` (a dtype, with acc_ref only): the sums are rounded to it, and back
    to float32 (exact), before the add: the bits of `acc + product.astype(acc_round).astype(float32)`, for a
    weight gradient that reaches its weight rounded (the experts', gmm.ops)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    trans_a, trans_b = kind == "dw", kind in ("dx", "nt")
    if (is_fp8(a.dtype) or is_fp8(b.dtype)) and kind != "nt":
        raise ValueError(f"mosaic matmul {kind}: fp8 operands are multiplied as nt (both with R contiguous)")
    if scale is not None and r_chunk:
        raise ValueError("mosaic matmul: a scale applies to whole sums, not to chunk partials")
    grouped = tile_groups is not None or group_blocks is not None
    if acc_ref is not None and (kind != "dw" or r_chunk or scale is not None or jnp.dtype(out_dtype) != jnp.float32):
        raise ValueError("mosaic matmul: acc_ref is for float32 dw products without r_chunk or a scale")
    if acc_round is not None and acc_ref is None:
        raise ValueError("mosaic matmul: acc_round rounds the sums added to acc_ref; pass acc_ref")
    if grouped and (
        kind not in ("nt", "dw")
        or (kind == "dw" and tile_groups is not None)
        or r_chunk
        or (tile_groups is not None and group_blocks is not None)
    ):
        raise ValueError("mosaic matmul: tile_groups (nt) or group_blocks (nt or dw), one of them, without r_chunk")
    if tile_groups is not None and b.ndim != 3:
        raise ValueError(f"mosaic matmul: tile_groups needs b stacked as (groups, n, R); got b {b.shape}")
    m = a.shape[1] if trans_a else a.shape[0]
    n = b.shape[-2] if trans_b else b.shape[1]
    r = a.shape[0] if trans_a else a.shape[1]
    cm, cn = cta_tile(kind, wg_n)
    br = block_r(a.dtype)
    if m % cm or n % cn or r % br or (r_chunk and r % r_chunk):
        raise ValueError(f"mosaic matmul {kind}: shape m={m} n={n} r={r} is not padded to the tiles {cm}x{cn}x{br}")
    if tile_groups is not None and tile_groups.shape != (m // cm,):
        raise ValueError(
            f"mosaic matmul: tile_groups has shape {tile_groups.shape}, want one per row tile ({m // cm},)"
        )
    chunk = r_chunk or r
    n_chunks = group_blocks.shape[1] if group_blocks is not None else r // chunk
    m_tiles, n_tiles = m // cm, n // cn
    out_dtype = jnp.float32 if r_chunk else jnp.dtype(out_dtype)
    split_rows = kind in ("dx", "nt")

    elems = SWIZZLE // jnp.dtype(a.dtype).itemsize
    tiled = (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(SWIZZLE))
    # epilogue: each warpgroup writes its tile in (64 x epi_n) pieces through two shared-memory slots
    epi_n = SWIZZLE // jnp.dtype(out_dtype).itemsize
    out_tiled = (plgpu.TilingTransform((8, epi_n)), plgpu.SwizzleTransform(SWIZZLE))
    epi_m = 64

    a_block = (br, cm) if trans_a else (cm, br)
    b_block = (cn, br) if trans_b else (br, cn)
    a_index = (lambda k: (k, 0)) if trans_a else (lambda k: (0, k))
    b_index = (lambda k: (0, k)) if trans_b else (lambda k: (k, 0))

    stream = STREAM if stream is None else stream
    if chunk // br < 2 and group_blocks is None and not stream:  # one reduction step per tile: a delayed
        delay = 0  # release would skip a barrier phase when the persistent loop runs the next tile (Pallas'
        # interpreter reports it); the streamed pipeline releases every slot itself
    release = {"delay_release": delay} if delay else {}
    n_items = n_chunks * m_tiles * n_tiles

    def item(lin, a_gmem, b_gmem, g_gmem):
        """Work item lin's operand views (whole reduction), first block, number of blocks and output place."""
        c = lin // (m_tiles * n_tiles)
        mi, ni = plgpu.planar_snake(lin % (m_tiles * n_tiles), (m_tiles, n_tiles), 1, SNAKE_WIDTH)
        rows, cols = pl.ds(mi * cm, cm), pl.ds(ni * cn, cn)
        if group_blocks is not None:  # item c reduces its own blocks of the whole R
            a_view = a_gmem.at[:, rows] if trans_a else a_gmem.at[rows, :]
            b_view = b_gmem.at[cols, :] if trans_b else b_gmem.at[:, cols]
            views, first, steps = (a_view, b_view), g_gmem[0, c], g_gmem[1, c]
        else:
            b_op = b_gmem.at[g_gmem[mi]] if tile_groups is not None else b_gmem
            rs = pl.ds(c * chunk, chunk)
            a_view = a_gmem.at[rs, rows] if trans_a else a_gmem.at[rows, rs]
            b_view = b_op.at[cols, rs] if trans_b else b_op.at[rs, cols]
            views, first, steps = (a_view, b_view), 0, chunk // br
        return views, first, steps, pl.ds(c * m + mi * cm, cm), cols

    def wg_part(wg):
        """This warpgroup's TILE x TILE part of the CTA tile: (rows, columns, columns' count)."""
        if split_rows:
            return pl.ds(wg * TILE, TILE), slice(None), cn
        return slice(None), pl.ds(wg * TILE, TILE), TILE

    def epilogue(acc, s_gmem, out_smem, out_gmem, wg, out_rows, cols, in_bar=None):
        """Scale, round and write this warpgroup's accumulator in (epi_m x epi_n) pieces through two
        shared-memory slots. `in_bar` (acc_ref): each piece of the output is first loaded into its slot and
        the sums are added to it."""
        wrows, wcols, wn = wg_part(wg)
        val = acc[...] if s_gmem is None else acc[...] * s_gmem[0]
        val = val.astype(out_dtype)
        if acc_round is not None:
            val = val.astype(acc_round).astype(jnp.float32)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        piece = 0
        for pm in range(TILE // epi_m):
            for pn in range(wn // epi_n):
                slot = piece % 2
                piece += 1
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                piece_rows, piece_cols = pl.ds(pm * epi_m, epi_m), pl.ds(pn * epi_n, epi_n)
                dst = out_gmem.at[out_rows, cols].at[wrows, wcols].at[piece_rows, piece_cols]
                part = val[pm * epi_m : (pm + 1) * epi_m, pn * epi_n : (pn + 1) * epi_n]
                if in_bar is not None:  # the slot's last store has read it (the wait above): load the piece
                    bar = in_bar.at[wg * 2 + slot]
                    plgpu.copy_gmem_to_smem(dst, out_smem.at[wg, slot], bar)
                    plgpu.barrier_wait(bar)
                    part = out_smem[wg, slot] + part
                out_smem[wg, slot] = part
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], dst)

    def mma(acc, a_smem, b_smem, wg):
        wrows, wcols, _ = wg_part(wg)
        lhs = a_smem.transpose((1, 0)) if trans_a else a_smem.at[wrows]
        rhs = b_smem.transpose((1, 0)) if trans_b else b_smem.at[:, wcols]
        plgpu.wgmma(acc, lhs, rhs)

    def split_refs(refs):
        refs = list(refs)
        s_gmem = refs.pop(0) if scale is not None else None
        g_gmem = refs.pop(0) if grouped else None
        (out_gmem,) = refs  # the output, or acc_ref (the last input; the kernel then has no output)
        return s_gmem, g_gmem, out_gmem

    # acc_ref: one barrier per (compute warpgroup, epilogue slot) for the loads of the output's pieces
    in_bars = {"in_bar": plgpu.Barrier(num_arrivals=1, num_barriers=4)} if acc_ref is not None else {}

    def pipeline(body, context, steps=chunk // br, first=0):
        # grouped reductions: a dynamic number of steps from a dynamic first block (whole-R views)
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec(
                    a_block, lambda k: a_index(k + first), transforms=tiled, memory_space=plgpu.SMEM, **release
                ),
                plgpu.BlockSpec(
                    b_block, lambda k: b_index(k + first), transforms=tiled, memory_space=plgpu.SMEM, **release
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=context,
        )

    def tiled_body(a_gmem, b_gmem, *refs):
        """One warp-specialized pipeline per work item (it fills and drains at every tile)."""
        s_gmem, g_gmem, out_gmem = split_refs(refs)

        def no_op(*_, **__):
            return None

        alloc_steps = stages if group_blocks is not None else chunk // br  # every slot of a dynamic grid
        b_alloc = b_gmem.at[0] if tile_groups is not None else b_gmem

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(no_op, no_op, alloc_steps).get_allocations(a_gmem, b_alloc),
            out_smem=plgpu.SMEM((2, 2, epi_m, epi_n), out_dtype, transforms=out_tiled),
            collective_axes="wg",
            **in_bars,
        )
        def scope(allocs, out_smem, in_bar=None):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((n_items,), collective_axes="sm")
            def tile_loop(info):
                (lin,) = info.index
                (a_view, b_view), first, steps, out_rows, cols = item(lin, a_gmem, b_gmem, g_gmem)

                def context(run):
                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((TILE, wg_part(0)[2]), jnp.float32))
                    def acc_scope(acc):
                        run(acc)
                        epilogue(acc, s_gmem, out_smem, out_gmem, wg, out_rows, cols, in_bar)

                def step(_, a_smem, b_smem, acc):
                    mma(acc, a_smem, b_smem, wg)
                    plgpu.wgmma_wait(delay)
                    return acc

                if group_blocks is not None:
                    pipe = pipeline(step, context, steps, first)
                else:
                    pipe = pipeline(step, context)
                pipe(a_view, b_view, allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def streamed_body(a_gmem, b_gmem, *refs):
        """One pipeline over all of this SM's work items: the memory warpgroup (the last) loads block after
        block into a ring of `stages` shared-memory slots, running ahead into the next item while the compute
        warpgroups finish an item and write it; each compute warpgroup waits for a slot's blocks, issues its
        wgmma and releases the slot once that wgmma is done (`delay` wgmmas later). Slots and barrier phases
        follow one running block count, carried from item to item by both sides. Each output tile is still
        one ascending loop of wgmmas into one accumulator that starts at zero: the bits of tiled_body."""
        s_gmem, g_gmem, out_gmem = split_refs(refs)
        sm, n_sms = lax.axis_index("sm"), lax.axis_size("sm")
        my_items = (n_items - sm + n_sms - 1) // n_sms  # items sm, sm + n_sms, ...

        @functools.partial(
            pl.run_scoped,
            a_smem=plgpu.SMEM((stages, *a_block), a_gmem.dtype, transforms=tiled),
            b_smem=plgpu.SMEM((stages, *b_block), b_gmem.dtype, transforms=tiled),
            out_smem=plgpu.SMEM((2, 2, epi_m, epi_n), out_dtype, transforms=out_tiled),
            ready=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            collective_axes="wg",
            **in_bars,
        )
        def scope(a_smem, b_smem, out_smem, ready, consumed, in_bar=None):
            wg = lax.axis_index("wg")

            @pl.when(wg == 2)
            def _memory():
                plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

                def one_item(i, g):
                    (a_view, b_view), first, steps, _, _ = item(sm + i * n_sms, a_gmem, b_gmem, g_gmem)

                    def load(k, g):
                        slot = lax.rem(g, stages)

                        @pl.when(g >= stages)
                        def _():
                            plgpu.barrier_wait(consumed.at[slot])

                        for view, shape, index, smem in (
                            (a_view, a_block, a_index, a_smem),
                            (b_view, b_block, b_index, b_smem),
                        ):
                            i0, i1 = index(k + first)
                            block = view.at[pl.ds(i0 * shape[0], shape[0]), pl.ds(i1 * shape[1], shape[1])]
                            plgpu.copy_gmem_to_smem(block, smem.at[slot], ready.at[slot])
                        return g + 1

                    return lax.fori_loop(0, steps, load, g)

                g_total = lax.fori_loop(0, my_items, one_item, jnp.int32(0))

                # the last slots' releases too, so that this warpgroup has seen every phase of `consumed` (jax
                # 0.11.2's interpreter checks that when the barriers go; on the GPU it only delays its exit)
                @pl.loop(jnp.maximum(g_total - stages, 0), g_total)
                def _(g):
                    plgpu.barrier_wait(consumed.at[lax.rem(g, stages)])

            @pl.when(wg < 2)
            def _compute():
                plgpu.set_max_registers(_compute_registers(), action="increase")

                def one_item(i, g):
                    _, _, steps, out_rows, cols = item(sm + i * n_sms, a_gmem, b_gmem, g_gmem)

                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((TILE, wg_part(0)[2]), jnp.float32))
                    def acc_scope(acc):
                        def step(k, g):
                            slot = lax.rem(g, stages)
                            plgpu.barrier_wait(ready.at[slot])
                            mma(acc, a_smem.at[slot], b_smem.at[slot], wg)
                            plgpu.wgmma_wait(delay)
                            if delay:  # the wgmma `delay` steps back is done: its slot is free

                                @pl.when(k >= delay)
                                def _():
                                    plgpu.barrier_arrive(consumed.at[lax.rem(g - delay, stages)])
                            else:
                                plgpu.barrier_arrive(consumed.at[slot])
                            return g + 1

                        g_end = lax.fori_loop(0, steps, step, g)
                        if delay:
                            plgpu.wgmma_wait(0)
                            for j in range(delay, 0, -1):  # the last `delay` slots of this item

                                @pl.when(steps >= j)
                                def _(j=j):
                                    plgpu.barrier_arrive(consumed.at[lax.rem(g_end - j, stages)])

                        epilogue(acc, s_gmem, out_smem, out_gmem, wg, out_rows, cols, in_bar)
                        return g_end

                    return acc_scope

                lax.fori_loop(0, my_items, one_item, jnp.int32(0))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out_rows_total = n_chunks * m if (r_chunk or group_blocks is not None) else m
    if acc_ref is not None and tuple(acc_ref.shape) != (out_rows_total, n):
        raise ValueError(
            f"mosaic matmul: acc_ref has shape {tuple(acc_ref.shape)}, want the output's {(out_rows_total, n)}"
        )
    run = plgpu.kernel(
        streamed_body if stream else tiled_body,
        out_type=() if acc_ref is not None else jax.ShapeDtypeStruct((out_rows_total, n), out_dtype),
        grid=(min(INTERPRET_SMS if interpret else _num_sms(), n_items),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}),
    )
    extra = [x for x in (scale, tile_groups if tile_groups is not None else group_blocks) if x is not None]
    if acc_ref is not None:
        run(a, b, *extra, acc_ref)
        return None
    out = run(a, b, *extra)
    return out.reshape(n_chunks, m, n) if r_chunk else out
