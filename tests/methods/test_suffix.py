"""Suffix decoding across requests (issue 67): the cache of earlier responses (bounded, oldest evicted,
never proposing an evicted response), the `suffix` methods lossless against transformers' greedy
tokens and the target's sampled distribution, faster on a request the engine has seen before, and
nothing remembered or proposed across keys or for a request that opts out."""
import pytest
import torch
from conftest import small_vocab_models
from helpers.tiny_refs import hf  # noqa: F401 (fixture)

from specengine import Engine, SpecEngineError
from specengine.request import RequestParams
from specengine.methods.suffix_cache import SuffixCache, SuffixCaches

PROMPTS = ["def add(a, b):\n", "x = [1, 2", "q"]


def reference_propose(responses: list[list[int]], text: list[int], sizes, gamma: int) -> tuple[int, list[int]]:
    """A plain search: the longest suffix of `text` (sizes, largest first) inside a held response, and
    what followed its last occurrence (the most recent response last)."""
    for n in sorted(sizes, reverse=True):
        if len(text) < n:
            continue
        found = None
        for r in responses:
            for j in range(n, len(r) + 1):
                if r[j - n: j] == text[-n:]:
                    found = r[j: j + gamma]
        if found is not None:
            return n, found
    return 0, []


def test_the_cache_finds_what_a_plain_search_finds_and_forgets_the_oldest():
    g = torch.Generator().manual_seed(0)
    cache, held = SuffixCache(max_tokens=120, sizes=(4, 2)), []
    for _ in range(40):
        r = torch.randint(0, 6, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
        cache.add(r)
        held.append(r)
        while sum(map(len, held)) > 120:
            held.pop(0)
        assert len(cache) == sum(map(len, held)) <= 120
        assert cache.entries <= 2 * 2 * 120  # bounded: stale entries are rebuilt away once they are half
        for _ in range(5):
            text = torch.randint(0, 6, (6,), generator=g).tolist()
            assert cache.propose(text, 5) == reference_propose(held, text, (4, 2), 5)


def reference_lookup(responses, text, sizes, cap=32, most=64):
    """A plain search for `lookup`: the occurrences of the longest suffix of `text` (sizes) inside a
    held response (its most recent `most`), each scored by how many tokens before its end agree
    with `text` (at most `cap`, never across a response's start); the best, the most recent on a tie.
    (absolute start is not comparable across implementations: returns (continuation, match length))."""
    for n in sorted(sizes, reverse=True):
        found = [(r, j) for r in responses for j in range(n, len(r) + 1) if len(text) >= n and r[j - n: j] == text[-n:]]
        if found:
            best = None
            for r, j in reversed(found[-most:]):
                m = 0
                while m < cap and j - 1 - m >= 0 and m < len(text) and r[j - 1 - m] == text[-1 - m]:
                    m += 1
                if best is None or m > best[1]:
                    best = (r[j:], m)
            return best
    return None


def test_a_lookup_scores_the_whole_agreement_as_a_plain_search_does():
    """The match length γ auto trusts runs past the indexed n-gram, to the response's start at most."""
    g = torch.Generator().manual_seed(1)
    cache, held = SuffixCache(max_tokens=200, sizes=(4, 2)), []
    for _ in range(30):
        r = torch.randint(0, 3, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
        cache.add(r)
        held.append(r)
        while sum(map(len, held)) > 200:
            held.pop(0)
        for _ in range(5):
            text = torch.randint(0, 3, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            got, want = cache.lookup(text), reference_lookup(held, text, (4, 2))
            assert (got is None) == (want is None)
            if got is not None:
                assert (cache.continuation(got[0], 50), got[1]) == want
    cache = SuffixCache(sizes=(2,))
    cache.add([5, 1, 2, 3, 4, 9])
    assert cache.lookup([7, 1, 2, 3, 4]) == (cache.base + 5, 4)  # 4 agree: two more than the 2-gram


def test_an_evicted_response_is_never_proposed():
    cache = SuffixCache(max_tokens=10, sizes=(2,))
    cache.add([7, 8, 9, 9])
    assert cache.propose([1, 7, 8], 3) == (2, [9, 9])
    for _ in range(4):
        cache.add([1, 2, 3])
    assert cache.propose([1, 7, 8], 3) == (0, [])
    with pytest.raises(SpecEngineError, match="suffix_cache_tokens"):
        SuffixCaches(-1)
    caches = SuffixCaches(100)
    held = caches.get("k")  # a running row holds its key's cache while it is still empty
    caches.remember("k", [1, 2, 3])
    assert caches.get("k") is held and len(held) == 3


def hf_greedy(hf, tokenizer, prompt, n):
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def free_width(eng):
    """Costs under which a wider verify costs nothing more: tree="auto" then takes every node it has."""
    from specengine.runtime.step_costs import StepCosts

    eng.step_costs = lambda state, width, draft=True: StepCosts(state.batch, 0.0, (1.0,) * width)


@pytest.mark.parametrize("method,opts", [("suffix", dict(gamma="auto")), ("suffix", dict(gamma=6)),
                                         ("suffix", dict(tree="3x4:8")), ("suffix", dict(tree="auto")),
                                         ("hybrid-suffix", dict(gamma="auto"))])
def test_suffix_equals_transformers_and_a_seen_request_takes_fewer_forwards(tiny_pair, tokenizer, hf, method, opts):
    eng = Engine(tiny_pair[0], tokenizer, draft=tiny_pair[2] if method.startswith("hybrid") else None, max_seq_len=256)
    if opts.get("tree") == "auto":
        free_width(eng)  # wide trees, branching where the occurrences disagree
    refs = [hf_greedy(hf, tokenizer, p, 40) for p in PROMPTS]
    first = eng.generate(PROMPTS, max_new_tokens=40, method=method, ignore_eos=True, **opts)
    assert [r.token_ids for r in first] == refs
    again = eng.generate(PROMPTS, max_new_tokens=40, method=method, ignore_eos=True, **opts)
    assert [r.token_ids for r in again] == refs
    assert again[0].stats["target_forwards"] < first[0].stats["target_forwards"]
    assert len(eng.suffix_caches.get("")) == 2 * 3 * 40
    if opts.get("tree") == "auto":
        assert first[0].stats["tree_rounds"] > 0  # some round's proposals branched


@pytest.mark.parametrize("opts", [dict(gamma=2), dict(tree="auto")])
def test_sampling_keeps_the_target_distribution(tmp_path, tokenizer, opts):
    from helpers.distribution_bounds import total_variation_bound
    from helpers.exact import N, PROMPT, V, exact_joint

    hf, target, _ = small_vocab_models(tmp_path, V)
    eng = Engine(target, tokenizer, max_seq_len=48)
    if "tree" in opts:
        free_width(eng)  # the cache's V continuations of the prompt's end: a tree of V branches
    cache = eng.suffix_caches.get("")
    for a in range(V):  # earlier responses continuing the prompt's last tokens every way
        cache.add(PROMPT[-2:] + [a, (a * 3) % V, 1])
    out = eng.generate([PROMPT] * N, max_new_tokens=2, method="suffix", temperature=1.0, seed=5,
                       ignore_eos=True, **opts)
    pairs = torch.tensor([r.token_ids for r in out])
    emp = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double() / N
    tv = 0.5 * (emp - exact_joint(hf, 1.0).double()).abs().sum().item()
    assert tv <= total_variation_bound(V * V, N), tv
    assert 0 < out[0].stats["acceptance_rate"] < 1
    assert out[0].stats.get("tree_rounds", 1) > 0


def test_nothing_is_shared_across_keys_or_kept_for_a_request_that_opts_out(tiny_pair, tokenizer):
    from specengine.serve.core import EngineCore

    eng = Engine(tiny_pair[0], tokenizer, max_seq_len=256, method="suffix")
    eng.generate(PROMPTS[0], max_new_tokens=30, ignore_eos=True, suffix_cache=False)
    assert len(eng.suffix_caches.get("")) == 0
    core = EngineCore(eng, max_batch=2)
    for key in ("alice", "alice", "bob"):
        core.add_request(PROMPTS[0], RequestParams(max_new_tokens=30, ignore_eos=True), cache_key=key)
        while core.has_unfinished():
            core.step()
    core.add_request(PROMPTS[0], RequestParams(max_new_tokens=30, suffix_cache=False), cache_key="bob")
    while core.has_unfinished():
        core.step()
    alice, bob = eng.suffix_caches.get("alice"), eng.suffix_caches.get("bob")
    assert len(alice) == 2 * len(bob) > 0 and len(eng.suffix_caches.get("")) == 0
