"""PEARL: every mode transition with controlled drafts, greedy equality with ar, EOS and
max_new_tokens inside a pending block, the sampling distribution, seeded reproducibility."""
import types

import pytest
import torch
from conftest import save_tiny, small_vocab_models
from helpers.exact import next_probs
from helpers.every_method import pinned_costs
from helpers.fakes import flushing_costs

from specengine import Engine, SamplingParams
from specengine.models.loading import load_model
from helpers.distribution_bounds import total_variation_bound

PROMPTS = ["def add(a, b):\n", "x = [1, 2", "q"]


class PoisonedDraft:
    """The target's weights, but its proposal for each absolute position in `poison` is the
    runner-up token: a draft whose rejections land exactly where a test wants them."""

    def __init__(self, model, poison):
        self.inner, self.poison = model, set(poison)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, tokens, cache, ops, tree_mask=None, attn_len=None, logits_at=None, return_hidden=False):
        lens = cache.lens.clone()
        logits = self.inner(tokens, cache, ops, tree_mask, attn_len, logits_at, return_hidden)
        for b in range(tokens.shape[0]):
            cols = range(tokens.shape[1]) if logits_at is None else logits_at[b].tolist()  # what logits holds
            for i, j in enumerate(cols):
                if int(lens[b]) + j + 1 in self.poison:  # the logits of token j predict position lens+j+1
                    logits[b, i, logits[b, i].argmax()] = float("-inf")
        return logits


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair  # target, same-weights draft, perturbed draft


@pytest.fixture(scope="module")
def ar_out(models, tokenizer):
    target, same, _ = models
    return Engine(target, tokenizer, same, max_seq_len=256).generate(PROMPTS, max_new_tokens=40, method="ar",
                                                                     ignore_eos=True)


def test_every_mode_transition(models, tokenizer, ar_out, tiny_dir):
    target = models[0]
    g = 4
    L = len(Engine(target, tokenizer).encode(PROMPTS[0])[0][0])
    # round: 1 pre reject | 2 pre accept | 3,4 post all | 5 post reject first | 6 pre accept |
    #        7 post reject middle | 8 pre accept | 9 post reject last (e1) | 10 pre ...
    poison = [L, L + 10, L + 13, L + 18]
    draft = PoisonedDraft(load_model(tiny_dir)[0], poison)
    eng = Engine(target, tokenizer, draft, max_seq_len=256)
    gen, _ = eng._start(PROMPTS[0], max_new_tokens=40, method="pearl", gamma=g, ignore_eos=True)
    for _ in gen.rounds():
        pass
    trace = gen.method.modes.trace
    assert trace[:10] == [
        ("pre", 1, 0), ("pre", 1, 1), ("post", g, g), ("post", g, g), ("post", g, 0),
        ("pre", 1, 1), ("post", g, 1), ("pre", 1, 1), ("post", g, g - 1), ("pre", 1, 1),
    ]
    assert gen.rows[0].ids == ar_out[0].token_ids
    assert gen.method.modes.rejections == 4


@pytest.mark.parametrize("draft", ["same", "perturbed"])
@pytest.mark.parametrize("gamma", [1, 2, 3, 5, None])
def test_pearl_equals_ar(models, tokenizer, ar_out, draft, gamma):
    target, same, perturbed = models
    eng = Engine(target, tokenizer, same if draft == "same" else perturbed, max_seq_len=256)
    if gamma is None:  # the window by cost: costs under which it drafts (on a loaded 2-core machine,
        eng.step_costs = pinned_costs  # measured ones made it decode plainly: [None-perturbed] failed)
    out = eng.generate(PROMPTS, max_new_tokens=40, method="pearl", gamma=gamma, ignore_eos=True)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar_out]
    s = out[0].stats
    assert s["gamma"] >= 1 and s["measured_cost_ratio"] > 0
    if draft == "same":
        assert s["acceptance_rate"] == 1.0 and s["mean_accepted_tokens"] == 40
    else:
        assert 0 < s["acceptance_rate"] < 1 and s["mean_accepted_tokens"] < 40
    single = eng.generate(PROMPTS[1], max_new_tokens=40, method="pearl", gamma=gamma, ignore_eos=True)
    assert single.token_ids == ar_out[1].token_ids


