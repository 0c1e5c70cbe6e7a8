"""Context parallelism: every sequence split over a ring of cp ranks, attention passing keys and values around it.

    local_positions(seq, cp, tp, sp)     the global positions this rank holds, in its local order
    split_sequence(x, cp)                (B, T) ids or targets -> (B, T/cp): this rank's two chunks
    dropout_keep(...)                    the attention-dropout mask of any block, from (seed, position): no state
    ring_attention(q, k, v, cp, ...)     causal attention over the whole ring (an autograd function)

Load balance (Megatron's, and Brandon et al.'s "striped" idea in its chunked form): a sequence of T tokens is cut
into 2cp chunks of T/(2cp); cp rank r holds chunks r and 2cp-1-r, so under the causal mask every rank does the
same attention work (an early chunk with little to attend to is paired with a late one with much). Positions
stay global: a rank's tokens take the wpe rows (and the dropout masks, and the loss targets) of the positions
they have in the whole sequence.

    T = 8 tokens, cp = 2:   chunks  [0 1] [2 3] [4 5] [6 7]      rank 0 holds chunks 0, 3 = positions 0 1 6 7
                                                                  rank 1 holds chunks 1, 2 = positions 2 3 4 5

Ring attention (Liu et al. 2023; Megatron's context parallelism): each rank keeps its queries and sends its
(k, v) to the next rank of the ring while it computes with the (k, v) it holds; after cp steps it has seen every
rank's keys. The partial results merge by the online softmax (running row max m, running sum l, unnormalised
output acc: the flash-attention recurrence), and the rank saves only q, k, v, the output and its log-sum-exp.
Backward goes around the ring again with (k, v), carrying the key/value gradients with them; after cp steps
each (dk, dv) has collected every rank's contribution and one last hop takes it home.

Per (q chunk a, kv chunk b) block the causal mask is: b < a whole block; b == a lower triangle; b > a nothing
(skipped). A sliding window also skips the blocks wholly farther back than it and masks the ones it
cuts. Document ids (data.document_mask) hide the pairs of different documents and skip a block whose two
chunks share no document in any row; every rank holds its rows' ids, so they are read, not sent. With the load-balanced chunks every off-diagonal ring step computes exactly half of the (2c x 2c)
block's pairs on every rank.

Attention dropout is a counter-based mask: keep(b, h, i, j) = hash(seed, b, h, i, j) >= p * 2^32 for row b of
the micro-batch, global head h and global positions i, j, with one `seed` per attention call drawn from torch's
default generator (the stream tp and cp ranks share, which torch.utils.checkpoint replays). Any block of the mask
is computed where it is needed, in forward and again in backward, so nothing is stored, no rank ever draws the
whole (B, H, T, T) mask, and the single process (which runs the same code with cp = 1 when dropout is on) drops
exactly the same attention weights as every layout.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from .grid import Axis


# ---------------------------------------------------------------- the load-balanced split
def chunk_ids(cp_rank: int, cp: int) -> tuple[int, ...]:
    """The chunks (of 2cp) that cp rank `cp_rank` holds, in its local order; cp = 1: the whole sequence."""
    return (cp_rank, 2 * cp - 1 - cp_rank) if cp > 1 else (0,)


def local_positions(seq: int, cp: Axis, tp: Optional[Axis] = None, sp: bool = False) -> torch.Tensor:
    """The global positions (0..seq-1) of the tokens this rank holds, in its local order: cp rank r's chunks r and
    2cp-1-r, then, with sequence parallelism, tp rank t's t-th share of those (seq divisible by 2cp, and by cp*tp
    with sp: config.validate)."""
    chunks = chunk_ids(cp.rank, cp.size)
    c = seq // (2 * cp.size) if cp.size > 1 else seq
    pos = torch.cat([torch.arange(k * c, (k + 1) * c) for k in chunks])
    if sp and tp is not None and tp.active:
        per = pos.numel() // tp.size
        pos = pos[tp.rank * per:(tp.rank + 1) * per]
    return pos


def split_sequence(x: torch.Tensor, cp: Axis, dim: int = 1) -> torch.Tensor:
    """This cp rank's chunks of a whole-sequence tensor (token ids, targets): (B, T) -> (B, T/cp)."""
    if not cp.active:
        return x
    return x.index_select(dim, local_positions(x.shape[dim], cp).to(x.device))


