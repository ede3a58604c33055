"""bench/ngram_policy_bound.py: each rung of the ladder knows less than the one above it, so it
can never be faster; the calibrated policy, the curves and lookup's agreements worked by hand."""
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from ngram_policy_bound import lookup_agreements, match_curves, policy_ladder  # noqa: E402

VERIFY = [1.0, 1.15, 1.25, 1.4, 1.6, 1.9, 2.1, 2.3, 2.6, 2.8, 3.0, 3.3, 3.5]  # the shape measured on CPUs


def test_lookup_agreements_worked_by_hand():
    # "7" occurs twice, followed by 1 (older, its 7 preceded by nothing) and by 2 (most recent,
    # preceded by 5 1 7 ... against the history's 8 7): both match 1 token back, the most recent wins
    # the tie, and its continuation 2 disagrees with the answer's 1
    assert lookup_agreements([7, 1, 5, 7, 2, 8, 7], [1, 5, 9])[0] == 0
    # a span copied from the prompt: after its first token, lookup's occurrence carries the rest
    assert lookup_agreements([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 9])[:3] == [0, 5, 4]


@pytest.mark.parametrize("seed", range(4))
def test_every_rung_is_at_most_the_one_above(seed):
    rng = random.Random(seed)
    vocab = rng.choice([4, 6, 10])  # few symbols: many repeats, matches of every length
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(5, 30))] for _ in range(3)]
    outputs = []
    for p in prompts:  # replies that copy spans of their prompt, with edits between
        out = []
        while len(out) < 40:
            s = rng.randrange(len(p))
            out += p[s: s + rng.randint(1, 8)] + [rng.randrange(vocab)]
        outputs.append(out[:40])
    r = policy_ladder(prompts, outputs, VERIFY)["decode_x_ar"]
    eps = 1e-9
    assert r["oracle_best_occurrence"] + eps >= r["oracle_lookup_occurrence"]
    assert r["oracle_lookup_occurrence"] + eps >= r["calibrated_match_length"]
    assert r["oracle_lookup_occurrence"] + eps >= r["shipped_policy"]
    assert min(r.values()) >= 1.0 - eps  # declining every proposal is plain decoding: the ar rate


def test_the_calibrated_policy_worked_by_hand():
    # reply 1 2 3 9 after prompt 1 2 3. Position 0: "3" occurs nowhere earlier, a decode (1.0).
    # Position 1: "1" occurs at 0 (match 1), its continuation 2 3 agrees 2; at 2: match 2, agrees
    # 1; at 3: match 3, agrees 0. The curve of match 1 is e = 1, 2, 2, ...: 2 tokens proposed
    # (3 / 1.25 beats 2 / 1.15 and 3 / 1.4), 2 3 accepted and 9 the bonus, for a width-3 verify (1.25)
    r = policy_ladder([[1, 2, 3]], [[1, 2, 3, 9]], VERIFY)["decode_x_ar"]
    assert r["calibrated_match_length"] == pytest.approx(4 / 2.25)
    assert r["oracle_lookup_occurrence"] == pytest.approx(4 / 2.25)


def test_the_curves_count_the_agreement_of_every_position():
    # positions 1..5 of the copy have lookup agreements 5, 4, 3, 2, 1 (then the 9 breaks it),
    # all from matches of length 1..5 (one bin each for 1, 2, 3, then >= 4 twice)
    e = match_curves([[1, 2, 3, 4, 5, 6]], [[1, 2, 3, 4, 5, 6, 9]], 12)
    assert e[0][1] == 1.0 and e[0][5] == 5.0 and e[0][6] == 5.0  # match 1: agreement 5
