"""Hopper backward of jagged softmax attention in Gluon (Triton's lower-level language).

The Triton compiler waits on every score product it cannot carry across iterations right after issuing it:
in the dk/dv loop it issues S^T = K Q^T, waits, issues dP^T = V dO^T, waits, and only then computes the
exponentials, so the tensor cores idle through the softmax. These kernels issue both products, wait for the
first alone and compute P under the second; issue P^T dO and compute dS under it; and leave dS^T Q in flight
into the next block. The dq kernel does the same with S = Q K^T, dP = dO V^T and dS K. Blocks come through
TMA into rings of mbarrier-tracked slots, refilled once the products that read them are retired.

Same contract, work lists and statistics as kernels.triton.triton_jagged_attention's backward (persistent
programs over heaviest-first (tile, head) items, no atomics, masking by adding a large negative number), for
the cases it takes: softmax, bf16 or fp16, equal head dims of 64 or 128, TMA-able tensors, compute
capability 9.0. The Triton kernels take everything else, and are its reference on the GPU.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# The key block of a dk/dv program and the query block of a dq program (two warpgroups of 64 rows), the block
# each streams, and its ring's slots.
TILE, STREAMED, STAGES, WARPS = 128, 64, 2, 8
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128)

_NEG_LARGE = gl.constexpr(-1.0e30)
_EMPTY_ROW_LSE = gl.constexpr(1.0e30)


@gluon.jit
def _item(item, num_heads, tiles_ptr, first_tile, q_offsets_ptr, kv_offsets_ptr):
    """As triton_jagged_attention._work_item: head, first row, starts and lengths, start in the statistics."""
    tile = first_tile + item // num_heads
    head = item % num_heads
    seq = gl.load(tiles_ptr + 2 * tile)
    first_row = gl.load(tiles_ptr + 2 * tile + 1)
    q_start = gl.load(q_offsets_ptr + seq)
    q_len = (gl.load(q_offsets_ptr + seq + 1) - q_start).to(gl.int32)
    kv_start = gl.load(kv_offsets_ptr + seq)
    kv_len = (gl.load(kv_offsets_ptr + seq + 1) - kv_start).to(gl.int32)
    stats_start = (((q_start + 3) // 4) * 4 + 4 * seq).to(gl.int32)
    return head, first_row, q_start, q_len, kv_start, kv_len, stats_start


@gluon.jit
def _load_pair(desc_a, desc_b, smem_a, smem_b, bars, row, col, count, pred, STAGES: gl.constexpr,
               BYTES: gl.constexpr):
    """Block `count` of a program's two streams (Q and dO, or K and V) into its ring slot, if pred."""
    slot = count % STAGES
    mbarrier.expect(bars.index(slot), 2 * BYTES, pred=pred)
    tma.async_copy_global_to_shared(desc_a, [row, col], bars.index(slot), smem_a.index(slot), pred=pred)
    tma.async_copy_global_to_shared(desc_b, [row, col], bars.index(slot), smem_b.index(slot), pred=pred)


