"""One Orbax CheckpointManager step = the whole run state.

Items per step:
  state  TrainState as a pytree (step, fp32 masters, optimizer state, RNG key *data* — typed keys are
         stored as their uint32 data plus the impl name so that restore into an abstract target works —
         and every extra collection: low-precision copies, scales, amax histories)
  data   Grain iterator state
  meta   step, resolved config, its hash, determinism policy record, per-leaf dtype/shape/digest, and the
         fingerprint history up to this step

Orbax writes each step into a temporary directory and renames it when complete, so a process killed
mid-save leaves nothing that `latest_step` treats as complete. On restore the saved leaf dtypes/shapes and
the config are checked against the target *before* reading arrays, and every restored leaf's digest is
checked against the one written at save time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from detjax import fingerprint as fp
from detjax.config import RESUME_MUTABLE_SECTIONS, Config, ConfigError, config_from_dict, with_flash_backend


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not match the run it is restored into."""


def _to_saveable(state: Any) -> dict[str, Any]:
    return {
        "step": state.step,
        "params": state.params,
        "opt_state": state.opt_state,
        "rng": jax.random.key_data(state.rng),
        "collections": state.collections,
    }


def _leaf_table(tree: Any) -> dict[str, dict[str, Any]]:
    return {
        jax.tree_util.keystr(p): {"dtype": str(x.dtype), "shape": list(x.shape)}
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


@functools.partial(jax.jit, static_argnames=("version",))
def _leaf_digests(tree: Any, version: int) -> list[jax.Array]:
    return [fp.tensor_digest(x, version) for x in jax.tree.leaves(tree)]


def leaf_digests(tree: Any, version: int = fp.DIGEST_VERSION) -> dict[str, str]:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    digests = jax.device_get(_leaf_digests(tree, version))
    return dict(zip(paths, (fp.digest_hex(d) for d in digests), strict=True))


def config_differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(saved) | set(current)):
        a, b = saved.get(k), current.get(k)
        key = f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, key + ".")
        elif a != b:
            out.append(f"{key}: saved {a!r}, now {b!r}")
    return out


def _state_handler() -> ocp.PyTreeCheckpointHandler:
    """The handler for the `state` item: Orbax's standard handlers, except that every jax.Array shard is
    written whole by its first replica. Orbax's default on CPU ("replica parallel") splits each replicated
    shard among its replicas with eager `lax.slice` calls, one small XLA compile per array shape and
    sharding; on GPU Orbax already writes by first replica. The other types keep Orbax's own handlers.
    The bytes written are the same either way."""
    th = ocp.type_handlers
    defaults = [(t, th.get_type_handler(t)) for t in (int, float, bytes, np.number, np.ndarray, str)]
    registry = th.create_type_handler_registry(*defaults, (jax.Array, th.ArrayHandler(use_replica_parallel=False)))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


# Test hook: SIGKILL this process right after the async save of this step has started (tests/test_ckpt.py).
KILL_DURING_SAVE_ENV = "DETJAX_DEBUG_KILL_DURING_SAVE"


