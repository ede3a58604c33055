"""A draft whose LM head covers only the most frequent tokens (`draft_vocab`, FR-Spec;
models/subset_head.py, drafting/frequent_vocab.py): the kept ids' logits are the full head's,
the rest -inf; greedy equals `ar`, sampling keeps the target's distribution, the table is
ranked by counted frequency and refuses a tokenizer whose ids name other tokens."""
import pytest
import torch
from conftest import VOCAB, small_vocab_models
from helpers.exact import V, assert_sd_keeps_the_joint, exact_joint

from specengine import Engine, SpecEngineError
from specengine.drafting import frequent_vocab
from specengine.drafting.frequent_vocab import build_table, draft_head_ids, fitting_table, frequent_ids, read_table
from specengine.models.decoder import Linear
from specengine.models.quant_linear import QuantLinear
from specengine.models.subset_head import SubsetHead, set_head_vocab

PROMPTS = ["def add(a, b):\n", "x = [1, 2"]


def q8_rows(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Q8_0 rows (per 32 values: an fp16 scale, then 32 int8)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, cols // 32, 34), generator=g, dtype=torch.uint8)
    blocks[..., :2] = (torch.rand(rows, cols // 32, generator=g) * 0.01 + 0.001).half().view(torch.uint8) \
        .reshape(rows, cols // 32, 2)
    return blocks.reshape(rows, cols // 32 * 34)


class Holder(torch.nn.Module):
    def __init__(self, head):
        super().__init__()
        self.lm_head = head


@pytest.mark.parametrize("kind", ["linear", "q8_0", "q8_0 interleaved"])
def test_the_kept_ids_get_the_full_heads_logits_and_the_rest_minus_inf(kind):
    torch.manual_seed(0)
    if kind == "linear":
        full = Linear(64, 40, bias=False)
    else:
        full = QuantLinear([("Q8_0", q8_rows(40, 64))])
        full.pack(kind.endswith("interleaved"))
    m = Holder(full)
    ids = torch.tensor([0, 3, 7, 8, 21, 39])
    set_head_vocab(m, ids)
    assert isinstance(m.lm_head, SubsetHead) and m.lm_head.out_features == 40
    h = torch.randn(2, 3, 64)
    with torch.inference_mode():
        got, want = m.lm_head(h), full(h)
    rest = torch.ones(40, dtype=torch.bool)
    rest[ids] = False
    torch.testing.assert_close(got[..., ids], want[..., ids])
    assert torch.isneginf(got[..., rest]).all()
    set_head_vocab(m, torch.tensor([1, 2]))  # cut again: from the full head, not the cut one
    assert m.lm_head.head.out_features == 2 and m.lm_head.full[0] is full
    set_head_vocab(m, None)
    assert m.lm_head is full


@pytest.fixture()
def tiny_table(tmp_path, tokenizer, monkeypatch):
    """A table for the test tokenizer, counted over a corpus of ours, as the shipped one."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 20 + "x = [1, 2, 3]\n" * 5)
    shipped = tmp_path / "vocabs"
    build_table(tokenizer, [corpus], shipped / "tiny.safetensors", "test corpus", "test", progress=False)
    monkeypatch.setattr(frequent_vocab, "SHIPPED", shipped)
    return shipped / "tiny.safetensors", corpus.read_text()


def test_the_table_ranks_by_counted_frequency(tiny_table, tokenizer):
    path, text = tiny_table
    ids = read_table(path).tolist()
    counts = {}
    for i in tokenizer(text, add_special_tokens=False)["input_ids"]:
        counts[i] = counts.get(i, 0) + 1
    assert len(ids) == len(tokenizer) and sorted(ids) == list(range(len(tokenizer)))
    ranked = [counts.get(i, 0) for i in ids]
    assert ranked == sorted(ranked, reverse=True) and ranked[0] == max(counts.values())
    unseen = [i for i in ids if i not in counts]
    assert unseen == sorted(unseen)  # ids the corpus never used follow in id order
    kept = frequent_ids(tokenizer, 5, VOCAB)
    specials = set(tokenizer.all_special_ids)  # <eos>, <|im_end|>, ...: no corpus ranks them, a reply ends on one
    assert not specials <= set(ids[:5])
    assert kept.tolist() == sorted(set(ids[:5]) | specials)


def test_greedy_equals_ar_and_the_draft_proposes_only_kept_ids(tiny_pair, tokenizer, tiny_table):
    target, _, draft = tiny_pair
    eng = Engine(target, tokenizer, draft, max_seq_len=128, draft_vocab=12)
    try:
        head = draft.lm_head
        assert isinstance(head, SubsetHead) and head.ids.tolist() == frequent_ids(tokenizer, 12, VOCAB).tolist()
        assert tokenizer.eos_token_id in head.ids.tolist()  # the draft can propose a reply's end
        seen = []
        hook = head.register_forward_hook(lambda mod, args, out: seen.append(out.argmax(-1).flatten()))
        ar = eng.generate(PROMPTS, max_new_tokens=24, method="ar", ignore_eos=True)
        for kw in (dict(gamma=3), dict(gamma="auto"), dict(tree="2x3:5")):
            out = eng.generate(PROMPTS, max_new_tokens=24, method="sd", ignore_eos=True, **kw)
            assert [r.token_ids for r in out] == [r.token_ids for r in ar]
        hook.remove()
        picked = torch.cat(seen)
        assert torch.isin(picked, head.ids).all()
        outside = set(sum((r.token_ids for r in ar), [])) - set(head.ids.tolist())
        assert outside  # the target emitted ids the draft cannot propose, and sd still matched
    finally:
        set_head_vocab(draft, None)


def test_sampling_keeps_the_target_distribution(tmp_path, tokenizer, monkeypatch):
    """V = 8, a draft that can propose 5 of them and the tokenizer's special ids: the joint of two
    sampled tokens matches the target's exact one, and the ids it cannot propose come out at their
    target rate."""
    from safetensors.torch import save_file

    order = [3, 0, 5, 1, 6, 2, 4, 7]  # a ranking of the 8 ids the models know (and the rest)
    ids = order + list(range(V, len(tokenizer)))
    (tmp_path / "vocabs").mkdir()
    path = tmp_path / "vocabs" / "v8.safetensors"
    meta = {"tokens_sha256": frequent_vocab.tokens_sha256(tokenizer, ids)}
    save_file({"ids": torch.tensor(ids, dtype=torch.int32)}, str(path), metadata=meta)
    monkeypatch.setattr(frequent_vocab, "SHIPPED", path.parent)
    hf, target, draft = small_vocab_models(tmp_path / "model", V)
    eng = Engine(target, tokenizer, draft, max_seq_len=40, draft_vocab=5)
    exact = exact_joint(hf, 1.0)
    cut = torch.tensor([i for i in range(V) if i not in draft.lm_head.ids.tolist()])
    assert exact.view(V, V)[cut].sum() > 0.05  # the ids the draft cannot propose matter to the check
    assert_sd_keeps_the_joint(eng, exact)


def test_engines_on_one_draft_model_each_use_their_own_head(tiny_pair, tokenizer, tiny_table):
    """draft_vocab cuts the draft model object's head in place: a later engine on the same
    model sets its own, and each call puts its engine's back."""
    target, _, draft = tiny_pair
    cut = Engine(target, tokenizer, draft, max_seq_len=128, draft_vocab=12)
    full = Engine(target, tokenizer, draft, max_seq_len=128)
    try:
        assert not isinstance(draft.lm_head, SubsetHead)
        cut.generate(PROMPTS[0], max_new_tokens=4, method="sd", gamma=2)
        assert isinstance(draft.lm_head, SubsetHead)
        full.generate(PROMPTS[0], max_new_tokens=4, method="sd", gamma=2)
        assert not isinstance(draft.lm_head, SubsetHead)
    finally:
        set_head_vocab(draft, None)


def test_bad_settings_are_refused(tiny_pair, tokenizer, tiny_table, tmp_path, monkeypatch):
    target, _, draft = tiny_pair
    with pytest.raises(SpecEngineError, match="draft_vocab.*no draft model"):
        Engine(target, tokenizer, draft_vocab=8)
    with pytest.raises(SpecEngineError, match="between 1 and"):
        Engine(target, tokenizer, draft, draft_vocab=10_000)
    with pytest.raises(SpecEngineError, match="draft_vocab must be an integer"):
        Engine(target, tokenizer, draft, draft_vocab=-1)
    Engine(target, tokenizer, draft_vocab=0)  # "no cut" needs no draft
    other = type("Other", (), {"convert_ids_to_tokens": lambda self, ids: [f"t{i}" for i in ids]})()
    with pytest.raises(SpecEngineError, match="no frequency table ships for this tokenizer"):
        frequent_ids(other, 8, VOCAB)
    with pytest.raises(SpecEngineError, match="counted with another tokenizer"):
        frequent_ids(other, 8, VOCAB, table=tiny_table[0])
    set_head_vocab(draft, None)
    assert not isinstance(draft.lm_head, SubsetHead)


def test_auto_cuts_where_a_table_fits_and_halves_the_head(tiny_pair, tokenizer, tiny_table, monkeypatch):
    """draft_vocab "auto" (the default): AUTO ids where a shipped table fits the tokenizer and
    the draft's vocabulary is at least twice that; else the full head. 0: never."""
    other = type("Other", (), {"convert_ids_to_tokens": lambda self, ids: [f"t{i}" for i in ids],
                               "__len__": lambda self: 10**6})()
    assert fitting_table(tokenizer)[0] == tiny_table[0] and fitting_table(other) is None
    monkeypatch.setattr(frequent_vocab, "AUTO", 12)
    assert draft_head_ids("auto", tokenizer, VOCAB).tolist() == frequent_ids(tokenizer, 12, VOCAB).tolist()
    assert draft_head_ids("auto", tokenizer, 23) is None  # would not halve the head
    assert draft_head_ids("auto", other, VOCAB) is None  # no table fits: no cut, no error
    assert draft_head_ids("auto", object(), VOCAB) is None  # a stand-in that names no tokens (benchmarks)
    assert draft_head_ids(0, tokenizer, VOCAB) is None
    target, _, draft = tiny_pair
    try:
        Engine(target, tokenizer, draft, max_seq_len=64)
        assert isinstance(draft.lm_head, SubsetHead)
        assert draft.lm_head.ids.tolist() == frequent_ids(tokenizer, 12, VOCAB).tolist()
        Engine(target, tokenizer, draft, max_seq_len=64, draft_vocab=0)
        assert not isinstance(draft.lm_head, SubsetHead)
    finally:
        set_head_vocab(draft, None)


def test_training_refuses_a_cut_head(tiny_pair, tokenizer, tiny_table, tmp_path):
    from specengine.training.head import HeadRecipe, prepare_data

    target, _, draft = tiny_pair
    try:
        eng = Engine(target, tokenizer, draft, max_seq_len=64, draft_vocab=12)
        with pytest.raises(SpecEngineError, match="full LM head.*draft_vocab=0"):
            prepare_data(eng, HeadRecipe(), tmp_path / "head.safetensors", tmp_path, "train-head")
    finally:
        set_head_vocab(draft, None)


def test_set_draft_head_takes_ids_of_ones_own(tiny_pair, tokenizer):
    """Engine.set_draft_head: a cut from given ids (no table needed), kept by later calls;
    greedy still equals ar; None gives the full head back; no draft is refused."""
    target, _, draft = tiny_pair
    eng = Engine(target, tokenizer, draft, max_seq_len=128, draft_vocab=0)
    try:
        ar = eng.generate(PROMPTS, max_new_tokens=16, method="ar", ignore_eos=True)
        eng.set_draft_head(torch.arange(0, VOCAB, 3))
        out = eng.generate(PROMPTS, max_new_tokens=16, method="sd", gamma=3, ignore_eos=True)
        assert isinstance(draft.lm_head, SubsetHead) and len(draft.lm_head.ids) == len(range(0, VOCAB, 3))
        assert [r.token_ids for r in out] == [r.token_ids for r in ar]
        eng.set_draft_head(None)
        eng.generate(PROMPTS[0], max_new_tokens=2, method="sd", gamma=2)
        assert not isinstance(draft.lm_head, SubsetHead)
        with pytest.raises(SpecEngineError, match="needs a draft model"):
            Engine(target, tokenizer).set_draft_head(None)
    finally:
        set_head_vocab(draft, None)
