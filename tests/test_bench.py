"""The benchmark scripts' measurement helpers (scripts/plain_step.py, which det_tax's workers use): the GPU
clock sampler and the step timer; and how scripts/shape_matrix.py turns its workers' records into a row. The
GPU figures come from GPU runs (docs/BENCHMARKS.md); here the sampler runs a stand-in query command,
since the CPU machine has no nvidia-smi."""

import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import plain_step  # noqa: E402


def test_parse_smi_medians_and_skips():
    lines = ["1980, 650.5, 60", "[N/A], 120.0, 41", "1755, 699.9, 63", "", "1800, 680.0, 62", "1, 2"]
    s = plain_step.parse_smi(lines)
    assert s == {"sm_clock_mhz": 1800.0, "power_w": 680.0, "temp_c_max": 63.0, "samples": 3}
    assert plain_step.parse_smi(["[N/A], [N/A], [N/A]", "garbage"]) is None
    assert plain_step.parse_smi([]) is None


def _query(body: str) -> list[str]:
    return [sys.executable, "-c", body]


def test_sampler_collects_while_open():
    with plain_step.GpuSampler(period_s=0.01, query=_query("print('1500, 300.5, 55')")) as g:
        for _ in range(100):  # a few samples, then leave the block
            if len(g._lines) >= 3:
                break
            time.sleep(0.05)
    assert g.summary is not None and g.summary["samples"] >= 3
    assert (g.summary["sm_clock_mhz"], g.summary["power_w"], g.summary["temp_c_max"]) == (1500.0, 300.5, 55.0)
    n = g.summary["samples"]
    time.sleep(0.1)
    assert len(g._lines) == n  # the thread stopped with the block


@pytest.mark.parametrize(
    "query",
    [["/nonexistent/nvidia-smi-missing"], _query("import sys; sys.exit(9)"), _query("print('no numbers here')")],
    ids=["missing", "fails", "unparsable"],
)
def test_sampler_without_a_gpu_reports_none(query):
    with plain_step.GpuSampler(period_s=0.01, query=query) as g:
        pass
    assert g.summary is None


def test_time_steps_fields_on_cpu():
    """The timer's fields for a tiny function: three step times, the dispatch time, the pipelined windows, and
    `gpu` None on a machine without nvidia-smi (the CPU CI machine)."""

    @jax.jit
    def run(state, batch):
        return state + batch, jnp.sum(state)

    batches = [jnp.full((8,), float(i)) for i in range(3)]
    timing, out = plain_step.time_steps(run, jnp.zeros(8), batches, steps=3, warmup=2, windows=2)
    assert set(timing) == {"median_ms", "min_ms", "max_ms", "pipelined_ms", "dispatch_ms", "first_step_s", "gpu"}
    assert 0 <= timing["min_ms"] <= timing["median_ms"] <= timing["max_ms"]
    assert timing["dispatch_ms"] >= 0 and timing["pipelined_ms"] > 0
    if jax.default_backend() == "cpu":
        assert timing["gpu"] is None or timing["gpu"]["samples"] >= 1
    # 1 compile call + (warmup + steps - 1) synced + windows x steps pipelined: 11 calls on batches 0, 1, 2, 0, ...;
    # the last call's output sums the state before its own add
    assert float(out) == 8 * sum(float(batches[i % 3][0]) for i in range(10))


def _events(*spans):
    return [{"name": n, "ts": ts, "dur": dur, "args": {}} for n, ts, dur in spans]


def test_profile_tables_count_busy_time_idle_gaps_and_small_ops():
    """scripts/profile_step.py's summary, which docs/BENCHMARKS.md quotes: busy time is the union of the ops'
    intervals (an op inside another adds nothing), idle time is the traced window (first start to last end)
    less that, and each gap is named by the ops on its two sides. Event times are microseconds; the summary
    prints ms per step."""
    import profile_step

    # a and b back to back, 10 ms idle, then c with the 2-us op d inside it (another stream): d starts last but
    # c ends last, so the window is 30 ms
    text = profile_step.tables(
        _events(("a", 0.0, 10e3), ("b", 10e3, 5e3), ("c", 25e3, 5e3), ("d", 27e3, 2.0)), {}, "", 1, 5
    )
    assert "busy 20.00 ms" in text and "device time per step: 20.00 ms" in text
    assert "device ops per step: 4, of which 1 under 5 us" in text
    assert "traced window 30.00 ms / step: device idle 10.00 ms / step in 1 gaps" in text
    assert "| 10000.0 | b | c |" in text
    # negative control: c right after b leaves no gap
    closed = profile_step.tables(
        _events(("a", 0.0, 10e3), ("b", 10e3, 5e3), ("c", 15e3, 5e3), ("d", 17e3, 2.0)), {}, "", 1, 5
    )
    assert "traced window 20.00 ms / step: device idle 0.00 ms / step in 0 gaps" in closed
    assert "| b | c |" not in closed


