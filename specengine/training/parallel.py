"""Train ParallelSpec's parallel drafter for a (target, draft) pair: `specengine train-parallel`.

Group-wise training (ParallelSpec, arXiv 2410.05589): one training sequence holds a real
text chunk x_0..x_{L-1} followed by G groups of k-1 masks. Group g is anchored after real
token a_g: its masks see x_0..x_{a_g} and the earlier masks of their own group only (a tree
mask, so position ids follow: MASK_i of group g sits at position a_g + i). One forward
therefore trains every group. MASK_i of group g learns the token x_{a_g+i+1}:
  loss = CE(student, target's top-k distribution at position a_g + i)   (distillation)
       + ce_weight * CE(student, x_{a_g+i+1})                            (the text)
Only the mask embeddings and the mask-row LoRA adapters train; the draft is frozen, so real
positions (and the draft's K/V) are unchanged.

Data rules as for the SpecDec++ head (head.py): Python sources of installed packages,
never HumanEval or MT-bench; provenance (package, version, path, sha256) recorded. The
target's top-k logits per chunk are cached on disk and training checkpoints every step
batch, so an interrupted run resumes.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..drafting.acceptance_head import model_fingerprint
from ..errors import SpecEngineError
from ..drafting.parallel_drafter import DrafterMeta, ParallelDrafter
from ..kernels.ops import TORCH
from ..kernels.rope_kv_write import rotate_qkv
from ..models.rope import rope_tables
from .head import CorpusRecipe, Report, both_splits, data_key, prepare_data


@dataclass
class ParallelRecipe(CorpusRecipe):
    n_train: int = 64  # chunks
    seq_len: int = 128
    k_max: int = 4
    groups: int = 16  # mask groups per chunk
    rank: int = 8
    topk: int = 32  # teacher logits kept per position
    ce_weight: float = 0.5
    epochs: int = 2
    lr: float = 1e-3  # peak; cosine decay to 0, gradients clipped at norm 1
    batch: int = 2


TEACHER_FIELDS = ("packages", "n_train", "n_val", "seq_len", "topk", "seed", "val_fraction")


class _TrainingCache:
    """The decoder's cache protocol for training forwards: each layer keeps its own k/v (no
    shared buffer written in place, so autograd can see through it)."""
    rope_local = None  # sliding-window RoPE tables are not kept for training (Gemma 3 drafters)

    def store(self, layer, qkv, rope, num_heads, num_kv_heads, op=None, qk_norm=None):
        q, k, v = rotate_qkv(qkv, rope.cos, rope.sin, num_heads, num_kv_heads, qk_norm)  # never in place: autograd
        self.write(layer, k, v)
        return q

    def layer(self, layer, length=None):
        return self._kv[layer]


class _FullSequenceCache(_TrainingCache):
    """A KV 'cache' for one full-sequence training forward from length 0."""

    def __init__(self, model, batch: int, length: int, device):
        c = model.config
        self.rope_cos, self.rope_sin = rope_tables(c.hf_config, c.head_dim, length, device)
        self.lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.max_seq_len = length
        self._kv = {}

    def write_positions(self, width):
        return torch.arange(width, device=self.lens.device)[None, :].expand(self.lens.shape[0], width)

    def write(self, layer, k, v):
        self._kv[layer] = (k, v)


def group_layout(L: int, anchors: torch.Tensor, k: int):
    """(mask_index [T], tree [T,T]) for L real tokens then one group of k-1 masks per anchor."""
    G, m = anchors.shape[0], k - 1
    T = L + G * m
    j = torch.arange(T)
    mask_index = torch.where(j >= L, (j - L) % m + 1, 0) if m else torch.zeros(T, dtype=torch.int64)
    group = torch.where(j >= L, (j - L) // max(m, 1), -1)
    tree = torch.zeros(T, T, dtype=torch.bool)
    tree[:L, :L] = torch.ones(L, L, dtype=torch.bool).tril()
    if m:
        q = torch.arange(L, T)
        g, i = group[q], mask_index[q]
        tree[q[:, None], torch.arange(L)[None, :]] = torch.arange(L)[None, :] <= anchors[g][:, None]
        same = (group[None, L:] == g[:, None]) & (mask_index[None, L:] <= i[:, None])
        tree[q[:, None], torch.arange(L, T)[None, :]] = same
    return mask_index, tree


def choose_anchors(L: int, k: int, groups: int, gen: torch.Generator) -> torch.Tensor:
    """G distinct anchors with room for k-1 targets after them (sorted)."""
    lo, hi = 8, L - k - 1
    if hi - lo < groups:
        raise SpecEngineError(f"seq_len {L} too short for {groups} groups of k={k}")
    return torch.sort(lo + torch.randperm(hi - lo, generator=gen)[:groups]).values


@torch.inference_mode()
def teacher_topk(engine, chunks: torch.Tensor, recipe: ParallelRecipe, cache_dir: Path, desc: str):
    """The target's top-k log-probs and ids at every position [N,L,topk], cached per batch."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    vals, ids = [], []
    for s in tqdm(range(0, len(chunks), recipe.batch), desc=f"teacher {desc}", unit="batch"):
        f = cache_dir / f"teacher_{desc}_{s:05d}.pt"
        if f.exists():
            v, i = torch.load(f)
        else:
            c = chunks[s: s + recipe.batch]
            engine.target.allocate(c.shape[0], c.shape[1])
            logp = torch.log_softmax(engine.target.forward(c.to(engine.device)).float(), -1)
            v, i = logp.topk(recipe.topk, -1)
            v, i = v.cpu(), i.cpu().to(torch.int32)
            torch.save((v, i), f)
        vals.append(v), ids.append(i)
    return torch.cat(vals), torch.cat(ids)


