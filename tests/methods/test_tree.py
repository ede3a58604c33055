"""Token trees: layout, the lossless acceptance rule, and path compaction."""
import pytest
import torch

from specengine import SpecEngineError
from specengine.kernels.rejection_sampling import rejection_sample_ref
from helpers.distribution_bounds import total_variation_bound
from specengine.methods.token_tree import TokenTree, TreeShape, ancestor_mask, children_table, tree_accept

#        0
#      / | \
#     1  2  3
#    / \     \
#   4   5     6
#   |
#   7
PARENT = torch.tensor([[-1, 0, 0, 0, 1, 1, 3, 4]])


def test_ancestor_mask_and_children():
    m = ancestor_mask(PARENT)[0]
    assert m[7].nonzero().flatten().tolist() == [0, 1, 4, 7]
    assert m[6].nonzero().flatten().tolist() == [0, 3, 6]
    assert m[0].nonzero().flatten().tolist() == [0]
    kids = children_table(PARENT, 3)[0]
    assert kids[0].tolist() == [1, 2, 3] and kids[1].tolist() == [4, 5, -1] and kids[7].tolist() == [-1, -1, -1]


def test_tree_shape_parsing():
    assert TreeShape.parse("4x5:16") == TreeShape(4, 5, 16) and TreeShape.parse("2x3").nodes == 6
    assert TreeShape.parse({"topk": 3, "depth": 2}).nodes == 6
    for bad in ("4y5", "0x3", "4x5:0", 7, "64x8"):
        with pytest.raises(SpecEngineError):
            TreeShape.parse(bad)


def test_greedy_accepts_the_longest_argmax_path():
    V = 10
    logits = torch.randn(1, 8, V, generator=torch.Generator().manual_seed(0))
    # make the path 0 -> 1 -> 4 -> 7 the target's argmax chain, then node 7's argmax is the bonus
    tokens = torch.tensor([[9, 2, 3, 4, 5, 6, 7, 8]])
    for node, child in ((0, 1), (1, 4), (4, 7)):
        logits[0, node, tokens[0, child]] = 50.0
    tree = TokenTree(tokens, PARENT, None)
    out, n_acc, path = tree_accept(logits, tree, torch.zeros(1), torch.zeros(1, dtype=torch.int64),
                                   torch.tensor(0), max_depth=3, max_children=3)
    assert n_acc.tolist() == [3] and path[0].tolist() == [1, 4, 7]
    assert out[0].tolist() == [2, 5, 8, int(logits[0, 7].argmax())]
    # break the chain at depth 2: node 1's argmax is no child -> the correction is that argmax
    logits[0, 1, tokens[0, 4]] = logits[0, 1, tokens[0, 5]] = -50.0  # neither child 4 nor child 5
    out, n_acc, _ = tree_accept(logits, tree, torch.zeros(1), torch.zeros(1, dtype=torch.int64), torch.tensor(0), 3, 3)
    assert n_acc.tolist() == [1] and out[0, :2].tolist() == [2, int(logits[0, 1].argmax())]


def test_a_chain_tree_equals_the_chain_sampler_in_greedy():
    g = torch.Generator().manual_seed(0)
    B, K, V = 6, 4, 7
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.7, logits[:, :K].argmax(-1), torch.randint(0, V, (B, K)))
    tree = TokenTree(torch.cat([torch.zeros(B, 1, dtype=torch.int64), drafts], 1),
                     torch.arange(-1, K).expand(B, K + 1).clone(), None)
    zeros = torch.zeros(B)
    ref, ref_n = rejection_sample_ref(logits, drafts, None, torch.full((B,), K), zeros,
                                      torch.zeros(B, dtype=torch.int64), torch.tensor(0))
    out, n_acc, _ = tree_accept(logits, tree, zeros, torch.zeros(B, dtype=torch.int64), torch.tensor(0), K, 1)
    assert torch.equal(out, ref) and torch.equal(n_acc, ref_n)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_tree_sampling_reproduces_the_target_distribution(temperature):
    """First token ~ p_root; given that it is child x, the second ~ p_x: what the target
    would sample token by token (1e5 rows, one seed each; TV within the sampling bound)."""
    g = torch.Generator().manual_seed(3)
    V, N = 6, 100_000
    logits = torch.randn(1, 8, V, generator=g) * 1.5
    tokens = torch.tensor([[0, 2, 4, 1, 2, 5, 3, 0]])  # root children 2, 4, 1 (node 1, 2, 3)
    tree = TokenTree(tokens.expand(N, 8), PARENT.expand(N, 8), None)
    seeds = torch.arange(N, dtype=torch.int64)
    out, n_acc, _ = tree_accept(logits.expand(N, 8, V), tree, torch.full((N,), temperature), seeds,
                                torch.tensor(5), max_depth=3, max_children=3)
    p = torch.softmax(logits[0] / temperature, -1)
    first = torch.bincount(out[:, 0], minlength=V).double() / N
    bound = total_variation_bound(V, N)
    assert 0.5 * (first - p[0].double()).abs().sum() < bound
    for node in (1, 2, 3):  # given the first token is this child, the second follows p_node
        rows = out[:, 0] == tokens[0, node]
        n = int(rows.sum())
        second = torch.bincount(out[rows, 1], minlength=V).double() / n
        assert 0.5 * (second - p[node].double()).abs().sum() < total_variation_bound(V, n)


# ---------------------------------------------------------------- end to end (tiny models)
from specengine import Engine  # noqa: E402

PROMPTS = ["def add(a, b):\n", "x = [1, 2", "q"]  # ragged: every row has its own tree


