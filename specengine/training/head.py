"""Train a SpecDec++ acceptance head for a (target, draft) pair: `specengine train-head`.

Recipe (docs/design.md, "SpecDec++"):
1. Corpus: the Python sources of installed packages (real code no one here wrote; never
   HumanEval or MT-bench, the evaluation sets). Files are split by path hash into train and
   held-out sets, tokenized with the target's tokenizer and cut into `seq_len` chunks.
2. Teacher-forced, batched forwards only (no autoregressive generation). Pass A runs both
   models on a real chunk: the target's token y_t and the draft's proposal d_t at each
   position. The mixed sequence keeps the first `prefix` real tokens, then takes y_t with
   probability `mix` (the paper: 15% target tokens) and d_t otherwise, so contexts look like
   speculation (mostly draft text, some target text). Pass B runs both models on it.
3. Labels at every position past the prefix: the draft's proposal x_t (its argmax, or a
   sample from q for mode="sampled") is accepted with probability min(1, p(x)/q(x))
   (greedy: 1 if x_t is the target's argmax, else 0). Features: the draft's final hidden
   state there. Each chunk's features are cached on disk, so extraction resumes.
4. Weighted BCE (rejections weighted `reject_weight`, the paper's 6), AdamW, a checkpoint per
   epoch (resumable); held-out AUROC and calibration are recorded beside the head.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..drafting.acceptance_head import AcceptanceHead, HeadMeta, model_fingerprint
from ..errors import SpecEngineError


@dataclass
class CorpusRecipe:
    """The corpus both trainers read: chunks of the Python sources of installed packages,
    held-out chunks from held-out files."""
    packages: tuple[str, ...] = ("transformers", "numpy", "setuptools")
    n_train: int = 48  # chunks
    n_val: int = 8
    seq_len: int = 256
    seed: int = 0
    val_fraction: float = 0.1


@dataclass
class HeadRecipe(CorpusRecipe):
    prefix: int = 32  # real tokens kept at the start of each mixed sequence
    mix: float = 0.15  # fraction of target tokens in the mixed sequence
    mode: str = "greedy"
    reject_weight: float = 6.0
    n_blocks: int = 2
    epochs: int = 12
    lr: float = 1e-3
    batch_size: int = 256
    forward_batch: int = 2


@dataclass
class CorpusFile:
    package: str
    version: str
    path: str
    sha256: str
    split: str


@dataclass
class Report:
    """What every trainer writes beside its artifact (`<out>.json`)."""
    recipe: dict
    files: list = field(default_factory=list)
    train_seconds: float = 0.0
    losses: list = field(default_factory=list)


@dataclass
class TrainReport(Report):
    train_positions: int = 0
    val_positions: int = 0
    extract_seconds: float = 0.0
    val_auroc: float | None = None
    val_auroc_constant: float = 0.5
    val_calibration: list = field(default_factory=list)
    val_accept_rate: float | None = None


def python_corpus(packages, val_fraction: float) -> list[tuple[CorpusFile, str]]:
    """Every .py file of the packages, sorted; split into train / val by a hash of its path."""
    out = []
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise SpecEngineError(f"package {pkg!r} is not installed; pick installed packages for the corpus")
        root = Path(list(spec.submodule_search_locations)[0])
        version = importlib.metadata.version(pkg)
        for f in sorted(root.rglob("*.py")):
            text = f.read_text(errors="replace")
            rel = f"{pkg}/{f.relative_to(root)}"
            bucket = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) / 2**32
            split = "val" if bucket < val_fraction else "train"
            out.append((CorpusFile(pkg, version, rel, hashlib.sha256(text.encode()).hexdigest(), split), text))
    return out


def make_chunks(corpus, tokenizer, recipe: HeadRecipe):
    """(train chunks, val chunks, the files they came from): [n, seq_len] int64 tensors."""
    rng = random.Random(recipe.seed)
    order = list(range(len(corpus)))
    rng.shuffle(order)
    chunks = {"train": [], "val": []}
    want = {"train": recipe.n_train, "val": recipe.n_val}
    used = []
    for i in order:
        meta, text = corpus[i]
        if len(chunks[meta.split]) >= want[meta.split]:
            if all(len(chunks[s]) >= want[s] for s in want):
                break
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        took = False
        for s in range(0, len(ids) - recipe.seq_len + 1, recipe.seq_len):
            if len(chunks[meta.split]) < want[meta.split]:
                chunks[meta.split].append(ids[s: s + recipe.seq_len])
                took = True
        if took:
            used.append(meta)
    if len(chunks["train"]) < recipe.n_train or len(chunks["val"]) < recipe.n_val:
        raise SpecEngineError(f"the corpus gave only {len(chunks['train'])} train / {len(chunks['val'])} val chunks "
                              f"of {recipe.seq_len} tokens; add packages or lower n_train / n_val")
    as_tensor = lambda c: torch.tensor(c, dtype=torch.int64)  # noqa: E731
    return as_tensor(chunks["train"]), as_tensor(chunks["val"]), used


def data_key(recipe, fields) -> str:
    """A short hash of the recipe fields a cache depends on: a changed recipe never reads
    another recipe's cached features or checkpoint."""
    blob = json.dumps({f: getattr(recipe, f) for f in fields}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


DATA_FIELDS = ("packages", "n_train", "n_val", "seq_len", "prefix", "mix", "mode", "seed", "val_fraction")


def prepare_data(engine, recipe, out_path, work_dir, what: str):
    """What every train-* run starts from: (out path, work dir, train chunks, held-out
    chunks, the source files used, as dicts for the report)."""
    if engine.draft is None:
        raise SpecEngineError(f"{what} needs a draft model")
    from ..models.subset_head import SubsetHead
    if isinstance(engine.draft.model.lm_head, SubsetHead):  # its -inf logits would be the targets of a loss
        raise SpecEngineError(f"{what} needs the draft's full LM head: build the engine with draft_vocab=0",
                              "draft_vocab")
    out_path = Path(out_path)
    work = Path(work_dir) if work_dir else out_path.with_suffix(".work")
    train_c, val_c, used = make_chunks(python_corpus(recipe.packages, recipe.val_fraction), engine.tokenizer, recipe)
    return out_path, work, train_c, val_c, [asdict(f) for f in used]


def _forward(runner, tokens, return_hidden=False):
    runner.allocate(tokens.shape[0], tokens.shape[1])
    return runner.forward(tokens.to(runner.device), return_hidden=return_hidden)


def _proposal(logits: torch.Tensor, mode: str, gen: torch.Generator) -> torch.Tensor:
    if mode == "greedy":
        return logits.argmax(-1)
    probs = torch.softmax(logits.float(), -1)
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]).cpu(), 1, generator=gen)
    return flat.reshape(probs.shape[:-1]).to(logits.device)


