"""schemathesis `--checks all` against the server's own /openapi.json (tiny models, loopback):
every generated request gets a 2xx or a 4xx with OpenAI's error body, never a 5xx; the
responses match the documented schema; the server stays healthy. Held against our test
tokenizer (characters, a chat template) and a second one (whitespace-split words, no chat
template), so the schema is truthful for any served model, not only ours. Bounded here (about a
minute); `make fuzz-server` runs a longer pass and writes bench/results/server_fuzz.json."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import save_tiny
from test_server import MODEL, start

from specengine import Engine

httpx = pytest.importorskip("httpx")
pytest.importorskip("schemathesis")
pytest.importorskip("uvicorn")

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "5"))
REPORT = os.environ.get("FUZZ_REPORT")  # a JSON run report (make fuzz-server)
CONFIG = Path(__file__).with_name("schemathesis.toml")
KEY = "sk-fuzz-51d0"


WORDS = ["<pad>", "<eos>", "<unk>"] + "def return if else for in x y z the a of to and is 0 1 2 ( ) :".split()


def word_model(path):
    """(a tiny model, a copy as its draft, its tokenizer): whole words split at whitespace, no chat
    template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specengine.models.loading import load_model

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")
    save_tiny(path, "qwen2", seed=3, vocab=len(WORDS))
    return load_model(path)[0], load_model(path)[0], fast


@pytest.mark.parametrize("model, api_key", [("chars", None), ("chars", KEY), ("words", None)])
def test_schemathesis_checks_all_pass(tiny_pair, tokenizer, tmp_path, model, api_key):
    from specengine.serve.server import create_app

    if model == "chars":
        target, _, draft = tiny_pair
        tok = tokenizer
    else:
        target, draft, tok = word_model(tmp_path / "words")
    app = create_app(Engine(target, tok, draft, max_seq_len=256, max_batch=4), MODEL, default_max_tokens=16,
                     max_batch=4, method="sd", gamma=3, api_key=api_key)
    url, stop = start(app)
    try:
        cmd = [str(Path(sys.executable).with_name("schemathesis")), "--config-file", str(CONFIG), "run",
               url + "/openapi.json", "--checks", "all", "-n", str(EXAMPLES), "--seed", "7", "--request-timeout", "60"]
        if api_key:
            cmd += ["-H", f"Authorization: Bearer {api_key}"]
        report = None if not REPORT else f"{REPORT.removesuffix('.json')}_{model}_{'key' if api_key else 'open'}.json"
        if report:
            cmd += ["--report", "json", "--report-json-path", str(Path(report).resolve())]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
        assert "passed" in proc.stdout
        assert httpx.get(url + "/health").json() == {"status": "ok"}  # and it still serves
        assert not app.state.engine.core.running and app.state.engine.error is None
    finally:
        stop()