def test_shape_matrix_rows_show_what_ran():
    """A cell's row from its workers' records: the ratio and the cold-start verdict when all ran; when the
    baseline fails, the strict-kernels figures and verdict still show, with the error after the row. Control:
    two strict-kernels processes with different digests give DIFFER."""
    import shape_matrix

    def rec(ms, digest):
        return {"pipelined_ms": ms, "digests": {"params": digest}, "peak_mem_bytes": 3 * 2**30}

    flops = 0.5 * 989e12 * 0.1  # 50 % MFU at a 100 ms step
    row, errs = shape_matrix.cell_row(
        "dense:1024:64:2048", 8, 130, flops, "plain", rec(100.0, "a"), [rec(104.0, "d"), rec(106.0, "d")], l1=True
    )
    assert not errs
    assert (
        row
        == "| dense:1024:64:2048 | 8 | 130 | plain | 100.0 | 50.0 % | 105.0 | 47.6 % | 1.050 x | 3.0 / 3.0 | equal |"
    )
    row, errs = shape_matrix.cell_row(
        "dense:1024:64:2048", 8, 130, flops, "plain", {"error": "OOM"}, [rec(104.0, "d"), rec(106.0, "d")], l1=True
    )
    assert errs == ["plain: OOM"]
    assert row.startswith("| dense:1024:64:2048 | 8 | 130 | plain | - | - | 105.0 | 47.6 % | - | - / 3.0 | equal |")
    assert row.endswith(" failed: plain: OOM")
    row, _ = shape_matrix.cell_row(
        "dense:1024:64:2048", 8, 130, flops, "plain", rec(100.0, "a"), [rec(104.0, "d"), rec(106.0, "e")], l1=True
    )
    assert row.endswith("| DIFFER |")


def test_shape_matrix_knows_a_worker_that_ran_out_of_memory():
    """--overlap runs a strict-kernels worker again alone when it failed to allocate beside its twin (the error
    lines of XLA's allocator and of CUDA's); another failure or a result is not retried."""
    import shape_matrix

    oom = shape_matrix.out_of_memory
    assert oom({"error": "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate"})
    assert oom({"error": "CUDA_ERROR_OUT_OF_MEMORY: out of memory"})
    assert not oom({"error": "ValueError: model.d_model must be a multiple of 128"})
    assert not oom({"pipelined_ms": 100.0})


def test_shape_matrix_set_makes_the_strict_mode_and_refuses_a_typo(monkeypatch):
    """--set MODULE.NAME=VALUE becomes a set= item of the strict-kernels workers' det_tax mode; a name the module
    lacks, or an item without a value, is refused before any worker starts."""
    import shape_matrix

    from detjax.pallas_kernels.flash_attention import mosaic

    monkeypatch.setattr(mosaic, "PERSISTENT", dict(mosaic.PERSISTENT))  # the parent applies the item too
    assert shape_matrix.strict_mode([]) == "strict-kernels"
    item = "detjax.pallas_kernels.flash_attention.mosaic.PERSISTENT[fwd]=True"
    assert shape_matrix.strict_mode([item]) == f"strict-kernels+set={item}"
    assert mosaic.PERSISTENT["fwd"] is True
    with pytest.raises(ValueError, match="has no entry 'fdw'"):
        shape_matrix.strict_mode(["detjax.pallas_kernels.flash_attention.mosaic.PERSISTENT[fdw]=True"])
    with pytest.raises(ValueError, match="write set=MODULE.NAME=VALUE"):
        shape_matrix.strict_mode(["detjax.pallas_kernels.flash_attention.mosaic.PERSISTENT"])


