"""The round's eager tail: on the GPU path every forward replays a CUDA graph, and what runs
between the graphs (input copies, sampling, the commit, the driver's read-out) is launched
kernel by kernel. A budget per round keeps that tail short, and a budget from a round's one
host sync to its first graph replay keeps the device's idle gap short (issue 26: "the draft
chain, the verify, the sampler and the commit with no eager gaps between them").

Counted on CPU with the GPU op selection forced (Triton attention, sampler and commit under
the interpreter, the engine's `kernels="triton"`) and graphs on through a stand-in capture
whose replays are marked: every aten op outside a replay that is not a view or an
allocation, plus every Triton launch, is a launch a GPU would see. The interpreter runs each
kernel once per call signature in this module (helpers/launches.py, Rehearsal: later calls
report the launches the first made and compute with the torch reference), which took the file
from ~150 to ~30 test-seconds on a 2-core Zen 5; the last test holds the shortcut to the full
path, launch for launch."""
import dataclasses
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specengine import Engine, generation

pytest.importorskip("triton")
from helpers.launches import NO_KERNEL, Rehearsal  # noqa: E402

pytestmark = pytest.mark.interpreter  # kernels on CPU tensors (conftest.py)

# aten ops that launch nothing when they change nothing (a `.to` to the dtype a tensor has, a
# reshape of a contiguous one); the cast or copy one of them does make is not counted
MAYBE_NOTHING = {"to", "contiguous", "resolve_conj", "resolve_neg", "flatten", "reshape", "detach_"}


SYNC = "SYNC"  # a device value read on the host


class RoundLaunches(TorchDispatchMode):
    """Eager launches per round, and from each round's sync to its first graph replay."""

    def __init__(self, rehearsal: Rehearsal | None = None):
        super().__init__()
        self.rehearsal = rehearsal
        self.depth = 0  # > 0 inside a graph replay or a Triton launch
        self.rounds: list[list[str]] = []
        self.before_replay: list[int] = []  # launches from the sync to the first replay, per round
        self.captured: set[int] = set()  # rounds that captured a graph (and ran its warm-ups)

    def launch(self, name):
        if self.rehearsal is not None:
            self.rehearsal.note(name, self.depth)
        if self.depth == 0 and self.rounds:
            self.rounds[-1].append(name)

    def replay(self, fn):
        if self.rounds and len(self.before_replay) < len(self.rounds):
            self.before_replay.append(len(self.rounds[-1]))
        self.depth += 1
        try:
            fn()
        finally:
            self.depth -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.launch(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def rehearsal():
    """The engine's Triton ops, interpreted once per call signature in this module (helpers/launches.py)."""
    return Rehearsal()


@pytest.fixture()
def counted(monkeypatch, rehearsal):
    """A RoundLaunches that sees Triton launches, graph replays and round boundaries."""
    from helpers.launches import launch_class

    InterpretedFunction = launch_class()  # noqa: N806 - the class whose `run` launches a kernel here

    counter = RoundLaunches(rehearsal)
    monkeypatch.setattr(rehearsal, "counter", counter)
    real_run, real_step = InterpretedFunction.run, generation.Generation.step

    def run(self, *a, **k):
        counter.launch("triton:" + self.fn.__name__)
        counter.depth += 1
        try:
            return real_run(self, *a, **k)
        finally:
            counter.depth -= 1

    def step(gen):
        counter.rounds.append([])
        return real_step(gen)

    def syncing(name):
        real = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            counter.launch(SYNC)
            return real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, read)
    for name in ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        syncing(name)
    monkeypatch.setattr(InterpretedFunction, "run", run)
    monkeypatch.setattr(generation.Generation, "step", step)
    return counter


def marking_capture(counter):
    def capture(fn, pool, device):
        counter.captured.add(len(counter.rounds) - 1)  # a capture's round is not counted
        fn(), fn()  # the warm-up runs a capture makes
        return type("Marked", (), {"replay": staticmethod(lambda: counter.replay(fn))})()
    return capture


def round_launches(engine, counter, **kw):
    """(eager launches per round, launches from each round's sync to the next round's first
    graph replay), for the rounds of one generation that captured nothing (nor did the round
    before them)."""
    engine.set_cuda_graphs(True, capture=marking_capture(counter), lazy=True)
    with torch.inference_mode(), counter:
        engine.generate(["def add(a, b):\n"], ignore_eos=True, **{"max_new_tokens": 16, **kw})
    assert len(counter.before_replay) == len(counter.rounds)  # every round replays a graph
    rounds = [[op for op in r if op not in MAYBE_NOTHING] for r in counter.rounds]
    plain = [i for i in range(1, len(rounds)) if not {i - 1, i} & counter.captured]
    gaps = [len(rounds[i - 1]) - rounds[i - 1].index(SYNC) - 1 + counter.before_replay[i] for i in plain]
    return [rounds[i] for i in plain], gaps


def triton_engine(tiny_pair, tokenizer):
    from helpers.fakes import random_drafter
    from helpers.fakes import random_head

    target, _, draft = tiny_pair
    return Engine(target, tokenizer, draft, max_seq_len=128, kernels="triton",
                  acceptance_head=random_head(draft, seed=3, bias=1.0), parallel_drafter=random_drafter(draft, k_max=3))