@pytest.fixture(scope="module")
def engines(tiny_pair, tokenizer):
    target, same, perturbed = tiny_pair
    return {"same": Engine(target, tokenizer, same, max_seq_len=256),
            "perturbed": Engine(target, tokenizer, perturbed, max_seq_len=256)}


@pytest.fixture(scope="module")
def ar_out(engines):
    return [r.token_ids for r in engines["same"].generate(PROMPTS, max_new_tokens=40, method="ar", ignore_eos=True)]


@pytest.mark.parametrize("draft", ["same", "perturbed"])
@pytest.mark.parametrize("tree", ["1x3", "2x3", "3x4:8", "4x5:12", "2x1"])
def test_sd_tree_equals_ar(engines, ar_out, draft, tree):
    out = engines[draft].generate(PROMPTS, max_new_tokens=40, method="sd", tree=tree, ignore_eos=True)
    assert [r.token_ids for r in out] == ar_out
    if draft == "same":  # the draft is the target: its top-1 child of the root is always accepted
        assert out[0].stats["acceptance_by_position"][0] == 1.0


@pytest.mark.parametrize("cut", [3, 6, 11])
def test_eos_inside_an_accepted_tree_path(engines, ar_out, tokenizer, tiny_pair, cut):
    """EOS lands mid-path (the same-weights draft accepts whole paths): each row stops right
    after its first EOS, with ar's tokens up to it."""
    target, same, _ = tiny_pair
    eng = Engine(target, tokenizer, same, max_seq_len=256)
    stop = ar_out[0][cut]
    eng.eos_ids = {stop}
    out = eng.generate(PROMPTS, max_new_tokens=40, method="sd", tree="2x4:6")
    for r, ref in zip(out, ar_out):
        end = ref.index(stop) + 1 if stop in ref else len(ref)
        assert r.token_ids == ref[:end] and r.finish_reason == ("eos" if stop in ref else "length")


@pytest.mark.parametrize("tree", ["3x3", "3x4:7"])
def test_drafted_tree_scores_are_the_draft_path_log_probs(engines, tree):
    """Every node's score = the draft's log-probs summed along its root path, computed by
    running the plain draft on prompt + path: the tree forwards see exactly their ancestors."""
    from specengine.kernels.ops import TORCH
    from specengine.methods.steps import draft_tree
    from specengine.runtime.kv_cache import KVCache

    eng = engines["perturbed"]
    gen, _ = eng._start(PROMPTS[:2], max_new_tokens=8, method="sd", tree=tree)
    shape, state = gen.method.tree, gen.state
    t, score = draft_tree(gen.ctx, state, shape, return_scores=True)
    assert t.tokens.shape[1] == shape.nodes + 1
    model = eng.draft.model
    for b in range(2):
        prompt = state.tokens[b, : int(state.n[b])].tolist()
        for j in range(1, t.tokens.shape[1]):
            path, u = [], j
            while u > 0:
                path.append(int(t.tokens[b, u])), (u := int(t.parent[b, u]))
            seq = prompt + path[::-1]
            cache = KVCache.for_model(model, 1, len(seq))
            logp = torch.log_softmax(model(torch.tensor([seq]), cache, TORCH)[0], -1)
            expect = sum(float(logp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(path[::-1]))
            assert abs(expect - float(score[b, j])) < 1e-3, (b, j)
            assert int(t.depth[b, j]) == len(path)


def test_tree_options_are_checked(engines):
    eng = engines["same"]
    with pytest.raises(SpecEngineError, match="tree"):
        eng.generate("q", max_new_tokens=4, method="ar", tree="2x2")
    with pytest.raises(SpecEngineError, match="not gamma"):
        eng.generate("q", max_new_tokens=4, method="sd", tree="2x2", gamma=3)
    with pytest.raises(SpecEngineError, match="KxD"):
        eng.generate("q", max_new_tokens=4, method="sd", tree="wide")


@pytest.mark.parametrize("tree", ["3x4:8", "2x3"])
def test_compacted_caches_equal_a_fresh_prefill(engines, tree):
    """After tree rounds (accepted paths moved by compact_kv) every committed position's K/V,
    in the target and the draft cache, equals a forward over the committed text from scratch."""
    from specengine.kernels.ops import TORCH
    from specengine.runtime.kv_cache import KVCache

    eng = engines["perturbed"]
    out = eng.generate(PROMPTS, max_new_tokens=30, method="sd", tree=tree, ignore_eos=True)
    for runner in (eng.target, eng.draft):
        for b, r in enumerate(out):
            seq = eng.encode(PROMPTS[b])[0][0] + r.token_ids
            # the last round may commit past max_new_tokens (kept ids are cut): compare what we know
            valid = min(int(runner.cache.lens[b]), len(seq) - 1)
            assert valid >= len(seq) - 3  # the draft may be 1-2 behind
            fresh = KVCache.for_model(runner.model, 1, len(seq))
            runner.model(torch.tensor([seq[:valid]]), fresh, TORCH)
            torch.testing.assert_close(runner.cache.kv[:, :, b, :valid], fresh.kv[:, :, 0, :valid], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_sd_tree_on_cuda_equals_ar(tiny_pair, tokenizer, backend):
    """On a GPU: tree verification through the Triton kernel's tree_mask (or the reference),
    compaction through the CUDA extension (or torch): ar's tokens, fp32."""
    import copy

    target, _, perturbed = (copy.deepcopy(m).to("cuda") for m in tiny_pair)  # the session's models stay on CPU
    eng = Engine(target, tokenizer, perturbed, max_seq_len=256, kernels="auto,attention=" + backend)
    ref = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=40, method="ar", ignore_eos=True)]
    out = eng.generate(PROMPTS, max_new_tokens=40, method="sd", tree="3x4:8", ignore_eos=True)
    assert [r.token_ids for r in out] == ref