def test_shape_matrix_budget_estimates_a_cell_from_the_finished_ones():
    """--budget-s starts a cell only if its estimate fits: the fastest finished cell of its kind with at least its
    FLOPs; else the longest of its kind scaled by the FLOPs' ratio; with none of its kind, the longest of any
    kind, scaled up only; 0 before any cell finished. A small cell after a big one is not judged by the big
    one's time."""
    import shape_matrix

    est = shape_matrix.cell_estimate_s
    done = [("dense", 8e14, 140.0), ("dense", 2e14, 80.0), ("dense", 4e14, 100.0)]
    assert est("dense", 1e14, []) == 0.0
    assert est("dense", 1e14, done) == 80.0
    assert est("dense", 3e14, done) == 100.0
    assert est("dense", 16e14, done) == 280.0
    assert est("hybrid", 4e14, done) == 140.0  # no hybrid finished: the longest dense one, not scaled down
    assert est("hybrid", 16e14, done) == 280.0
    assert est("hybrid", 4e14, [*done, ("hybrid", 4e14, 120.0)]) == 120.0


def test_det_tax_workers_import_their_own_trees_detjax(tmp_path, python):
    """A det_tax worker times the detjax of the tree its script is in: a `src=DIR` mode runs DIR's det_tax
    with DIR first on its PYTHONPATH, even where the caller's PYTHONPATH names another tree first (as a
    device runner's does), and the mode's other items reach the worker without the src item. Control: the
    caller's environment alone imports the caller's detjax."""
    import subprocess

    import det_tax

    repo = Path(__file__).resolve().parents[1]
    other = tmp_path / "other"
    (other / "scripts").mkdir(parents=True)
    (other / "scripts" / "det_tax.py").write_text("")
    (other / "detjax").mkdir()
    (other / "detjax" / "__init__.py").write_text("")
    caller = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(repo), "XLA_FLAGS": "--x"}

    cmd, env = det_tax.worker_command(f"strict-kernels+src={other}+model.d_model=64", "c.yaml", 5, 2, ["a=1"], caller)
    assert cmd[1] == str(other / "scripts" / "det_tax.py")
    assert cmd[cmd.index("--worker") + 1] == "strict-kernels+model.d_model=64" and cmd[-1] == "a=1"
    assert "XLA_FLAGS" not in env

    def imported(env):
        probe = [python, "-c", "import detjax, pathlib; print(pathlib.Path(detjax.__file__).parent.parent)"]
        return Path(subprocess.run(probe, env=env, capture_output=True, text=True, cwd=tmp_path).stdout.strip())

    assert imported(env) == other.resolve()
    assert imported(caller) == repo  # control: without the worker's PYTHONPATH, the caller's tree
    cmd, env = det_tax.worker_command("strict-kernels+xla=--y", "c.yaml", 5, 2, [], caller)
    assert cmd[1] == str(repo / "scripts" / "det_tax.py") and env["XLA_FLAGS"] == "--y"
    with pytest.raises(FileNotFoundError, match="src=DIR names a detjax tree"):
        det_tax.worker_command(f"strict-kernels+src={tmp_path / 'none'}", "c.yaml", 5, 2, [], caller)


def test_det_tax_set_items_set_a_module_constant_in_the_worker_only(monkeypatch):
    """`+set=MODULE.NAME=VALUE` parses to a literal and sets that constant (the worker calls
    apply_module_settings before it builds the step); it is not a config override; a name the module lacks and
    a malformed item are errors (a typo must not time the default twice)."""
    import det_tax

    from detjax.model import ce

    mode = "strict-kernels+set=detjax.model.ce.KERNEL_FWD=True+train.steps=3"
    assert det_tax.split_mode(mode)[1] == ["train.steps=3"]
    assert det_tax.module_settings(mode) == [("detjax.model.ce", "KERNEL_FWD", True)]
    monkeypatch.setattr(ce, "KERNEL_FWD", False)
    det_tax.apply_module_settings(mode)
    assert ce.KERNEL_FWD is True
    det_tax.apply_module_settings("strict-kernels")  # no set items: nothing changes
    assert ce.KERNEL_FWD is True
    with pytest.raises(ValueError, match="has no KERNEL_FW"):
        det_tax.apply_module_settings("strict-kernels+set=detjax.model.ce.KERNEL_FW=True")
    with pytest.raises(ValueError, match="write set=MODULE.NAME=VALUE"):
        det_tax.module_settings("strict-kernels+set=KERNEL_FWD")


