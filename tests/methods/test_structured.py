"""Structured output (issue 66): every method under a constraint is lossless against an independent
reference. Greedy: the same tokens as transformers `generate` with xgrammar's own logits processor
(fp32, token for token). Sampling: the empirical distribution of sampled outputs within the TV bound
of the masked, renormalized target distribution computed from transformers' logits by hand. Grammar
drafting (forced tokens as drafts) changes nothing but the speed; bad constraints are clear errors."""
import json

import pytest
import torch
from helpers.distribution_bounds import total_variation_bound
from helpers.tiny_refs import engine, hf  # noqa: F401 (fixtures)

from specengine import SpecEngineError

xgr = pytest.importorskip("xgrammar")

PROMPT = "abc 12 {"
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}}, "required": ["id", "tag", "ok"]}
CONSTRAINTS = [("json_schema", SCHEMA), ("regex", r"(ab|cd)+[0-9]{2,4}x"), ("choice", ["alpha beta", "alpha gamma"]),
               ("grammar", 'root ::= "(" item ("," item)* ")"\nitem ::= [a-d]+ | [0-9]')]
CASES = [("ar", {}), ("sd", dict(gamma=3)), ("sd", dict(gamma="auto")), ("sd", dict(tree="2x3:5")),
         ("pearl", dict(gamma=3)), ("parallelspec", dict(gamma=3)), ("parallelspec", dict(tree="2x3:5")),
         ("ngram", dict(gamma=4)), ("ngram", dict(tree="2x3:5")), ("ngram", dict(tree="auto")), ("suffix", dict(tree="auto")),
         ("hybrid", dict(gamma=3))]


STOP = [1, 3]  # the engine's end-of-sequence ids for this tokenizer (<eos>, and <|im_end|> of its chat template)


def compiled(tokenizer, vocab: int, kind: str, value):
    """The reference's grammar, compiled by xgrammar directly (not through specengine)."""
    comp = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=STOP))
    if kind == "json_schema":
        return comp.compile_json_schema(json.dumps(value), any_whitespace=False)
    if kind == "regex":
        return comp.compile_regex(value)
    if kind == "choice":
        return comp.compile_regex("|".join(f"({c})" for c in value))
    return comp.compile_grammar(value)


