"""ParallelSpec: the parallel drafter, its group-wise training, and the lossless method."""
import pytest
import torch
from conftest import small_vocab_models
from helpers.fakes import random_drafter

from specengine import Engine, SpecEngineError
from specengine.kernels.ops import TORCH
from specengine.models.loading import load_model
from specengine.methods.steps import drafter_layout
from specengine.runtime.kv_cache import KVCache
from specengine.drafting.parallel_drafter import load_drafter
from specengine.training.parallel import ParallelRecipe, _FullSequenceCache, group_layout, mask_logits, train_parallel

RECIPE = ParallelRecipe(packages=("tqdm", "safetensors"), n_train=6, n_val=2, seq_len=40, k_max=4, groups=6,
                        rank=4, topk=8, epochs=4, lr=1e-2, batch=2)


def fresh_draft(tiny_dir, perturb=0.05):
    model = load_model(tiny_dir)[0]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * perturb * p.abs().mean())
    return model


@pytest.fixture(scope="module")
def trained(tiny_pair, tiny_dir, tokenizer, tmp_path_factory):
    target = tiny_pair[0]
    draft = fresh_draft(tiny_dir)
    eng = Engine(target, tokenizer, draft=draft, max_seq_len=128)
    path = tmp_path_factory.mktemp("drafter") / "drafter.safetensors"
    report = train_parallel(eng, path, RECIPE, draft_name="tiny")
    return eng, path, report


def test_group_wise_mask_equals_each_group_alone(tiny_dir):
    draft = fresh_draft(tiny_dir)
    drafter = random_drafter(draft)
    L, k = 20, 4
    x = torch.randint(0, draft.config.vocab_size, (1, L))
    anchors = torch.tensor([5, 9, 14])
    mask_index, tree = group_layout(L, anchors, k)
    T = tree.shape[0]
    tokens = torch.cat([x, torch.zeros(1, T - L, dtype=torch.int64)], 1)
    with torch.no_grad():
        together = drafter(tokens, mask_index[None], _FullSequenceCache(draft, 1, T, "cpu"), TORCH,
                           tree[None])
        for g, a in enumerate(anchors.tolist()):
            alone_tokens = torch.cat([x[:, : a + 1], torch.zeros(1, k - 1, dtype=torch.int64)], 1)
            n = alone_tokens.shape[1]
            idx = torch.cat([torch.zeros(a + 1, dtype=torch.int64), torch.arange(1, k)])[None]
            alone = drafter(alone_tokens, idx, _FullSequenceCache(draft, 1, n, "cpu"), TORCH,
                            torch.ones(n, n, dtype=torch.bool).tril()[None])
            rows = slice(L + g * (k - 1), L + (g + 1) * (k - 1))
            torch.testing.assert_close(together[0, rows], alone[0, a + 1:], atol=1e-4, rtol=1e-4)
        # training's split forward (real rows once without grad, then the masks) gives the same logits
        torch.testing.assert_close(mask_logits(drafter, x, anchors, k)[0], together[0, L:], atol=1e-4, rtol=1e-4)
        # real rows are the plain draft's, whatever the adapters hold
        plain = draft(x, _FullSequenceCache(draft, 1, L, "cpu"), TORCH)
        torch.testing.assert_close(together[0, :L], plain[0], atol=1e-5, rtol=1e-5)


def test_drafter_layout_masks_see_only_valid_real_slots():
    mask_index, tree = drafter_layout(torch.tensor([1, 3]), k=3)  # 4 real slots, 2 masks
    assert mask_index[0].tolist() == [0, 0, 0, 0, 1, 2]
    assert tree[0, 4].tolist() == [True, False, False, False, True, False]  # row 0: one valid real slot
    assert tree[1, 5].tolist() == [True, True, True, False, True, True]
    assert tree[1, 2].tolist() == [True, True, True, False, False, False]  # real rows: causal


def test_training_lowers_the_heldout_loss(trained):
    _, path, report = trained
    assert report.losses[-1] < report.losses[0]
    assert report.val_loss_after < report.val_loss_before
    assert len(report.val_mask_agreement_after) == RECIPE.k_max - 1
    assert {f["split"] for f in report.files} == {"train", "val"}
    assert path.stat().st_size < 1_000_000  # the delta only: masks + adapters


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_parallelspec_equals_ar(trained, tiny_pair, tokenizer, k):
    eng, path, _ = trained
    prompts = ["def f(x):", "import os\n", "ab"]
    ref = eng.generate(prompts, max_new_tokens=20, method="ar", ignore_eos=True)
    out = eng.generate(prompts, max_new_tokens=20, method="parallelspec", gamma=k, ignore_eos=True)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert out[0].stats["draft_forwards"] == out[0].stats["target_forwards"]  # one draft forward per round


def test_masks_never_change_the_committed_draft_cache(tiny_dir, tiny_pair, tokenizer):
    draft = fresh_draft(tiny_dir)
    eng = Engine(tiny_pair[0], tokenizer, draft=draft, max_seq_len=64, parallel_drafter=random_drafter(draft))
    r = eng.generate("def f(x):", max_new_tokens=15, method="parallelspec", gamma=4, ignore_eos=True)
    n = int(eng.draft.cache.lens[0])
    ids = (eng.encode("def f(x):")[0][0] + r.token_ids)[:n]
    cached = eng.draft.cache.kv[:, :, 0, :n].clone()
    with torch.no_grad():  # the same draft weights without any adapter, prefilled from scratch
        plain = fresh_draft(tiny_dir)
        cache = KVCache.for_model(plain, 1, 64)
        plain(torch.tensor([ids]), cache)
    torch.testing.assert_close(cached, cache.kv[:, :, 0, :n], atol=1e-5, rtol=1e-5)