@gluon.jit
def _store_block(ptr, x, first, count, row_stride, col, ROWS: gl.constexpr, DIM: gl.constexpr,
                 NUM_WARPS: gl.constexpr):
    """Rows [first, first + ROWS) of a [tokens, heads * DIM] tensor at column col, those below count: row by row,
    since rows past the sequence belong to the next one."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // DIM, DIM // 8], [NUM_WARPS, 1], [1, 0])
    x = gl.convert_layout(x.to(ptr.dtype.element_ty), layout)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, layout))
    ptrs = ptr + gl.expand_dims((first + rows).to(gl.int64) * row_stride, 1) + col + gl.expand_dims(cols, 0)
    gl.store(ptrs, x, mask=gl.expand_dims(rows < count, 1))


@gluon.jit
def _dkdv_kernel(q_desc, k_desc, v_desc, do_desc, stats_ptr, dk_ptr, dv_ptr, q_offsets_ptr, kv_offsets_ptr,
                 tiles_ptr, tile_index_ptr, num_heads, stats_stride, delta_offset, qk_scale, scale,
                 DTYPE: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_M: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    q_layout: gl.constexpr = gl.SliceLayout(0, st_layout)  # along the queries of S^T
    dtype: gl.constexpr = DTYPE
    Q_BYTES: gl.constexpr = BLOCK_M * HEAD_DIM * 2
    KV_BYTES: gl.constexpr = BLOCK_N * HEAD_DIM * 2

    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    first_tile = gl.load(tile_index_ptr + 2 * (BLOCK_N // 16))
    items = gl.load(tile_index_ptr + 2 * (BLOCK_N // 16) + 1) * num_heads
    done = 0  # query blocks this program has consumed: ring slot and mbarrier phase of the next ones
    visits = 0  # items that loaded their K and V: phase of kv_bar
    for item in range(gl.program_id(0), items, gl.num_programs(0)):
        head, n0, q_start, q_len, kv_start, kv_len, stats_start = _item(
            item, num_heads, tiles_ptr, first_tile, q_offsets_ptr, kv_offsets_ptr)
        shift = kv_len - q_len  # query i sees keys j <= i + shift when causal
        if CAUSAL:
            lo = (gl.minimum(gl.maximum(n0 - shift, 0), q_len) // BLOCK_M) * BLOCK_M
            seen_from = gl.minimum(gl.maximum(n0 + BLOCK_N - 1 - shift, lo), q_len)
            unmasked = lo + gl.cdiv(seen_from - lo, BLOCK_M) * BLOCK_M
        else:
            lo = 0
            unmasked = 0
        blocks = gl.cdiv(q_len - lo, BLOCK_M)
        col = head * HEAD_DIM
        q_row = (q_start + lo).to(gl.int32)
        stats = stats_ptr + head * stats_stride + stats_start
        keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))

        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        if blocks > 0:
            mbarrier.expect(kv_bar.index(0), 2 * KV_BYTES)
            tma.async_copy_global_to_shared(k_desc, [(kv_start + n0).to(gl.int32), col], kv_bar.index(0),
                                            k_smem.index(0))
            tma.async_copy_global_to_shared(v_desc, [(kv_start + n0).to(gl.int32), col], kv_bar.index(0),
                                            v_smem.index(0))
            for i in gl.static_range(STAGES):
                _load_pair(q_desc, do_desc, q_smem, do_smem, bars, q_row + i * BLOCK_M, col, done + i, i < blocks,
                           STAGES, Q_BYTES)
            mbarrier.wait(kv_bar.index(0), visits % 2)
            visits += 1
            k_t = k_smem.index(0)
            v_t = v_smem.index(0)
            dk = warpgroup_mma_init(dk)  # carried through the loop as in-flight products
            dv = warpgroup_mma_init(dv)
            p_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, op_layout)
            ds_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, op_layout)
            for j in range(blocks):
                this = done + j
                m0 = lo + j * BLOCK_M
                rows = m0 + gl.arange(0, BLOCK_M, layout=q_layout)
                lse = gl.load(stats + rows, mask=rows < q_len, other=_EMPTY_ROW_LSE)
                delta = gl.load(stats + delta_offset + rows, mask=rows < q_len, other=0.0)
                slot = this % STAGES
                mbarrier.wait(bars.index(slot), (this // STAGES) % 2)
                q_s = q_smem.index(slot)
                do_s = do_smem.index(slot)
                s_t = warpgroup_mma(k_t, q_s.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout),
                                    use_acc=False, is_async=True)
                dp_t = warpgroup_mma(v_t, do_s.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout),
                                     use_acc=False, is_async=True)
                # Retires the previous block's dV and dK products (and S^T): their slot can be refilled.
                s_t, dk, dv, p_op, ds_op = warpgroup_mma_wait(1, deps=[s_t, dk, dv, p_op, ds_op])
                _load_pair(q_desc, do_desc, q_smem, do_smem, bars, q_row + (j - 1 + STAGES) * BLOCK_M, col,
                           this - 1 + STAGES, (j > 0) & (j - 1 + STAGES < blocks), STAGES, Q_BYTES)
                s_t = s_t * qk_scale
                if m0 < unmasked:
                    visible = gl.expand_dims(keys, 1) <= gl.expand_dims(rows, 0) + shift
                    s_t = s_t + gl.where(visible, 0.0, _NEG_LARGE)
                p_t = gl.exp2(s_t - gl.expand_dims(lse, 0))
                p_op = gl.convert_layout(p_t.to(dtype), op_layout)
                dv = warpgroup_mma(p_op, do_s, dv, is_async=True)
                dp_t, p_op = warpgroup_mma_wait(1, deps=[dp_t, p_op])  # P^T dO stays in flight
                ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
                ds_op = gl.convert_layout(ds_t.to(dtype), op_layout)
                dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)
            dk, dv = warpgroup_mma_wait(0, deps=[dk, dv])
            done += blocks
        row_stride = num_heads * HEAD_DIM
        _store_block(dk_ptr, dk * scale, kv_start + n0, kv_len - n0, row_stride, col, BLOCK_N, HEAD_DIM, NUM_WARPS)
        _store_block(dv_ptr, dv, kv_start + n0, kv_len - n0, row_stride, col, BLOCK_N, HEAD_DIM, NUM_WARPS)


@gluon.jit
def _dq_kernel(q_desc, k_desc, v_desc, do_desc, stats_ptr, dq_ptr, q_offsets_ptr, kv_offsets_ptr, tiles_ptr,
               tile_index_ptr, num_heads, stats_stride, delta_offset, qk_scale, scale,
               DTYPE: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = DTYPE
    Q_BYTES: gl.constexpr = BLOCK_M * HEAD_DIM * 2
    KV_BYTES: gl.constexpr = BLOCK_N * HEAD_DIM * 2

    q_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    first_tile = gl.load(tile_index_ptr + 2 * (BLOCK_M // 16))
    items = gl.load(tile_index_ptr + 2 * (BLOCK_M // 16) + 1) * num_heads
    done = 0
    visits = 0
    for item in range(gl.program_id(0), items, gl.num_programs(0)):
        head, m0, q_start, q_len, kv_start, kv_len, stats_start = _item(
            item, num_heads, tiles_ptr, first_tile, q_offsets_ptr, kv_offsets_ptr)
        shift = kv_len - q_len
        if CAUSAL:
            hi = gl.minimum(gl.maximum(gl.minimum(m0 + BLOCK_M, q_len) + shift, 0), kv_len)
            unmasked = (gl.minimum(gl.maximum(m0 + 1 + shift, 0), kv_len) // BLOCK_N) * BLOCK_N
        else:
            hi = kv_len
            unmasked = (kv_len // BLOCK_N) * BLOCK_N
        blocks = gl.cdiv(hi, BLOCK_N)
        col = head * HEAD_DIM
        kv_row = kv_start.to(gl.int32)
        rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
        stats = stats_ptr + head * stats_stride + stats_start
        lse = gl.load(stats + rows, mask=rows < q_len, other=_EMPTY_ROW_LSE)
        delta = gl.load(stats + delta_offset + rows, mask=rows < q_len, other=0.0)

        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
        if blocks > 0:
            mbarrier.expect(q_bar.index(0), 2 * Q_BYTES)
            tma.async_copy_global_to_shared(q_desc, [(q_start + m0).to(gl.int32), col], q_bar.index(0),
                                            q_smem.index(0))
            tma.async_copy_global_to_shared(do_desc, [(q_start + m0).to(gl.int32), col], q_bar.index(0),
                                            do_smem.index(0))
            for i in gl.static_range(STAGES):
                _load_pair(k_desc, v_desc, k_smem, v_smem, bars, kv_row + i * BLOCK_N, col, done + i, i < blocks,
                           STAGES, KV_BYTES)
            mbarrier.wait(q_bar.index(0), visits % 2)
            visits += 1
            q_t = q_smem.index(0)
            do_t = do_smem.index(0)
            dq = warpgroup_mma_init(dq)
            ds_op = gl.zeros([BLOCK_M, BLOCK_N], dtype, op_layout)
            for j in range(blocks):
                this = done + j
                n0 = j * BLOCK_N
                slot = this % STAGES
                mbarrier.wait(bars.index(slot), (this // STAGES) % 2)
                k_s = k_smem.index(slot)
                v_s = v_smem.index(slot)
                s = warpgroup_mma(q_t, k_s.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                                  use_acc=False, is_async=True)
                dp = warpgroup_mma(do_t, v_s.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                                   use_acc=False, is_async=True)
                # Retires the previous block's dS K product: its slot can be refilled.
                s, dq, ds_op = warpgroup_mma_wait(1, deps=[s, dq, ds_op])
                _load_pair(k_desc, v_desc, k_smem, v_smem, bars, kv_row + (j - 1 + STAGES) * BLOCK_N, col,
                           this - 1 + STAGES, (j > 0) & (j - 1 + STAGES < blocks), STAGES, KV_BYTES)
                s = s * qk_scale
                if n0 + BLOCK_N > unmasked:
                    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                    visible = gl.expand_dims(cols, 0) < hi
                    if CAUSAL:
                        visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + shift)
                    s = s + gl.where(visible, 0.0, _NEG_LARGE)
                p = gl.exp2(s - gl.expand_dims(lse, 1))
                dp = warpgroup_mma_wait(0, deps=[dp])
                ds = p * (dp - gl.expand_dims(delta, 1))
                ds_op = gl.convert_layout(ds.to(dtype), op_layout)
                dq = warpgroup_mma(ds_op, k_s, dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=[dq])
            done += blocks
        _store_block(dq_ptr, dq * scale, q_start + m0, q_len - m0, num_heads * HEAD_DIM, col, BLOCK_M, HEAD_DIM,
                     NUM_WARPS)


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def supports_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, silu: bool, tma_ok: bool) -> bool:
    """Whether these kernels take the backward: see the module docstring."""
    return (not silu and tma_ok and q.is_cuda and q.dtype in SUPPORTED_DTYPES
            and q.shape[2] in SUPPORTED_HEAD_DIMS and k.shape[2] == v.shape[2] == q.shape[2]
            and _is_hopper(q.device.index or 0))


def _descriptor(x: torch.Tensor, rows: int, dtype) -> TensorDescriptor:
    heads, dim = x.shape[1], x.shape[2]
    layout = gl.NVMMASharedLayout.get_default_for([rows, dim], dtype)
    return TensorDescriptor.from_tensor(x.view(x.shape[0], heads * dim), [rows, dim], layout)


def backward(q, k, v, d_out, stats, dq, dk, dv, q_offsets, kv_offsets, tiles, key_index, query_index,
             stats_stride: int, delta_offset: int, causal: bool, scale: float, programs: tuple[int, int]) -> None:
    """dk, dv and dq [tokens, H, D] from contiguous q, k, v, d_out and the statistics [2, H, stats_stride] (base-2
    logsumexp, delta); `key_index`/`query_index`: the tile table's rows for key blocks of TILE and query blocks
    of TILE; `programs`: persistent programs of the dk/dv and dq kernels."""
    heads, dim = q.shape[1], q.shape[2]
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    qk_scale = scale * 1.4426950408889634
    common = dict(DTYPE=dtype, HEAD_DIM=dim, CAUSAL=causal, STAGES=STAGES, NUM_WARPS=WARPS, num_warps=WARPS)
    _dkdv_kernel[(programs[0],)](
        _descriptor(q, STREAMED, dtype), _descriptor(k, TILE, dtype), _descriptor(v, TILE, dtype),
        _descriptor(d_out, STREAMED, dtype), stats, dk, dv, q_offsets, kv_offsets, tiles, key_index, heads,
        stats_stride, delta_offset, qk_scale, scale, BLOCK_N=TILE, BLOCK_M=STREAMED, **common,
    )
    _dq_kernel[(programs[1],)](
        _descriptor(q, TILE, dtype), _descriptor(k, STREAMED, dtype), _descriptor(v, STREAMED, dtype),
        _descriptor(d_out, TILE, dtype), stats, dq, q_offsets, kv_offsets, tiles, query_index, heads,
        stats_stride, delta_offset, qk_scale, scale, BLOCK_M=TILE, BLOCK_N=STREAMED, **common,
    )