def test_unrelated_draft(models, tokenizer, ar_out, tmp_path):
    save_tiny(tmp_path, "llama", seed=99, scale=4.0)
    eng = Engine(models[0], tokenizer, load_model(tmp_path)[0], max_seq_len=256)
    out = eng.generate(PROMPTS, max_new_tokens=40, method="pearl", gamma=3, ignore_eos=True)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar_out]


@pytest.mark.parametrize("cut", [5, 6, 7, 9, 13])
def test_max_new_tokens_and_eos_inside_a_pending_block(models, tokenizer, ar_out, cut):
    target, same, _ = models
    eng = Engine(target, tokenizer, same, max_seq_len=256)
    r = eng.generate(PROMPTS[0], max_new_tokens=cut, method="pearl", gamma=4, ignore_eos=True)
    assert r.token_ids == ar_out[0].token_ids[:cut] and r.finish_reason == "length"
    stop = ar_out[0].token_ids[cut]
    first = ar_out[0].token_ids.index(stop)
    eng.eos_ids = {stop}
    r = eng.generate(PROMPTS[0], max_new_tokens=40, method="pearl", gamma=4)
    assert r.token_ids == ar_out[0].token_ids[: first + 1] and r.finish_reason == "eos"


def test_seeded_sampling_is_reproducible(models, tokenizer):
    target, _, perturbed = models
    eng = Engine(target, tokenizer, perturbed, max_seq_len=256)
    kw = dict(max_new_tokens=20, method="pearl", gamma=3, temperature=0.9, top_p=0.9, ignore_eos=True)
    a, b, c = (eng.generate(PROMPTS, seed=s, **kw) for s in (4, 4, 5))
    assert [r.token_ids for r in a] == [r.token_ids for r in b] != [r.token_ids for r in c]


V, N, PROMPT = 8, 50_000, [3, 5, 2]


@pytest.mark.parametrize("gamma,kw,costs", [(2, dict(temperature=1.0), None), (3, dict(temperature=0.8, top_k=6), None),
                                            (None, dict(temperature=0.9), flushing_costs)])
def test_sampling_distribution_of_three_tokens(tmp_path, tokenizer, gamma, kw, costs, monkeypatch):
    """1e5 independent rows, three tokens each (a pre-verify round, then post-verify blocks; or with
    `costs`, the pending draft verified alone by a flush, then a plain step): the pair (t1, t2)
    matches the target's exact joint over 64 outcomes, and (t2, t3) given the likeliest t1 matches its
    exact conditional (TV bounds from the sample counts). With a window by cost the draft reads the
    prompt up front here (three tokens would never pay for its read, test_draft_prime.py)."""
    from specengine.methods.pearl import Pearl

    monkeypatch.setattr(Pearl, "defers_draft_prefill", False)
    hf, target, draft = small_vocab_models(tmp_path, V)
    eng = Engine(target, tokenizer, draft, max_seq_len=24 if gamma else 72)  # a window by cost: 64 of headroom
    if costs is not None:
        eng.step_costs = costs
    params = SamplingParams(seed=7, **kw)
    out = eng.generate([PROMPT] * N, max_new_tokens=3, method="pearl", gamma=gamma, seed=7, ignore_eos=True, **kw)
    toks = torch.tensor([r.token_ids for r in out])
    assert 0 < out[0].stats["acceptance_rate"] < 1
    assert out[0].stats["flush_rounds"] == (0 if costs is None else 1)
    sampling = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    p1 = next_probs(hf, PROMPT, **sampling)  # transformers' warpers: independent of our filter
    joint = torch.stack([p1[a] * next_probs(hf, PROMPT + [a], **sampling) for a in range(V)])
    emp = torch.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V).double() / N
    assert 0.5 * (emp - joint.flatten().double()).abs().sum() <= total_variation_bound(V * V, N)
    a = int(joint.sum(1).argmax())  # the likeliest first token: check the third given the first two
    sel = toks[:, 0] == a
    cond = torch.stack([next_probs(hf, PROMPT + [a, b], **sampling) for b in range(V)])
    cond = (cond * (joint[a] / joint[a].sum())[:, None]).flatten()
    emp3 = torch.bincount(toks[sel, 1] * V + toks[sel, 2], minlength=V * V).double() / int(sel.sum())
    assert 0.5 * (emp3 - cond.double()).abs().sum() <= total_variation_bound(V * V, int(sel.sum()))


