"""SpecDec++: the acceptance head, its training, the stopping policy, and losslessness."""
import pytest
import torch
from conftest import small_vocab_models
from helpers.fakes import random_head

from specengine import Engine, SpecEngineError
from specengine.drafting.acceptance_head import AcceptanceHead, HeadMeta, load_head, model_fingerprint
from specengine.methods.policies import SpecDecPolicy, make_policy
from specengine.training.head import HeadRecipe, auroc, train_head, weighted_bce

RECIPE = HeadRecipe(packages=("tqdm", "safetensors"), n_train=8, n_val=4, seq_len=48, prefix=8, epochs=40,
                    forward_batch=4, lr=3e-3, batch_size=64)


@pytest.fixture(scope="module")
def trained(tiny_pair, tokenizer, tmp_path_factory):
    target, _, perturbed = tiny_pair
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=128)
    path = tmp_path_factory.mktemp("head") / "head.safetensors"
    report = train_head(eng, path, RECIPE, draft_name="tiny-perturbed")
    return eng, path, report


def test_training_loss_falls_and_heldout_auroc_beats_a_constant(trained):
    _, path, report = trained
    assert report.train_positions == 8 * (48 - 8 - 1) and report.val_positions == 4 * (48 - 8 - 1)
    assert report.losses[-1] < 0.9 * report.losses[0], report.losses
    assert 0 < report.val_accept_rate < 1  # both labels occur on held-out text
    assert report.val_auroc > 0.6, report.val_auroc  # a constant predictor scores 0.5
    assert {f["split"] for f in report.files} == {"train", "val"}
    assert all(len(f["sha256"]) == 64 and f["version"] for f in report.files)  # provenance recorded
    assert path.with_suffix(".json").exists()


def test_extraction_resumes_from_its_cache(trained, tmp_path):
    eng, path, report = trained
    work = path.with_suffix(".work")
    cached = sorted(work.rglob("train_*.pt"))
    assert cached
    stamp = [f.stat().st_mtime_ns for f in cached]
    again = train_head(eng, tmp_path / "again.safetensors", RECIPE, work_dir=work)
    assert [f.stat().st_mtime_ns for f in cached] == stamp  # features read back, not recomputed
    assert again.train_positions == report.train_positions
    from dataclasses import replace

    from specengine.training.head import DATA_FIELDS, data_key

    assert data_key(replace(RECIPE, n_train=9), DATA_FIELDS) != data_key(RECIPE, DATA_FIELDS)  # no stale reuse
    assert data_key(replace(RECIPE, epochs=99), DATA_FIELDS) == data_key(RECIPE, DATA_FIELDS)


@pytest.mark.parametrize("threshold", [0.2, 0.5, 0.8])
@pytest.mark.parametrize("gamma", [3, 6])
def test_greedy_specdec_equals_ar(trained, threshold, gamma):
    eng, path, _ = trained
    eng2 = Engine(eng.target.model, eng.tokenizer, draft=eng.draft.model, max_seq_len=128, acceptance_head=path)
    prompts = ["def f(x):", "import os\n", "class A:"]
    ref = eng2.generate(prompts, max_new_tokens=24, method="ar", ignore_eos=True)
    out = eng2.generate(prompts, max_new_tokens=24, method="sd", policy="specdec++", gamma=gamma,
                        threshold=threshold, ignore_eos=True)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert out[0].stats["policy"] == "specdec++" and out[0].stats["gamma_mean"] <= gamma