class StopSignals:
    """SIGTERM/SIGINT set a flag; the loop then saves a checkpoint (if enabled) and stops after the current
    step. Installed only in the main thread (signal handlers cannot be set elsewhere).

    With several processes, SIGTERM is left to JAX's preemption service (jax.distributed starts it): a SIGTERM
    that reaches any one process is propagated to all, and `stop_at(step)` turns True on every process at the
    same step (multihost_utils.reached_preemption_sync_point), so all of them save that step and stop."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, Any] = {}
        self._multi = jax.process_count() > 1

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT,) if self._multi else (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def stop_at(self, step: int) -> bool:
        """Whether to save and stop after `step` steps (called once per step, in step order)."""
        if self._multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step) and self.received is None:
                self.received = signal.SIGTERM
        return self.received is not None

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


class Checkpointer:
    def __init__(self, directory: str | Path, cfg: Config) -> None:
        self.directory = Path(directory).absolute()
        self.cfg = with_flash_backend(cfg)  # an auto flash backend as a Trainer resolves it on this device
        c = cfg.ckpt
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=c.keep,
                save_interval_steps=1,  # detjax decides when to save; see Checkpointer.due
                enable_async_checkpointing=c.async_save,
                create=True,
            ),
            item_names=("state", "data", "meta"),
            item_handlers={
                "state": _state_handler(),
                "data": ocp.JsonCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    # ------------------------------------------------------------------------------------------- save

    def due(self, step: int, signalled: bool = False) -> bool:
        """Whether the state after `step` steps is saved now: every ckpt.every steps, and on a stop signal."""
        return signalled or (self.cfg.ckpt.every > 0 and step % self.cfg.ckpt.every == 0)

    def save(
        self, state: Any, data_state: dict[str, Any], history: list[dict[str, Any]], policy: dict[str, Any]
    ) -> int:
        """Start an (async) save of `state` at step = state.step; returns that step."""
        step = int(jax.device_get(state.step))
        if int(data_state["next_step"]) != step:
            raise CheckpointError(
                f"refusing to save: data iterator is at step {data_state['next_step']} but the state is at step "
                f"{step}; they must agree or the resumed run would read other batches"
            )
        tree = _to_saveable(state)
        meta = {
            "step": step,
            "config": self.cfg.to_dict(),
            "config_hash": self.cfg.hash(),
            "policy": policy,
            "rng_impl": str(jax.random.key_impl(state.rng)),
            "leaves": _leaf_table(tree),
            "digests": leaf_digests(tree),
            "digest_version": fp.DIGEST_VERSION,
            "fingerprints": [r for r in history if r["step"] < step],
            "data_sha256": json_sha256(data_state),
        }
        meta["meta_sha256"] = json_sha256(meta)  # over every other meta field: config, history, rng_impl ...
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(tree),
                data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        if step == int(os.environ.get(KILL_DURING_SAVE_ENV, "-1")):
            os.kill(os.getpid(), signal.SIGKILL)
        return step

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    # ---------------------------------------------------------------------------------------- restore

    def latest_step(self) -> int | None:
        self.manager.reload()
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """The complete checkpoints' steps, ascending."""
        self.manager.reload()
        return sorted(int(s) for s in self.manager.all_steps())

    def read_meta(self, step: int) -> dict[str, Any]:
        """The meta item of checkpoint `step`, checked against its checksum and stored config hash."""
        meta = self._read_meta(step)
        self.check_meta_integrity(step, meta)
        return meta

    def sync(self, name: str) -> None:
        """Wait for every process (a no-op with one), e.g. after the primary moved checkpoints."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(name)
        self.manager.reload()

    def _read_meta(self, step: int) -> dict[str, Any]:
        path = self.directory / str(step) / "meta"
        try:
            return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax raises several types for unreadable JSON
            raise CheckpointError(
                f"checkpoint step {step}: item 'meta' at {path} is unreadable ({short_cause(e)})"
            ) from None

    def check_meta_integrity(self, step: int, meta: dict[str, Any]) -> None:
        """The meta item against its own checksum, and the stored config against its stored hash."""
        if "meta_sha256" not in meta:
            print(
                f"warning: checkpoint step {step} predates metadata checksums; its config, fingerprint history and "
                "data state are not integrity-checked",
                file=sys.stderr,
            )
        elif json_sha256({k: v for k, v in meta.items() if k != "meta_sha256"}) != meta["meta_sha256"]:
            raise CheckpointError(
                f"checkpoint step {step}: item 'meta' (config, fingerprint history, PRNG implementation, leaf "
                "table) does not match the checksum written at save. The checkpoint is corrupt or was edited. "
                "Fix: resume from an earlier step or restart"
            )
        try:
            stored = config_from_dict(meta["config"]).hash()
        except ConfigError as e:
            raise CheckpointError(f"checkpoint step {step}: the stored config does not load ({e})") from None
        if stored != meta.get("config_hash"):
            raise CheckpointError(
                f"checkpoint step {step}: the stored config hashes to {stored}, not to the stored config_hash "
                f"{meta.get('config_hash')}. The checkpoint was edited. Fix: resume from an earlier step or restart"
            )

    def check_compatible(self, meta: dict[str, Any], abstract_saveable: dict[str, Any]) -> None:
        """Config hash, then every leaf's dtype and shape, before any array is read."""
        if meta.get("config_hash") != self.cfg.hash():
            saved = config_from_dict(meta["config"]).trajectory_dict()
            diffs = config_differences(saved, self.cfg.trajectory_dict())
            raise CheckpointError(
                "checkpoint was written by a run with another trajectory config:\n  "
                + "\n  ".join(diffs or ["(config hash differs)"])
                + f"\nOnly these sections (and train.steps) may change on resume: {list(RESUME_MUTABLE_SECTIONS)}. "
                "Fix: resume with "
                "the saved values (see config.yaml in the run directory) or start a new run"
            )
        want = _leaf_table(abstract_saveable)
        saved = meta["leaves"]
        for k in sorted(set(want) | set(saved)):
            if k not in saved or k not in want:
                where = "checkpoint" if k not in saved else "target state"
                raise CheckpointError(f"leaf state{k} is missing from the {where}. Fix: resume with the same model")
            if saved[k] != want[k]:
                raise CheckpointError(
                    f"leaf state{k}: checkpoint has dtype {saved[k]['dtype']} shape {saved[k]['shape']}, target has "
                    f"dtype {want[k]['dtype']} shape {want[k]['shape']}; refusing to cast or reshape. Fix: resume "
                    "with the config that wrote the checkpoint"
                )

    def restore(self, abstract_state: Any, shardings: Any, step: int | None = None):
        """Restore (state, data_state, meta) into the given target shardings, fully checked."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}. Fix: check ckpt.dir / --run-dir")
        meta = self.read_meta(step)
        abstract = jax.eval_shape(_to_saveable, abstract_state)
        self.check_compatible(meta, abstract)
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract,
            _to_saveable_shardings(shardings),
        )
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        try:
            got = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(target, restore_args=restore_args),
                    data=ocp.args.JsonRestore(),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory}: reading the items failed ({short_cause(e)}). "
                "The checkpoint is corrupt or incomplete. Fix: resume from an earlier step (ckpt keeps "
                f"{self.cfg.ckpt.keep}) or restart"
            ) from None
        tree, data_state = got["state"], got["data"]
        if "data_sha256" in meta and json_sha256(data_state) != meta["data_sha256"]:
            raise CheckpointError(
                f"checkpoint step {step}: item 'data' (the data iterator state) does not match the checksum written "
                "at save; resuming would read other batches. The checkpoint is corrupt or was edited. Fix: resume "
                "from an earlier step or restart"
            )
        version = meta.get("digest_version", 1)  # checkpoints written before version 2 have no field
        if version not in fp.DIGEST_VERSIONS:
            raise CheckpointError(
                f"checkpoint step {step}: its leaf digests are version {version}, which this detjax does not know "
                f"(it knows {fp.DIGEST_VERSIONS}). Fix: resume with the detjax version that wrote it"
            )
        digests = leaf_digests(tree, version)
        bad = [k for k in meta["digests"] if digests.get(k) != meta["digests"][k]]
        if bad:
            k = bad[0]
            raise CheckpointError(
                f"checkpoint step {step}: item 'state' leaf {k} has digest {digests.get(k)} after restore but "
                f"{meta['digests'][k]} was written at save ({len(bad)} leaf/leaves differ). The checkpoint is "
                "corrupt. Fix: resume from an earlier step or restart"
            )
        if int(data_state.get("next_step", -1)) != step or int(jax.device_get(tree["step"])) != step:
            raise CheckpointError(
                f"checkpoint step {step}: data iterator state says next step {data_state.get('next_step')}, train "
                f"state says step {int(jax.device_get(tree['step']))}; they must agree. The checkpoint is inconsistent"
            )
        impl = meta.get("rng_impl")
        try:
            rng = jax.random.wrap_key_data(tree["rng"], impl=_impl_name(impl))
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointError(
                f"checkpoint step {step}: saved PRNG implementation {impl!r} cannot wrap the saved key data "
                f"({short_cause(e)}). Fix: resume with the jax version and config that wrote it"
            ) from None
        state = abstract_state.replace(
            step=tree["step"],
            params=tree["params"],
            opt_state=tree["opt_state"],
            rng=rng,
            collections=tree["collections"],
        )
        return state, data_state, meta


def json_sha256(obj: Any) -> str:
    """sha256 of an object's canonical JSON (sorted keys): the checksum of the JSON checkpoint items."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def short_cause(e: BaseException, limit: int = 300) -> str:
    """The innermost cause of an exception chain, as its type and first line (Orbax/TensorStore errors run
    to kilobytes with the cause buried in a spec)."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    text = lines[0] if lines else ""
    for marker in ("CRC", "crc32", "truncated", "Truncated", "No such file", "Not found", "NOT_FOUND", "corrupt"):
        hit = next((x for x in lines if marker in x), None)
        if hit is not None:
            text = hit
            break
    return f"{type(e).__name__}: {text[:limit]}"


def _impl_name(impl: str | None) -> str:
    # str(key_impl) looks like "PRNGImpl(threefry2x32)" or "threefry2x32" depending on the jax version
    if impl is None:
        return "threefry2x32"
    return impl[impl.find("(") + 1 : impl.rfind(")")] if "(" in impl else impl


def _to_saveable_shardings(state_sharding: Any) -> dict[str, Any]:
    return {
        "step": state_sharding.step,
        "params": state_sharding.params,
        "opt_state": state_sharding.opt_state,
        "rng": state_sharding.rng,
        "collections": state_sharding.collections,
    }


def host_bytes(tree: Any) -> dict[str, bytes]:
    """Exact bytes of every leaf (typed keys as key data): for byte-level equality in tests and tools."""
    out = {}
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        a = np.asarray(jax.device_get(x))
        out[jax.tree_util.keystr(p)] = a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()
    return out
