"""Hopper forward of jagged softmax attention in Gluon (Triton's lower-level language).

The Triton forward waits on each block's score product before its softmax, so within a program the tensor
cores idle while the exponentials run. Here the loop is rotated as FlashAttention-3 does within a warpgroup:
block j's scores S_j = Q K_j^T and the previous block's P_{j-1} V_{j-1} are both issued asynchronously, the
wait lets the second stay in flight, and the softmax of S_j runs under it. K and V blocks come through TMA
into two-slot rings with one mbarrier per slot; a slot is refilled as soon as the product that read it is done.

Same contract and work lists as kernels.triton.triton_jagged_attention's forward (persistent programs over
heaviest-first (tile, head) items; masking by adding a large negative number; base-2 logsumexp saved), for
the cases it takes: softmax, bf16 or fp16 inputs, head dims 64 or 128 (equal for values), TMA-able tensors,
compute capability 9.0. Everything else stays with the Triton kernels, which are also its reference on the
GPU (the PyTorch reference is the oracle of both).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# (BLOCK_M, BLOCK_N, warps) per head dim: two warpgroups of 64 query rows each.
BLOCKS = {64: (128, 128, 8), 128: (128, 128, 8)}
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)

_NEG_LARGE = gl.constexpr(-1.0e30)
_RUNNING_MAX_START = gl.constexpr(-0.5e30)
_EMPTY_ROW_LSE = gl.constexpr(1.0e30)


@gluon.jit
def _load_kv(desc, smem, bars, row, col, count, pred, BYTES: gl.constexpr):
    """Block `count` of this program's K (or V) stream into its ring slot, if pred."""
    slot = count % 2
    mbarrier.expect(bars.index(slot), BYTES, pred=pred)
    tma.async_copy_global_to_shared(desc, [row, col], bars.index(slot), smem.index(slot), pred=pred)


@gluon.jit
def _scaled_scores(s, n0, rows, hi, shift, unmasked, qk_scale, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                   CAUSAL: gl.constexpr):
    """Scores in base-2 units; past `unmasked` a large negative number added where the key is not visible."""
    s = s * qk_scale
    if n0 + BLOCK_N > unmasked:
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(cols, 0) < hi
        if CAUSAL:
            visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + shift)
        s = s + gl.where(visible, 0.0, _NEG_LARGE)
    return s