@pytest.fixture(scope="module")
def engine(tiny_pair, tokenizer, rehearsal):
    """Every op on Triton, each kernel shape interpreted once in this module (the rehearsal)."""
    eng = triton_engine(tiny_pair, tokenizer)
    for runner in (eng.target, eng.draft):
        runner.set_kernels(rehearsal.table(runner.normal_ops))
    return eng


# method -> (call, eager launches per round, launches from a round's sync to the next round's
# first graph replay). Set a few launches above what this test counted when they were set
# (docs/design.md, "A round's eager tail", has the counts before and after).
CALLS = {
    "ar": (dict(method="ar"), 13, 4),
    "sd": (dict(method="sd", gamma=3), 30, 7),
    "sd-sampled": (dict(method="sd", gamma=3, temperature=0.9, seed=3), 31, 7),
    "specdec++": (dict(method="sd", policy="specdec++", gamma=4, threshold=0.5), 74, 13),
    "parallelspec": (dict(method="parallelspec", gamma=3), 48, 14),
    "sd-tree": (dict(method="sd", tree="2x3:5"), 132, 11),
    "parallelspec-tree": (dict(method="parallelspec", tree="2x2"), 90, 13),
    "pearl": (dict(method="pearl", gamma=3), 52, 11),
    "pearl-parallel": (dict(method="pearl", policy="parallel", gamma=3, max_new_tokens=8), 74, 17),
    "ngram": (dict(method="ngram", gamma=4, max_new_tokens=24), 17, 9),  # counted 14, 7
    "ngram-tree": (dict(method="ngram", tree="2x3:5", max_new_tokens=24), 42, 12),  # counted 39, 10
    # counted 76, 9: a draft round after n-gram rounds reads what the draft missed (~10 launches a forward)
    "hybrid": (dict(method="hybrid", gamma=4, max_new_tokens=48), 82, 12),
}


@pytest.fixture()
def gpu_policies(monkeypatch):
    """SpecDec++ as on CUDA: its stop flags stay on the device (on a CPU it reads them per
    draft step, which costs nothing without an asynchronous queue)."""
    from specengine.methods.policies import SpecDecPolicy

    attach = SpecDecPolicy.attach
    monkeypatch.setattr(SpecDecPolicy, "attach", lambda self, head, early_exit: attach(self, head, False))


@pytest.mark.parametrize("name", list(CALLS))
def test_one_sync_and_a_short_eager_tail_per_round(engine, counted, gpu_policies, name):
    kw, per_round, sync_to_replay = CALLS[name]
    rounds, before = round_launches(engine, counted, **kw)
    print("COUNTS", name, max(len(r) for r in rounds), max(before), len(rounds))  # -s shows the counts
    assert len(rounds) >= 2 and len(before) == len(rounds)
    for r, ops in enumerate(rounds):
        assert ops.count(SYNC) == 1, (r, ops)  # the round's one host sync
        assert len(ops) <= per_round, (len(ops), " ".join(ops))
    assert max(before) <= sync_to_replay, (before, rounds[0])


@pytest.mark.parametrize("name", ["sd", "sd-tree", "pearl"])  # the chain, tree and PEARL captures
def test_log_probabilities_ride_the_rounds_one_sync(engine, counted, gpu_policies, name):
    """generate(logprobs=k) reads each round's log-probabilities in the sync it already has."""
    kw = CALLS[name][0]
    rounds, _ = round_launches(engine, counted, logprobs=2, **kw)
    assert len(rounds) >= 2 and all(ops.count(SYNC) == 1 for ops in rounds), rounds


def test_the_counter_sees_an_eager_tail(engine, counted, gpu_policies, monkeypatch):
    """The budgets can fail: with the torch commit (eleven launches) ar is over its budget,
    and a sync inside a round is seen."""
    from specengine.kernels.commit_tokens import commit_tokens_ref

    def commit_with(fn):  # the table's commit replaced (applied when round_launches sets the graphs)
        monkeypatch.setattr(engine.target, "normal_ops", dataclasses.replace(engine.target.normal_ops,
                                                                              commit_tokens=fn))

    commit_with(commit_tokens_ref)
    rounds, _ = round_launches(engine, counted, method="ar")
    assert min(len(r) for r in rounds) > CALLS["ar"][1]
    counted.rounds.clear(), counted.before_replay.clear()
    engine.set_cuda_graphs(False)
    commit_with(lambda *a: (commit_tokens_ref(*a), a[1].tolist()))
    rounds, _ = round_launches(engine, counted, method="ar")
    assert all(r.count(SYNC) == 2 for r in rounds)


@pytest.mark.parametrize("name", ["sd", "sd-tree", "pearl"])  # a chain, a tree, PEARL's overlap
def test_the_rehearsal_counts_what_every_kernel_run_counts(tiny_pair, tokenizer, engine, counted, gpu_policies, name,
                                                           monkeypatch):
    """The shortcut against the full path: the same rounds counted with every Triton op
    interpreted at every call (a fresh engine) and with the module's rehearsal (each call
    signature interpreted once, then its launches reported): launch for launch alike."""
    kw = CALLS[name][0]
    rehearsed = round_launches(engine, counted, **kw)
    for name, empty in (("rounds", []), ("before_replay", []), ("captured", set()), ("rehearsal", None)):
        monkeypatch.setattr(counted, name, empty)  # the patched launches now feed a fresh count
    full = round_launches(triton_engine(tiny_pair, tokenizer), counted, **kw)
    assert rehearsed == full
