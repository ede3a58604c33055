"""The exact target distribution of a tiny model's next tokens, by transformers' own logits
warpers (temperature, then top-k, then top-p: HF's order), never by our filter, so a broken
top-k / top-p in specengine cannot hide behind a reference that shares it."""
import torch

V, N, PROMPT = 8, 50_000, [3, 5, 2]  # 50k rows: TV bound 0.024, a dropped top-k filter moves 0.12


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The target distribution by transformers' warpers (independent of specengine.methods.sampling)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    ids, scores = torch.zeros(1, 1, dtype=torch.long), logits.float()[None]
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return torch.softmax(scores, -1)[0]


def next_probs(hf, prefix: list[int], **sampling) -> torch.Tensor:
    with torch.no_grad():
        return hf_probs(hf(torch.tensor([prefix])).logits[0, -1], **sampling)


def exact_joint(hf, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """P(t1, t2) over the V*V continuations of PROMPT, flattened."""
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    p1 = next_probs(hf, PROMPT, **kw)
    return torch.stack([p1[a] * next_probs(hf, PROMPT + [a], **kw) for a in range(V)]).flatten()


def assert_sd_keeps_the_joint(eng, exact: torch.Tensor) -> None:
    """sd γ 2 samples two tokens after N copies of PROMPT: their empirical joint is within the
    total-variation bound of `exact`, and some drafts were accepted, some rejected."""
    from helpers.distribution_bounds import total_variation_bound

    out = eng.generate([PROMPT] * N, max_new_tokens=2, seed=7, ignore_eos=True, method="sd", gamma=2,
                       temperature=1.0)
    pairs = torch.tensor([r.token_ids for r in out])
    emp = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double() / N
    assert 0.5 * (emp - exact.double()).abs().sum() <= total_variation_bound(V * V, N)
    assert 0 < out[0].stats["acceptance_rate"] < 1
