"""The default real pair in bf16 with batch-invariant mode: speculation gives ar's tokens. A
module of its own, so the fp32 pair of test_real_pair.py is freed before this one loads (the
suite holds one real pair at a time)."""
import pytest

from helpers.real import HUGE_PAGES_IN_TESTS
from specengine import Engine
from specengine.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.prompts import humaneval

pytestmark = [pytest.mark.real, pytest.mark.slow]


def test_bf16_speculation_equals_ar_in_batch_invariant_mode():
    """bf16 on the real pair with the mode on (probed here: padded or not, whichever this
    machine needs): sd and pearl give exactly ar's tokens."""
    eng = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", dtype="bfloat16",
                                 max_seq_len=512, batch_invariant=True, huge_pages=HUGE_PAGES_IN_TESTS)
    assert eng.batch_invariant and eng.ops.names["attention"] == "cpu-rows"  # CI builds the extension
    # HumanEval/0's signature and first docstring line only: a bf16 prefill in this mode costs
    # ~0.1 s a token on a 2-core AVX2 CPU (the whole prompt: 17 s per call, three calls)
    p = humaneval(1)[0]["prompt"].split(" Check if")[0]
    ar = eng.generate(p, max_new_tokens=16, method="ar", ignore_eos=True).token_ids
    for method in ("sd", "pearl"):
        r = eng.generate(p, max_new_tokens=16, method=method, gamma=3, ignore_eos=True)
        assert r.token_ids == ar, method
        assert 0 < r.stats["acceptance_rate"] < 1, method  # drafts accepted and rejected: both paths ran