def test_draft_on_its_own_device_adapter(models, tokenizer, ar_out, tiny_dir):
    """A draft on another device than the target is wrapped so inputs/outputs cross devices;
    same tokens (the adapter forced CPU->CPU here, cuda:0 -> cuda:1 on a two-GPU machine)."""
    from specengine.runtime.cross_device import CrossDeviceDraft

    if torch.cuda.device_count() > 1:
        eng = Engine(load_model(tiny_dir, device="cuda:0")[0], tokenizer, load_model(tiny_dir, device="cuda:1")[0],
                     max_seq_len=256)
    else:
        eng = Engine(models[0], tokenizer, load_model(tiny_dir)[0], max_seq_len=256)
        eng.draft = CrossDeviceDraft(eng.draft, eng.device)
    assert isinstance(eng.draft, CrossDeviceDraft)
    for method in ("pearl", "sd"):
        out = eng.generate(PROMPTS, max_new_tokens=40, method=method, gamma=3, ignore_eos=True)
        assert [r.token_ids for r in out] == [r.token_ids for r in ar_out]


@pytest.fixture
def mid_call_probes(monkeypatch):
    """PEARL probing later in a call too, as on CUDA (on a CPU its probes fall on first rounds only:
    `test_on_a_cpu_probes_fall_on_a_calls_first_round_only`): the wait, flush and catch-up machinery;
    its draft reads the prompt up front (where PEARL's rounds lose the deferred read never pays, and
    probes wait for it: test_draft_prime.py)."""
    from specengine.methods.pearl import Pearl

    monkeypatch.setattr(Pearl, "_probes_mid_call", lambda self: True)
    monkeypatch.setattr(Pearl, "defers_draft_prefill", False)


def test_a_window_chosen_by_cost_falls_back_to_plain_rounds_losslessly(models, tokenizer, ar_out, monkeypatch, mid_call_probes):
    """pearl with its window chosen by cost, where the costs say a PEARL round loses to a plain
    decode: it decodes plainly (pending drafts verified first, the draft kept to the committed
    tokens), runs a PEARL round every 16 plain ones (the draft resynced first), and gives ar's
    tokens; with the window given, it never falls back."""
    from specengine.runtime.step_costs import StepCosts

    target, same, _ = models
    eng = Engine(target, tokenizer, same, max_seq_len=256)
    losing = StepCosts(3, draft_s=0.5, target_s=tuple(1.0 + w for w in range(17)))
    monkeypatch.setattr(eng, "step_costs", lambda state, width: losing)
    out = eng.generate(PROMPTS, max_new_tokens=40, method="pearl", ignore_eos=True)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar_out]
    s = out[0].stats
    assert s["plain_rounds"] >= 32 and s["rounds"] > s["plain_rounds"] and s["accepted_drafts"] > 0
    given = eng.generate(PROMPTS, max_new_tokens=40, method="pearl", gamma=2, ignore_eos=True)
    assert [r.token_ids for r in given] == [r.token_ids for r in ar_out] and given[0].stats["plain_rounds"] == 0