def hf_constrained(hf, tokenizer, kind, value, max_new: int) -> list[int]:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    proc = xgr.contrib.hf.LogitsProcessor(compiled(tokenizer, hf.config.vocab_size, kind, value))
    out = hf.generate(ids, max_new_tokens=max_new, do_sample=False, logits_processor=[proc], eos_token_id=STOP,
                      pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("kind,value", CONSTRAINTS, ids=[c[0] for c in CONSTRAINTS])
def test_every_method_under_a_constraint_gives_transformers_constrained_tokens(engine, hf, tokenizer, kind, value):
    assert sorted(engine.eos_ids) == STOP
    ref = hf_constrained(hf, tokenizer, kind, value, 40)
    for method, opts in CASES:
        for draft in (True, False):
            r = engine.generate(PROMPT, max_new_tokens=40, method=method, grammar_draft=draft, **{kind: value}, **opts)
            assert r.token_ids == ref, (method, opts, draft, r.text, tokenizer.decode(ref))
            assert r.finish_reason == ("eos" if ref[-1] in STOP else "length")


def test_pearls_flush_under_a_constraint_gives_transformers_constrained_tokens(tiny_pair, hf, tokenizer, monkeypatch):
    """PEARL with its window by cost, where a pre-verify round wins and a post-verify round loses (draft
    0.5 of a step, every width one step), and a draft with the target's weights: each accepted window
    is verified alone (`pearl_round.flush_pending`), its pending drafts walked by the grammar like any
    verify's. Greedy, every constraint: transformers' constrained tokens. The draft reads the prompt up
    front (deferred, a constrained reply's projected length would not pay for it early on)."""
    from helpers.fakes import flushing_costs

    from specengine import Engine
    from specengine.methods.pearl import Pearl

    monkeypatch.setattr(Pearl, "defers_draft_prefill", False)

    target, same, _ = tiny_pair
    eng = Engine(target, tokenizer, same, max_seq_len=256, dtype="float32")
    eng.step_costs = flushing_costs
    flushes = 0
    # the last takes the draft's first token (the unconstrained text is 'n55fy5:!...') and forbids its
    # second: the first flush's pending draft must be rejected by the constraint
    for kind, value in CONSTRAINTS + [("regex", "n[^5]*")]:
        ref = hf_constrained(hf, tokenizer, kind, value, 40)
        r = eng.generate(PROMPT, max_new_tokens=40, method="pearl", grammar_draft=False, **{kind: value})
        assert r.token_ids == ref, (kind, r.text, tokenizer.decode(ref))
        flushes += r.stats["flush_rounds"]
    assert flushes


def test_outputs_parse_and_end_where_the_grammar_ends(engine):
    r = engine.generate(PROMPT, max_new_tokens=80, method="ngram", json_schema=SCHEMA)
    assert r.finish_reason == "eos", r.text
    obj = json.loads(r.text)
    assert set(obj) == {"id", "tag", "ok"} and obj["tag"] in ("red", "green", "blue") and isinstance(obj["ok"], bool)
    assert r.stats["grammar_tokens"] > 0  # keys, quotes and enum tails came from the grammar
    for method in ("sd", "hybrid"):
        on = engine.generate(PROMPT, max_new_tokens=80, method=method, gamma=3, json_schema=SCHEMA)
        off = engine.generate(PROMPT, max_new_tokens=80, method=method, gamma=3, json_schema=SCHEMA,
                              grammar_draft=False)
        assert on.token_ids == off.token_ids == r.token_ids
        assert on.stats["grammar_tokens"] > 0 and on.stats["grammar_rounds"] > 0 and off.stats["grammar_tokens"] == 0
        assert on.stats["target_forwards"] < off.stats["target_forwards"]
    r = engine.generate(PROMPT, max_new_tokens=30, method="sd", gamma=3, choice=["alpha beta", "alpha gamma"])
    assert r.text in ("alpha beta", "alpha gamma")
    r = engine.generate(PROMPT, max_new_tokens=5, json_schema=SCHEMA)  # cut mid-object
    assert r.finish_reason == "length" and r.text == '{"id"'
    plain = engine.generate(PROMPT, max_new_tokens=8, method="sd", gamma=3)
    assert plain.stats["grammar_tokens"] is None


def test_a_batch_mixes_rows_under_different_constraints_and_none(engine, hf, tokenizer):
    """The serving core's case: each row as if decoded alone under its own constraint (or none)."""
    from specengine.generation import Generation
    from specengine.methods.sampling import SamplingParams
    from specengine.structured import Constraint

    rows = [Constraint.parse(json_schema=SCHEMA), None, Constraint.parse(regex=CONSTRAINTS[1][1])]
    ids = tokenizer(PROMPT).input_ids
    from specengine.runtime.step_costs import StepCosts

    measured = engine.step_costs
    for method, opts in (("sd", dict(gamma=3)), ("ngram", dict(gamma=4)), ("ar", {}), ("ngram", dict(tree="auto"))):
        if "tree" in opts:  # free width: wide trees beside the grammar's forced chains in one round
            engine.step_costs = lambda state, width, draft=True: StepCosts(state.batch, 0.0, (1.0,) * width)
        try:
            gen = Generation(engine, [ids] * 3, SamplingParams(), 30, engine.new_method(
                method, opts.get("gamma"), None, None, opts.get("tree")), set(engine.eos_ids), [], constraints=rows)
            for _ in gen.rounds():
                pass
        finally:
            engine.step_costs = measured
        if "tree" in opts:
            assert gen.method.tree_rounds > 0 and gen.method.grammar_rounds > 0
        assert gen.rows[0].ids == hf_constrained(hf, tokenizer, "json_schema", SCHEMA, 30)
        assert gen.rows[2].ids == hf_constrained(hf, tokenizer, "regex", CONSTRAINTS[1][1], 30)
        alone = engine.generate(PROMPT, max_new_tokens=30, method="ar", ignore_eos=False)
        assert gen.rows[1].ids == alone.token_ids


def masked_probs(hf, ids: list[int], allowed: list[int], temperature: float = 1.0) -> torch.Tensor:
    """The target's distribution over `allowed` only, renormalized (by hand from transformers' logits)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1].float() / temperature
    return torch.softmax(logits[allowed], -1)


@pytest.mark.parametrize("method,opts", [("sd", dict(gamma=2)), ("ngram", dict(gamma=3)), ("ar", {})])
def test_sampling_under_a_constraint_keeps_the_masked_target_distribution(engine, hf, tokenizer, method, opts):
    """Two constrained tokens of N rows (row b samples with seed + b): their joint within the TV bound of
    the product of masked, renormalized target conditionals. The regex's last token is forced (EOS
    after two), so grammar drafting runs too."""
    N, first, second = 12_000, "abc", "abcd"
    ids = tokenizer(PROMPT).input_ids
    tok = [tokenizer.convert_tokens_to_ids(c) for c in second]
    exact = torch.stack([masked_probs(hf, ids, tok[:3])[i] * masked_probs(hf, ids + [tok[i]], tok)
                         for i in range(3)]).flatten()
    out = engine.generate([PROMPT] * N, max_new_tokens=3, method=method, temperature=1.0, seed=3,
                          regex=f"[{first}][{second}]", **opts)
    assert all(r.token_ids[-1] in STOP and len(r.token_ids) == 3 for r in out)  # EOS, forced, ends every row
    pairs = torch.tensor([[tok.index(t) for t in r.token_ids[:2]] for r in out])
    emp = torch.bincount(pairs[:, 0] * 4 + pairs[:, 1], minlength=12).double() / N
    tv = 0.5 * (emp - exact.double()).abs().sum().item()
    assert tv <= total_variation_bound(12, N), tv


@pytest.mark.parametrize("method", ["ar", "sd", "ngram", "pearl"])
def test_processed_logprobs_are_the_constrained_distribution(engine, method):
    """logprobs_mode="processed" reports the distribution sampled from: under a choice constraint
    the forced first token has log-probability 0 and every alternative listed is allowed; raw stays
    the model's own."""
    kw = dict(max_new_tokens=6, temperature=1.0, seed=2, choice=["alpha beta", "alpha gamma"], logprobs=3, method=method)
    processed = engine.generate(PROMPT, logprobs_mode="processed", **kw)
    raw = engine.generate(PROMPT, **kw)
    assert processed.token_ids == raw.token_ids and processed.text.startswith("alpha")
    assert processed.logprobs[0].logprob == 0.0 and raw.logprobs[0].logprob < 0
    for entry in processed.logprobs:  # the alternatives the grammar refuses have no mass: 'b' or 'g' at most
        assert len([v for v in entry.top.values() if v > float("-inf")]) <= 2


