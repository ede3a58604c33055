"""EngineConfig is the one place engine options are written: Engine, CLI and serving core."""
import dataclasses

import pytest

from specengine import Engine, EngineConfig, SpecEngineError
from specengine.cli import build_parser, config_from_args
from specengine.serve import EngineCore


@pytest.mark.parametrize("cmd", ["generate", "bench", "serve", "train-head", "train-parallel"])
def test_every_option_is_a_cli_flag(cmd):
    sub = next(a for a in build_parser()._actions if a.dest == "cmd").choices[cmd]
    dests = {a.dest for a in sub._actions}
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= dests


def test_cli_flags_give_the_config():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--max-seq-len", "512", "--gamma", "3",
                                      "--no-cuda-graphs", "--batch-invariant", "off", "--policy", "confidence",
                                      "--threshold", "0.5"])
    assert config_from_args(args) == EngineConfig(max_seq_len=512, gamma=3, cuda_graphs=False,
                                                  batch_invariant=False, policy="confidence", threshold=0.5)
    assert config_from_args(build_parser().parse_args(["generate", "--prompt", "x"])) == EngineConfig()
    assert config_from_args(build_parser().parse_args(["serve"])).max_batch == 8


@pytest.mark.parametrize("options,param", [({"max_seq_len": 1}, "max_seq_len"), ({"gamma": 0}, None),
                                           ({"batch_invariant": "yes"}, "batch_invariant"),
                                           ({"maxseqlen": 64}, "maxseqlen"), ({"dtype": "fp8"}, "dtype"),
                                           ({"kernels": "cuda"}, "kernels"), ({"weights": "int4"}, "weights"),
                                           ({"attention_backend": "torch"}, "kernels")])
def test_bad_options_name_themselves(options, param):
    with pytest.raises(SpecEngineError) as err:
        EngineConfig().replace(**options)
    assert param is None or err.value.param == param


def test_engine_and_core_read_the_config(tiny_pair, tokenizer):
    config = EngineConfig(max_seq_len=96, max_batch=3)
    eng = Engine(tiny_pair[0], tokenizer, draft=tiny_pair[2], config=config, gamma=2)
    assert eng.config == dataclasses.replace(config, gamma=2) and eng.max_seq_len == 96
    assert EngineCore(eng).max_batch == 3


def test_the_setters_keep_the_config_true(tiny_pair, tokenizer):
    eng = Engine(tiny_pair[0], tokenizer, draft=tiny_pair[2], max_seq_len=64)
    eng.set_cpu_matmul("linear")
    eng.set_kernels("torch,attention=torch")
    eng.set_batch_invariant(False, 5)
    assert (eng.config.cpu_matmul, eng.config.kernels) == ("linear", "torch,attention=torch")
    assert (eng.config.batch_invariant, eng.config.invariant_width) == (False, 5)
    eng.set_cuda_graphs(False)
    assert eng.config.cuda_graphs is False
    eng.set_cuda_graphs(True)
    assert eng.config.cuda_graphs is True
    with pytest.raises(SpecEngineError) as err:
        eng.set_cpu_matmul("fast")
    assert err.value.param == "cpu_matmul" and eng.config.cpu_matmul == "linear"


def test_gguf_weights_need_a_gguf_file(tiny_dir):
    with pytest.raises(SpecEngineError, match="weights='gguf' needs a .gguf file or a registry model") as err:
        Engine.from_pretrained(str(tiny_dir), weights="gguf")
    assert err.value.param == "weights"


def test_an_install_without_the_cpu_kernels_says_so(tiny_dir, monkeypatch):
    """Without the compiled CPU kernels every CPU op runs its torch reference and GGUF blocks are
    dequantized at every matmul. Loading on a CPU says so and how to rebuild; with them, nothing."""
    import warnings

    from specengine.kernels import cpu_ext

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        Engine.from_pretrained(str(tiny_dir), dtype="float32", device="cpu")
    assert not [w for w in seen if "not built" in str(w.message)]
    monkeypatch.setattr(cpu_ext, "EXT", None)
    with pytest.warns(RuntimeWarning, match=r"CPU kernels \(specengine._quantext\) are not built.*--no-build-isolation"):
        Engine.from_pretrained(str(tiny_dir), dtype="float32", device="cpu")