def test_det_tax_set_items_set_one_entry_of_a_module_dict(monkeypatch):
    """`+set=MODULE.DICT[KEY]=VALUE` sets one entry (a pinned tile) and leaves the others; a key the dict lacks
    is an error, as is an entry of something that is not a dict."""
    import det_tax

    from detjax.pallas_kernels.gmm import kernel as gk

    monkeypatch.setattr(gk, "TILES", dict(gk.TILES))
    before = dict(gk.TILES)
    det_tax.apply_module_settings("strict-kernels+set=detjax.pallas_kernels.gmm.kernel.TILES[tgmm_num_warps]=8")
    assert gk.TILES == {**before, "tgmm_num_warps": 8} and before["tgmm_num_warps"] != 8
    with pytest.raises(ValueError, match="has no entry 'tgmm_warps'"):
        det_tax.apply_module_settings("strict-kernels+set=detjax.pallas_kernels.gmm.kernel.TILES[tgmm_warps]=8")
    with pytest.raises(ValueError, match="has no entry"):
        det_tax.apply_module_settings("strict-kernels+set=detjax.pallas_kernels.gmm.kernel.tgmm[x]=1")


def test_shape_matrix_parent_runs_jax_on_the_cpu_and_workers_get_the_callers_platforms():
    """The parent's parameter count must not start a GPU backend (it would preallocate the memory its workers
    need); the workers get the caller's JAX_PLATFORMS back. The subprocess asks for cuda: without
    parent_on_cpu, jax would start cuda there (or fail on a machine without one) instead of printing cpu."""
    import os
    import subprocess

    import shape_matrix

    caller = {"XLA_FLAGS": "--x", "JAX_COMPILATION_CACHE_DIR": "/c", "JAX_PLATFORMS": "cpu", "A": "1"}
    assert shape_matrix.worker_env(caller, "cuda") == {"A": "1", "JAX_PLATFORMS": "cuda"}
    assert shape_matrix.worker_env(caller, None) == {"A": "1"}
    code = "import shape_matrix, jax; c = shape_matrix.parent_on_cpu(); print(c, jax.devices()[0].platform)"
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    env = {**os.environ, "JAX_PLATFORMS": "cuda", "PYTHONPATH": scripts}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["cuda", "cpu"], out.stderr[-2000:]


GATED_CHILD = """
import json, sys, time
import det_tax
compile_s, code = float(sys.argv[1]), int(sys.argv[2])
time.sleep(compile_s)  # the compilation
ready = time.time()
if code:
    sys.exit(code)  # a worker that fails before its gate
waited = det_tax.bench_gate(poll_s=0.01)
start = time.time()
time.sleep(0.3)  # the timed steps
print(json.dumps(dict(waited=waited, ready=ready, start=start, end=time.time())))
"""


def test_overlap_compiles_side_by_side_and_steps_one_at_a_time():
    """det_tax.run_gated (det_tax and shape_matrix --overlap): each worker's steps start only after every worker
    has compiled (is at its gate) and after the worker before it has exited, so no steps share the machine with
    another worker's compilation or steps; a worker that dies before its gate holds nobody up. The control starts
    the same children without a gate: the fast one's steps then run during the slow one's compilation. det_tax
    gates only its strategy=kernels modes of this tree (autotuned modes compile alone)."""
    import json
    import subprocess

    import det_tax

    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    env = {**os.environ, "PYTHONPATH": scripts}
    cmds = [[sys.executable, "-c", GATED_CHILD, c, x] for c, x in (("0.0", "0"), ("1.0", "0"), ("0.2", "3"))]
    outs = det_tax.run_gated([(cmd, env) for cmd in cmds], poll_s=0.01)
    assert [o.returncode for o in outs] == [0, 0, 3], [o.stderr[-500:] for o in outs]
    runs = [json.loads(o.stdout) for o in outs[:2]]
    assert all(r["waited"] for r in runs)
    assert min(r["start"] for r in runs) >= max(r["ready"] for r in runs)  # steps after every compilation
    assert runs[1]["start"] >= runs[0]["end"]  # one at a time, in order

    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for cmd in cmds[:2]]
    free = [json.loads(p.communicate()[0]) for p in procs]
    assert not any(r["waited"] for r in free)
    assert free[0]["start"] < free[1]["ready"]  # the control: steps during the other's compilation

    # det_tax --overlap gates the strategy=kernels modes of this tree only: the autotuned ones compile alone
    modes = ["fastest", "strict-kernels", "canonical+determinism.canonical_leaf=1", "strict-kernels+src=old", "off"]
    assert det_tax.gated_modes(modes) == ["strict-kernels", "canonical+determinism.canonical_leaf=1"]


