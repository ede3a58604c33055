"""What every Triton kernel here shares, imported one way (`from .jit import triton, tl, ...`).

- `triton` / `tl`: Triton itself, or, where it is not installed, a stand-in that lets the op
  files define their kernels at import (so each file's torch reference, the CPU path, always
  imports); a launcher marked `needs_triton` then says what is missing when called. The ops
  table (`kernels/ops.py`) never picks a kernel without Triton.
- the counter-based hash of `rng.counter_uniform`, bit for bit (uint32 arithmetic held in
  int64, wrapping products then masked, exactly as the torch reference does);
- the samplers' helpers (rejection sampling's one-kernel and split paths, draft sampling):
  row statistics over vocab tiles, the accept test, the exponential race and the token
  writes: one definition each, so every path draws the numbers the torch reference draws;
- the fused step's roundings (`rms_scaled`, `silu_mul`), shared by add_rms_norm / silu_and_mul and
  the fused linears' prologues, so the input a fused linear multiplies is rounded as the unfused
  op would have written it.
Helpers are `@triton.jit` functions, never kernels (no `_kernel` suffix): kernels live in
their op's file beside its reference.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # the references still import; launching a kernel explains
    class _NoTriton:
        """triton / triton.language without Triton: every attribute, call and decorator is a
        stand-in, so kernel definitions import; `needs_triton` launchers refuse to run."""

        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            return self

    triton = tl = _NoTriton()
    HAVE_TRITON = False


def needs_triton(launcher):
    """A kernel's launcher: unchanged with Triton; without it, a clear error when called."""
    if HAVE_TRITON:
        return launcher

    def refuse(*args, **kwargs):
        raise ImportError(f"{launcher.__name__} is a Triton kernel and Triton is not installed: "
                          "pip install 'specengine[triton]', or use kernels='torch'")
    refuse.__name__ = refuse.__qualname__ = launcher.__name__
    refuse.__doc__ = launcher.__doc__
    return refuse


@triton.jit
def rms_scaled(x, inv, w):
    """RMSNorm's output in fp32, transformers' roundings: the normed row (x * inv, fp32) rounded to x's
    dtype before the weight multiplies it."""
    return w.to(tl.float32) * (x.to(tl.float32) * inv).to(x.dtype).to(tl.float32)


@triton.jit
def silu_mul(g, u):
    """silu(g) * u in fp32, transformers' MLP roundings: silu in fp32 rounded to g's dtype first."""
    gf = g.to(tl.float32)
    return (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32) * u.to(tl.float32)


GOLDEN = 0x9E3779B9
M32 = 0xFFFFFFFF


def stream_key(stream: int) -> int:
    return (stream * GOLDEN) & M32


@triton.jit
def mix32(x):
    x = x & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def counter_uniform(seed, offset, pos, idx, key):
    """Uniform fp32 in (0, 1); every argument is int64 (scalars or tensors)."""
    h = mix32(seed ^ key)
    h = mix32(h ^ (seed >> 32))
    h = mix32(h ^ offset)
    h = mix32(h ^ pos)
    h = mix32(h ^ idx)
    return ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)

@triton.jit
def _row_stats(row_base, v_start, v_end, t_eff, live, BLOCK_V: tl.constexpr):
    """Per row: max m and first argmax of the logits l, and sum(exp((l - m) / T)), over the
    vocab range [v_start, v_end) (tiles of BLOCK_V). Subtracting before dividing keeps every
    temperature finite (l / T overflows fp32 for tiny T; (l - m) / T <= 0 never does).

    row_base [BB] pointers to each row's logits; rows that are not `live` read nothing.
    """
    BB: tl.constexpr = row_base.shape[0]
    m = tl.full((BB,), float("-inf"), tl.float32)
    s = tl.zeros((BB,), tl.float32)
    best = tl.full((BB,), float("-inf"), tl.float32)
    arg = tl.zeros((BB,), tl.int64)
    for v0 in range(v_start, v_end, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_base[:, None] + offs[None, :], mask=live[:, None] & (offs[None, :] < v_end),
                    other=float("-inf")).to(tl.float32)
        tmax = tl.max(x, 1)
        targ = tl.argmax(x, 1).to(tl.int64) + v0
        better = tmax > best
        arg = tl.where(better, targ, arg)
        best = tl.where(better, tmax, best)
        m_new = tl.maximum(m, tmax)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp((m - m_safe) / t_eff) + tl.sum(tl.exp((x - m_safe[:, None]) / t_eff[:, None]), 1)
        m = m_new
    return m, s, arg