def test_a_probes_accepted_window_is_verified_before_plain_rounds_resume(models, tokenizer, ar_out, mid_call_probes):
    """Costs that make PEARL's rounds lose, a draft that agrees with the target everywhere: each probe's
    pre-verify round accepts its token and leaves γ - 1 drafts pending; the next round, plain by the
    costs, verifies them in one target forward (a flush: all accepted, and the bonus) instead of
    dropping them. Same tokens as `ar`; the draft, resynced at the next probe, drafts the target's
    tokens again (every later probe accepted)."""
    target, same, _ = models
    eng = Engine(target, tokenizer, same, max_seq_len=256)
    eng.step_costs = flushing_costs
    gen, _ = eng._start(PROMPTS[0], max_new_tokens=40, method="pearl", ignore_eos=True)
    for _ in gen.rounds():
        pass
    assert gen.rows[0].ids == ar_out[0].token_ids
    trace, g = gen.method.modes.trace, gen.method.gamma
    flushes = [i for i, t in enumerate(trace) if t[0] == "flush"]
    assert flushes and all(trace[i - 1] == ("pre", 1, 1) and trace[i] == ("flush", g - 1, g - 1) for i in flushes)
    assert gen.method.flushes == len(flushes) >= 2


def test_after_a_flush_the_draft_keeps_only_the_drafts_it_accepted(models, tokenizer, ar_out, mid_call_probes):
    """A draft that disagrees now and then, a window of 4 whose rounds lose to plain steps (a forward
    of 5 costs 3, of up to 4 one): after each probe's accepted pre-verify round a flush verifies the 3
    pending drafts, and one that rejects some leaves the draft's cache valid only up to the new n - 1
    (the correction it never saw and the drafts after it are not its tokens)."""
    from specengine.runtime.step_costs import StepCosts

    target, _, perturbed = models
    eng = Engine(target, tokenizer, perturbed, max_seq_len=320)
    eng.step_costs = lambda state, width, draft=True: StepCosts(state.batch, 0.25, tuple(1.0 if w < 4 else 3.0
                                                                                         for w in range(width)))
    rejected = 0
    for prompt in PROMPTS:
        ar = eng.generate(prompt, max_new_tokens=200, method="ar", ignore_eos=True).token_ids
        gen, _ = eng._start(prompt, max_new_tokens=200, method="pearl", ignore_eos=True)
        seen, trace = 0, gen.method.modes.trace
        for _ in gen.rounds():
            if len(trace) == seen:  # a plain round
                continue
            seen = len(trace)
            kind, proposed, accepted = trace[-1]
            if kind == "flush":
                assert int(gen.ctx.draft.cache.lens[0]) <= int(gen.state.n[0]) - 1
                rejected += accepted < proposed
        assert gen.method.gamma == 4 and gen.rows[0].ids == ar
    assert rejected


def _pearl_rounds(slowdown: float, measured: bool = True, rounds: int = 120) -> list[bool]:
    """PEARL's own round choices (window by cost, greedy) when its rounds take `slowdown` times what
    the model predicts and plain rounds take what it predicts: which rounds decoded plainly."""
    from specengine.methods.pearl import Pearl, PearlModes
    from specengine.runtime.step_costs import StepCosts

    p = Pearl()
    p.ctx = types.SimpleNamespace(device=torch.device("cpu"))
    p.gamma, p.costs = 3, StepCosts(1, 0.1, tuple(1.0 + 0.05 * w for w in range(5)), measured=measured)
    p.calibrate = measured
    p.modes = PearlModes(torch.zeros(1, dtype=torch.bool))
    return [_one_round(p, lambda p: ([2], [3]), slowdown)[0] for _ in range(rounds)]