def test_threshold_controls_the_proposal_length(tiny_pair, tokenizer):
    """A head that always predicts P(accept) = sigmoid(bias): low thresholds stop at k_min, a
    threshold above 1 - p^gamma never stops early (the host ends the loop on CPU)."""
    target, _, perturbed = tiny_pair
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=128, acceptance_head=random_head(perturbed, bias=0.0))
    with torch.no_grad():  # P(accept) = 0.5 exactly: zero the blocks and the output weights
        for p in eng.acceptance_head("greedy").parameters():
            p.zero_()
    short = eng.generate("abc", max_new_tokens=20, method="sd", policy="specdec++", gamma=6, threshold=0.4,
                         ignore_eos=True)
    long = eng.generate("abc", max_new_tokens=20, method="sd", policy="specdec++", gamma=6, threshold=0.99,
                        ignore_eos=True)
    assert short.stats["gamma_mean"] == 1  # 1 - 0.5 > 0.4 after the first token
    assert long.stats["gamma_mean"] == 6  # 1 - 0.5**6 = 0.984 < 0.99
    ref = eng.generate("abc", max_new_tokens=20, method="ar", ignore_eos=True)
    assert short.token_ids == long.token_ids == ref.token_ids


def test_sampling_distribution_with_specdec(tmp_path, tokenizer):
    from helpers.exact import N, PROMPT, V, exact_joint

    from helpers.distribution_bounds import total_variation_bound

    hf, target, draft = small_vocab_models(tmp_path, V)
    eng = Engine(target, tokenizer, draft, max_seq_len=16, acceptance_head=random_head(draft, seed=3, bias=1.0))
    exact = exact_joint(hf, 1.0)
    out = eng.generate([PROMPT] * N, max_new_tokens=2, method="sd", policy="specdec++", gamma=3, threshold=0.5,
                       temperature=1.0, seed=99, ignore_eos=True)
    pairs = torch.tensor([r.token_ids for r in out])
    emp = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double() / N
    tv = 0.5 * (emp - exact.double()).abs().sum().item()
    assert tv <= total_variation_bound(V * V, N), tv
    assert 0 < out[0].stats["acceptance_rate"] < 1


def test_bad_head_files_give_clear_errors(tiny_pair, tokenizer, tmp_path):
    target, _, perturbed = tiny_pair
    with pytest.raises(SpecEngineError, match="not found"):
        load_head(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(SpecEngineError, match="not a readable safetensors head file"):
        load_head(junk)
    from safetensors.torch import save_file

    nometa = tmp_path / "nometa.safetensors"
    save_file({"w": torch.zeros(2)}, str(nometa))
    with pytest.raises(SpecEngineError, match="not an acceptance head"):
        load_head(nometa)
    cfg = perturbed.config
    wide = AcceptanceHead(HeadMeta(cfg.hidden_size * 2, cfg.vocab_size, model_fingerprint(cfg), "greedy", 1))
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=64, acceptance_head=wide.save(tmp_path / "w.st"))
    with pytest.raises(SpecEngineError, match="does not fit the draft"):
        eng.generate("abc", max_new_tokens=4, method="sd", policy="specdec++")
    other = AcceptanceHead(HeadMeta(cfg.hidden_size, cfg.vocab_size, "0123456789abcdef", "greedy", 1, "other"))
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=64, acceptance_head=other)
    with pytest.raises(SpecEngineError, match="trained for another draft"):
        eng.generate("abc", max_new_tokens=4, method="sd", policy="specdec++")
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=64)  # nothing ships for a tiny draft
    with pytest.raises(SpecEngineError, match="train-head"):
        eng.generate("abc", max_new_tokens=4, method="sd", policy="specdec++")


def test_policy_options_are_validated():
    with pytest.raises(SpecEngineError, match="threshold must be in"):
        make_policy("specdec++", 4, threshold=1.5)
    with pytest.raises(SpecEngineError, match="threshold applies"):
        make_policy("fixed", 4, threshold=0.3)
    assert isinstance(make_policy("specdec++", "auto"), SpecDecPolicy)


def test_weighted_bce_and_auroc():
    logit = torch.tensor([2.0, -2.0])
    y = torch.tensor([1.0, 0.0])
    assert weighted_bce(logit, y, 6.0) > weighted_bce(logit, y, 1.0)  # rejections weigh more
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert auroc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == 0.5  # ties count half


def test_cli_train_commands_need_a_draft(capsys):
    from specengine.cli import main

    for cmd in ("train-head", "train-parallel"):
        assert main([cmd, "--out", "x.safetensors"]) == 2
        assert f"{cmd} needs --draft" in capsys.readouterr().err
