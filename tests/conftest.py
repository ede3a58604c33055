"""Shared fixtures: tiny random HF checkpoints (saved with save_pretrained, loaded by our
loader) and a small character-level tokenizer with a chat template, all made offline."""
from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import pytest
import torch

# Triton's interpreter is chosen before triton is first imported, per run by what its tests
# need: without a usable GPU every kernel runs under it; on a GPU the kernels compile, and the
# tests that run kernels on CPU tensors (marked `interpreter`: launch counting, GPU op
# selection forced on a CPU) run in a second process with SPECENGINE_TEST_INTERPRETER=1.
INTERPRETER_ENV = "SPECENGINE_TEST_INTERPRETER"
if not torch.cuda.is_available() or os.environ.get(INTERPRETER_ENV) == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite's own machine table (what the tests' engines measure and file), shared by the xdist
# workers and the processes tests start, removed at the end: no test files into the user's table.
if not os.environ.get("SPECENGINE_PLAN_DIR"):
    import atexit
    import shutil
    import tempfile

    os.environ["SPECENGINE_PLAN_DIR"] = tempfile.mkdtemp(prefix="specengine-test-plan-")
    atexit.register(shutil.rmtree, os.environ["SPECENGINE_PLAN_DIR"], True)
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("SPECENGINE_TEST_THREADS"):
    torch.set_num_threads(int(os.environ["SPECENGINE_TEST_THREADS"]))  # one per worker: no oversubscription
# the slow tier on two workers: every memory-heavy file on one (helpers/scheduling.py)
from helpers.scheduling import pytest_runtest_setup, pytest_xdist_make_scheduler  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    # a fast tier first: the tests marked `slow` (real models, the GPU-command rehearsals, the
    # nvcc compile) run last, in their order, so a broken change fails in minutes
    items[:] = [i for i in items if "slow" not in i.keywords] + [i for i in items if "slow" in i.keywords]
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason=f"runs Triton kernels on CPU tensors: on a GPU machine run it with "
                                   f"{INTERPRETER_ENV}=1 (scripts/gpu_check.sh does)")
    for item in items:
        if "interpreter" in item.keywords:
            item.add_marker(skip)


def _peaks() -> tuple[float, float]:
    """(this process, the largest process it ran and waited for) peak resident GiB. Linux counts a
    forked child's pages before its exec: a child started when its parent was at its peak reports
    that peak, whatever it used itself."""
    import resource

    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB -> GiB on Linux
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20)


_WORKER_PEAKS = {}  # xdist worker id -> its _peaks(), sent when it ends


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: tell the controller
        session.config.workeroutput["peaks"] = _peaks()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    if "peaks" in getattr(node, "workeroutput", {}):
        _WORKER_PEAKS[node.gateway.id] = node.workeroutput["peaks"]


def pytest_terminal_summary(terminalreporter):
    """The suite's peak resident memory in its summary (the budget: at most 16 GB on a 24 GiB
    CI machine): per process, workers and the children they ran included."""
    own, child = _peaks()
    line = f"peak resident memory: {own:.1f} GiB (pytest), {child:.1f} GiB (largest child)"
    for wid, (w_own, w_child) in sorted(_WORKER_PEAKS.items()):
        line += f"; {wid}: {w_own:.1f} GiB, {w_child:.1f} GiB (its largest child)"
    terminalreporter.write_line(line)


# SPECENGINE_NO_SKIPS=1 (CI): only "needs CUDA" may skip; the compiled GGUF kernel once per ISA copy (`ext`)
pytest_plugins = ["helpers.strict_skips", "helpers.quant_ext"]

CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?()[]{}=+-*/_'\"\n\t<>|#")
SPECIAL = ["<unk>", "<eos>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = len(SPECIAL) + len(CHARS)


def make_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(kind="llama", vocab=VOCAB, **kw):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    base = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                eos_token_id=1, bos_token_id=None, pad_token_id=0)
    base.update(kw)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
           "gemma3": Gemma3TextConfig}[kind]
    if kind == "mistral":
        base.setdefault("sliding_window", None)
    return cls(**base)


def save_tiny(path, kind="llama", seed=0, scale=1.0, shard=None, **kw):
    """A random model saved as an HF dir; `scale` widens the init so logits are peaked."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(scale)
            elif kind in ("qwen3", "gemma3") and "norm" in name:  # norm weights that differ per dim and layer
                p.add_(torch.randn_like(p) * 0.3)
    save_kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **save_kw)
    make_tokenizer().save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny(path, "llama", seed=0, scale=4.0)
    return path


@pytest.fixture(scope="session")
def tiny_pair(tiny_dir):
    """(target, same-weights draft, perturbed draft, unrelated draft) engines' models."""
    from specengine.models.loading import load_model

    target = load_model(tiny_dir)[0]
    same = load_model(tiny_dir)[0]
    perturbed = load_model(tiny_dir)[0]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.abs().mean())
    return target, same, perturbed




@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


def small_vocab_models(path, vocab: int = 8, noise: float = 0.3):
    """(transformers model, our target, our perturbed draft) on a tiny vocabulary, for exact
    enumeration of the target's distribution in the sampling tests."""
    from specengine.models.loading import load_model

    # half the usual width (hidden 32, two heads of 16): these tests sample 2e4-5e4 rows, and the
    # models' width is what they pay for, not what they check
    hf = save_tiny(path, "qwen2", seed=21, vocab=vocab, scale=6.0, hidden_size=32, intermediate_size=64,
                   num_attention_heads=2, num_key_value_heads=1)
    target, draft = load_model(path)[0], load_model(path)[0]
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.abs().mean())
    return hf, target, draft


def assert_sampler_matches_target(sampler, stochastic: bool, device: str = "cpu", seed: int = 5):
    """One round over 2e5 rows: the first emitted token ~ p1 and, given d1 accepted, the
    second ~ p2, each within the TV bound from its sample count (rejection_sample contract)."""
    from helpers.distribution_bounds import total_variation_bound

    V, K, N, temp = 6, 2, 200_000, 0.8
    g = torch.Generator().manual_seed(11)
    p_logits = torch.randn(K + 1, V, generator=g) * 1.5
    q_probs = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)
    if stochastic:
        drafts = torch.multinomial(q_probs, N, replacement=True, generator=g).T.contiguous()
        q = q_probs.expand(N, K, V).contiguous().to(device)
    else:  # a deterministic draft always proposes the same tokens
        drafts, q = torch.tensor([[2, 4]]).expand(N, K).contiguous(), None
    out, _ = sampler(p_logits.expand(N, K + 1, V).contiguous().to(device), drafts.to(device), q,
                     torch.full((N,), K, dtype=torch.int32, device=device), torch.full((N,), temp, device=device),
                     torch.arange(N, dtype=torch.int64, device=device) + seed, torch.tensor(0, device=device))
    out = out.cpu()
    p = torch.softmax(p_logits / temp, -1)
    emp1 = torch.bincount(out[:, 0], minlength=V).double() / N
    assert 0.5 * (emp1 - p[0]).abs().sum() <= total_variation_bound(V, N)
    acc = out[:, 0] == drafts[:, 0]
    emp2 = torch.bincount(out[acc, 1], minlength=V).double() / int(acc.sum())
    assert 0.5 * (emp2 - p[1]).abs().sum() <= total_variation_bound(V, int(acc.sum()))
    if stochastic:  # the check can fail: the draft's own distribution is far away
        assert 0.5 * (q_probs[0] - p[0]).abs().sum() > 5 * total_variation_bound(V, N)
