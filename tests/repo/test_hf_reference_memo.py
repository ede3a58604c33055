"""The transformers reference is kept per machine (tests/helpers/hf_reference.py) under a key of
everything its tokens depend on: a rewritten weights file or another job is another key."""
import os

from helpers.hf_reference import _memo


def test_the_memo_key_follows_the_files_and_the_job(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    first = _memo(tmp_path, '{"new": 32}')
    assert _memo(tmp_path, '{"new": 32}') == first
    assert _memo(tmp_path, '{"new": 33}') != first
    os.utime(weights, ns=(1, 1))  # re-written (a re-conversion): another answer
    assert _memo(tmp_path, '{"new": 32}') != first
