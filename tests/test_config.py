"""Every config error names the key, the value and the fix."""

import pytest

from detjax.config import Config, ConfigError, load_config


def test_tiny_loads_and_is_frozen(tiny_path):
    cfg = load_config(tiny_path)
    assert cfg.model.pattern == "M*E-" and cfg.train.n_micro == 2 and cfg.determinism.mode == "strict"
    with pytest.raises(AttributeError):
        cfg.train.steps = 3  # type: ignore[misc]
    assert load_config(tiny_path, ["train.steps=7"]).train.steps == 7
    assert cfg.hash() == load_config(tiny_path, ["run.name=x"]).hash()
    assert cfg.hash() != load_config(tiny_path, ["train.seed=3"]).hash()


@pytest.mark.parametrize(
    "override,pattern",
    [
        ("model.d_modle=64", r"unknown config key 'model.d_modle'.*did you mean 'model.d_model'"),
        ("trian.steps=3", r"unknown config key 'trian'.*did you mean 'train'"),
        ("train.steps=abc", r"'train.steps' = 'abc': must be an int"),
        ("train.lr=fast", r"'train.lr' = 'fast': must be a float"),
        (
            "model.pattern=M*X",
            r"'model.pattern' = 'M\*X': unknown block letter\(s\) \['X'\].*Fix: use only M",
        ),
        ("model.n_kv_heads=3", r"'model.n_kv_heads' = 3: must divide n_heads = 4"),
        ("model.moe.top_k=5", r"'model.moe.top_k' = 5: must be between 1 and n_experts = 4.*top_k <= 4"),
        ("train.micro_batch=5", r"'train.global_batch' = 16: is not divisible by train.micro_batch = 5"),
        ("model.mamba.chunk_size=24", r"'model.mamba.chunk_size' = 24: must divide train.seq_len = 64"),
        ("model.mamba.n_heads=5", r"'model.mamba.n_heads' = 5: must divide d_inner"),
        ("model.vocab_size=100", r"'model.vocab_size' = 100: the byte tokenizer needs"),
        ("determinism.mode=loose", r"'determinism.mode' = 'loose': is not one of \['off', 'strict'\]"),
        ("model.moe.router=argmax", r"is not one of \['softmax', 'sigmoid'\]"),
        ("model.head_dim=15", r"RoPE needs an even head_dim"),
        ("data.source=arrayrecord", r"'data.path' = '': data.source is 'arrayrecord' but no path"),
        ("model.dropout=1.5", r"'model.dropout' = 1.5: must be in \[0, 1\)"),
        ("train.steps", r"override 'train.steps' is not key=value"),
        # numbers that would train on NaN or backwards (issue: they used to be accepted)
        ("train.lr=.inf", r"'train.lr' = inf: must be a positive, finite number"),
        ("train.lr=.nan", r"'train.lr' = nan: must be a positive, finite number"),
        ("train.eps=0", r"'train.eps' = 0.0: must be a positive"),
        ("train.b1=2.0", r"'train.b1' = 2.0: must be in \[0, 1\)"),
        ("train.b2=1", r"'train.b2' = 1.0: must be in \[0, 1\)"),
        ("train.clip_norm=-1", r"'train.clip_norm' = -1.0: must be a positive, finite norm"),
        ("train.weight_decay=-0.1", r"'train.weight_decay' = -0.1: must be >= 0"),
        ("model.norm_eps=0", r"'model.norm_eps' = 0.0: must be in \(0, 1\)"),
        ("model.init_std=0", r"'model.init_std' = 0.0: must be a positive"),
        ("train.decay_steps=-1", r"'train.decay_steps' = -1: must be >= 0"),
        ("data.builtin_sentences=0", r"'data.builtin_sentences' = 0: must be >= 1"),
        ("data.builtin_sentences=-5", r"'data.builtin_sentences' = -5: must be >= 1"),
    ],
)
def test_config_errors(tiny_path, override, pattern):
    with pytest.raises(ConfigError, match=pattern) as e:
        load_config(tiny_path, [override])
    assert "Fix:" in str(e.value) or "not key=value" in str(e.value)