def _one_round(p, outcome, slowdown: float = 1.0) -> tuple[bool, list[int], list[int]]:
    """One round of PEARL's choices as `Pearl.round` books it, without the models: plain or not, then
    the round's (n_acc, num_draft) (`outcome(pearl)` for a PEARL round), its time `slowdown` x the
    model's for a PEARL round."""
    plain = p._plain_wins()
    p._book(plain)
    p.wait.count(plain)
    n_acc, num_draft = ([0], [0]) if plain else outcome(p)
    p.after_round(n_acc, num_draft)
    p.timed(p._kind[1] * (1.0 if plain else slowdown))
    return plain, n_acc, num_draft


def test_pearl_by_cost_settles_on_plain_rounds_when_its_rounds_measure_slower(mid_call_probes):
    """The model says PEARL's rounds win (draft 0.1 of a decode, 2 of 3 accepted); measured 3x
    slower than predicted, they lose: after a few rounds of each kind PEARL decodes plainly,
    probing every 16 plain rounds; measured as predicted, it keeps its rounds."""
    slow = _pearl_rounds(3.0)
    assert not slow[0] and any(slow[:12])  # the model's choice first, plain rounds timed early
    assert sum(slow[40:]) > 0.85 * len(slow[40:]) and not all(slow[40:])
    fair = _pearl_rounds(1.0)
    assert sum(fair) <= 4
    assert not any(_pearl_rounds(3.0, measured=False))  # pinned costs: the model alone


def test_a_probe_that_confirms_plain_rounds_doubles_the_wait(mid_call_probes):
    """Settled on plain rounds, PEARL probes after 16, then 32, then 64 plain rounds (each probe
    pays the draft's catch-up and a losing round: every 16 rounds, PEARL settled on plain ran
    0.83-0.95x `ar` on the real pair), as sd's γ auto does."""
    slow = _pearl_rounds(3.0, rounds=240)
    pearl_rounds = [i for i, plain in enumerate(slow) if not plain]
    settled = next(i for i in range(1, len(pearl_rounds)) if pearl_rounds[i] - pearl_rounds[i - 1] > 1)
    probes = pearl_rounds[settled - 1:]  # the last PEARL round before settling, then the probes
    assert [b - a - 1 for a, b in zip(probes, probes[1:])] == [16, 32, 64]  # plain rounds between them


def test_on_a_cpu_probes_fall_on_a_calls_first_round_only():
    """On a CPU a probe later in a call first catches the draft up on every token it sat out (~0.13 of
    a target step each on the AVX2 EPYC: settled on plain rounds, PEARL ran 0.91x `ar` in the mean of
    9 HumanEval calls against 0.99x with probes at first rounds only, A/B in one process). The
    calls of `test_a_greedy_call_starts_from_what_the_engines_last_call_learned`: no probe after the
    first call settles; each later probe is a call's first round, where the wait (doubled by each)
    ends within the call: the 2nd, 3rd, 4th and 6th calls (waits 16, 32, 64, 128)."""
    calls = _pearl_calls({}, calls=6)
    first = calls[0]
    assert first[:4] == [False] * 4 and all(first[9:])  # the prior tried, then plain to the end
    assert all(all(later[1:]) for later in calls[1:])  # never a probe past a first round
    assert [i for i, later in enumerate(calls[1:], 2) if not later[0]] == [2, 3, 4, 6]


def _one_of_three(p) -> tuple[list[int], list[int]]:
    return [1], [3]  # one of three accepted: 2 committed


