"""Causal sliding-window attention over packed documents, with interchangeable backends.

What it replaces: HEAD modded-nanogpt's direct FA3 varlen call (`flash_attn_varlen_func` from the
`kernels` hub, train_gpt.py:1104-1141). FA3 is not installable on our H200 and FA2 varlen
(`torch.nn.attention.varlen.varlen_attn`) does not survive CUDA graph capture (DESIGN.md section 4:
cudaErrorStreamCaptureImplicit in global mode, silently wrong replays in thread_local mode), so the
graph path uses FlexAttention with a BlockMask built from block-level document bounds with tensor
ops only (`BlockMask.from_kv_blocks`, as the early-2025 speedrun records did; `create_block_mask`
inside the compiled forward had not finished compiling after 5 minutes at T=16,384 on the H200).

Semantics (all backends): query i attends key j iff j <= i, i - j <= window (FA's window_size=(W, 0))
and both lie in the same document of `cum_seqlens` (int32 [C], entry 0 is 0, padded with T).

Backends:
- "reference": dense [T, T] boolean mask + SDPA. O(T^2) memory; CPU tests and the CPU trainer.
  No data-dependent shapes, so it compiles with fullgraph=True.
- "flex":      FlexAttention with a block mask (block size 128, T % 128 == 0). Checked in torch
               2.13 CPU: forward runs eager and compiled, but FlexAttention has NO CPU backward
               ("FlexAttention does not support backward on CPU"), so `auto` never picks it on CPU.
- "varlen":    torch.nn.attention.varlen.varlen_attn (FA2), CUDA eager only (not graph-safe).
- "fa3":       varlen_attn after activate_flash_attention_impl("FA3"), where that works.
- "fa4":       FlashAttention 4 varlen (the flash-attn-4 package) as two custom ops
               (model/attention_fa4.py), CUDA SM90 / SM100; compiles and captures like flex.
`resolve_backend("auto", device)`: CUDA -> "flex", CPU -> "reference". The trainer logs the result.

What must stay stable: nothing here owns memory; `window` and `max_seqlen` are Python ints the
compiled forward specializes on (part of StepGraphKey).

Paired heads (facts 1.2): `pair_heads` turns [T, H, D] into [2T, H/2, D] (position 2t holds head 2p
of pair p, position 2t+1 head 2p+1); the caller doubles cum_seqlens, max_seqlen stays in doubled
positions, and the window (in doubled positions) is not changed, i.e. effectively halved.
The output goes back to [T, H*D] either by `unpair_heads` (a copy) or, without one, as
`paired_rows` read by a projection whose columns `pair_major_columns` permuted (a copy of the
weight, [N, H*D], instead of the activations, [T, H*D]); GPTConfig.paired_head_copies picks.

Legend: T tokens, H heads, D head_dim, C cum_seqlens entries, NB blocks of BLOCK tokens.
"""

import importlib

import torch
import torch.nn.functional as F
from torch import Tensor

from track_1_short.model.attention_fa4 import fa4_attention, fa4_unavailable_reason
from track_1_short.model.tokens import BLOCK_TOKENS
from track_1_short.model.gpt_config import BACKENDS

BLOCK = BLOCK_TOKENS  # FlexAttention tile (query and key) in tokens


def _fa3_available() -> bool:
    attention = importlib.import_module("torch.nn.attention")
    if not hasattr(attention, "activate_flash_attention_impl"):
        return False
    if "FA3" not in attention.list_flash_attention_impls():
        return False
    try:
        attention.activate_flash_attention_impl("FA3")
    except (ImportError, RuntimeError, ModuleNotFoundError):
        return False
    return True


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend `name` means on `device` ("auto" resolved); ValueError if it cannot run there."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} unknown; choose one of {BACKENDS}")
    cuda = torch.device(device).type == "cuda"
    if name == "auto":
        return "flex" if cuda else "reference"
    if name in ("varlen", "fa3") and not cuda:
        raise ValueError(f"attention backend {name!r} needs CUDA; use 'reference' on {device}")
    if name == "fa3" and not _fa3_available():
        raise ValueError("attention backend 'fa3': FA3 is not importable here; use 'flex'")
    why = fa4_unavailable_reason(device) if name == "fa4" else None
    if why is not None:
        raise ValueError(f"attention backend 'fa4' cannot run on {device}: {why}; use 'flex'")
    return name