def test_off_parses_and_bad_files(tmp_path):
    assert load_config(None, ["determinism.mode=off"]).determinism.mode == "off"
    (tmp_path / "bad.yaml").write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match=r"not valid YAML: line 2, column 1: expected ',' or ']'") as e:
        load_config(tmp_path / "bad.yaml")
    assert "\n" not in str(e.value)  # one line
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "sec.yaml").write_text("model: 3\n")
    with pytest.raises(ConfigError, match="'model' = 3: must be a mapping"):
        load_config(tmp_path / "sec.yaml")
    assert isinstance(Config(), Config)
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError, match="is empty. Fix: "):
        load_config(tmp_path / "empty.yaml")
    with pytest.raises(ConfigError, match="is a directory. Fix: "):
        load_config(tmp_path)


def test_numbers_as_yaml_writes_them(tiny_path):
    """YAML 1.1 reads 1e6 (no dot) as a string; float keys take it as the number it is."""
    assert load_config(tiny_path, ["train.lr=1e-3"]).train.lr == 1e-3
    assert load_config(tiny_path, ["train.lr=1e6"]).train.lr == 1e6
    assert load_config(tiny_path, ["train.eps=1e-8"]).train.eps == 1e-8
    cfg = load_config(tiny_path, ["train.steps=4"])
    assert cfg.train.warnings() and "never reaches" in cfg.train.warnings()[0]  # warm-up 20 > 4 steps
    assert load_config(tiny_path).train.warnings() == []


