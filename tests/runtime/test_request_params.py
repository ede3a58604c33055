"""Per-request options live once (request.py `RequestParams`): the API, the CLI and the server's
schema take their names, defaults and bounds from it, and nothing else writes them out."""
import dataclasses
import re
from pathlib import Path

import pytest

from specengine import Engine, SpecEngineError
from specengine.cli import build_parser, request_from_args
from specengine.request import RequestParams, served_fields

ROOT = Path(__file__).resolve().parents[2]


def test_the_cli_flags_are_the_fields_with_their_defaults():
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    params = request_from_args(args)
    assert params == RequestParams()
    args = build_parser().parse_args(["generate", "--prompt", "x", "--max-new-tokens", "7", "--temperature", "0.5",
                                      "--stop", "a", "--stop", "b", "--ignore-eos", "--tree", "2x2"])
    assert request_from_args(args) == RequestParams(max_new_tokens=7, temperature=0.5, stop=["a", "b"],
                                                    ignore_eos=True, tree="2x2")
    bench = build_parser().parse_args(["bench"])
    assert (bench.max_new_tokens, bench.temperature, bench.seed) == (RequestParams.max_new_tokens, 0.0, 0)


def test_the_server_schema_is_the_served_fields_under_openai_names():
    pytest.importorskip("fastapi")
    from specengine.serve.schema import Sampling

    props = Sampling.model_json_schema()["properties"]
    for f in served_fields():
        assert f.metadata["served"] in props and props[f.metadata["served"]]["description"] == f.metadata["help"]
    assert props["top_k"]["minimum"] == 0 and props["top_p"]["maximum"] == 1
    assert props["temperature"]["default"] == 1.0  # OpenAI's default, the one documented difference
    assert not {"method", "gamma", "tree"} & props.keys()  # a served request runs the server's method


def test_the_api_takes_keywords_or_a_params_object(tiny_pair, tokenizer):
    eng = Engine(tiny_pair[0], tokenizer, max_seq_len=256)
    by_kw = eng.generate("ab", max_new_tokens=5, ignore_eos=True).token_ids
    assert eng.generate("ab", RequestParams(max_new_tokens=5, ignore_eos=True)).token_ids == by_kw
    assert len(eng.generate("ab", ignore_eos=True).token_ids) == RequestParams.max_new_tokens
    with pytest.raises(SpecEngineError, match="unknown request option 'max_tokens'") as e:
        eng.generate("ab", max_tokens=5)
    assert e.value.param == "max_tokens"


def test_a_served_request_cannot_change_the_method(tiny_pair, tokenizer):
    from specengine.serve import EngineCore

    core = EngineCore(Engine(tiny_pair[0], tokenizer, max_seq_len=64))
    with pytest.raises(SpecEngineError, match="cannot set 'gamma'"):
        core.add_request("ab", RequestParams(gamma=3))


def test_no_other_module_writes_a_request_default():
    """The default max_new_tokens (and its siblings) is written in request.py only."""
    default = RequestParams.max_new_tokens
    pattern = re.compile(rf"max_new_tokens(: int)?\s*=\s*{default}\b|--max-new-tokens.*default={default}")
    found = [str(p.relative_to(ROOT)) for p in (ROOT / "specengine").rglob("*.py")
             if p.name != "request.py" and pattern.search(p.read_text())]
    assert not found, found
    assert {f.name for f in dataclasses.fields(RequestParams)} >= {"max_new_tokens", "temperature", "top_k", "top_p",
                                                                   "seed", "stop", "ignore_eos"}