@torch.library.custom_op("track_1_short::document_ids", mutates_args=())
def _document_ids(cum_seqlens: Tensor, num_tokens: int) -> Tensor:
    pos = torch.arange(num_tokens, device=cum_seqlens.device, dtype=cum_seqlens.dtype)
    return torch.searchsorted(cum_seqlens, pos, right=True) - 1  # [T] int64


@_document_ids.register_fake
def _document_ids_fake(cum_seqlens: Tensor, num_tokens: int) -> Tensor:
    return cum_seqlens.new_empty(num_tokens, dtype=torch.int64)


def document_ids(cum_seqlens: Tensor, num_tokens: int) -> Tensor:
    """Document index of every token (int64 [T]); padding entries (== T) never match a token.

    A custom op on purpose: inductor then runs it as an extern kernel whose output has a fixed
    layout. As a fused pointwise buffer it reached FlexAttention's mask_mod with a FlexibleLayout,
    and the flex template lowering failed with "convert FlexibleLayout to FixedLayout first"
    (torch 2.11+cu130 on the H200, tiny GPT, 1,024 paired positions; 2026-11-29)."""
    return _document_ids(cum_seqlens, num_tokens)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, cum_seqlens: Tensor, window: int,
                        scale: float) -> Tensor:
    t = q.shape[0]
    doc = document_ids(cum_seqlens, t)  # [T]
    pos = torch.arange(t, device=q.device)
    delta = pos[:, None] - pos[None, :]  # [T, T] query - key
    mask = (delta >= 0) & (delta <= window) & (doc[:, None] == doc[None, :])  # [T, T]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)  # [H, T, D]
    return out.transpose(0, 1)


def _block_lists(lo: Tensor, hi: Tensor, num_blocks: int) -> tuple[Tensor, Tensor]:
    """Per query block m, the key blocks n in [lo[m], hi[m]) as (count [1,1,NB], indices [1,1,NB,NB])."""
    j = torch.arange(num_blocks, device=lo.device, dtype=torch.int32)
    count = (hi - lo).clamp(min=0).to(torch.int32)  # [NB]
    idx = (lo[:, None] + j[None, :]).clamp(max=num_blocks - 1).to(torch.int32)  # [NB, NB]
    return count[None, None], idx[None, None]