def _pearl_calls(store: dict, calls: int, new: int = 48, outcome=_one_of_three, greedy: bool = True) -> list[list[bool]]:
    """Calls (greedy unless said) of one engine (its acceptance store `store`) of `new` tokens each,
    PEARL's window by measured costs that its rounds take as predicted: by default every PEARL round commits 2 tokens
    where the costs break even at 2.14 (window 3, draft 0.35 of a decode), while the chain model's
    prior at 0.7 expects 2.53; `outcome(pearl)` -> a PEARL round's (n_acc, num_draft) otherwise. Which
    rounds of each call decoded plainly."""
    from specengine.methods.base import CallInputs
    from specengine.methods.pearl import Pearl
    from specengine.runtime.step_costs import StepCosts

    costs = StepCosts(1, 0.35, tuple(1.0 + 0.05 * w for w in range(18)), measured=True)
    ctx = types.SimpleNamespace(device=torch.device("cpu"), acceptance=store, step_costs=lambda state, width: costs)
    state = types.SimpleNamespace(batch=1, tokens=torch.zeros(1, 1, dtype=torch.long),
                                  params=types.SimpleNamespace(greedy=greedy))
    out = []
    for _ in range(calls):
        p, row = Pearl(), types.SimpleNamespace(max_new=new, ids=[], finish_reason=None)
        p.begin(ctx, CallInputs(state, [[1]], [row], 0.0))
        assert p.gamma == 3 and p.calibrate == greedy
        plains = []
        while len(row.ids) < new:
            plain, n_acc, num_draft = _one_round(p, outcome)
            plains.append(plain)
            row.ids += [0] * (1 if plain else n_acc[0] + (n_acc[0] < num_draft[0]))
        out.append(plains)
    return out


def test_a_greedy_call_starts_from_what_the_engines_last_call_learned(mid_call_probes):
    """Where PEARL's rounds lose (AVX2 copy on the Xeon: ~1.9 tokens a window of 3, break-even 2.1),
    each call paid its first windows at the prior's expectation and a probe after 16 plain rounds
    (0.92x `ar`). A greedy call starts from what the engine's last one learned: its rounds' yield
    (plain after one window), and the probe wait it ended on, the plain rounds counted on across
    calls (16 doubled to 32 by the first call's probe, 15 plain rounds since). A wait that ends
    within a call ends at its first round, where the draft owes no catch-up: probes at the first
    rounds of the 2nd, 3rd and 5th calls, each doubling the wait (32, 64, 128 rounds)."""
    calls = _pearl_calls({}, calls=6)
    first = calls[0]
    assert first[:4] == [False] * 4 and first[9:25] == [True] * 16 and not first[25]  # the prior tried; a probe after 16
    for i, later in enumerate(calls[1:], 2):
        assert later[1:] == [True] * (len(later) - 1) and later[0] == (i not in (2, 3, 5)), (i, later)
    fresh, = _pearl_calls({}, calls=1)
    assert fresh == first  # a new engine (store) starts from the prior again
    store = {}
    _pearl_calls(store, calls=1)
    sampled, = _pearl_calls(store, calls=1, greedy=False)  # a seeded sampled call repeats its tokens: no
    assert sampled == _pearl_calls({}, calls=1, greedy=False)[0] and not sampled[0]  # earlier call's state