# ---------------------------------------------------------------- counter-based attention dropout
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding values < 2^32, in 16-bit halves so that nothing overflows."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Wellons' `lowbias32`), on int64 tensors holding values < 2^32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def dropout_keep(seed: int, p: float, batch: int, heads: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                 device) -> torch.Tensor:
    """The keep mask (bool, (batch, len(heads), len(q_pos), len(k_pos))) of attention dropout with probability p:
    element (b, h, i, j) is kept when hash(seed, b, heads[h], q_pos[i], k_pos[j]) >= p * 2^32. `heads` and the
    positions are global (a tp rank's heads, a cp rank's chunks), so every layout computes the same mask."""
    i64 = dict(dtype=torch.int64, device=device)
    b = torch.arange(batch, **i64).view(-1, 1, 1, 1)
    h = heads.to(**i64).view(1, -1, 1, 1)
    s = _mix32(torch.tensor([(seed >> 32) & _M32], **i64)) ^ (seed & _M32)
    x = _mix32(_mix32(s ^ _mix32(b * 65599 + h)) ^ q_pos.to(**i64).view(1, 1, -1, 1))
    x = _mix32(x ^ k_pos.to(**i64).view(1, 1, 1, -1))
    return x >= int(round(p * 2.0 ** 32))


def draw_seed() -> int:
    """One attention call's dropout seed from torch's default generator (the stream tp and cp ranks share)."""
    return int(torch.randint(0, 2 ** 62, (1,)).item())


# ---------------------------------------------------------------- the ring exchange
class Ring:
    """Point-to-point hops around the cp ring: send a tensor to the next rank while receiving the previous rank's.

    `start` posts both (isend / irecv over the cp group: gloo on CPU, NCCL on GPU) and returns at once; `wait`
    blocks until they are done and returns what arrived. `seconds` counts the time spent inside both (for
    `megalite bench train`'s share of step time inside cp communication)."""

    seconds = 0.0  # class-wide: every Ring of this process adds to it

    def __init__(self, cp: Axis):
        self.cp = cp  # the peers as global ranks (what isend/irecv take), from their ranks in the cp group
        self.next = dist.get_global_rank(cp.group, (cp.rank + 1) % cp.size)
        self.prev = dist.get_global_rank(cp.group, (cp.rank - 1) % cp.size)
        self._works, self._recv, self._sent = [], None, None

    def start(self, t: torch.Tensor) -> None:
        t0 = time.perf_counter()
        t = t.contiguous()
        self._recv = torch.empty_like(t)
        self._works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, self.next, self.cp.group),
                                              dist.P2POp(dist.irecv, self._recv, self.prev, self.cp.group)])
        self._sent = t  # kept alive until the send completes
        Ring.seconds += time.perf_counter() - t0

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        for w in self._works:
            w.wait()
        out, self._works, self._recv, self._sent = self._recv, [], None, None
        Ring.seconds += time.perf_counter() - t0
        return out

    def hop(self, t: torch.Tensor) -> torch.Tensor:
        self.start(t)
        return self.wait()


# ---------------------------------------------------------------- ring attention
def _blocks(my_chunks, src_chunks, c: int = 1, window: int = 0):
    """(i, j, a, b) for every (my q chunk i = global chunk a, src kv chunk j = b) pair the mask does not wholly
    hide: causal (b <= a), and with a sliding window, the nearest pair of the block (a's first query, b's last
    key: (a - b - 1) c + 1 apart) less than `window` apart."""
    return [(i, j, a, b) for i, a in enumerate(my_chunks) for j, b in enumerate(src_chunks)
            if b <= a and (not window or (a - b - 1) * c + 1 < window)]