def flex_block_mask(cum_seqlens: Tensor, num_tokens: int, window: int):
    """BlockMask from document bounds with tensor ops only (no create_block_mask).

    Query block m (first token qf, last ql) needs key blocks [lo, m] with
    lo = block of max(start of qf's document, qf - window). Blocks in [lo_full, m) are fully
    allowed (same document as ql, ql - first key <= window); the rest of [lo, m] is partial."""
    from torch.nn.attention.flex_attention import BlockMask

    if num_tokens % BLOCK:
        raise ValueError(f"flex attention needs tokens % {BLOCK} == 0 (got {num_tokens}); "
                         f"use attention backend 'reference' or pad the batch")
    nb = num_tokens // BLOCK
    doc = document_ids(cum_seqlens, num_tokens)  # [T]
    starts = cum_seqlens.long()[doc.long()]  # [T] first token of each token's document
    m = torch.arange(nb, device=cum_seqlens.device)
    qf, ql = m * BLOCK, m * BLOCK + BLOCK - 1  # [NB]
    lo = torch.maximum(starts[qf], qf - window) // BLOCK  # [NB]
    first_allowed = torch.maximum(starts[ql], ql - window)  # [NB] earliest key allowed for ql
    lo_full = torch.maximum((first_allowed + BLOCK - 1) // BLOCK, lo)  # [NB]
    # partial blocks: [lo, lo_full) then the diagonal block m
    n_edge = (torch.minimum(lo_full, m) - lo).clamp(min=0)  # [NB]
    j = torch.arange(nb, device=m.device)
    partial_idx = torch.where(j[None, :] < n_edge[:, None], lo[:, None] + j[None, :], m[:, None])
    partial_num = (n_edge + 1).to(torch.int32)[None, None]  # [1, 1, NB]
    full_num, full_idx = _block_lists(lo_full, m, nb)

    def mask_mod(b, h, qi, ki):
        return (qi >= ki) & (qi - ki <= window) & (doc[qi] == doc[ki])

    return BlockMask.from_kv_blocks(partial_num, partial_idx.clamp(max=nb - 1).to(torch.int32)[None, None],
                                    full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(num_tokens, num_tokens))


def flex_attention(q: Tensor, k: Tensor, v: Tensor, cum_seqlens: Tensor, window: int,
                   scale: float) -> Tensor:
    from torch.nn.attention.flex_attention import flex_attention as flex

    mask = flex_block_mask(cum_seqlens, q.shape[0], window)
    out = flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
               block_mask=mask, scale=scale)  # [1, H, T, D]
    return out[0].transpose(0, 1)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cum_seqlens: Tensor, max_seqlen: int,
                     window: int, scale: float) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    cu = cum_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=(window, 0))


def attention(q: Tensor, k: Tensor, v: Tensor, cum_seqlens: Tensor, max_seqlen: int, window: int,
              scale: float, backend: str) -> Tensor:
    """q, k, v [T, H, D] -> [T, H, D]. `backend` must already be resolved (resolve_backend)."""
    if backend == "reference":
        return reference_attention(q, k, v, cum_seqlens, window, scale)
    if backend == "flex":
        return flex_attention(q, k, v, cum_seqlens, window, scale)
    if backend in ("varlen", "fa3"):
        return varlen_attention(q, k, v, cum_seqlens, max_seqlen, window, scale)
    if backend == "fa4":
        return fa4_attention(q, k, v, cum_seqlens, max_seqlen, window, scale)
    raise ValueError(f"attention backend {backend!r} not resolved; call resolve_backend first")


def pair_heads(x: Tensor) -> Tensor:
    """[T, H, D] -> [2T, H/2, D]: pair p's two heads become consecutive positions."""
    t, h, d = x.shape
    return x.view(t, h // 2, 2, d).transpose(1, 2).reshape(2 * t, h // 2, d)


def unpair_heads(x: Tensor) -> Tensor:
    """[2T, H/2, D] -> [T, H, D] (inverse of pair_heads)."""
    t2, hp, d = x.shape
    return x.view(t2 // 2, 2, hp, d).transpose(1, 2).reshape(t2 // 2, 2 * hp, d)


def paired_rows(x: Tensor) -> Tensor:
    """[2T, H/2, D] -> [T, H*D] without a copy: token t's row holds its heads in pair-major order,
    column (j, p, d) for head 2p + j (unpair_heads' order is (2p + j, d)). A projection reads it
    with its columns put in the same order by `pair_major_columns`."""
    t2, hp, d = x.shape
    return x.reshape(t2 // 2, 2 * hp * d)


def pair_major_columns(w: Tensor, num_heads: int) -> Tensor:
    """[N, H*D] with columns (h, d) -> [N, H*D] with columns (j, p, d) for h = 2p + j: a copy of the
    weight, so that F.linear(paired_rows(x), pair_major_columns(w, H)) equals
    F.linear(unpair_heads(x).reshape(T, H*D), w) without copying the activations."""
    n, hd = w.shape
    return w.view(n, num_heads // 2, 2, hd // num_heads).transpose(1, 2).reshape(n, hd)