class _PrefixThenMasks(_TrainingCache):
    """The mask rows' training 'cache': each layer's real K/V (computed once, without grad)
    followed by the masks' own, read in full by `_explicit_mask_attention`."""

    def __init__(self, real: _FullSequenceCache, batch: int, length: int):
        self.rope_cos, self.rope_sin, self.real = real.rope_cos, real.rope_sin, real
        self.lens = torch.zeros(batch, dtype=torch.int32, device=real.lens.device)
        self.max_seq_len = length
        self._kv = {}

    def write_positions(self, width):
        return None  # unused: write() appends

    def write(self, layer, k, v):
        rk, rv = self.real.layer(layer)
        self._kv[layer] = (torch.cat([rk, k], 1), torch.cat([rv, v], 1))


def _explicit_mask_attention(q, k, v, cache_lens, mask, sm_scale=None, window=None):
    """q [B,M,H,D] over all of k/v [B,S,Hkv,D] under an explicit [M,S] mask (training only);
    window [B,M]: each mask row's first visible position (a sliding-window layer)."""
    m = mask.reshape(1, 1, *mask.shape[-2:])
    if window is not None:
        m = m & (torch.arange(k.shape[1], device=k.device) >= window[:, None, :, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m, scale=sm_scale,
        enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def mask_logits(drafter, chunk: torch.Tensor, anchors: torch.Tensor, k: int) -> torch.Tensor:
    """Logits [B, G*(k-1), V] of every mask of every group: the same numbers as one forward
    over the whole group layout, but the real tokens run once without grad and only the
    mask rows are differentiated (the real rows hold no trainable weight)."""
    B, L = chunk.shape
    mask_index, tree = group_layout(L, anchors, k)
    T = tree.shape[0]
    dev = drafter.mask_embed.device
    real = _FullSequenceCache(drafter.model, B, T, dev)
    with torch.no_grad():
        first = torch.zeros(B, 1, dtype=torch.int64, device=dev)  # no LM head over the real rows
        drafter.model(chunk.to(dev), real, logits_at=first)
    # with cache.lens = 0 a mask row's depth in its [M,T] mask row is its position: anchor + i
    tokens = torch.zeros(B, T - L, dtype=torch.int64, device=dev)
    ops = TORCH.with_attention(_explicit_mask_attention, "explicit-mask")
    return drafter(tokens, mask_index[L:].expand(B, T - L).to(dev), _PrefixThenMasks(real, B, T), ops,
                   tree[L:].to(dev))


def group_loss(drafter, chunk: torch.Tensor, t_vals, t_ids, anchors, recipe: ParallelRecipe, return_acc=False):
    """Mean distillation + text loss over every mask of every group of a batch of chunks."""
    k = recipe.k_max
    dev = drafter.mask_embed.device
    logits = mask_logits(drafter, chunk, anchors, k)
    j = torch.arange(logits.shape[1])  # mask rows in group_layout's order: group-major, MASK_1..MASK_{k-1}
    g, i = j // (k - 1), j % (k - 1) + 1
    src = anchors[g] + i  # the real position whose next token MASK_i predicts
    logq = torch.log_softmax(logits.float(), -1)  # [B, G*(k-1), V]
    tv, ti = t_vals[:, src].to(dev), t_ids[:, src].to(dev).long()
    kd = -(torch.softmax(tv, -1) * logq.gather(-1, ti)).sum(-1).mean()
    text = chunk[:, src + 1].to(dev)
    ce = -logq.gather(-1, text[..., None]).squeeze(-1).mean()
    loss = kd + recipe.ce_weight * ce
    if not return_acc:
        return loss
    # greedy agreement of MASK_i with the target's argmax, per mask index
    hit = (logq.argmax(-1) == ti[..., 0])
    acc = [float(hit[:, i == m].float().mean()) for m in range(1, k)]
    return loss, acc


@dataclass
class ParallelReport(Report):
    teacher_seconds: float = 0.0
    val_loss_before: float | None = None
    val_loss_after: float | None = None
    val_mask_agreement_before: list = field(default_factory=list)
    val_mask_agreement_after: list = field(default_factory=list)


def _evaluate(drafter, chunks, t_vals, t_ids, recipe, gen):
    losses, accs = [], []
    with torch.no_grad():
        for s in range(0, len(chunks), recipe.batch):
            anchors = choose_anchors(chunks.shape[1], recipe.k_max, recipe.groups, gen)
            loss, acc = group_loss(drafter, chunks[s: s + recipe.batch], t_vals[s: s + recipe.batch],
                                   t_ids[s: s + recipe.batch], anchors, recipe, return_acc=True)
            losses.append(float(loss)), accs.append(acc)
    return sum(losses) / len(losses), [sum(a[m] for a in accs) / len(accs) for m in range(recipe.k_max - 1)]


def train_parallel(engine, out_path, recipe: ParallelRecipe | None = None, work_dir=None, draft_name: str = "",
                   command: str = "") -> ParallelReport:
    """Train a parallel drafter for the engine's draft, write it to out_path with a report.

    Why long: the resumable pipeline in order (data, teacher cache, before-score, epochs with
    checkpoints, after-score, save); each stage is a call, the function is their sequence."""
    recipe = recipe or ParallelRecipe()
    if recipe.k_max < 2:
        raise SpecEngineError("k_max must be >= 2 (k-1 masks)")
    out_path, work, train_c, val_c, files = prepare_data(engine, recipe, out_path, work_dir, "train-parallel")
    report = ParallelReport(recipe=asdict(recipe), files=files)
    teacher = work / f"teacher-{data_key(recipe, TEACHER_FIELDS)}"
    (tv, ti), (vv, vi), report.teacher_seconds = both_splits(teacher_topk, engine, train_c, val_c, recipe, teacher)

    model = engine.draft.model
    from ..models.cpu_matmul import unpack

    unpack(model)  # autograd needs plain weights (packed oneDNN weights have no backward)
    cfg = model.config
    torch.manual_seed(recipe.seed)
    meta = DrafterMeta(cfg.hidden_size, cfg.own_vocab_size, model_fingerprint(cfg), recipe.k_max, recipe.rank,
                       draft_name)
    drafter = ParallelDrafter(model, meta).to(engine.draft.device)
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(drafter.trainable_state().values())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    steps = recipe.epochs * ((len(train_c) + recipe.batch - 1) // recipe.batch)
    # a constant 2e-3 diverged after ~60 steps on the real pair (bench/results/cpu_parallel_drafter_training.json): decay it
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))
    ckpt = work / f"checkpoint-{data_key(recipe, sorted(asdict(recipe)))}.pt"  # a changed recipe starts afresh
    step0 = 0
    if ckpt.exists():
        state = torch.load(ckpt)
        drafter.load_trainable(state["drafter"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        report.losses, step0 = state["losses"], state["step"]
    report.val_loss_before, report.val_mask_agreement_before = _evaluate(
        drafter, val_c, vv, vi, recipe, torch.Generator().manual_seed(99)) if step0 == 0 else (None, [])
    gen = torch.Generator().manual_seed(recipe.seed)
    t0 = time.perf_counter()
    with torch.enable_grad():
        bar = tqdm(range(steps), desc="training drafter", initial=step0, total=steps)
        for step in bar:
            order = torch.randperm(len(train_c), generator=gen)  # consumed every step: resumes identically
            anchors = choose_anchors(train_c.shape[1], recipe.k_max, recipe.groups, gen)
            if step < step0:
                continue
            idx = order[: recipe.batch]
            loss = group_loss(drafter, train_c[idx], tv[idx], ti[idx], anchors, recipe)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            report.losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{report.losses[-1]:.3f}")
            torch.save({"drafter": {k: v.detach() for k, v in drafter.trainable_state().items()},
                        "opt": opt.state_dict(), "sched": sched.state_dict(), "losses": report.losses,
                        "step": step + 1}, ckpt)
    report.train_seconds = time.perf_counter() - t0
    for p in params:
        p.requires_grad_(False)
    report.val_loss_after, report.val_mask_agreement_after = _evaluate(
        drafter, val_c, vv, vi, recipe, torch.Generator().manual_seed(99))
    drafter.save(out_path, extra={"command": command})
    out_path.with_suffix(".json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    engine._drafter = drafter  # the engine now drafts with it
    return report