@triton.jit
def _accept(logits_rows, drafts_ptr, q_ptr, rows, row_ok, i, live, m, s, arg, greedy, t_eff, seed, offset,
            s_lk, s_db, s_dk, s_qb, s_qk, V, KEY_ACCEPT, HAS_Q: tl.constexpr):
    """The accept test of draft position i given its statistics: greedy x == argmax, else
    u * q(x) < p(x). Returns ok per row (False for rows that are not live)."""
    BB: tl.constexpr = rows.shape[0]
    x = tl.load(drafts_ptr + rows * s_db + i * s_dk, mask=row_ok, other=0)
    x = tl.minimum(tl.maximum(x, 0), V - 1)
    l_x = tl.load(logits_rows + i * s_lk + x, mask=live, other=0.0).to(tl.float32)
    p_x = tl.exp((l_x - m) / t_eff) / s
    if HAS_Q:
        q_x = tl.load(q_ptr + rows * s_qb + i * s_qk + x, mask=live, other=1.0).to(tl.float32)
    else:
        q_x = tl.full((BB,), 1.0, tl.float32)
    u = counter_uniform(seed, offset, tl.zeros((BB,), tl.int64) + i, tl.zeros((BB,), tl.int64), KEY_ACCEPT)
    return live & tl.where(greedy, x == arg, u * q_x < p_x)


@triton.jit
def _race(end_rows, rows, v_start, v_end, sampling, done, n_acc, j_q, x_end, m_end, s_end, t_eff, seed, offset,
          q_ptr, s_qb, s_qk, KEY_SAMPLE, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    """The exponential race argmax(r / E) over [v_start, v_end) for the residual r =
    max(p - q, 0) of rejected rows (p for the others) and for p itself (the fallback of an
    all-zero residual). Returns (best r/E, its index, best p/E, its index): first index on ties."""
    BB: tl.constexpr = rows.shape[0]
    best_r = tl.full((BB,), -1.0, tl.float32)
    idx_r = tl.zeros((BB,), tl.int64)
    best_p = tl.full((BB,), -1.0, tl.float32)
    idx_p = tl.zeros((BB,), tl.int64)
    for v0 in range(v_start, v_end, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        inb = sampling[:, None] & (offs[None, :] < v_end)
        x = tl.load(end_rows[:, None] + offs[None, :], mask=inb, other=float("-inf")).to(tl.float32)
        p = tl.exp((x - m_end[:, None]) / t_eff[:, None]) / s_end[:, None]
        if HAS_Q:
            qv = tl.load(q_ptr + (rows * s_qb + j_q * s_qk)[:, None] + offs[None, :], mask=inb,
                         other=0.0).to(tl.float32)
        else:
            qv = (offs[None, :] == x_end[:, None]).to(tl.float32)
        r = tl.where(done[:, None], tl.maximum(p - qv, 0.0), p)
        u = counter_uniform(seed[:, None], offset[:, None], n_acc.to(tl.int64)[:, None],
                            offs.to(tl.int64)[None, :], KEY_SAMPLE)
        e = -tl.log(u)
        sr = tl.where(inb, r / e, -1.0)
        sp = tl.where(inb, p / e, -1.0)
        tr, ar = tl.max(sr, 1), tl.argmax(sr, 1).to(tl.int64) + v0
        tp, ap = tl.max(sp, 1), tl.argmax(sp, 1).to(tl.int64) + v0
        idx_r = tl.where(tr > best_r, ar, idx_r)
        best_r = tl.maximum(tr, best_r)
        idx_p = tl.where(tp > best_p, ap, idx_p)
        best_p = tl.maximum(tp, best_p)
    return best_r, idx_r, best_p, idx_p


@triton.jit
def _row_params(rows, row_ok, num_draft_ptr, temp_ptr, seed_ptr, offset_ptr):
    nd = tl.load(num_draft_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    temp = tl.load(temp_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    greedy = temp <= 0
    seed = tl.load(seed_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    offset = tl.load(offset_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    return nd, greedy, tl.where(greedy, 1.0, temp), seed, offset


@triton.jit
def _end_draft(drafts_ptr, rows, row_ok, n_acc, s_db, s_dk, K):
    """The q row the residual uses (the rejected position, or the last one) and its draft."""
    j_q = tl.minimum(n_acc, K - 1)
    return j_q, tl.load(drafts_ptr + rows * s_db + j_q * s_dk, mask=row_ok & (j_q >= 0), other=-1)


@triton.jit
def _write_tokens(out_ptr, drafts_ptr, rows, row_ok, n_acc, final, s_db, s_dk, s_ob, K, BLOCK_K: tl.constexpr):
    """Accepted drafts, then the final token, then -1."""
    kk = tl.arange(0, BLOCK_K)[None, :]
    d = tl.load(drafts_ptr + rows[:, None] * s_db + kk * s_dk, mask=row_ok[:, None] & (kk < K), other=-1)
    na = n_acc[:, None]
    out = tl.where(kk < na, d, tl.where(kk == na, final[:, None], -1))
    tl.store(out_ptr + rows[:, None] * s_ob + kk, out, mask=row_ok[:, None] & (kk < K + 1))