class _RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole ring's keys and values.

    forward: cp - 1 hops of (k, v) to the next rank (each overlapped with the block computed meanwhile);
    backward: cp - 1 hops of (k, v) again, and cp hops of their gradient (dk, dv), which ends at its owner.
    Inputs (B, H, T/cp, D) in local order (chunks r, 2cp-1-r); computed in fp32 whatever the input dtype (the
    softmax statistics need it), the output returned in q's dtype.
    """

    @staticmethod
    def forward(ctx, q, k, v, cp: Axis, dropout_p: float, seed: int, head0: int, window: int, docs):
        with torch.autocast(q.device.type, enabled=False):
            ctx.meta = (cp, dropout_p, seed, head0, window, docs)
            out, lse = _forward(q.float(), torch.stack([k.float(), v.float()]), *ctx.meta)
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dkv = _backward(q.float(), torch.stack([k.float(), v.float()]), out, lse, g.float(), *ctx.meta)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


class _Blocks:
    """The per-block maths both passes share: chunk views, scores with the causal (sliding-window, document)
    mask, the dropout mask."""

    def __init__(self, q, cp: Axis, dropout_p: float, seed: int, head0: int, window: int = 0, docs=None):
        self.cp, self.p, self.seed, self.window, self.docs = cp, dropout_p, seed, window, docs
        self.mine = chunk_ids(cp.rank, cp.size)
        self.c = q.shape[2] // len(self.mine)
        self.scale = 1.0 / math.sqrt(q.shape[-1])
        self.heads = torch.arange(head0, head0 + q.shape[1])
        self.device, self.batch = q.device, q.shape[0]
        self.causal = torch.ones(self.c, self.c, dtype=torch.bool, device=q.device).tril()
        self._seen = {}  # (a, b) -> the block's visible pairs, built once a pass

    def chunk(self, t, i):  # (..., T/cp, D) -> chunk i of this rank's local order
        return t[..., i * self.c:(i + 1) * self.c, :]

    def blocks(self, src: int):
        """The blocks of src's kv chunks this rank computes: the causal (window) ones, less, with documents, those
        whose query and key chunks share no document in any row (their scores would all be hidden)."""
        out = _blocks(self.mine, chunk_ids(src, self.cp.size), self.c, self.window)
        return out if self.docs is None else [blk for blk in out if bool(self.visible(blk[2], blk[3]).any())]

    def doc(self, k: int):  # (B, c): the document ids of global chunk k
        return self.docs[:, k * self.c:(k + 1) * self.c]

    def visible(self, a: int, b: int):
        """The pairs (query of chunk a, key of chunk b) the mask leaves, (c, c) or with documents (B, 1, c, c);
        None when it hides nothing."""
        if (a, b) not in self._seen:
            vis = None
            if self.window and (a - b + 1) * self.c - 1 >= self.window:  # the block's farthest pair is outside
                i = torch.arange(self.c, device=self.device)
                dist = (a - b) * self.c + i[:, None] - i[None, :]  # query position - key position
                vis = (dist >= 0) & (dist < self.window)
            elif a == b:
                vis = self.causal
            if self.docs is not None:  # the global row's document ids of both chunks: every rank holds them
                same = (self.doc(a)[:, :, None] == self.doc(b)[:, None, :])[:, None]
                vis = same if vis is None else same & vis
            self._seen[(a, b)] = vis
        return self._seen[(a, b)]

    def scores(self, q_i, k_j, a: int, b: int):  # (B, H, c, D) x2 -> (B, H, c, c) for global chunks a, b
        s = (q_i @ k_j.transpose(-1, -2)) * self.scale
        vis = self.visible(a, b)
        return s if vis is None else s.masked_fill(~vis, float("-inf"))

    def keep(self, a: int, b: int):
        """Dropout's 1/(1-p)-scaled keep mask of the block (q chunk a, kv chunk b), or None without dropout."""
        if not self.p:
            return None
        pos = lambda k: torch.arange(k * self.c, (k + 1) * self.c)  # noqa: E731
        keep = dropout_keep(self.seed, self.p, self.batch, self.heads, pos(a), pos(b), self.device)
        return keep.to(torch.float32) / (1.0 - self.p)