def test_a_probe_lasts_while_its_windows_are_accepted(mid_call_probes):
    """A pre-verify round commits one token whatever the text: judged on it alone, every probe
    confirmed plain decoding and dropped the drafts it had accepted. With drafts pending, the next
    round verifies them where a post-verify round's own expected tokens beat a plain step. The first
    call: pre-verify rounds accept their token, post-verify rounds 2 of 3 (α 0.75; 2 tokens a round
    on average against a break-even of 2.14, but a post-verify round's 2.3 beat it): settled on
    plain, each probe is its pre-verify round and the post-verify round after it. The second call's
    text turns predictable (4 windows accepted whole): its first-round probe runs on through them,
    PEARL resumes, and plain rounds return after the rejections. Where post-verify rounds cannot
    beat a plain step (a window accepted whole commits no more than plain steps would in its time),
    the pending drafts are dropped."""
    def alternating(p):  # pre-verify: its token accepted; post-verify: 2 of 3 (3 committed), back to pre
        return ([2], [3]) if p.modes.any_post else ([1], [1])

    store = {}
    first, = _pearl_calls(store, calls=1, outcome=alternating)
    probe = next(i for i in range(12, len(first)) if not first[i])  # settled on plain rounds by then
    assert all(first[probe - 16:probe]) and first[probe:probe + 2] == [False, False] and all(first[probe + 2:])
    posts = []

    def accepted_four(p):
        if not p.modes.any_post:
            return [1], [1]  # pre-verify: its one token accepted
        posts.append(1)
        return ([3], [3]) if len(posts) <= 4 else ([0], [3])  # four windows accepted whole, then a rejection

    second, = _pearl_calls(store, calls=1, outcome=accepted_four)
    assert second[:6] == [False] * 6 and all(second[8:24]) and not second[24], second  # probe, 4 + 1 post-verify
    from specengine.methods.pearl import Pearl
    from specengine.runtime.step_costs import StepCosts

    p = Pearl()
    p.ctx = types.SimpleNamespace(device=torch.device("cpu"))
    p.gamma, p.costs, p.modes = 3, StepCosts(1, 0.35, (1.0, 1.0, 1.5, 2.0, 2.5)), types.SimpleNamespace(any_post=True)
    p.accepted = p.proposed = 4.0  # every draft accepted: a window commits 3 tokens in 3.05 plain steps' time
    assert p._plain_wins()


def test_pearl_expects_the_tokens_its_rounds_commit_not_a_chains():
    """A pre-verify round proposes one token and commits one where it is accepted (no bonus: the
    draft's next tokens stay pending for the next round's verify), two where it is rejected (the
    correction); a post-verify round that accepts its γ commits γ. The chain model at that
    acceptance (nearly 1) would expect γ + 1, and counting accepted + 1 per round overstated PEARL's
    rounds by 35% on the real pair (88 counted, 65 committed on HumanEval/1 x 64: its prediction
    error was +34%). PEARL's expected tokens per round, which its plain-round check and its
    prediction use, follow what its rounds commit."""
    from specengine.methods.pearl import Pearl, PearlModes
    from specengine.methods.policies import expected_tokens

    p = Pearl()
    p.gamma, p.modes = 3, PearlModes(torch.zeros(1, dtype=torch.bool))
    for _ in range(30):
        p.after_round([1], [1])  # the one proposed token accepted: one committed
    assert expected_tokens(p.accepted / p.proposed, p.gamma) > 3.5
    assert p.round_tokens() == pytest.approx(1.0, rel=0.05)
    for _ in range(60):
        p.after_round([3], [3])  # post-verify, all γ accepted: γ committed
    assert p.round_tokens() == pytest.approx(3.0, rel=0.05)
    for _ in range(60):
        p.after_round([0], [3])  # rejected at once: the correction alone
    assert p.round_tokens() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("new,probes", [(60, 1), (120, 2)])
def test_pearl_skips_the_probe_its_reply_cannot_repay(models, tokenizer, new, probes, mid_call_probes):
    """Costs that make PEARL's rounds lose: it decodes plainly and probes after 16, then 32 plain
    rounds, but no probe catches up more tokens than the call has left (ProbeWait.due, as sd's γ
    auto): 60 tokens leave room for the first probe only, 120 for two. Tokens stay ar's. (Pinned costs
    carry nothing between calls, so no wait is under way at the first round: no probe there.)"""
    from specengine.runtime.step_costs import StepCosts

    target, _, perturbed = models
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=256)
    eng.step_costs = lambda state, width, draft=True: StepCosts(state.batch, 0.5, tuple(1.0 + w for w in range(width)))
    ar = eng.generate("def f(x):", max_new_tokens=new, method="ar", ignore_eos=True).token_ids
    r = eng.generate("def f(x):", max_new_tokens=new, method="pearl", ignore_eos=True)
    assert r.token_ids == ar
    drafted = [i for i, (proposed, _, _) in enumerate(r.stats["round_log"]) if proposed]
    assert len(drafted) == probes and drafted[0] >= 16, drafted
