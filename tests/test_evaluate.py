"""`python -m detjax.evaluate`: lm-eval on the exported checkpoint, end to end on the CPU with a local task.

Needs lm-eval, torch and transformers (the `hf` extra); skipped without them. The task is a small
multiple-choice jsonl written here (no hub access): lm-eval's accuracy must equal the accuracy detjax's own
forward gives when it scores each choice by the summed log-probability of its tokens, as lm-eval does.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_export_hf import LENGTH, random_params, tiny_cfg, write_run

DOCS = [
    ("The cat sat on the", ["mat.", "sky.", "idea."], 0),
    ("Water is", ["wet.", "dry.", "loud."], 0),
    ("One, two,", ["three.", "blue.", "seven."], 0),
    ("The sun rises in the", ["west.", "east.", "box."], 1),
    ("Snow is", ["hot.", "green.", "cold."], 2),
    ("A dog says", ["woof.", "moo.", "meow."], 0),
]

TASK = """task: detjax_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def detjax_accuracy(cfg, params) -> float:
    """Each choice scored by sum log p(" " + choice | question) under detjax's forward (byte tokens)."""
    from detjax.data.tokenizer import ByteTokenizer
    from detjax.model.lm import HybridLM

    tok, model = ByteTokenizer(), HybridLM(cfg.model)
    hits = []
    for question, choices, label in DOCS:
        scores = []
        for choice in choices:
            ctx, cont = tok.encode(question, eos=False), tok.encode(" " + choice, eos=False)
            ids = np.zeros((1, LENGTH), np.int32)
            ids[0, : len(ctx) + len(cont)] = np.concatenate([ctx, cont])
            logp = jax.nn.log_softmax(model.apply({"params": params}, jnp.asarray(ids))[0][0], axis=-1)
            pos = np.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
            scores.append(float(np.asarray(logp)[pos, cont].sum()))
        hits.append(int(np.argmax(scores)) == label)
    return float(np.mean(hits))


def test_evaluate_local_task_matches_detjax(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from detjax.evaluate import main as evaluate_main

    cfg = tiny_cfg("M-*-")
    run = write_run(tmp_path / "run", cfg, seed=5)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    docs = tasks / "docs.jsonl"
    docs.write_text("".join(json.dumps({"question": q, "choices": c, "label": y}) + "\n" for q, c, y in DOCS))
    (tasks / "detjax_tiny_mc.yaml").write_text(TASK.format(path=docs))

    args = [str(run), "--tasks", "detjax_tiny_mc", "--include-path", str(tasks), "--batch-size", "4"]
    assert evaluate_main(args) == 0
    got = json.loads((run / "lm_eval.json").read_text())["results"]["detjax_tiny_mc"]["acc,none"]
    want = detjax_accuracy(cfg, random_params(cfg, 5))
    assert got == pytest.approx(want, abs=1e-9)
    assert "detjax_tiny_mc" in capsys.readouterr().out

    assert evaluate_main([str(run), "--tasks", "no_such_task_xyz", "--include-path", str(tasks)]) == 2
    assert "unknown lm-eval task(s) no_such_task_xyz" in capsys.readouterr().err