@gluon.jit
def _forward_kernel(q_desc, k_desc, v_desc, out_ptr, lse_ptr, q_offsets_ptr, kv_offsets_ptr, tiles_ptr,
                    tile_index_ptr, num_heads, total_q, qk_scale,
                    DTYPE: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [NUM_WARPS, 1], [1, 0])
    dtype: gl.constexpr = DTYPE
    KV_BYTES: gl.constexpr = BLOCK_N * HEAD_DIM * 2  # bytes of a 16-bit block
    Q_BYTES: gl.constexpr = BLOCK_M * HEAD_DIM * 2

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()

    first_tile = gl.load(tile_index_ptr + 2 * (BLOCK_M // 16))
    items = gl.load(tile_index_ptr + 2 * (BLOCK_M // 16) + 1) * num_heads
    done = 0  # K (and V) blocks this program has consumed: ring slot and mbarrier phase of the next ones
    visits = 0  # items that loaded a Q block: phase of q_bar
    for item in range(gl.program_id(0), items, gl.num_programs(0)):
        tile = first_tile + item // num_heads
        head = item % num_heads
        seq = gl.load(tiles_ptr + 2 * tile)
        m0 = gl.load(tiles_ptr + 2 * tile + 1)
        q_start = gl.load(q_offsets_ptr + seq)
        q_len = (gl.load(q_offsets_ptr + seq + 1) - q_start).to(gl.int32)
        kv_start = gl.load(kv_offsets_ptr + seq)
        kv_len = (gl.load(kv_offsets_ptr + seq + 1) - kv_start).to(gl.int32)
        shift = kv_len - q_len  # query i sees keys j <= i + shift when causal
        if CAUSAL:
            hi = gl.minimum(gl.maximum(gl.minimum(m0 + BLOCK_M, q_len) + shift, 0), kv_len)
            unmasked = (gl.minimum(gl.maximum(m0 + 1 + shift, 0), kv_len) // BLOCK_N) * BLOCK_N
        else:
            hi = kv_len
            unmasked = (kv_len // BLOCK_N) * BLOCK_N
        blocks = gl.cdiv(hi, BLOCK_N)
        col = head * HEAD_DIM
        kv_row = kv_start.to(gl.int32)
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))

        m_i = gl.full([BLOCK_M], _RUNNING_MAX_START, gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        if blocks > 0:
            mbarrier.expect(q_bar, Q_BYTES)
            tma.async_copy_global_to_shared(q_desc, [(q_start + m0).to(gl.int32), col], q_bar, q_smem)
            for i in gl.static_range(2):
                _load_kv(k_desc, k_smem, k_bars, kv_row + i * BLOCK_N, col, done + i, i < blocks, KV_BYTES)
                _load_kv(v_desc, v_smem, v_bars, kv_row + i * BLOCK_N, col, done + i, i < blocks, KV_BYTES)
            mbarrier.wait(q_bar, visits % 2)
            visits += 1

            # Block 0 alone: its scores, then its K slot refilled with block 2.
            mbarrier.wait(k_bars.index(done % 2), (done // 2) % 2)
            s = warpgroup_mma(q_smem, k_smem.index(done % 2).permute((1, 0)),
                              gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False)
            _load_kv(k_desc, k_smem, k_bars, kv_row + 2 * BLOCK_N, col, done + 2, 2 < blocks, KV_BYTES)
            s = _scaled_scores(s, 0, rows, hi, shift, unmasked, qk_scale, s_layout, BLOCK_N, CAUSAL)
            m_i = gl.maximum(m_i, gl.max(s, axis=1))
            p = gl.exp2(s - gl.expand_dims(m_i, 1))
            l_i = gl.sum(p, axis=1)

            for j in range(1, blocks):
                this = done + j
                s_token = warpgroup_mma(q_smem, _wait_slot(k_smem, k_bars, this).permute((1, 0)),
                                        gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False,
                                        is_async=True)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                acc_token = warpgroup_mma(p_op, _wait_slot(v_smem, v_bars, this - 1), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=[s_token])  # P_{j-1} V_{j-1} stays in flight
                _load_kv(k_desc, k_smem, k_bars, kv_row + (j + 2) * BLOCK_N, col, this + 2, j + 2 < blocks,
                         KV_BYTES)
                s = _scaled_scores(s, j * BLOCK_N, rows, hi, shift, unmasked, qk_scale, s_layout, BLOCK_N, CAUSAL)
                m_new = gl.maximum(m_i, gl.max(s, axis=1))
                alpha = gl.exp2(m_i - m_new)
                p = gl.exp2(s - gl.expand_dims(m_new, 1))
                l_i = l_i * alpha + gl.sum(p, axis=1)
                m_i = m_new
                acc, p_op = warpgroup_mma_wait(0, deps=[acc_token, p_op])
                _load_kv(v_desc, v_smem, v_bars, kv_row + (j + 1) * BLOCK_N, col, this + 1, j + 1 < blocks,
                         KV_BYTES)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)

            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p_op, _wait_slot(v_smem, v_bars, done + blocks - 1), acc)
            done += blocks

        has_key = l_i > 0.0
        l_safe = gl.where(has_key, l_i, 1.0)
        lse = gl.where(has_key, m_i + gl.log2(l_safe), _EMPTY_ROW_LSE)
        gl.store(lse_ptr + head * total_q + q_start + rows, lse, mask=rows < q_len)
        acc = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
        # Stored row by row in 16-byte pieces: rows past q_len belong to the next sequence, so no TMA store.
        o = gl.convert_layout(acc.to(dtype), store_layout)
        out_rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
        out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, store_layout))
        ptrs = out_ptr + gl.expand_dims((q_start + out_rows) * (num_heads * HEAD_DIM), 1) \
            + col + gl.expand_dims(out_cols, 0)
        gl.store(ptrs, o, mask=gl.expand_dims(out_rows < q_len, 1))


@gluon.jit
def _wait_slot(smem, bars, count):
    """The ring slot holding block `count` of a stream, once its copy has landed."""
    mbarrier.wait(bars.index(count % 2), (count // 2) % 2)
    return smem.index(count % 2)


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def supports_forward(q: torch.Tensor, v: torch.Tensor, silu: bool, tma_ok: bool) -> bool:
    """Whether this forward takes the call: see the module docstring."""
    return (not silu and tma_ok and q.is_cuda and q.dtype in SUPPORTED_DTYPES and q.shape[2] in BLOCKS
            and v.shape[2] == q.shape[2] and _is_hopper(q.device.index or 0))


def block_m(head_dim: int) -> int:
    """The query block size the work list must be built for."""
    return BLOCKS[head_dim][0]


def forward(q, k, v, out, lse, q_offsets, kv_offsets, tiles, tile_index, causal: bool, scale: float,
            programs: int) -> None:
    """out [total_q, H, D] and lse [H, total_q] (base 2) for contiguous q, k, v [tokens, H, D]."""
    heads, dim = q.shape[1], q.shape[2]
    block_rows, block_cols, warps = BLOCKS[dim]
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def descriptor(x, rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, dim], dtype)
        return TensorDescriptor.from_tensor(x.view(x.shape[0], heads * dim), [rows, dim], layout)

    _forward_kernel[(programs,)](
        descriptor(q, block_rows), descriptor(k, block_cols), descriptor(v, block_cols), out, lse, q_offsets,
        kv_offsets, tiles, tile_index, heads, q.shape[0], scale * 1.4426950408889634,
        DTYPE=dtype, HEAD_DIM=dim, CAUSAL=causal, BLOCK_M=block_rows, BLOCK_N=block_cols, NUM_WARPS=warps, num_warps=warps,
    )