def _two_stages(x, z):
    a = jnp.sin(x) * jax.nn.silu(z)  # line A
    return jnp.cos(a).sum(axis=-1)  # line B


def test_profile_source_lines_name_the_lines_a_fusion_holds():
    """profile_step.hlo_source_lines (--source-lines): each op of the compiled HLO names the source lines of
    the JAX ops inside it. The function's two lines are found in its fused ops; the control: a line of this
    file that computes nothing there (the def line) is in no op's list."""
    import inspect

    import profile_step

    text = jax.jit(_two_stages).lower(jnp.ones((64, 128)), jnp.ones((64, 128))).compile().as_text()
    found = profile_step.hlo_source_lines(text, under="tests")
    first = inspect.getsourcelines(_two_stages)[1]
    here = Path(__file__).name
    listed = {w for pairs in found.values() for w, _ in pairs}
    assert {f"{here}:{first + 1}", f"{here}:{first + 2}"} <= listed, found
    assert f"{here}:{first}" not in listed
    assert all(k >= 1 for pairs in found.values() for _, k in pairs)
    old_form = '%m = f32[2]{0} multiply(%a, %b), metadata={source_file="/r/detjax/model/m.py" source_line=7}'
    assert profile_step.hlo_source_lines("ENTRY %main (a: f32[2]) -> f32[2] {\n" + old_form + "\n}")["m"] == [
        ("model/m.py:7", 1)
    ]


def test_op_breakdown_counts_each_op_once_a_call():
    """profile_step.op_breakdown (gemm_bench --grouped --breakdown): a jitted function's ops, the largest
    first, each once a call whatever the number of traced calls; a second product adds its own op."""
    import profile_step

    x = jnp.ones((256, 256))
    one = jax.jit(lambda x: jnp.tanh(x @ x) + 1)
    two = jax.jit(lambda x: jnp.tanh(x @ x) @ x + 1)
    rows = profile_step.op_breakdown(lambda: jax.block_until_ready(one(x)), 3)
    assert rows and all(calls == 1 for _, _, calls in rows)
    assert [ms for _, ms, _ in rows] == sorted((ms for _, ms, _ in rows), reverse=True) and rows[0][1] > 0
    more = profile_step.op_breakdown(lambda: jax.block_until_ready(two(x)), 2)
    assert sum(calls for _, _, calls in more) > sum(calls for _, _, calls in rows)


def test_gemm_bench_takes_a_dense_configs_projections():
    """gemm_bench --config: the products of a dense config at one microbatch's rows (the fused q+k+v and
    gate+up padded to the fused column multiple, as the model fuses them), counted per block; hybrid
    patterns are refused."""
    import gemm_bench

    root = Path(__file__).resolve().parents[1]
    over = ["model.d_model=4096", "model.head_dim=128", "model.n_heads=32", "model.n_kv_heads=16"]
    over += ["model.ffn_dim=16384", "train.seq_len=4096", "train.micro_batch=2", "train.global_batch=8"]
    m, rows = gemm_bench.config_shapes(str(root / "configs/gpu_dense.yaml"), [*over, "model.pattern=*-*-*-*-"])
    assert m == 8192
    assert [r[:3] + r[4:] for r in rows] == [
        ("attn q+k+v", 4096, 8192, 4),
        ("attn o", 4096, 4096, 4),
        ("mlp gate+up", 4096, 32768, 4),
        ("mlp down", 16384, 4096, 4),
        ("lm head", 4096, 32768, 1),
    ]
    _, odd = gemm_bench.config_shapes(str(root / "configs/gpu_dense.yaml"), ["model.n_kv_heads=1"])
    assert odd[0][2] == 1280  # q 1024 + k 64 + v 64 = 1152 columns, padded to a multiple of 256
    with pytest.raises(SystemExit, match="dense patterns only"):
        gemm_bench.config_shapes(str(root / "configs/gpu_medium.yaml"), [])