def test_sampling_distribution_with_the_parallel_drafter(tmp_path, tokenizer):
    from helpers.exact import N, PROMPT, V, exact_joint

    from helpers.distribution_bounds import total_variation_bound

    hf, target, draft = small_vocab_models(tmp_path, V)
    eng = Engine(target, tokenizer, draft, max_seq_len=32, parallel_drafter=random_drafter(draft, k_max=3))
    exact = exact_joint(hf, 1.0)
    out = eng.generate([PROMPT] * N, max_new_tokens=2, method="parallelspec", gamma=3, temperature=1.0, seed=5,
                       ignore_eos=True)
    pairs = torch.tensor([r.token_ids for r in out])
    emp = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double() / N
    tv = 0.5 * (emp - exact.double()).abs().sum().item()
    assert tv <= total_variation_bound(V * V, N), tv
    assert 0 < out[0].stats["acceptance_rate"] < 1


def test_bad_drafter_files_and_options(tiny_dir, tiny_pair, tokenizer, tmp_path, trained):
    _, path, _ = trained
    with pytest.raises(SpecEngineError, match="not found"):
        load_drafter(tmp_path / "none.safetensors", fresh_draft(tiny_dir))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(SpecEngineError, match="not a parallel drafter file"):
        load_drafter(junk, fresh_draft(tiny_dir))
    from conftest import save_tiny

    save_tiny(tmp_path / "other", "llama", seed=3, intermediate_size=96)  # same hidden size and vocab
    with pytest.raises(SpecEngineError, match="trained for another draft"):
        load_drafter(path, load_model(tmp_path / "other")[0])
    eng = Engine(tiny_pair[0], tokenizer, draft=fresh_draft(tiny_dir), max_seq_len=64)
    with pytest.raises(SpecEngineError, match="train-parallel"):
        eng.generate("abc", max_new_tokens=4, method="parallelspec")
    eng = Engine(tiny_pair[0], tokenizer, draft=fresh_draft(tiny_dir), max_seq_len=64, parallel_drafter=path)
    with pytest.raises(SpecEngineError, match="exceeds the drafter's k_max"):
        eng.generate("abc", max_new_tokens=4, method="parallelspec", gamma=6)
    with pytest.raises(SpecEngineError, match="integer >= 1"):
        eng.generate("abc", max_new_tokens=4, method="parallelspec", gamma=0)


@pytest.mark.parametrize("gamma", [2, 4])
def test_pearl_with_the_parallel_drafter_equals_ar(trained, gamma):
    """PEARL whose window is drafted in one forward (policy="parallel"): same tokens as ar,
    one draft forward per round."""
    eng, _, _ = trained
    prompts = ["def f(x):", "import os\n", "ab"]
    ref = eng.generate(prompts, max_new_tokens=20, method="ar", ignore_eos=True)
    out = eng.generate(prompts, max_new_tokens=20, method="pearl", policy="parallel", gamma=gamma, ignore_eos=True)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    s = out[0].stats
    assert s["policy"] == "pearl+parallel" and s["draft_forwards"] == s["target_forwards"]
    with pytest.raises(SpecEngineError, match="policy 'parallel'"):
        eng.generate("ab", max_new_tokens=4, method="pearl", policy="heuristic")


@pytest.mark.parametrize("tree", ["2x3", "3x4:6"])
def test_parallelspec_tree_equals_ar(trained, tree):
    """A token tree from the parallel drafter's one forward (top-K per position, best N by
    joint draft probability): same tokens as ar, one draft forward per round."""
    eng, _, _ = trained
    prompts = ["def f(x):", "import os\n", "ab"]
    ref = eng.generate(prompts, max_new_tokens=20, method="ar", ignore_eos=True)
    out = eng.generate(prompts, max_new_tokens=20, method="parallelspec", tree=tree, ignore_eos=True)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    s = out[0].stats
    assert s["draft_forwards"] == s["target_forwards"] and s["tree"].startswith(tree.split(":")[0])


@pytest.mark.parametrize("tree", [None, "2x3"])
@pytest.mark.parametrize("cut", [2, 5, 9])
def test_eos_inside_a_parallelspec_round(trained, tree, cut):
    """EOS among a round's accepted tokens (chain or tree): each row stops right after its
    first EOS, with ar's tokens up to it."""
    eng, _, _ = trained
    prompts = ["def f(x):", "import os\n", "ab"]
    ref = [r.token_ids for r in eng.generate(prompts, max_new_tokens=20, method="ar", ignore_eos=True)]
    stop, saved = ref[0][cut], eng.eos_ids
    eng.eos_ids = {stop}
    try:
        out = eng.generate(prompts, max_new_tokens=20, method="parallelspec", gamma=3 if tree is None else None,
                           tree=tree)
    finally:
        eng.eos_ids = saved
    for r, want in zip(out, ref):
        end = want.index(stop) + 1 if stop in want else len(want)
        assert r.token_ids == want[:end] and r.finish_reason == ("eos" if stop in want else "length")