@torch.inference_mode()
def extract_features(engine, chunks: torch.Tensor, recipe: HeadRecipe, cache_dir: Path, desc: str):
    """(hidden [N,H] fp16, labels [N] fp32) for every position past the prefix; per-batch
    results are cached in cache_dir, so an interrupted run resumes where it stopped."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    feats, labels = [], []
    B = recipe.forward_batch
    for start in tqdm(range(0, len(chunks), B), desc=desc, unit="batch"):
        f = cache_dir / f"{desc}_{start:05d}.pt"
        if f.exists():
            h, y = torch.load(f)
        else:
            h, y = _extract_batch(engine, chunks[start: start + B], recipe, seed=recipe.seed * 100003 + start)
            torch.save((h, y), f)
        feats.append(h)
        labels.append(y)
    return torch.cat(feats), torch.cat(labels)


def _extract_batch(engine, c: torch.Tensor, recipe: HeadRecipe, seed: int):
    gen = torch.Generator().manual_seed(seed)
    P = recipe.prefix
    seq = c.clone()
    if recipe.mix < 1:  # pass A: what the target and the draft would emit on the real text
        y = _forward(engine.target, c).argmax(-1).cpu()
        d = _proposal(_forward(engine.draft, c), recipe.mode, gen).cpu()
        use_target = torch.rand(c.shape, generator=gen) < recipe.mix
        nxt = torch.where(use_target, y, d)
        seq[:, P + 1:] = nxt[:, P:-1]
    p_logits = _forward(engine.target, seq).float()
    q_logits, hidden = _forward(engine.draft, seq, return_hidden=True)
    q_logits = q_logits.float().to(p_logits.device)
    x = _proposal(q_logits, recipe.mode, gen)
    if recipe.mode == "greedy":
        label = (p_logits.argmax(-1) == x).float()
    else:
        lp = torch.log_softmax(p_logits, -1).gather(-1, x[..., None]).squeeze(-1)
        lq = torch.log_softmax(q_logits, -1).gather(-1, x[..., None]).squeeze(-1)
        label = torch.exp(torch.clamp(lp - lq, max=0.0))
    sl = slice(P, c.shape[1] - 1)
    return hidden[:, sl].reshape(-1, hidden.shape[-1]).to(torch.float16).cpu(), label[:, sl].reshape(-1).cpu()


def weighted_bce(logit: torch.Tensor, target: torch.Tensor, reject_weight: float) -> torch.Tensor:
    """BCE with the rejection side up-weighted: -(y log s + w (1 - y) log(1 - s))."""
    return -(target * F.logsigmoid(logit) + reject_weight * (1 - target) * F.logsigmoid(-logit)).mean()


def auroc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve for binary labels (rank statistic, ties averaged)."""
    label = label.bool()
    n_pos, n_neg = int(label.sum()), int((~label).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(score)
    ranks = torch.empty(len(score), dtype=torch.float64)
    ranks[order] = torch.arange(1, len(score) + 1, dtype=torch.float64)
    s_sorted = score[order]
    i = 0
    while i < len(score):  # average the ranks of tied scores
        j = i
        while j + 1 < len(score) and s_sorted[j + 1] == s_sorted[i]:
            j += 1
        if j > i:
            ranks[order[i: j + 1]] = ranks[order[i: j + 1]].mean()
        i = j + 1
    return float((ranks[label].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def calibration(prob: torch.Tensor, label: torch.Tensor, bins: int = 10) -> list[dict]:
    edges = torch.linspace(0, 1, bins + 1)
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (prob >= lo) & ((prob < hi) | (hi == 1))
        if m.any():
            out.append({"bin": [round(float(lo), 2), round(float(hi), 2)], "n": int(m.sum()),
                        "mean_predicted": float(prob[m].mean()), "mean_observed": float(label[m].float().mean())})
    return out


def train(head: AcceptanceHead, x: torch.Tensor, y: torch.Tensor, recipe: HeadRecipe, ckpt: Path | None = None):
    """Weighted-BCE training; returns the mean loss per epoch. Resumes from ckpt if present."""
    opt = torch.optim.AdamW(head.parameters(), lr=recipe.lr, weight_decay=0.01)
    losses, first = [], 0
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        losses, first = state["losses"], state["epoch"]
    gen = torch.Generator().manual_seed(recipe.seed)
    x = x.float()
    for epoch in tqdm(range(first, recipe.epochs), desc="training head", initial=first, total=recipe.epochs):
        perm = torch.randperm(len(x), generator=gen)
        total = 0.0
        for s in range(0, len(x), recipe.batch_size):
            idx = perm[s: s + recipe.batch_size]
            loss = weighted_bce(head(x[idx]), y[idx], recipe.reject_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        losses.append(total / len(x))
        if ckpt is not None:
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "losses": losses, "epoch": epoch + 1},
                       ckpt)
    return losses


def both_splits(fn, engine, train_c, val_c, recipe, cache: Path):
    """fn(engine, chunks, recipe, cache, split) on the training and the held-out chunks (each
    cached under `cache`), and the seconds both took."""
    t0 = time.perf_counter()
    train = fn(engine, train_c, recipe, cache, "train")
    return train, fn(engine, val_c, recipe, cache, "val"), time.perf_counter() - t0


def train_head(engine, out_path, recipe: HeadRecipe | None = None, work_dir=None, draft_name: str = "",
               command: str = "") -> TrainReport:
    """Extract features, train, evaluate on held-out files; writes the head and `<head>.json`."""
    recipe = recipe or HeadRecipe()
    if recipe.mode not in ("greedy", "sampled"):
        raise SpecEngineError(f"mode must be 'greedy' or 'sampled', got {recipe.mode!r}")
    out_path, work, train_c, val_c, files = prepare_data(engine, recipe, out_path, work_dir, "train-head")
    report = TrainReport(recipe=asdict(recipe), files=files)
    features = work / f"features-{data_key(recipe, DATA_FIELDS)}"
    (x, y), (xv, yv), report.extract_seconds = both_splits(extract_features, engine, train_c, val_c, recipe, features)
    report.train_positions, report.val_positions = len(x), len(xv)
    torch.manual_seed(recipe.seed)
    cfg = engine.draft.model.config
    meta = HeadMeta(cfg.hidden_size, cfg.own_vocab_size, model_fingerprint(cfg), recipe.mode, recipe.n_blocks,
                    draft_name)
    head = AcceptanceHead(meta)
    t0 = time.perf_counter()
    with torch.enable_grad():
        report.losses = train(head, x, y, recipe, work / f"checkpoint-{data_key(recipe, sorted(asdict(recipe)))}.pt")
    report.train_seconds = time.perf_counter() - t0
    with torch.no_grad():
        prob = head.accept_prob(xv.float())
    binary = yv > 0.5 if recipe.mode == "greedy" else torch.bernoulli(yv, generator=torch.Generator().manual_seed(1)) > 0
    report.val_auroc = auroc(prob, binary)
    report.val_calibration = calibration(prob, yv)
    report.val_accept_rate = float(yv.mean())
    head.save(out_path, extra={"command": command, "val_auroc": report.val_auroc})
    out_path.with_suffix(".json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    return report
