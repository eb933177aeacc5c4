"""compare exit codes: 0 identical, 1 divergent (all differing fields, both exact values), 2 bad input."""

import json

from detjax.compare import main


def _write(d, recs):
    d.mkdir()
    (d / "fingerprints.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return str(d)


def _rec(step, loss, digest="00ff"):
    return {"step": step, "lm_loss": {"hex": float(loss).hex(), "value": loss}, "digest": {"params": digest}}


def test_identical(tmp_path):
    recs = [_rec(0, 1.5), _rec(1, 1.25)]
    assert main([_write(tmp_path / "a", recs), _write(tmp_path / "b", recs)]) == 0


def test_first_divergent_step_and_fields(tmp_path, capsys):
    a = _write(tmp_path / "a", [_rec(0, 1.5), _rec(1, 1.25), _rec(2, 1.0, "aa")])
    b = _write(tmp_path / "b", [_rec(0, 1.5), _rec(1, 1.25 + 2**-20, "bb"), _rec(2, 9.0)])
    assert main([a, b]) == 1
    out = capsys.readouterr().out
    assert "DIVERGED at step 1" in out
    assert "lm_loss" in out and (1.25).hex() in out and (1.25 + 2**-20).hex() in out
    assert "digest.params" in out and "'00ff'" in out and "'bb'" in out
    assert "step 2" not in out


def test_missing_step_is_divergence(tmp_path, capsys):
    a = _write(tmp_path / "a", [_rec(0, 1.5), _rec(1, 1.0)])
    b = _write(tmp_path / "b", [_rec(0, 1.5)])
    assert main([a, b]) == 1
    assert "only in run A" in capsys.readouterr().out


def test_bad_input(tmp_path, capsys):
    good = _write(tmp_path / "a", [_rec(0, 1.5)])
    assert main([good, str(tmp_path / "nope")]) == 2
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "fingerprints.jsonl").write_text("{not json\n")
    assert main([good, str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_runs_with_different_digest_versions_are_refused(tmp_path, capsys):
    old = _write(tmp_path / "old", [_rec(0, 1.5)])  # records before digest version 2 carry no version
    new = _write(tmp_path / "new", [{**_rec(0, 1.5), "digest_version": 2}])
    assert main([old, new]) == 2
    err = capsys.readouterr().err
    assert "version-1 digests" in err and "version-2 digests" in err and err.count("\n") == 1
    assert main([new, _write(tmp_path / "new2", [{**_rec(0, 1.5), "digest_version": 2}])]) == 0  # control