def test_checkpoints_off_refuses_what_needs_them(tiny_path, tmp_path):
    for extra in ("ckpt.every=5", "ckpt.resume=true"):
        with pytest.raises(ConfigError, match=r"'ckpt.enabled' = False: checkpoints are off but .*Fix: set ckpt"):
            load_config(tiny_path, ["ckpt.enabled=false", extra])
    from detjax.train import train

    with pytest.raises(ConfigError, match=r"resume asks for a checkpoint but checkpoints are off"):
        train(load_config(tiny_path, ["ckpt.enabled=false"]), tmp_path / "run", resume=True)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_print_config_lists_every_key(tiny_path, capsys):
    import yaml

    from detjax.config import Config
    from detjax.train import main

    assert main(["--print-config", "--config", str(tiny_path), "train.steps=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["steps"] == 7 and printed["train"]["on_nonfinite"] == "stop"
    assert printed == load_config(tiny_path, ["train.steps=7"]).to_dict()  # every section, every key
    assert set(printed) == set(Config().to_dict())
    assert main(["--print-config", "train.bogus=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bogus" in err[0]
    assert main([]) == 2 and "--config FILE is required" in capsys.readouterr().err


def test_profile_steps_writes_a_profiler_trace(tiny_path, tmp_path):
    """run.profile_steps=1-2: a jax.profiler trace of step 1 in <run>/profile (an .xplane.pb that xprof and
    TensorBoard open); malformed ranges are config errors."""
    from detjax.train import train

    over = ["train.steps=3", "run.profile_steps=1-2", "ckpt.enabled=false", "run.progress=false"]
    train(load_config(tiny_path, [*over, "model.pattern='-'", "model.mtp.depth=0"]), tmp_path / "run")
    traces = list((tmp_path / "run" / "profile").rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0
    for bad in ("3-1", "x", "2-2"):
        with pytest.raises(ConfigError, match=r"'run.profile_steps' .*must be 'A-B' with 0 <= A < B\. Fix: "):
            load_config(tiny_path, [f"run.profile_steps={bad}"])


def test_auto_canonical_leaf_is_the_microbatch_within_the_mesh():
    """determinism.canonical_leaf=0 (the default) resolves to train.micro_batch (a power of two at most), at
    most global_batch / (data x fsdp x expert); the resolved config is the explicit one, hash included; a
    resume adopts the leaf its run started with; default numerics keep the hash of before the auto leaf."""
    from detjax.config import auto_canonical_leaf, with_canonical_leaf
    from detjax.step import Trainer
    from detjax.train import adopt_leaf

    canon = ["determinism.numerics=canonical", "run.tensorboard=false"]
    cfg = load_config("configs/gpu_medium.yaml", canon)  # global batch 16 in microbatches of 4
    assert cfg.determinism.canonical_leaf == 0
    assert [auto_canonical_leaf(cfg, s) for s in (1, 2, 4, 8, 16)] == [4, 4, 4, 2, 1]
    odd = ["train.micro_batch=3", "train.global_batch=48"]  # not a power of two: the leaf is 2
    assert auto_canonical_leaf(load_config("configs/gpu_medium.yaml", [*canon[1:], *odd]), 1) == 2
    explicit = load_config("configs/gpu_medium.yaml", canon + ["determinism.canonical_leaf=4"])
    assert with_canonical_leaf(cfg, {}) == explicit and with_canonical_leaf(explicit, {"data": 8}) == explicit
    assert with_canonical_leaf(cfg, {}).hash() == explicit.hash() != with_canonical_leaf(cfg, {"data": 8}).hash()
    assert Trainer(cfg).cfg.determinism.canonical_leaf == 4  # a Trainer resolves an auto leaf itself
    assert adopt_leaf(cfg, {"determinism": {"canonical_leaf": 2}}).determinism.canonical_leaf == 2
    assert adopt_leaf(explicit, {"determinism": {"canonical_leaf": 2}}) == explicit  # set: kept
    # the leaf is not part of default numerics: their hashes are those of the configs before the auto leaf
    # (with the flash backend resolved as a run resolves it: the Triton kernels here)
    assert Trainer(load_config("configs/tiny.yaml")).cfg.hash() == "1c32bb4cfe70a95e"
    assert Trainer(load_config("configs/gpu_medium.yaml")).cfg.hash() == "0c415bb0ae2ccb32"


def test_auto_flash_backend_is_mosaic_on_hopper_where_it_fits_and_a_resume_keeps_the_first():
    """model.flash_backend=auto (the default) resolves to the Mosaic kernels on a Hopper GPU under
    kernels=pallas where they take the shape (head_dim 64/128, bf16, seq_len a multiple of 128), else to
    Triton, whose hash is that of the configs before the key existed; the resolved config is the explicit
    one; a resume adopts the backend its run recorded (a run from before the key: Triton)."""
    from types import SimpleNamespace

    from detjax.config import auto_flash_backend, with_flash_backend
    from detjax.train import adopt_flash_backend

    pallas = ["model.kernels=pallas", "run.tensorboard=false"]
    cfg = load_config("configs/gpu_medium.yaml", pallas)  # head_dim 64, seq 2048, bf16
    assert cfg.model.flash_backend == "auto"
    assert auto_flash_backend(cfg, "gpu", "9.0") == "mosaic"
    assert [auto_flash_backend(cfg, p, cc) for p, cc in (("gpu", "8.0"), ("gpu", "10.0"), ("cpu", ""))] == [
        "triton"
    ] * 3
    for bad in ("model.head_dim=32", "train.seq_len=1984", "model.compute_dtype=float32", "model.kernels=reference"):
        assert auto_flash_backend(load_config("configs/gpu_medium.yaml", [*pallas, bad]), "gpu", "9.0") == "triton", bad
    hopper = SimpleNamespace(platform="gpu", compute_capability="9.0")
    explicit = load_config("configs/gpu_medium.yaml", [*pallas, "model.flash_backend=mosaic"])
    assert with_flash_backend(cfg, hopper) == explicit and with_flash_backend(explicit, None) == explicit
    triton = load_config("configs/gpu_medium.yaml", [*pallas, "model.flash_backend=triton"])
    assert with_flash_backend(cfg, SimpleNamespace(platform="cpu")) == triton
    assert triton.hash() != explicit.hash() != cfg.hash() != triton.hash()
    assert adopt_flash_backend(cfg, {"model": {"flash_backend": "triton"}}) == triton
    assert adopt_flash_backend(cfg, {"model": {}}) == triton  # recorded before the key existed
    assert adopt_flash_backend(cfg, {"model": {"flash_backend": "mosaic"}}) == explicit
    assert adopt_flash_backend(triton, {"model": {"flash_backend": "mosaic"}}) == triton  # set: kept
