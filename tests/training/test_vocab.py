"""training/vocab.py (token mass from stored top-k, choosing a vocabulary: size, always-kept specials,
blending with a parent vocabulary) and the distillation job's use of it (training/job.py
`choose_job_vocabulary`: parent's size by default, vocab_size 0 keeps the parent's, full stays full)."""
from __future__ import annotations

import json
import types

import numpy as np
import pytest

from training.job import choose_job_vocabulary
from training.vocab import choose_vocabulary, coverage, token_mass


# ----------------------------------------------------------------------------- token_mass
def test_token_mass_sums_the_targets_probability_per_token():
    ids = np.array([[3, 1, 7], [3, 2, 1]])
    lps = np.log(np.array([[0.5, 0.25, 0.125], [0.75, 0.125, 0.0625]]))
    mass = token_mass(ids, lps, 8)
    want = np.zeros(8)
    want[3], want[1], want[7], want[2] = 0.5 + 0.75, 0.25 + 0.0625, 0.125, 0.125
    np.testing.assert_allclose(mass, want)
    assert mass.shape == (8,) and mass.dtype == np.float64


def test_token_mass_ignores_ids_outside_the_vocabulary_and_non_finite_entries():
    ids = np.array([[0, -1, 9, 4], [4, 1, 2, 3]])
    lps = np.array([[np.log(0.5), 0.0, 0.0, np.log(0.25)], [np.nan, -np.inf, np.log(0.5), np.log(0.5)]],
                   dtype=np.float16)
    mass = token_mass(ids, lps, 5)
    np.testing.assert_allclose(mass, [0.5, 0.0, 0.5, 0.5, 0.25], rtol=1e-3)    # -1, 9 and NaN dropped; -inf is 0


# ----------------------------------------------------------------------------- choose_vocabulary
def test_choose_keeps_the_size_largest_sorted_with_ties_to_the_lower_id():
    mass = np.array([0.0, 5.0, 1.0, 3.0, 3.0, 0.5, 2.0])
    assert choose_vocabulary(mass, 3) == [1, 3, 4]
    assert choose_vocabulary(mass, 4) == [1, 3, 4, 6]
    tie = np.array([1.0, 2.0, 2.0, 2.0])
    assert choose_vocabulary(tie, 2) == [1, 2]                         # 1, 2, 3 tie: lower ids first
    assert choose_vocabulary(mass, 100) == [1, 2, 3, 4, 5, 6]           # only tokens with positive mass
    with pytest.raises(ValueError, match="size must be >= 1"):
        choose_vocabulary(mass, 0)


def test_always_kept_specials_count_within_the_size():
    mass = np.array([0.0, 5.0, 1.0, 3.0, 3.0, 0.5, 2.0, 0.0, 0.0])
    got = choose_vocabulary(mass, 4, always=[8, 7, 8, 42])              # 42: outside the vocabulary, ignored
    assert got == [1, 3, 7, 8]                                          # the two specials + the two heaviest
    assert choose_vocabulary(mass, 1, always=[7, 8]) == [7, 8]          # specials are never dropped


def test_a_heavily_used_window_token_displaces_an_unused_parent_token():
    prior = [0, 1, 2, 3]
    mass = np.zeros(10)
    mass[[0, 1, 2]] = [1.0, 1.0, 1.0]
    mass[5] = 3.0                                  # share 0.5 of the window, not in the parent's vocabulary
    mass[6] = 0.01                                 # a rare new token: share 0.0017 < prior_weight / len(prior)
    got = choose_vocabulary(mass, 4, prior=prior, prior_weight=0.5)
    assert got == [0, 1, 2, 5]                     # 3 (unused in the window) left, 5 entered, 6 did not
    assert choose_vocabulary(mass, 5, prior=prior, prior_weight=0.5) == [0, 1, 2, 3, 5]
    # prior_weight 0: the window alone decides
    assert choose_vocabulary(mass, 4, prior=prior, prior_weight=0.0) == [0, 1, 2, 5]
    assert choose_vocabulary(mass, 5, prior=prior, prior_weight=0.0) == [0, 1, 2, 5, 6]


def test_the_prior_outweighs_a_modest_window_preference():
    """A parent token the window uses a little stays against a new token the window uses a little more:
    the blend leans to the parent by prior_weight / len(prior)."""
    prior = [0, 1]
    mass = np.zeros(6)
    mass[[0, 1, 4]] = [10.0, 1.0, 2.0]             # 4 beats 1 on mass alone
    assert choose_vocabulary(mass, 2, prior=prior, prior_weight=0.0) == [0, 4]
    assert choose_vocabulary(mass, 2, prior=prior, prior_weight=0.5) == [0, 1]


