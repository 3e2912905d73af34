"""`rvcompile.runtime.perplexity` without a model: the window plan scores every token exactly
once with real left context, `score` reads the right logit rows (against a per-token brute
force over a causal toy model), and `rvrun ppl` refuses bad input with one line before loading.
The artifact-level checks (against transformers, quantized builds) are in
tests/test_default_model.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from rvcompile.runtime import cli
from rvcompile.runtime.perplexity import check_window, plan_windows, score

BOS = 2
VOCAB = 11


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 30, 31, 100])
@pytest.mark.parametrize("window,stride", [(3, 1), (8, 1), (8, 3), (8, 6), (16, 8), (200, 50)])
def test_plan_scores_each_token_once_with_context(n, window, stride):
    plan = plan_windows(n, window, stride)
    scored = [j for w in plan for j in range(w.score_from, w.end)]
    assert scored == list(range(n))  # each once, in order
    assert plan[0].begin == plan[0].score_from == 0
    for prev, w in zip(plan, plan[1:], strict=False):
        assert w.begin == prev.begin + stride
        assert w.score_from == prev.end
        assert w.score_from - w.begin >= window - 1 - stride  # real tokens before the first scored
    for w in plan:
        assert 0 < w.end - w.begin <= window - 1  # BOS + at most window - 1 text tokens
        assert w.begin <= w.score_from < w.end


@pytest.mark.parametrize("window,stride", [(2, 1), (8, 0), (8, 7), (8, 8), (8, -1)])
def test_bad_window_or_stride_refused(window, stride):
    with pytest.raises(ValueError, match="stride"):
        check_window(window, stride)


def test_empty_text_refused():
    with pytest.raises(ValueError, match="no tokens"):
        plan_windows(0, 8, 4)


def _causal_logits(inputs) -> np.ndarray:
    """A toy causal model: row i depends on every input up to i (so context matters)."""
    x = np.asarray(inputs, np.int64)
    table = np.random.default_rng(5).normal(size=(VOCAB, VOCAB)) * 3
    prefix_hash = np.cumsum((x + 1) * np.arange(1, x.size + 1)) % VOCAB
    return (table[x] + table[prefix_hash] * 0.5).astype(np.float32)


def _brute_force_nll(ids, window, stride) -> np.ndarray:
    """Token j's NLL from its own forward: BOS + the window's tokens up to j."""
    out = np.empty(len(ids))
    for w in plan_windows(len(ids), window, stride):
        for j in range(w.score_from, w.end):
            context = [BOS, *ids[w.begin:j]]
            row = _causal_logits(context + [ids[j]])[len(context) - 1].astype(np.float64)
            out[j] = np.log(np.exp(row).sum()) - row[ids[j]]
    return out


@pytest.mark.parametrize("window,stride", [(40, 3), (8, 3), (6, 4)])
def test_score_matches_brute_force(window, stride):
    ids = np.random.default_rng(0).integers(3, VOCAB, size=37)
    s = score(_causal_logits, ids, bos_id=BOS, window=window, stride=stride)
    ref = _brute_force_nll(ids, window, stride)
    np.testing.assert_allclose(s.nll, ref, rtol=1e-12, atol=1e-12)
    assert s.tokens == 37 and s.windows == len(plan_windows(37, window, stride))
    assert s.perplexity == pytest.approx(np.exp(ref.mean()), rel=1e-12)


def test_score_uses_left_context():
    """Overlapping windows give later tokens context that disjoint-like windows lack."""
    ids = np.random.default_rng(1).integers(3, VOCAB, size=60)
    long_ctx = score(_causal_logits, ids, bos_id=BOS, window=20, stride=2).nll
    short_ctx = score(_causal_logits, ids, bos_id=BOS, window=20, stride=18).nll
    assert np.array_equal(long_ctx[:19], short_ctx[:19])  # the first window is the same
    assert not np.allclose(long_ctx[19:], short_ctx[19:])


def test_top1_is_the_argmax_at_each_position():
    ids = np.random.default_rng(2).integers(3, VOCAB, size=25)
    s = score(_causal_logits, ids, bos_id=BOS, window=26, stride=1)
    full = _causal_logits([BOS, *ids])
    assert np.array_equal(s.top1, full[:-1].argmax(-1))


def _run_cli(argv, capsys) -> tuple[int, str]:
    rc = cli.main(argv)
    return rc, capsys.readouterr().err.strip()


def test_cli_refuses_missing_text(tmp_path, capsys):
    rc, err = _run_cli(["ppl", str(tmp_path / "x.rvp"), "--text", str(tmp_path / "none.txt")],
                       capsys)
    assert rc == 2 and err.startswith("rvrun: error: --text") and "\n" not in err


def test_cli_refuses_bad_stride_before_loading(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello")
    rc, err = _run_cli(["ppl", str(tmp_path / "missing.rvp"), "--text", str(text),
                        "--window", "16", "--stride", "15"], capsys)
    assert rc == 2 and "stride" in err and "\n" not in err


def test_cli_refuses_missing_artifact(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello")
    rc, err = _run_cli(["ppl", str(tmp_path / "missing.rvp"), "--text", str(text)], capsys)
    assert rc == 2 and err.startswith("rvrun: error:") and "\n" not in err
