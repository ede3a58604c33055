"""Every speculative method with a draft model, for tests that hold a model family or a pair
to `ar`'s greedy tokens: chains (fixed, auto γ, SpecDec++ with an untrained head), trees,
PEARL, hybrid n-gram + draft, ParallelSpec with an untrained drafter."""
import pytest

from helpers.fakes import random_drafter, random_head

from specengine.runtime.step_costs import StepCosts

CASES = [("sd", dict(method="sd", gamma=3)), ("sd-auto", dict(method="sd", gamma="auto")),
         ("sd-tree", dict(method="sd", tree="2x2")), ("pearl", dict(method="pearl")),
         ("hybrid", dict(method="hybrid", gamma=2)), ("specdec", dict(method="sd", policy="specdec++")),
         ("parallelspec", dict(method="parallelspec"))]
every_method = pytest.mark.parametrize("kw", [c[1] for c in CASES], ids=[c[0] for c in CASES])


def pinned_costs(state, width, draft=True):
    """Step costs under which every cost-driven choice drafts (γ auto, PEARL's window 3), whatever the
    machine's timing: measured on a loaded 2-core CI machine, PEARL once decoded plainly (0 accepted)."""
    return StepCosts(state.batch, 0.3 if draft else 0.0, tuple(1.0 + 0.15 * w for w in range(width)))


def generate_tokens(engine, prompts, kw, max_new_tokens=30):
    """The rows' tokens from `engine` with method options `kw` (untrained artifacts installed
    where the method needs one; step costs pinned), and how many drafts were accepted."""
    engine.step_costs = pinned_costs
    if kw.get("policy") == "specdec++":
        engine._heads["greedy"] = random_head(engine.draft.model)
    if kw["method"] == "parallelspec":
        engine._drafter = random_drafter(engine.draft.model, k_max=4)
    out = engine.generate(prompts, max_new_tokens=max_new_tokens, ignore_eos=True, **kw)
    return [r.token_ids for r in out], sum(r.stats.get("accepted_drafts", 0) for r in out)
