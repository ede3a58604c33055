"""Overlapped rounds (docs/design.md, "Overlapped rounds"): `ar` launches round k+1 before the
host reads round k. Forced on here (a GPU engine's default; the logic is the same on a CPU):
tokens against transformers' greedy loop and against the plain driver, EOS / stop strings /
length inside the overlap, and how many rounds were launched."""
import pytest
import torch

from specengine import Engine
from specengine.methods.ar import AutoRegressive

PROMPTS = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5], [8, 8]]


@pytest.fixture(scope="module")
def hf(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()


def engine(tiny_pair, tokenizer, overlap: bool) -> Engine:
    eng = Engine(tiny_pair[0], tokenizer, max_seq_len=96, max_batch=4)
    eng.overlap_rounds = overlap
    return eng


@pytest.fixture
def launches(monkeypatch):
    """How many `ar` rounds were launched (a list, appended per round)."""
    seen = []
    real = AutoRegressive.round

    def counted(self, state, timer):
        seen.append(1)
        return real(self, state, timer)

    monkeypatch.setattr(AutoRegressive, "round", counted)
    return seen


def test_overlapped_ar_is_transformers_greedy_on_ragged_rows(tiny_pair, tokenizer, hf):
    out = engine(tiny_pair, tokenizer, True).generate(PROMPTS, max_new_tokens=14, ignore_eos=True, method="ar")
    for p, r in zip(PROMPTS, out):
        x = torch.tensor([p])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=14, pad_token_id=0)
        assert r.token_ids == ref[0, len(p):].tolist()


def test_the_next_round_is_launched_before_this_one_is_read(tiny_pair, tokenizer, launches):
    gen, _ = engine(tiny_pair, tokenizer, True)._start(PROMPTS, max_new_tokens=6, ignore_eos=True, method="ar")
    gen.step()
    assert len(launches) == 2 and gen._pending is not None
    for _ in gen.rounds():
        pass
    assert len(launches) == 6  # the length limit is foreseen: no round past the last is launched
    gen, _ = engine(tiny_pair, tokenizer, False)._start(PROMPTS, max_new_tokens=6, ignore_eos=True, method="ar")
    gen.step()
    assert len(launches) == 7 and gen._pending is None


def test_eos_stop_strings_and_sampling_inside_the_overlap(tiny_pair, tokenizer, launches):
    plain, ahead = engine(tiny_pair, tokenizer, False), engine(tiny_pair, tokenizer, True)
    ref = plain.generate(PROMPTS, max_new_tokens=12, ignore_eos=True, method="ar")
    eos = ref[0].token_ids[4]
    at = ref[0].token_ids.index(eos)
    for eng in (plain, ahead):
        eng.eos_ids = {eos}
    del launches[:]
    a, b = (e.generate(PROMPTS, max_new_tokens=12, method="ar") for e in (plain, ahead))
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.finish_reason for r in a] == [r.finish_reason for r in b] and a[0].finish_reason == "eos"
    assert a[0].token_ids == ref[0].token_ids[: at + 1]
    del launches[:]
    a, b = (e.generate(PROMPTS[0], max_new_tokens=12, method="ar") for e in (plain, ahead))
    assert a.token_ids == b.token_ids == ref[0].token_ids[: at + 1]
    assert len(launches) == 2 * (at + 1) + 1  # EOS is not foreseen: the overlap launched one round more
    stop = tokenizer.decode(ref[1].token_ids[3:5])
    kw = dict(max_new_tokens=12, ignore_eos=True, method="ar", stop=[stop])
    a, b = plain.generate(PROMPTS[1], **kw), ahead.generate(PROMPTS[1], **kw)
    assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason) and a.finish_reason == "stop"
    kw = dict(max_new_tokens=10, ignore_eos=True, method="ar", temperature=0.9, top_k=20, seed=3, logprobs=2)
    a, b = plain.generate(PROMPTS, **kw), ahead.generate(PROMPTS, **kw)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [[e.logprob for e in r.logprobs] for r in a] == [[e.logprob for e in r.logprobs] for r in b]


def test_only_one_token_rounds_overlap_and_only_a_gpu_engine_by_default(tiny_pair, tokenizer):
    eng = Engine(tiny_pair[0], tokenizer, draft=tiny_pair[2], max_seq_len=96)
    assert eng.overlap_rounds is False  # a CPU runs no ahead of the host
    eng.overlap_rounds = True
    gen, _ = eng._start([5, 9, 2], max_new_tokens=4, method="sd", gamma=2)
    assert gen.method.one_token_rounds is False  # a speculative round's host reads decide the next
    gen, _ = eng._start([5, 9, 2], max_new_tokens=4, method="ar")
    assert gen.method.one_token_rounds is True


