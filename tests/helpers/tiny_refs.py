"""Fixtures shared by the tests that compare every method with transformers on the tiny pair
(log-probabilities, structured output, suffix decoding): import them by name into a test module."""
import pytest
import torch
from helpers.fakes import random_drafter

from specengine import Engine


@pytest.fixture(scope="module")
def hf(tiny_dir):
    """transformers' own model of the tiny target, fp32: the independent reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny_pair, tokenizer):
    """The tiny target with the perturbed draft and a random parallel drafter: every method runs, fp32."""
    target, _, draft = tiny_pair
    return Engine(target, tokenizer, draft, max_seq_len=256, parallel_drafter=random_drafter(draft, k_max=4),
                  dtype="float32")
