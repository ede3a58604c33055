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