def test_bad_constraints_are_clear_errors(engine):
    with pytest.raises(SpecEngineError, match="json_schema cannot be compiled: .*objec") as e:
        engine.generate(PROMPT, max_new_tokens=4, json_schema={"type": "objec"})
    assert e.value.param == "json_schema"
    with pytest.raises(SpecEngineError, match="not valid JSON"):
        engine.generate(PROMPT, max_new_tokens=4, json_schema="{oops")
    with pytest.raises(SpecEngineError, match="regex does not compile"):
        engine.generate(PROMPT, max_new_tokens=4, regex="a(b")
    with pytest.raises(SpecEngineError, match="one output constraint, not json_schema and regex"):
        engine.generate(PROMPT, max_new_tokens=4, json_schema=SCHEMA, regex="a")
    with pytest.raises(SpecEngineError, match="non-empty list"):
        engine.generate(PROMPT, max_new_tokens=4, choice=[])
    with pytest.raises(SpecEngineError, match="response_format"):
        engine.generate(PROMPT, max_new_tokens=4, response_format={"type": "xml"})
    with pytest.raises(SpecEngineError, match="grammar cannot be compiled"):
        engine.generate(PROMPT, max_new_tokens=4, grammar="root ::= undefined_rule")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert engine.generate(PROMPT, max_new_tokens=4, response_format=fmt).token_ids == \
        engine.generate(PROMPT, max_new_tokens=4, json_schema=SCHEMA).token_ids
    assert engine.generate(PROMPT, max_new_tokens=4, response_format={"type": "text"}).stats["grammar_tokens"] is None


def test_a_grammar_the_tokenizer_cannot_write_ends_the_row_with_a_reason(engine):
    """No token of the vocabulary starts the regex (the character tokenizer has no 'Z'): the row ends
    before any token, never with a garbage one."""
    r = engine.generate(PROMPT, max_new_tokens=8, regex="Z+")
    assert r.token_ids == [] and r.finish_reason == "constraint_dead_end"
    from specengine.serve.core import EngineCore  # a served row that ends at admission, alone in the core
    from specengine.request import RequestParams

    core = EngineCore(engine, max_batch=2, method="sd", gamma=3)
    rid = core.add_request(PROMPT, RequestParams(max_new_tokens=8, regex="Z+"))
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [(rid, "constraint_dead_end")]


@pytest.mark.parametrize("V", [69, 1000, 151_936])
def test_both_ways_of_applying_masks_agree_with_xgrammars_kernel(V):
    """structured.rows.apply_masks: unpacked bits (sparse masks) and xgrammar's kernel (dense ones)
    give xgrammar's result bit for bit, on sparse, dense and random masks, odd widths included."""
    from specengine.structured.rows import apply_masks

    g = torch.Generator().manual_seed(V)
    logits = torch.randn(2, 3, V, generator=g)
    words = (V + 31) // 32
    for kind in ("sparse", "dense", "random"):
        masks = torch.randint(-2**31, 2**31 - 1, (6, words), dtype=torch.int32, generator=g)
        if kind == "sparse":
            masks &= torch.randint(0, 2, masks.shape, dtype=torch.int32, generator=g) * 0 + 0x00010001
        elif kind == "dense":
            masks |= ~torch.tensor(1 << 3, dtype=torch.int32)
        ref = logits.reshape(6, V).clone()
        xgr.apply_token_bitmask_inplace(ref, masks, vocab_size=V)
        # logits as a CPU matmul path may give them: transposed ((W @ xᵀ)ᵀ, cpu_matmul "wxt"), not contiguous
        strided = logits.reshape(6, V).t().contiguous().t().reshape(2, 3, V)
        assert not strided.is_contiguous()
        for path in ("sparse", "dense", "auto"):
            assert torch.equal(apply_masks(xgr, logits, masks, V, path).reshape(6, V), ref), (kind, path)
            assert torch.equal(apply_masks(xgr, strided, masks, V, path).reshape(6, V), ref), (kind, path, "strided")