def test_sd_gamma_auto_decoding_plainly_overlaps_like_ar_and_still_probes(tiny_pair, tokenizer, monkeypatch):
    """γ auto with costs that make speculation lose decodes plainly; its plain rounds are launched
    ahead like ar's (a GPU's "never slower"), the probes still run, and the tokens are ar's. (The
    draft read the prompt up front: a deferred read never pays under these costs, so none would probe.)"""
    from specengine.methods.sd import SpeculativeDecoding
    from specengine.runtime.step_costs import StepCosts

    monkeypatch.setattr(SpeculativeDecoding, "defers_draft_prefill", False)

    eng = Engine(tiny_pair[0], tokenizer, draft=tiny_pair[2], max_seq_len=160)
    eng.step_costs = lambda state, width, draft=True: StepCosts(state.batch, 5.0, (1.0,) * width)
    eng.overlap_rounds = True
    ref = eng.generate(PROMPTS, max_new_tokens=60, ignore_eos=True, method="ar")
    out = eng.generate(PROMPTS, max_new_tokens=60, ignore_eos=True, method="sd", gamma="auto")
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    stats = out[0].stats
    assert stats["plain_rounds"] > 40 and stats["rounds_launched_ahead"] > 30
    assert any(proposed for proposed, _, _ in stats["round_log"])  # a probe drafted after 16 plain rounds
    eng.overlap_rounds = False
    again = eng.generate(PROMPTS, max_new_tokens=60, ignore_eos=True, method="sd", gamma="auto")
    assert again[0].stats["rounds_launched_ahead"] == 0
    assert [r.token_ids for r in again] == [r.token_ids for r in ref]


def test_pearl_decoding_plainly_overlaps_like_ar_and_still_probes(tiny_pair, tokenizer, monkeypatch):
    """PEARL with its window by cost, where the costs make its rounds lose: its plain stretches are
    launched ahead like ar's (a GPU's "never slower" with every window rejected), only plain steps
    are (a probe waits for the round before it to be read), its probes still run, and the tokens
    are ar's, with the overlap on and off. PEARL probes mid-call as on CUDA (on a CPU only at first
    rounds: Pearl._probes_mid_call), its draft having read the prompt up front (where its rounds lose, the
    deferred read never pays and no probe runs: test_draft_prime.py)."""
    from specengine.generation import Generation
    from specengine.methods.pearl import Pearl
    from specengine.runtime.step_costs import StepCosts

    monkeypatch.setattr(Pearl, "_probes_mid_call", lambda self: True)
    monkeypatch.setattr(Pearl, "defers_draft_prefill", False)

    kinds = []  # (launched ahead, the round was a plain step) per launch
    real = Generation._launch

    def launch(self, ahead):
        out = real(self, ahead)
        if self.method.name == "pearl":
            kinds.append((ahead, self.method.plain_last))
        return out

    monkeypatch.setattr(Generation, "_launch", launch)

    eng = Engine(tiny_pair[0], tokenizer, draft=tiny_pair[2], max_seq_len=160)
    eng.step_costs = lambda state, width, draft=True: StepCosts(state.batch, 0.5, tuple(1.0 + w for w in range(width)))
    eng.overlap_rounds = True
    ref = eng.generate(PROMPTS, max_new_tokens=60, ignore_eos=True, method="ar")
    out = eng.generate(PROMPTS, max_new_tokens=60, ignore_eos=True, method="pearl")
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    stats = out[0].stats
    assert stats["plain_rounds"] > 40 and stats["rounds_launched_ahead"] > 30
    assert stats["rounds"] > stats["plain_rounds"]  # a probe after 16 plain rounds ran a PEARL round
    assert all(plain for ahead, plain in kinds if ahead) and not all(plain for _, plain in kinds)
    eng.overlap_rounds = False
    again = eng.generate(PROMPTS, max_new_tokens=60, ignore_eos=True, method="pearl")
    assert again[0].stats["rounds_launched_ahead"] == 0
    assert [r.token_ids for r in again] == [r.token_ids for r in ref]
    assert again[0].stats["plain_rounds"] == stats["plain_rounds"]  # pinned costs: the same choices, a round later


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_overlapped_rounds_give_the_plain_drivers_tokens(tiny_dir):
    """On a GPU the read-out really is asynchronous (pinned copy, event): graphs on, ragged
    rows, EOS inside the overlap, against the same engine with the overlap off."""
    eng = Engine.from_pretrained(str(tiny_dir), device="cuda", max_seq_len=512, max_batch=4)
    assert eng.overlap_rounds is True
    prompts = ["def add(a, b):\n", "x = [1", "for i in range(10):"]
    ahead = eng.generate(prompts, max_new_tokens=40, method="ar", ignore_eos=True)
    eng.overlap_rounds = False
    plain = eng.generate(prompts, max_new_tokens=40, method="ar", ignore_eos=True)
    assert [r.token_ids for r in ahead] == [r.token_ids for r in plain]
    eng.eos_ids = {plain[0].token_ids[7]}
    plain = eng.generate(prompts, max_new_tokens=40, method="ar")
    eng.overlap_rounds = True
    ahead = eng.generate(prompts, max_new_tokens=40, method="ar")
    assert [(r.token_ids, r.finish_reason) for r in ahead] == [(r.token_ids, r.finish_reason) for r in plain]