def _forward(q, kv, cp: Axis, dropout_p, seed, head0, window, docs):
    """q (B, H, T/cp, D), kv (2, B, H, T/cp, D) -> output (B, H, T/cp, D), log-sum-exp (B, H, T/cp)."""
    blk = _Blocks(q, cp, dropout_p, seed, head0, window, docs)
    n = len(blk.mine)
    m = [torch.full(q.shape[:2] + (blk.c,), float("-inf"), device=q.device) for _ in range(n)]  # row max
    l = [torch.zeros(q.shape[:2] + (blk.c,), device=q.device) for _ in range(n)]  # row sum of exp  # noqa: E741
    acc = [torch.zeros(q.shape[:2] + (blk.c, q.shape[-1]), device=q.device) for _ in range(n)]
    ring = Ring(cp) if cp.active else None
    for step in range(cp.size):
        src = (cp.rank - step) % cp.size  # whose (k, v) we hold
        if step < cp.size - 1:
            ring.start(kv)  # the next hop travels while this block is computed
        for i, j, a, b in blk.blocks(src):
            s = blk.scores(blk.chunk(q, i), blk.chunk(kv[0], j), a, b)
            m_new = torch.maximum(m[i], s.amax(-1))
            # a row the window (or its document) hides wholly, so far, has max -inf: its terms are 0, not
            # exp(-inf + inf)
            m_new = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_new.unsqueeze(-1))
            fix = torch.exp(m[i] - m_new)  # rescales what was summed under the old max
            l[i] = l[i] * fix + p.sum(-1)
            keep = blk.keep(a, b)
            acc[i] = acc[i] * fix.unsqueeze(-1) + (p if keep is None else p * keep) @ blk.chunk(kv[1], j)
            m[i] = m_new
        if step < cp.size - 1:
            kv = ring.wait()
    out = torch.cat([a / s.unsqueeze(-1) for a, s in zip(acc, l)], dim=2)
    lse = torch.cat([mx + torch.log(s) for mx, s in zip(m, l)], dim=2)
    # stored (B, T, H, D) in memory, as SDPA returns it: the caller's (b h t d -> b t (h d)) is then a view, so the
    # output saved here and the projection's saved input are one storage (one copy of the bytes, not two)
    return out.transpose(1, 2).contiguous().transpose(1, 2), lse


def _backward(q, kv, out, lse, g, cp: Axis, dropout_p, seed, head0, window, docs):
    """Gradients of the forward above: dq (B, H, T/cp, D) and this rank's own dkv (2, B, H, T/cp, D).

    With P = softmax(S) (rows normalised over the whole sequence: exp(S - lse)) and the dropout's scaled mask D:
    out = (P * D) V, so dV = (P * D)^T g, dP = (g V^T) * D, and dS = P * (dP - delta) with
    delta = rowsum(dP * P) = rowsum(g * out) (the flash-attention identity), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d).
    """
    blk = _Blocks(q, cp, dropout_p, seed, head0, window, docs)
    delta = (g * out).sum(-1)  # (B, H, T/cp)
    dq = torch.zeros_like(q)
    dkv = torch.zeros_like(kv)
    ring = Ring(cp) if cp.active else None
    for step in range(cp.size):
        src = (cp.rank - step) % cp.size
        if step < cp.size - 1:
            ring.start(kv)
        for i, j, a, b in blk.blocks(src):
            q_i, g_i = blk.chunk(q, i), blk.chunk(g, i)
            k_j, v_j = blk.chunk(kv[0], j), blk.chunk(kv[1], j)
            s = blk.scores(q_i, k_j, a, b)
            p = torch.exp(s - blk.chunk(lse.unsqueeze(-1), i))
            keep = blk.keep(a, b)
            dp = g_i @ v_j.transpose(-1, -2)
            if keep is not None:
                dp = dp * keep
            blk.chunk(dkv[1], j).add_((p if keep is None else p * keep).transpose(-1, -2) @ g_i)
            ds = p * (dp - blk.chunk(delta.unsqueeze(-1), i)) * blk.scale
            blk.chunk(dq, i).add_(ds @ k_j)
            blk.chunk(dkv[0], j).add_(ds.transpose(-1, -2) @ q_i)
        if step < cp.size - 1:
            kv = ring.wait()
        if cp.active:  # (dk, dv) follow their (k, v) to the next rank; after the last step they are home
            dkv = ring.hop(dkv)
    return dq, dkv


def ring_attention(q, k, v, cp: Axis, dropout_p: float = 0.0, seed: int = 0, head0: int = 0, window: int = 0,
                   docs: Optional[torch.Tensor] = None):
    """Causal attention, (B, H, T/cp, D) x3 -> (B, H, T/cp, D), of this cp rank's tokens (local order: chunks r and
    2cp-1-r) against the whole sequence held by the ring (the ranks of `cp.group`). With cp = 1 it is plain
    causal attention with the counter-based dropout (the single process's path when dropout is on).
    `head0`: the global index of q's first head (tp rank x heads per rank), for the dropout mask. `window` > 0:
    query i sees only keys j with i - window < j <= i; blocks wholly outside it are skipped, the partial ones
    masked. `docs` (B, T) (data.document_mask): the document ids of the whole rows, in global order (every rank
    holds its rows' ids: nothing travels); a query sees only keys of its own document, and a block whose chunks
    share no document is skipped."""
    return _RingAttention.apply(q, k, v, cp, dropout_p, seed, head0, window, docs)
