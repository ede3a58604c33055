"""bench/ngram_bound.py: the n-gram τ bound replayed from the target's tokens, against rounds
worked out by hand."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from ngram_bound import copy_bound, replay_tau  # noqa: E402


def test_a_copied_span_is_committed_in_one_round_after_its_first_token():
    # round 1: "6" occurs nowhere earlier, one token; round 2: "1" occurs at 0, the five that
    # followed it agree, then the bonus (9)
    assert replay_tau([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 9], 16, "most_recent") == (7, 2)
    assert replay_tau([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 9], 3, "most_recent") == (7, 3)  # 1 | 2 3 4 5 | 6 9


def test_the_best_occurrence_beats_the_most_recent_where_they_differ():
    # "7" occurs twice: followed by 1 (older) and by 2 (most recent); the answer continues with 1
    prompt, output = [7, 1, 5, 7, 2, 8, 7], [1, 5, 9]
    assert replay_tau(prompt, output, 16, "most_recent") == (3, 2)  # "2 8" is wrong: 1 | then "7 1" -> 5, bonus 9
    assert replay_tau(prompt, output, 16, "best_occurrence") == (3, 1)  # 1 5 agree, 9 the bonus


def test_the_whole_call_bound_folds_in_the_prefill_share():
    b = copy_bound([[1, 2, 3, 4, 5, 6]], [[1, 2, 3, 4, 5, 6, 9]], prefill_fraction=0.2)
    assert b["tau_most_recent"] == pytest.approx(3.5)
    assert b["ratio_bound_most_recent"] == pytest.approx(1 / (0.2 + 0.8 / 3.5))
    assert copy_bound([[1, 2]], [[3, 4]])["tau_best_occurrence"] == 1.0  # nothing to copy: one token a round