def test_an_unused_window_with_a_prior_returns_the_prior():
    prior = [7, 2, 4, 2]                           # unsorted, a duplicate: a set of ids
    assert choose_vocabulary(np.zeros(9), 3, prior=prior) == [2, 4, 7]
    assert choose_vocabulary(np.zeros(9), 5, prior=prior) == [2, 4, 7]          # nothing else has any score
    assert choose_vocabulary(np.zeros(9), 4, prior=prior, always=[8]) == [2, 4, 7, 8]
    assert choose_vocabulary(np.zeros(9), 3) == []                               # no window, no prior: nothing


def test_coverage():
    assert coverage([1, 2, 3], [1, 1, 4, 2]) == 0.75
    assert coverage([1], []) == 0.0


# ----------------------------------------------------------------------------- the job's choice
def _draft(tmp_path, parent_ids, full=12, specials=(10, 11)):
    """What choose_job_vocabulary reads of a training.distill.Draft: its folder (draftsmith.json, through
    serving.models.read_output_token_ids), how many ids it could emit, its tokenizer's special ids."""
    folder = tmp_path / "parent"
    folder.mkdir(parents=True)
    if parent_ids is not None:
        (folder / "draftsmith.json").write_text(json.dumps({"output_token_ids": parent_ids, "other": 1}))
    return types.SimpleNamespace(folder=folder, full_vocab_size=full,
                                 tokenizer=types.SimpleNamespace(all_special_ids=list(specials)))


def _units(*rows):
    """One unit whose scored rows are {token id: probability} dicts (the stored target top-k)."""
    ids = np.array([list(r) for r in rows])
    lps = np.log(np.array([list(r.values()) for r in rows]))
    return [types.SimpleNamespace(target_ids=ids, target_logprobs=lps)]


WINDOW = _units({5: 0.9, 0: 0.05}, {5: 0.8, 1: 0.1}, {6: 0.7, 0: 0.2})        # 5 and 6 heavy, 0 and 1 some


def test_job_rechooses_at_the_parents_size_by_default(tmp_path):
    parent = [0, 1, 2, 3, 10, 11]
    got = choose_job_vocabulary(_draft(tmp_path, parent), WINDOW, vocab_size=None)
    assert got.ids == [0, 1, 5, 6, 10, 11] and got.how == "window"
    assert got.entered == [5, 6] and got.left == [2, 3]
    assert (got.size, got.parent_size, got.scored_rows) == (6, 6, 3)
    s = got.summary()
    assert (s["entered"], s["left"], s["size"], s["chosen_by"]) == (2, 2, 6, "window")
    f = got.to_file("4")
    assert f["output_token_ids"] == got.ids and f["parent_version"] == "4" and f["entered"] == [5, 6]
    bigger = choose_job_vocabulary(_draft(tmp_path / "b", parent), WINDOW, vocab_size=8)
    assert bigger.ids == [0, 1, 2, 3, 5, 6, 10, 11] and bigger.left == []


def test_job_keeps_the_parents_rows_when_the_window_agrees_or_vocab_size_is_0(tmp_path):
    parent = [11, 6, 0, 1, 5, 10]                                                 # stored order is kept
    same = choose_job_vocabulary(_draft(tmp_path / "a", parent), WINDOW, vocab_size=None)
    assert same.ids == parent and same.entered == [] and same.left == []
    kept = choose_job_vocabulary(_draft(tmp_path / "b", [0, 1, 2, 3, 10, 11]), WINDOW, vocab_size=0)
    assert kept.ids == [0, 1, 2, 3, 10, 11] and kept.how == "parent" and kept.entered == kept.left == []


def test_a_full_vocabulary_parent_stays_full_unless_a_size_is_asked_for(tmp_path):
    full = choose_job_vocabulary(_draft(tmp_path / "a", None), WINDOW, vocab_size=None)
    assert full.ids is None and full.how == "full" and full.entered == full.left == []
    assert full.size == full.parent_size == 12 and full.to_file("1")["output_token_ids"] is None
    assert choose_job_vocabulary(_draft(tmp_path / "b", None), WINDOW, vocab_size=0).ids is None
    cut = choose_job_vocabulary(_draft(tmp_path / "c", None), WINDOW, vocab_size=4)
    assert cut.ids == [5, 6, 10, 11] and cut.how == "window"                     # specials + the two heaviest
    assert cut.entered == [] and cut.left == [0, 1, 2, 3, 4, 7, 8, 9]
    # asking for the whole vocabulary (or more) from a cut parent: full, every other token entered
    back = choose_job_vocabulary(_draft(tmp_path / "d", [0, 1, 10, 11]), WINDOW, vocab_size=12)
    assert back.ids is None and back.how == "full" and back.entered == [2, 3, 4, 5, 6, 7, 8, 9]
