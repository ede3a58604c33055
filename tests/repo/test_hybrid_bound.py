"""bench/hybrid_bound.py: the oracle round sequence against an exhaustive search, the agreements
against rounds worked out by hand, and the teacher-forced draft argmax against transformers."""
import itertools
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from hybrid_bound import draft_predictions, draft_runs, ngram_agreements, oracle_seconds  # noqa: E402


def test_agreements_worked_by_hand():
    # at 0 the history ends with "6", which occurs nowhere earlier; at 1 it ends with "1" (at 0),
    # whose continuation 2 3 4 5 6 agrees with the rest up to the 9
    assert ngram_agreements([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 9])[:3] == [0, 5, 4]
    # "7" occurs twice, followed by 1 (older) and 2 (most recent): the older agrees with 1 5
    assert ngram_agreements([7, 1, 5, 7, 2, 8, 7], [1, 5, 9])[0] == 2
    # pred[j]: the draft's token after the first j + 1 tokens; the prompt is 2 long
    pred = [0, 7, 8, 5, 9, 9]  # after the prompt: 7 (right), 8 (right), 5 (wrong: 4), 9 (right)
    assert draft_runs(pred, 2, [7, 8, 4, 9]) == [2, 1, 0, 1]


def exhaustive(n, verify_s, a_ng, a_d, draft_s, gamma_max, i=0):
    """Every sequence of rounds, tried one by one (no memo): the reference of oracle_seconds."""
    if i >= n:
        return 0.0
    options = [verify_s(1) + exhaustive(n, verify_s, a_ng, a_d, draft_s, gamma_max, i + 1)]
    for agree, step in ((a_ng, 0.0), (a_d, draft_s)):
        if agree is None:
            continue
        for g in range(1, gamma_max + 1):
            if g <= agree[i]:  # a proposal past the agreement commits no more and costs more
                options.append(g * step + verify_s(g + 1) + exhaustive(n, verify_s, a_ng, a_d, draft_s, gamma_max,
                                                                        min(n, i + g + 1)))
    return min(options)


@pytest.mark.parametrize("seed", range(6))
def test_the_oracle_is_the_cheapest_sequence_of_rounds(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    a_ng = [rng.randint(0, 4) for _ in range(n)]
    a_d = [rng.randint(0, 4) for _ in range(n)]
    slope = rng.uniform(0.0, 0.5)
    verify_s = lambda w: 1.0 + slope * max(w - 3, 0)  # noqa: E731 - flat to width 3, as on the CPUs measured
    draft_s = rng.uniform(0.1, 0.6)
    for ng, d in itertools.product((a_ng, None), (a_d, None)):
        assert oracle_seconds(n, verify_s, ng, d, draft_s, 3) == pytest.approx(exhaustive(n, verify_s, ng, d, draft_s, 3))


def test_free_wide_verifies_commit_a_copied_span_in_one_round():
    assert oracle_seconds(6, lambda w: 1.0, [5, 0, 0, 0, 0, 0], None, 0.3, 12) == 1.0  # 5 proposed + the bonus
    assert oracle_seconds(6, lambda w: 1.0, None, None, 0.3, 12) == 6.0  # nothing to propose: 6 decodes


def test_the_teacher_forced_draft_argmax_is_transformers(tiny_dir):
    from transformers import AutoModelForCausalLM

    from specengine import Engine

    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), dtype="float32", cpu_matmul="linear",
                                 max_seq_len=256)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    ids = torch.randint(3, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].argmax(-1).tolist()
    assert draft_predictions(eng, ids) == ref
