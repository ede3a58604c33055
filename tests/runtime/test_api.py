"""The public API: prompt forms, stop strings, streaming, seeded sampling, stats names."""
import pytest
import torch

from specengine import Engine, GenerationResult


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), device="cpu", max_seq_len=256, dtype="float32")


def test_from_pretrained_defaults_to_sd_with_a_draft(engine, tiny_dir):
    assert engine.method == "sd"
    assert Engine.from_pretrained(str(tiny_dir)).method == "ar"


def test_prompt_forms_agree(engine):
    text = "def add(a, b):"
    ids = engine.encode(text)[0][0]
    by_text = engine.generate(text, max_new_tokens=12)
    assert isinstance(by_text, GenerationResult)
    assert engine.generate(ids, max_new_tokens=12).token_ids == by_text.token_ids
    assert engine.generate(torch.tensor(ids), max_new_tokens=12).token_ids == by_text.token_ids
    batch = engine.generate([text, "x ="], max_new_tokens=12)
    assert isinstance(batch, list) and batch[0].token_ids == by_text.token_ids
    assert engine.generate([ids, engine.encode("x =")[0][0]], max_new_tokens=12)[1].token_ids == batch[1].token_ids


def test_chat_messages_use_the_chat_template(engine):
    msgs = [{"role": "user", "content": "hi"}]
    expected = engine.tokenizer(engine.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False).input_ids
    assert engine.encode(msgs)[0] == [expected]
    r = engine.generate(msgs, max_new_tokens=5)
    assert r.prompt_tokens == len(expected)
    assert len(engine.generate([msgs, msgs], max_new_tokens=3)) == 2


def test_result_text_ids_and_stats_names(engine):
    r = engine.generate("ab", max_new_tokens=10, ignore_eos=True)
    assert len(r.token_ids) == 10 and r.finish_reason == "length"
    assert r.text == engine.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    for key in ("tokens_per_s", "tokens_per_target_forward", "acceptance_rate", "draft_cost_ratio",
                "mean_accepted_tokens", "new_tokens", "wall_time_s"):
        assert key in r.stats
    assert r.stats["new_tokens"] == 10


def test_stop_strings_truncate_text(engine):
    full = engine.generate("q", max_new_tokens=30, ignore_eos=True, method="ar")
    stop = full.text[5:7]
    assert stop and stop in full.text
    r = engine.generate("q", max_new_tokens=30, ignore_eos=True, stop=[stop])
    assert r.finish_reason == "stop"
    assert r.text == full.text[: full.text.index(stop)]
    assert full.token_ids[: len(r.token_ids)] == r.token_ids


def test_stream_yields_the_generated_text(engine):
    full = engine.generate("def f(", max_new_tokens=20, ignore_eos=True)
    pieces = list(engine.stream("def f(", max_new_tokens=20, ignore_eos=True))
    assert len(pieces) > 1 and "".join(pieces) == full.text
    assert engine.last_stats["new_tokens"] == 20


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_seeded_sampling_is_reproducible(engine, method):
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=20, top_p=0.9, method=method, ignore_eos=True)
    a = engine.generate(["ab", "cd"], seed=3, **kw)
    b = engine.generate(["ab", "cd"], seed=3, **kw)
    c = engine.generate(["ab", "cd"], seed=4, **kw)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_acceptance_by_position():
    from specengine.counters import Counters

    c = Counters()
    for n_acc, num_draft in [(0, 3), (3, 3), (1, 3), (1, 1)]:  # rounds: reject d1; all; d1 only; one draft, taken
        c.count_positions(n_acc, num_draft)
    assert c.reached == [4, 2, 1] and c.accepted_at == [3, 1, 1]
    assert c.acceptance_by_position() == [0.75, 0.5, 1.0]


def test_acceptance_by_position_of_a_draft_equal_to_the_target(engine):
    r = engine.generate("ab", max_new_tokens=12, ignore_eos=True, method="sd", gamma=3)
    assert r.stats["acceptance_by_position"] == [1.0, 1.0, 1.0]  # the draft is the target: nothing rejected
    assert sum(r.stats["accepted_by_position"]) == r.stats["accepted_drafts"]


def test_end_of_generation_tokens_count_as_eos(tiny_pair):
    """A GGUF names one eos id; the tokenizer's other end tokens (Qwen's <|endoftext|> after its
    <|im_end|>) end a reply too, as transformers' generation_config and llama.cpp have them."""
    from conftest import make_tokenizer

    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|fim_pad|>"]})
    eng = Engine(tiny_pair[0], tok, max_seq_len=64)
    ends = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert ends | {tok.eos_token_id} <= eng.eos_ids
    assert tok.convert_tokens_to_ids("<|fim_pad|>") not in eng.eos_ids  # a special token, not an end
