"""The lexicon: a domain guessed from token ids by TF-IDF centroids (adaptive.index.lexicon)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adaptive.index.lexicon import Lexicon


def test_the_worked_example():
    lex = Lexicon.fit({"a": [[1, 2], [1, 3]], "b": [[4, 5]]})
    assert lex.names == ("a", "b") and lex.prompts == 3
    assert lex.tokens.tolist() == [1, 2, 3, 4, 5]
    assert lex.idf.tolist() == pytest.approx([math.log(4 / 3) + 1] + [math.log(2) + 1] * 4)
    # [1, 2] and [1, 3] scaled to unit length, averaged, scaled again: a's centroid
    w1, w2 = math.log(2) * (math.log(4 / 3) + 1), math.log(2) * (math.log(2) + 1)
    p1 = np.array([w1, w2, 0, 0, 0]) / math.hypot(w1, w2)
    p2 = np.array([w1, 0, w2, 0, 0]) / math.hypot(w1, w2)
    a = (p1 + p2) / np.linalg.norm(p1 + p2)
    assert lex.centroids[0] == pytest.approx(a, abs=1e-6)
    # [2, 9]: token 9 is unknown, weighs log(2) * (log(4) + 1) in the norm only
    unknown = math.log(2) * (math.log(4) + 1)
    sims = lex.similarities([2, 9])
    assert sims["a"] == pytest.approx(a[1] * w2 / math.hypot(w2, unknown), abs=1e-6)
    assert sims["a"] == pytest.approx(0.2786, abs=1e-4) and sims["b"] == 0.0
    assert lex.guess([2, 9]) == "a"
    assert lex.guess([5, 5, 4]) == "b"


def test_repeats_weigh_by_their_logarithm_and_shared_tokens_little():
    lex = Lexicon.fit({"a": [[0, 1, 1], [0, 1]], "b": [[0, 2], [0, 2, 2]]})
    assert lex.idf[0] < lex.idf[1]  # token 0 is in every prompt
    assert lex.guess([0, 0, 0, 0, 1]) == "a"  # four of the shared token do not outweigh one of a's
    assert lex.guess([0, 2]) == "b"


def test_nothing_to_go_on_is_no_guess():
    lex = Lexicon.fit({"a": [[1, 2]], "b": [[3]]})
    assert lex.guess([]) is None
    assert lex.guess([7, 8, 9]) is None  # no calibration token in it
    assert lex.similarities([]) == {"a": 0.0, "b": 0.0}


def test_fit_leaves_out_domains_without_prompts_and_refuses_none():
    assert Lexicon.fit({"a": [[1]], "empty": []}).names == ("a",)
    with pytest.raises(ValueError, match="no domain"):
        Lexicon.fit({"empty": []})


def test_arrays_round_trip_and_inconsistent_ones_are_refused():
    lex = Lexicon.fit({"a": [[1, 2], [1, 3]], "b": [[4, 5]]})
    back = Lexicon.from_arrays(lex.to_arrays())
    assert back.names == lex.names and back.prompts == 3
    assert back.similarities([2, 9]) == pytest.approx(lex.similarities([2, 9]))
    bad = dict(lex.to_arrays(), centroids=np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError, match="shapes disagree"):
        Lexicon.from_arrays(bad)
    with pytest.raises(ValueError, match="ascending"):
        Lexicon.from_arrays(dict(lex.to_arrays(), tokens=np.array([5, 4, 3, 2, 1])))
    with pytest.raises(ValueError, match="distinct domain names"):
        Lexicon.from_arrays(dict(lex.to_arrays(), names=np.array(["a", "a"])))
