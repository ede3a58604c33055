"""bench/hybrid_policy_replay.py: the replays against independent code (ngram_policy_bound's
replay of the same policy, a plain loop for `sd`), the catch-up worked by hand, and the bound
on the hybrid's choices never slower than the n-gram replay it includes."""
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from hybrid_policy_replay import (HybridDecoding, NgramDecoding, catch_up_s, choice_bound, replay,  # noqa: E402
                                  replay_all, replay_sd)
from ngram_policy_bound import replay_seconds, shipped_chooser  # noqa: E402
from specengine.methods.policies import AutoGammaPolicy  # noqa: E402
from specengine.runtime.step_costs import StepCosts  # noqa: E402

VERIFY = (1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5, 1.8, 1.9, 2.0, 2.2, 2.3)
COSTS = StepCosts(1, 0.35, VERIFY)


def reply(seed: int) -> dict:
    """A prompt, a reply that copies spans of it with edits between, and draft predictions that
    are right about 85% of the time."""
    rng = random.Random(seed)
    prompt = [rng.randrange(12) for _ in range(30)]
    out = []
    while len(out) < 60:
        s = rng.randrange(len(prompt))
        out += prompt[s: s + rng.randint(1, 10)] + [rng.randrange(12)]
    out = out[:60]
    text = prompt + out
    pred = [text[j + 1] if j + 1 < len(text) and rng.random() < 0.85 else 99 for j in range(len(text))]
    return {"prompt": prompt, "output": out, "pred": pred, "pre_t": 3.0, "pre_d": 1.0}


@pytest.mark.parametrize("seed", range(3))
def test_the_ngram_replay_equals_the_policy_ladder_replay(seed):
    row = reply(seed)
    got, kinds = replay(NgramDecoding, row, COSTS)
    want = row["pre_t"] + replay_seconds(row["prompt"], row["output"], COSTS.verify_s, *shipped_chooser(
        StepCosts(1, 0.0, VERIFY)))
    assert got == pytest.approx(want) and kinds["draft"] == 0


@pytest.mark.parametrize("seed", range(3))
def test_the_sd_replay_equals_a_plain_loop(seed):
    row = reply(seed)
    text, n, p = row["prompt"] + row["output"], len(row["output"]), len(row["prompt"])
    pol, t, i = AutoGammaPolicy(), row["pre_t"] + row["pre_d"], 0
    pol.set_costs(COSTS)
    while i < n:  # the draft's chain from position i: its argmax while it agrees with the reply
        g, a = pol.gamma, 0
        while a < g and i + a < n and row["pred"][p + i + a - 1] == text[p + i + a]:
            a += 1
        t += g * COSTS.draft_s + COSTS.verify_s(g + 1)
        pol.update([a], [g])
        i += a + 1
    assert replay_sd(row, COSTS) == pytest.approx(t)


def test_the_catch_up_worked_by_hand():
    """The draft reads what it missed in its chain's first forward (up to the method's width W)
    and, past that, in forwards of W before it; each a draft step scaled by the target's width
    curve, the first beyond its usual 2."""
    cost = lambda w: 1.0 + 0.1 * (w - 1)  # noqa: E731
    costs = StepCosts(1, 0.1, tuple(cost(w) for w in range(1, 20)))
    m = HybridDecoding(gamma="auto")
    W = m.max_width
    assert catch_up_s(m, 0, costs) == 0.0
    for behind, before, first in ((1, 0, 3), (W - 2, 0, W), (W - 1, 1, W), (3 * W + 4, 2 * W + 6, W)):
        ahead = (before // W) * cost(W) + (cost(before % W) if before % W else 0.0)
        assert catch_up_s(m, behind, costs) == pytest.approx(0.1 * (ahead + cost(first) - cost(2)) / cost(1))


def test_the_hybrid_replay_commits_every_token_and_the_bound_includes_ngram():
    rows = [reply(s) for s in range(3)]
    for row in rows:
        t, kinds = replay(HybridDecoding, row, COSTS)
        assert t >= row["pre_t"] and sum(kinds.values()) >= 1
        assert choice_bound(row, COSTS) <= replay(NgramDecoding, row, COSTS)[0] + 1e-9
    out = replay_all({"draft_s": COSTS.draft_s, "verify_s": list(VERIFY), "sets": {"a": rows[:2], "b": rows[2:]}})
    assert set(out["a"]["tokens_per_s"]) == {"ar", "ngram", "sd", "hybrid", "hybrid_told_when_to_prefill",
                                            "hybrid_choice_bound"}
    assert out["choice_bound_vs_best_of_mixed_set"] > 0 and out["hybrid_vs_best_of_mixed_set"] > 0