def test_attention_bench_yardstick_by_kv_head_groups_is_the_whole_call():
    """attention_bench's float32 yardstick runs over groups of kv heads (each with its query heads) where the
    whole call's scores would not fit; the groups are independent, so the result is the whole call's. Control:
    a budget that takes every head at once makes one call, and a small one several."""
    import attention_bench

    from detjax.pallas_kernels.flash_attention.reference import attention_reference

    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (1, 32, 8, 16))
    k, v = jax.random.normal(ks[1], (1, 32, 4, 16)), jax.random.normal(ks[2], (1, 32, 4, 16))
    g = jax.random.normal(ks[3], q.shape)
    calls = []

    def ref(q, k, v, g):
        calls.append(k.shape[2])
        o, pull = jax.vjp(attention_reference, q, k, v)
        return o, pull(g)

    whole = ref(q, k, v, g)
    per_kv = 2 * 32 * 32 * 4  # bytes of one kv head's float32 scores (2 query heads each)
    calls.clear()
    grouped = attention_bench.by_kv_heads(ref, q, k, v, g, budget_bytes=2 * per_kv)
    assert calls == [2, 2]
    for a, b in zip(jax.tree.leaves(grouped), jax.tree.leaves(whole), strict=True):
        assert a.shape == b.shape
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(b)))
    calls.clear()
    attention_bench.by_kv_heads(ref, q, k, v, g, budget_bytes=4 * per_kv)
    assert calls == [4]


def test_triton_regs_lowers_the_triton_kernels_for_hopper_on_the_cpu(monkeypatch):
    """triton_regs lowers detjax's Pallas Triton kernels for CUDA on a machine without a GPU, each with its
    pinned num_warps (the SSD backward's its own), and restores jax's lowering and the kernels' interpreted
    path afterwards. Control: a different pinned bwd_num_warps shows in the lowered backward alone. (The
    registers and spills need the `triton` package, which the suite does not install.)"""
    import triton_regs

    from detjax.pallas_kernels.ssd import kernel as sk
    from detjax.pallas_kernels.ssd import ops as ssd_ops

    f32 = jnp.float32
    x, da, bc = (jax.ShapeDtypeStruct(s, f32) for s in ((1, 128, 2, 16), (1, 128, 2), (1, 128, 16)))

    def fwd_bwd(chunk):
        def run(x, da, b, c, dy):
            y, pull = jax.vjp(lambda *t: ssd_ops.ssd(*t, chunk), x, da, b, c)
            return y, pull(dy)

        return run

    kernels = triton_regs.lowered(fwd_bwd(32), (x, da, bc, bc, x))
    names = ["ssd_chunk_state", "ssd_state_pass", "ssd_fwd", "ssd_chunk_dstate", "ssd_dstate_pass", "ssd_bwd"]
    names += ["ssd_sum_heads"] if ssd_ops.KERNEL_SUM_HEADS else []
    assert [k[0] for k in kernels] == names
    assert all("tt.func" in k[3] for k in kernels)
    warps = [sk.TILES["num_warps"]] * 5 + [sk.TILES["bwd_num_warps"]] + [sk.TILES["num_warps"]] * (len(names) - 6)
    assert [k[1] for k in kernels] == warps
    assert ssd_ops.interpret_mode() is True  # restored: this CPU interprets the kernels again

    monkeypatch.setitem(sk.TILES, "bwd_num_warps", 2 * sk.TILES["bwd_num_warps"])
    again = triton_regs.lowered(fwd_bwd(16), (x, da, bc, bc, x))  # another chunk: a new trace
    assert [k[1] for k in again] == warps[:5] + [sk.TILES["bwd_num_warps"]] + warps[6:]
    assert again[5][1] != kernels[5][1]


def test_profile_step_set_refuses_a_name_the_module_lacks_in_one_line():
    """profile_step.py --set MODULE.NAME=VALUE sets a module constant as det_tax's set= items do; a typo stops
    it before anything is built, with one line naming the constant and no traceback (exit 2)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "scripts" / "profile_step.py"), "--config", str(root / "configs" / "tiny.yaml")]
    cmd += ["--set", "detjax.pallas_kernels.ssd.ops.KERNEL_SUM_HEDS=True"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("profile_step: --set: ")
    assert "KERNEL_SUM_HEDS" in out.stderr and "Traceback" not in out.stderr
