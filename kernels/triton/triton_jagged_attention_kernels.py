"""The Triton jagged attention kernels (device code): the forward, the backward's prologue, dq per query block and
dk, dv per key block, each persistent over a tile list (kernels.triton.triton_tile_table). Launched by
kernels.triton.triton_jagged_attention, which holds the contract."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.triton_jagged_attention_configs import (AUTOTUNE_KEY, DKDV_CONFIGS, DQ_CONFIGS, FWD_CONFIGS,
                                                            jit_unspecialised, pruner, short_bench)

LOG2E = 1.4426950408889634
# Scores of invalid positions get this added: exp2 of it is exactly 0, and it stays finite.
NEG_LARGE = -1.0e30
# The logsumexp stored for a query that sees no key: every recomputed probability of it is 0.
EMPTY_ROW_LSE = 1.0e30

# Constants the kernels read (globals inside @triton.jit must be constexpr).
_LOG2E = tl.constexpr(LOG2E)
_NEG_LARGE = tl.constexpr(NEG_LARGE)
# The running max starts above NEG_LARGE, so an invalid score's exp2(s - m) is 0 even while a row
# has seen no valid key yet: masking needs only the subtraction.
_RUNNING_MAX_START = tl.constexpr(NEG_LARGE / 2)
_EMPTY_ROW_LSE = tl.constexpr(EMPTY_ROW_LSE)
STATS_TMA_ROWS = 32  # 128 bytes of fp32: the alignment of a bulk copy's shared-memory destination
_STATS_TMA_ROWS = tl.constexpr(STATS_TMA_ROWS)


# ---------------------------------------------------------------------------------------------------
# Shared device helpers


@triton.jit
def _work_item(item, num_heads, tiles_ptr, first_tile, q_offsets_ptr, kv_offsets_ptr):
    """The (tile, head) item's head, first row, its sequence's starts and lengths, and where the sequence starts
    in the backward's statistics."""
    tile = first_tile + item // num_heads
    head = item % num_heads
    seq = tl.load(tiles_ptr + 2 * tile)
    first_row = tl.load(tiles_ptr + 2 * tile + 1)
    q_start = tl.load(q_offsets_ptr + seq)
    q_len = (tl.load(q_offsets_ptr + seq + 1) - q_start).to(tl.int32)
    kv_start = tl.load(kv_offsets_ptr + seq)
    kv_len = (tl.load(kv_offsets_ptr + seq + 1) - kv_start).to(tl.int32)
    return head, first_row, q_start, q_len, kv_start, kv_len, _stats_start(q_start, seq)


@triton.jit
def _stats_start(q_start, seq):
    """Where sequence `seq`'s queries start in a head's row of the backward's statistics
    (triton_jagged_attention._query_stats): a multiple of 4, so that every block starts 16-byte aligned, as
    descriptor loads need."""
    return (((q_start + 3) // 4) * 4 + 4 * seq).to(tl.int32)


@triton.jit
def _load_rows(base, rows, stride, row_ok, DIM: tl.constexpr, DIM_PAD: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """[rows, DIM_PAD] from a [tokens, DIM] slice; zeros past DIM and, if checked, past valid rows."""
    cols = tl.arange(0, DIM_PAD)
    ptrs = base + rows[:, None] * stride + cols[None, :]
    if CHECK_ROWS:
        if DIM == DIM_PAD:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None] & (cols[None, :] < DIM), other=0.0)
    else:
        if DIM == DIM_PAD:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=cols[None, :] < DIM, other=0.0)
    return x


@triton.jit
def _load_block(desc, base, first, row0, col0, stride, limit, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                BLOCK: tl.constexpr, CHECK_ROWS: tl.constexpr, TMA: tl.constexpr):
    """Rows [first, first + BLOCK) of one head's slice of a sequence.

    TMA: through the descriptor, at (row0 + first, col0) of [tokens, heads * dim]; rows past the sequence
    then hold the tokens that follow it (zeros past the tensor), which callers must keep out of results.
    Otherwise through pointers from `base`: zeros past DIM and, if checked, from row `limit` on.
    """
    if TMA:
        x = desc.load([row0 + first, col0])
    else:
        rows = first + tl.arange(0, BLOCK)
        x = _load_rows(base, rows, stride, rows < limit, DIM, DIM_PAD, CHECK_ROWS)
    return x


@triton.jit
def _row_stats(stats_desc, stats_ptr, stats_row, delta_offset, first, rows, row_ok, TMA: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """Logsumexp and delta of query rows `rows` (from `first`, at stats_row + first of the flat statistics): rows
    past the sequence get an empty-row logsumexp and delta 0, so their probabilities, and what they add to dk and
    dv, are exactly 0.

    TMA: one bulk copy each; the statistics' layout keeps every block 16-byte aligned for it. Pointer loads of these
    small vectors, which Triton pipelines through cp.async and a block-wide barrier, made the dk/dv kernel 40-50%
    slower on the H200 (benchmarks/jagged_attention.py --overhead, before and after). Blocks of fewer than
    STATS_TMA_ROWS rows (the short-query configs' 16) load through pointers: with 3 stages the pipeliner puts them
    in a ring of 64-byte slots, and a bulk copy into the second, not 128-byte aligned, stopped the kernel with a
    misaligned address (Triton 3.6; each 3-stage short-query config over sequences of two query blocks).
    """
    if TMA and BLOCK_M >= _STATS_TMA_ROWS:
        lse = tl.where(row_ok, stats_desc.load([stats_row + first]), _EMPTY_ROW_LSE)
        delta = tl.where(row_ok, stats_desc.load([stats_row + delta_offset + first]), 0.0)
    else:
        lse = tl.load(stats_ptr + stats_row + rows, mask=row_ok, other=_EMPTY_ROW_LSE)
        delta = tl.load(stats_ptr + stats_row + delta_offset + rows, mask=row_ok, other=0.0)
    return lse, delta


@triton.jit
def _store_rows(base, x, rows, stride, row_ok, DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    cols = tl.arange(0, DIM_PAD)
    tl.store(base + rows[:, None] * stride + cols[None, :], x, mask=row_ok[:, None] & (cols[None, :] < DIM))


# A head (or value) dim is computed in up to two column parts (triton_jagged_attention.dim_parts): the first padded
# to PAD, and, where the dim has one (REST > 0), a second of REST columns. Without a second part, the helpers below
# hand back the first in its place, which the callers never read.


@triton.jit
def _load_row_parts(base, rows, stride, row_ok, DIM: tl.constexpr, PAD: tl.constexpr, REST: tl.constexpr):
    """Rows of a [tokens, DIM] slice in its column parts: [rows, PAD], [rows, REST]."""
    x = _load_rows(base, rows, stride, row_ok, DIM - REST, PAD, True)
    x_b = x
    if REST > 0:
        x_b = _load_rows(base + PAD, rows, stride, row_ok, REST, REST, True)
    return x, x_b


@triton.jit
def _store_row_parts(base, x, x_b, rows, stride, row_ok, DIM: tl.constexpr, PAD: tl.constexpr, REST: tl.constexpr):
    _store_rows(base, x, rows, stride, row_ok, DIM - REST, PAD)
    if REST > 0:
        _store_rows(base + PAD, x_b, rows, stride, row_ok, REST, REST)


@triton.jit
def _zero_parts(ROWS: tl.constexpr, PAD: tl.constexpr, REST: tl.constexpr):
    """fp32 accumulators of both column parts."""
    x = tl.zeros([ROWS, PAD], dtype=tl.float32)
    x_b = x
    if REST > 0:
        x_b = tl.zeros([ROWS, REST], dtype=tl.float32)
    return x, x_b


@triton.jit
def _zero_outside(x_ptr, offsets_ptr, num_seqs, total_rows, row_width, row_stride, program, programs,
                  BLOCK: tl.constexpr = 1024):
    """Zeros in the rows of a [tokens, heads, dim] output (heads side by side, rows `row_stride` apart) that no
    sequence owns (before the first offset, from the last on): the kernels write every other row, so outputs need
    no zero fill first. The calling kernel's `programs` programs share the rows, usually none."""
    first = tl.load(offsets_ptr).to(tl.int64) * row_width
    last = tl.load(offsets_ptr + num_seqs).to(tl.int64) * row_width
    # tl.cast, not .to: an integer argument equal to 1 arrives as a constexpr
    outside = first + (tl.cast(total_rows, tl.int64) * row_width - last)
    for start in range(program * BLOCK, outside, programs * BLOCK):
        i = start + tl.arange(0, BLOCK)
        where = tl.where(i < first, i, i - first + last)
        row = where // row_width
        tl.store(x_ptr + row * row_stride + (where - row * row_width), tl.zeros([BLOCK], dtype=x_ptr.dtype.element_ty),
                 mask=i < outside)


@triton.jit
def _visible_keys(m0, q_len, kv_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key range of query block [m0, m0 + BLOCK_M): [0, unmasked) needs no mask, [unmasked, hi) does."""
    if CAUSAL:
        shift = kv_len - q_len  # query i sees keys j <= i + shift
        hi = tl.minimum(tl.maximum(tl.minimum(m0 + BLOCK_M, q_len) + shift, 0), kv_len)
        every_row_sees = tl.minimum(tl.maximum(m0 + 1 + shift, 0), kv_len)
    else:
        hi = kv_len
        every_row_sees = kv_len
    return (every_row_sees // BLOCK_N) * BLOCK_N, hi


@triton.jit
def _seeing_queries(n0, q_len, kv_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Query range of key block [n0, n0 + BLOCK_N): [lo, unmasked) needs the causal mask, [unmasked, q_len) not."""
    if CAUSAL:
        shift = kv_len - q_len
        lo = (tl.minimum(tl.maximum(n0 - shift, 0), q_len) // BLOCK_M) * BLOCK_M
        every_key_seen_from = tl.minimum(tl.maximum(n0 + BLOCK_N - 1 - shift, lo), q_len)
        unmasked = lo + tl.cdiv(every_key_seen_from - lo, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        unmasked = 0
    return lo, unmasked


@triton.jit
def _visible(col_ok, cols, rows, shift, CAUSAL: tl.constexpr):
    """[rows, cols]: key inside the sequence and, when causal, not after the query."""
    if CAUSAL:
        visible = col_ok[None, :] & (cols[None, :] <= rows[:, None] + shift)
    else:
        visible = col_ok[None, :] & (rows[:, None] >= 0)
    return visible


@triton.jit
def _block_parts(a_desc, a_rest_desc, b_desc, b_rest_desc, a_base, b_base, first, row0, a_col, b_col, stride_a,
                 stride_b, limit, A_DIM: tl.constexpr, B_DIM: tl.constexpr, A_PAD: tl.constexpr,
                 B_PAD: tl.constexpr, A_REST: tl.constexpr, B_REST: tl.constexpr, BLOCK: tl.constexpr,
                 CHECK_ROWS: tl.constexpr, TMA: tl.constexpr):
    """Rows [first, first + BLOCK) of two tensors (K and V, or Q and dO), each in its column parts
    (triton_jagged_attention.dim_parts): the padded first part and, where the dim has one (A_REST, B_REST > 0), the
    second; without it the first again."""
    a = _load_block(a_desc, a_base, first, row0, a_col, stride_a, limit, A_DIM - A_REST, A_PAD, BLOCK, CHECK_ROWS, TMA)
    b = _load_block(b_desc, b_base, first, row0, b_col, stride_b, limit, B_DIM - B_REST, B_PAD, BLOCK, CHECK_ROWS, TMA)
    a_rest, b_rest = a, b
    if A_REST > 0:
        a_rest = _load_block(a_rest_desc, a_base + A_PAD, first, row0, a_col + A_PAD, stride_a, limit, A_REST,
                             A_REST, BLOCK, CHECK_ROWS, TMA)
    if B_REST > 0:
        b_rest = _load_block(b_rest_desc, b_base + B_PAD, first, row0, b_col + B_PAD, stride_b, limit, B_REST,
                             B_REST, BLOCK, CHECK_ROWS, TMA)
    return a, a_rest, b, b_rest


@triton.jit
def _dot_t(a, a_rest, b, b_rest, SPLIT: tl.constexpr):
    """a b^T over both column parts of the shared dim."""
    out = tl.dot(a, tl.trans(b))
    if SPLIT:
        out = tl.dot(a_rest, tl.trans(b_rest), out)
    return out


# ---------------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _forward_blocks(acc, acc_b, m_i, l_i, q, q_b, k_desc, v_desc, kb_desc, vb_desc, kv_row, k_col, v_col, k_base,
                    v_base, stride_kt, stride_vt, rows, lo, hi, shift, scale, inv_len, HEAD_DIM: tl.constexpr,
                    VALUE_DIM: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, D_B: tl.constexpr,
                    DV_B: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                    SILU: tl.constexpr, TMA: tl.constexpr, FP8: tl.constexpr):
    # Only the masked range can reach past the keys (hi): its mask drops the keys TMA loads from there.
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k, k_b, v, v_b = _block_parts(k_desc, kb_desc, v_desc, vb_desc, k_base, v_base, n0, kv_row, k_col, v_col,
                                      stride_kt, stride_vt, hi, HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, D_B, DV_B, BLOCK_N,
                                      MASKED, TMA)
        if FP8:  # the weights meet V in fp16 (exact for e4m3 values): in FP8, weights far below 1 would flush to zero
            v = v.to(tl.float16)
            v_b = v_b.to(tl.float16)
        s = _dot_t(q, q_b, k, k_b, D_B > 0)
        if MASKED:
            visible = _visible(col_ok, cols, rows, shift, CAUSAL)
        if SILU:
            x = s * scale
            w = x * tl.sigmoid(x) * inv_len
            if MASKED:
                w = w * visible.to(tl.float32)
            acc = tl.dot(w.to(v.dtype), v, acc)
            if DV_B > 0:
                acc_b = tl.dot(w.to(v_b.dtype), v_b, acc_b)
        else:
            s = s * (scale * _LOG2E)
            if MASKED:
                s = s + tl.where(visible, 0.0, _NEG_LARGE)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            if DV_B > 0:
                acc_b = tl.dot(p.to(v_b.dtype), v_b, acc_b * alpha[:, None])
            m_i = m_new
    return acc, acc_b, m_i, l_i


@triton.autotune(configs=FWD_CONFIGS, key=AUTOTUNE_KEY, do_bench=short_bench,
                 prune_configs_by={"early_config_prune": pruner("forward")})
@jit_unspecialised
def forward_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, kb_desc, vb_desc, out_ptr, stats_ptr, q_offsets_ptr, kv_offsets_ptr, tiles_ptr,
    tile_index_ptr, descale_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
    stride_oh, stats_stride, total_q, num_seqs, num_heads, scale, length_bucket, query_bucket,
    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, D_B: tl.constexpr,
    DV_B: tl.constexpr, CAUSAL: tl.constexpr, SILU: tl.constexpr, TMA: tl.constexpr, FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    if FP8:  # real values are q * descale[0], k * descale[1], v * descale[2]
        scale = scale * tl.load(descale_ptr) * tl.load(descale_ptr + 1)
        v_descale = tl.load(descale_ptr + 2)
    first_tile = tl.load(tile_index_ptr + 2 * (BLOCK_M // 16))
    items = tl.load(tile_index_ptr + 2 * (BLOCK_M // 16) + 1) * num_heads
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        head, m0, q_start, q_len, kv_start, kv_len, stats_start = _work_item(
            item, num_heads, tiles_ptr, first_tile, q_offsets_ptr, kv_offsets_ptr)
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q, q_b = _load_row_parts(q_ptr + q_start * stride_qt + head * stride_qh, rows, stride_qt, row_ok, HEAD_DIM,
                                 D_PAD, D_B)
        kv_row = kv_start.to(tl.int32)
        k_base = k_ptr + kv_start * stride_kt + head * stride_kh
        v_base = v_ptr + kv_start * stride_vt + head * stride_vh
        shift = kv_len - q_len
        inv_len = 1.0 / tl.maximum(kv_len, 1).to(tl.float32)
        unmasked, hi = _visible_keys(m0, q_len, kv_len, BLOCK_M, BLOCK_N, CAUSAL)

        acc, acc_b = _zero_parts(BLOCK_M, DV_PAD, DV_B)
        m_i = tl.full([BLOCK_M], _RUNNING_MAX_START, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, acc_b, m_i, l_i = _forward_blocks(
            acc, acc_b, m_i, l_i, q, q_b, k_desc, v_desc, kb_desc, vb_desc, kv_row, head * HEAD_DIM, head * VALUE_DIM,
            k_base, v_base, stride_kt, stride_vt, rows, 0, unmasked, shift, scale, inv_len, HEAD_DIM, VALUE_DIM,
            D_PAD, DV_PAD, D_B, DV_B, BLOCK_N, False, CAUSAL, SILU, TMA, FP8)
        acc, acc_b, m_i, l_i = _forward_blocks(
            acc, acc_b, m_i, l_i, q, q_b, k_desc, v_desc, kb_desc, vb_desc, kv_row, head * HEAD_DIM, head * VALUE_DIM,
            k_base, v_base, stride_kt, stride_vt, rows, unmasked, hi, shift, scale, inv_len, HEAD_DIM, VALUE_DIM,
            D_PAD, DV_PAD, D_B, DV_B, BLOCK_N, True, CAUSAL, SILU, TMA, FP8)
        if not SILU:
            has_key = l_i > 0.0
            l_safe = tl.where(has_key, l_i, 1.0)
            acc = acc / l_safe[:, None]
            if DV_B > 0:
                acc_b = acc_b / l_safe[:, None]
            lse = tl.where(has_key, m_i + tl.log2(l_safe), _EMPTY_ROW_LSE)
            tl.store(stats_ptr + head * stats_stride + stats_start + rows, lse, mask=row_ok)
        if FP8:
            acc = acc * v_descale
            if DV_B > 0:
                acc_b = acc_b * v_descale
        _store_row_parts(out_ptr + q_start * stride_ot + head * stride_oh, acc.to(out_ptr.dtype.element_ty),
                         acc_b.to(out_ptr.dtype.element_ty), rows, stride_ot, row_ok, VALUE_DIM, DV_PAD, DV_B)
    _zero_outside(out_ptr, q_offsets_ptr, num_seqs, total_q, num_heads * VALUE_DIM, num_heads * VALUE_DIM,
                  tl.program_id(0), tl.num_programs(0))


# ---------------------------------------------------------------------------------------------------
# Backward: the per-query statistics both backward kernels read


@jit_unspecialised
def backward_prologue_kernel(out_ptr, do_ptr, stats_ptr, dq_ptr, dk_ptr, dv_ptr, q_offsets_ptr, kv_offsets_ptr,
                             tiles_ptr, tile_index_ptr, stride_ot, stride_oh, stride_dot, stride_doh, stride_dqt,
                             stride_dkt, stride_dvt, stats_stride, delta_offset, total_q, total_kv, num_seqs,
                             HEAD_DIM: tl.constexpr,
                             VALUE_DIM: tl.constexpr, DV_PAD: tl.constexpr, SILU: tl.constexpr,
                             ZERO_DQ: tl.constexpr, BLOCK: tl.constexpr):
    """What the backward's kernels need first. Softmax: delta = rowsum(dO * O) in fp32 of one query tile of one
    head, beside its logsumexp in the statistics (triton_jagged_attention._query_stats). And zeros in the
    gradients' rows that no sequence owns (_zero_outside), so that the two kernels after it write only their own
    rows."""
    tile = tl.program_id(0)
    num_heads = tl.num_programs(1)
    first_tile = tl.load(tile_index_ptr + 2 * (BLOCK // 16))
    if not SILU and tile < tl.load(tile_index_ptr + 2 * (BLOCK // 16) + 1):
        head, m0, q_start, q_len, _, _, stats_start = _work_item(
            tile * num_heads + tl.program_id(1), num_heads, tiles_ptr, first_tile, q_offsets_ptr, q_offsets_ptr)
        rows = m0 + tl.arange(0, BLOCK)
        row_ok = rows < q_len
        o = _load_rows(out_ptr + q_start * stride_ot + head * stride_oh, rows, stride_ot, row_ok, VALUE_DIM, DV_PAD,
                       True)
        do = _load_rows(do_ptr + q_start * stride_dot + head * stride_doh, rows, stride_dot, row_ok, VALUE_DIM,
                        DV_PAD, True)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(stats_ptr + head * stats_stride + stats_start + rows + delta_offset, delta, mask=row_ok)
    program = tile * num_heads + tl.program_id(1)
    programs = tl.num_programs(0) * num_heads
    if ZERO_DQ:
        _zero_outside(dq_ptr, q_offsets_ptr, num_seqs, total_q, num_heads * HEAD_DIM, stride_dqt, program, programs)
    _zero_outside(dk_ptr, kv_offsets_ptr, num_seqs, total_kv, num_heads * HEAD_DIM, stride_dkt, program, programs)
    _zero_outside(dv_ptr, kv_offsets_ptr, num_seqs, total_kv, num_heads * VALUE_DIM, stride_dvt, program, programs)


# ---------------------------------------------------------------------------------------------------
# Backward: dq per query block


@triton.jit
def _dq_blocks(dq, dq_b, q, q_b, do, do_b, lse, delta, k_desc, v_desc, kb_desc, vb_desc, kv_row, k_col, v_col, k_base,
               v_base, stride_kt, stride_vt, rows, lo, hi, shift, scale, inv_len, HEAD_DIM: tl.constexpr,
               VALUE_DIM: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, D_B: tl.constexpr,
               DV_B: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               SILU: tl.constexpr, TMA: tl.constexpr):
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k, k_b, v, v_b = _block_parts(k_desc, kb_desc, v_desc, vb_desc, k_base, v_base, n0, kv_row, k_col, v_col,
                                      stride_kt, stride_vt, hi, HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, D_B, DV_B, BLOCK_N,
                                      MASKED, TMA)
        s = _dot_t(q, q_b, k, k_b, D_B > 0)
        dp = _dot_t(do, do_b, v, v_b, DV_B > 0)
        if MASKED:
            visible = _visible(col_ok, cols, rows, shift, CAUSAL)
        if SILU:
            x = s * scale
            sig = tl.sigmoid(x)
            ds = dp * sig * (1.0 + x * (1.0 - sig)) * inv_len
            if MASKED:
                ds = ds * visible.to(tl.float32)
        else:
            s = s * (scale * _LOG2E)
            if MASKED:
                s = s + tl.where(visible, 0.0, _NEG_LARGE)
            p = tl.exp2(s - lse[:, None])
            ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
        if D_B > 0:
            dq_b = tl.dot(ds.to(k_b.dtype), k_b, dq_b)
    return dq, dq_b


@triton.autotune(configs=DQ_CONFIGS, key=AUTOTUNE_KEY, do_bench=short_bench,
                 prune_configs_by={"early_config_prune": pruner("dq")})
@jit_unspecialised
def dq_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, kb_desc, vb_desc, do_ptr, stats_ptr, dq_ptr, q_offsets_ptr, kv_offsets_ptr,
    tiles_ptr, tile_index_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stats_stride, delta_offset, num_heads, scale, length_bucket, query_bucket,
    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, D_B: tl.constexpr,
    DV_B: tl.constexpr, CAUSAL: tl.constexpr, SILU: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    first_tile = tl.load(tile_index_ptr + 2 * (BLOCK_M // 16))
    items = tl.load(tile_index_ptr + 2 * (BLOCK_M // 16) + 1) * num_heads
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        head, m0, q_start, q_len, kv_start, kv_len, stats_start = _work_item(
            item, num_heads, tiles_ptr, first_tile, q_offsets_ptr, kv_offsets_ptr)
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q, q_b = _load_row_parts(q_ptr + q_start * stride_qt + head * stride_qh, rows, stride_qt, row_ok, HEAD_DIM,
                                 D_PAD, D_B)
        kv_row = kv_start.to(tl.int32)
        do, do_b = _load_row_parts(do_ptr + q_start * stride_dot + head * stride_doh, rows, stride_dot, row_ok,
                                   VALUE_DIM, DV_PAD, DV_B)
        if SILU:
            lse = tl.zeros([BLOCK_M], dtype=tl.float32)
            delta = lse
        else:
            stats = stats_ptr + head * stats_stride + stats_start + rows
            lse = tl.load(stats, mask=row_ok, other=_EMPTY_ROW_LSE)
            delta = tl.load(stats + delta_offset, mask=row_ok, other=0.0)
        k_base = k_ptr + kv_start * stride_kt + head * stride_kh
        v_base = v_ptr + kv_start * stride_vt + head * stride_vh
        shift = kv_len - q_len
        inv_len = 1.0 / tl.maximum(kv_len, 1).to(tl.float32)
        unmasked, hi = _visible_keys(m0, q_len, kv_len, BLOCK_M, BLOCK_N, CAUSAL)

        dq, dq_b = _zero_parts(BLOCK_M, D_PAD, D_B)
        dq, dq_b = _dq_blocks(dq, dq_b, q, q_b, do, do_b, lse, delta, k_desc, v_desc, kb_desc, vb_desc, kv_row,
                              head * HEAD_DIM, head * VALUE_DIM, k_base, v_base, stride_kt, stride_vt, rows, 0,
                              unmasked, shift, scale, inv_len, HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, D_B, DV_B, BLOCK_N,
                              False, CAUSAL, SILU, TMA)
        dq, dq_b = _dq_blocks(dq, dq_b, q, q_b, do, do_b, lse, delta, k_desc, v_desc, kb_desc, vb_desc, kv_row,
                              head * HEAD_DIM, head * VALUE_DIM, k_base, v_base, stride_kt, stride_vt, rows, unmasked,
                              hi, shift, scale, inv_len, HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, D_B, DV_B, BLOCK_N, True,
                              CAUSAL, SILU, TMA)
        _store_row_parts(dq_ptr + q_start * stride_dqt + head * stride_dqh, (dq * scale).to(dq_ptr.dtype.element_ty),
                         (dq_b * scale).to(dq_ptr.dtype.element_ty), rows, stride_dqt, row_ok, HEAD_DIM, D_PAD, D_B)


# ---------------------------------------------------------------------------------------------------
# Backward: dk, dv per key block


@triton.jit
def _dkdv_blocks(dk, dk_b, dv, dv_b, k, k_b, v, v_b, q_desc, do_desc, qb_desc, dob_desc, dq_desc, stats_desc, q_row,
                 q_col, do_col, stats_row, delta_offset, q_base, do_base, stats_ptr, dq_base, stride_qt, stride_dot,
                 stride_dqt, cols, lo, hi, q_len, shift, scale, inv_len,
                 HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                 D_B: tl.constexpr, DV_B: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                 SILU: tl.constexpr, ADD_DQ: tl.constexpr, TMA: tl.constexpr, DQ_TMA: tl.constexpr):
    # Rows past q_len get an empty-row logsumexp, so (softmax) their probabilities are 0 without a mask. Through
    # pointers they also load as zeros; through TMA they hold the next sequence's queries, which SiLU must mask.
    for m0 in range(lo, hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q, q_b, do, do_b = _block_parts(q_desc, qb_desc, do_desc, dob_desc, q_base, do_base, m0, q_row, q_col, do_col,
                                        stride_qt, stride_dot, q_len, HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, D_B, DV_B,
                                        BLOCK_M, True, TMA)
        s_t = _dot_t(k, k_b, q, q_b, D_B > 0)  # [BLOCK_N, BLOCK_M]
        dp_t = _dot_t(v, v_b, do, do_b, DV_B > 0)
        if MASKED:
            visible = cols[:, None] <= rows[None, :] + shift
        if SILU:
            x = s_t * scale
            sig = tl.sigmoid(x)
            w_t = x * sig * inv_len
            ds_t = dp_t * sig * (1.0 + x * (1.0 - sig)) * inv_len
            if MASKED or TMA:
                keep = row_ok[None, :]
                if MASKED:
                    keep = keep & visible
                keep = keep.to(tl.float32)
                w_t = w_t * keep
                ds_t = ds_t * keep
            dv = tl.dot(w_t.to(do.dtype), do, dv)
            if DV_B > 0:
                dv_b = tl.dot(w_t.to(do_b.dtype), do_b, dv_b)
        else:
            lse, delta = _row_stats(stats_desc, stats_ptr, stats_row, delta_offset, m0, rows, row_ok, TMA,
                                     BLOCK_M)
            s_t = s_t * (scale * _LOG2E)
            if MASKED:
                s_t = s_t + tl.where(visible, 0.0, _NEG_LARGE)
            p_t = tl.exp2(s_t - lse[None, :])
            dv = tl.dot(p_t.to(do.dtype), do, dv)
            if DV_B > 0:
                dv_b = tl.dot(p_t.to(do_b.dtype), do_b, dv_b)
            ds_t = p_t * (dp_t - delta[None, :])
        ds_t = ds_t.to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        if D_B > 0:
            dk_b = tl.dot(ds_t, q_b, dk_b)
        if ADD_DQ:
            # dS^T K of this key block, added to the query rows' fp32 sums: five matmuls per block pair
            # instead of seven with a separate dq pass that recomputes S and dP.
            dq = tl.dot(tl.trans(ds_t), k) * scale
            if DQ_TMA:
                # One bulk add of the whole block. Its rows past q_len belong to the next sequence (or lie past
                # the tensor, where TMA drops them); their dS is exactly 0, so they add nothing. Key rows past
                # kv_len are zeros (pointer loads of k), so garbage dS there adds nothing either.
                dq_desc.atomic_add([q_row + m0, q_col], dq)
            else:
                dcols = tl.arange(0, D_PAD)
                tl.atomic_add(dq_base + rows[:, None] * stride_dqt + dcols[None, :], dq,
                              mask=row_ok[:, None] & (dcols[None, :] < HEAD_DIM - D_B), sem="relaxed")
                if D_B > 0:
                    dq_b = tl.dot(tl.trans(ds_t), k_b) * scale
                    dcols_b = tl.arange(0, D_B)
                    tl.atomic_add(dq_base + D_PAD + rows[:, None] * stride_dqt + dcols_b[None, :], dq_b,
                                  mask=row_ok[:, None], sem="relaxed")
    return dk, dk_b, dv, dv_b


@triton.autotune(configs=DKDV_CONFIGS, key=[*AUTOTUNE_KEY, "ADD_DQ", "DQ_TMA"], do_bench=short_bench,
                 reset_to_zero=["dq_ptr"], prune_configs_by={"early_config_prune": pruner("dkdv")})
@jit_unspecialised
def dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, q_desc, do_desc, qb_desc, dob_desc, stats_ptr, stats_desc, dk_ptr, dv_ptr, dq_ptr,
    dq_desc, q_offsets_ptr, kv_offsets_ptr, tiles_ptr, tile_index_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_vt, stride_vh, stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt,
    stride_dqh, stats_stride, delta_offset, num_heads, scale, length_bucket, query_bucket, HEAD_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, D_B: tl.constexpr, DV_B: tl.constexpr,
    CAUSAL: tl.constexpr, SILU: tl.constexpr, TMA: tl.constexpr, ADD_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    first_tile = tl.load(tile_index_ptr + 2 * (BLOCK_N // 16))
    items = tl.load(tile_index_ptr + 2 * (BLOCK_N // 16) + 1) * num_heads
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        head, n0, q_start, q_len, kv_start, kv_len, stats_start = _work_item(
            item, num_heads, tiles_ptr, first_tile, q_offsets_ptr, kv_offsets_ptr)
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_len
        # (the kernel's parts in this order, loads and stores: others spill more at split head dims)
        k_base = k_ptr + kv_start * stride_kt + head * stride_kh
        k = _load_rows(k_base, cols, stride_kt, col_ok, HEAD_DIM - D_B, D_PAD, True)
        v_base = v_ptr + kv_start * stride_vt + head * stride_vh
        v = _load_rows(v_base, cols, stride_vt, col_ok, VALUE_DIM - DV_B, DV_PAD, True)
        k_b, v_b = k, v
        if D_B > 0:
            k_b = _load_rows(k_base + D_PAD, cols, stride_kt, col_ok, D_B, D_B, True)
        if DV_B > 0:
            v_b = _load_rows(v_base + DV_PAD, cols, stride_vt, col_ok, DV_B, DV_B, True)
        q_base = q_ptr + q_start * stride_qt + head * stride_qh
        do_base = do_ptr + q_start * stride_dot + head * stride_doh
        dq_base = dq_ptr + q_start * stride_dqt + head * stride_dqh
        shift = kv_len - q_len
        inv_len = 1.0 / tl.maximum(kv_len, 1).to(tl.float32)
        lo, unmasked = _seeing_queries(n0, q_len, kv_len, BLOCK_M, BLOCK_N, CAUSAL)

        dk, dk_b = _zero_parts(BLOCK_N, D_PAD, D_B)
        dv, dv_b = _zero_parts(BLOCK_N, DV_PAD, DV_B)
        q_row = q_start.to(tl.int32)  # the descriptors' row of this sequence's first query
        stats_row = head * stats_stride + stats_start  # and of its first query's logsumexp in the statistics
        dk, dk_b, dv, dv_b = _dkdv_blocks(
            dk, dk_b, dv, dv_b, k, k_b, v, v_b, q_desc, do_desc, qb_desc, dob_desc, dq_desc, stats_desc, q_row,
            head * HEAD_DIM, head * VALUE_DIM, stats_row, delta_offset, q_base, do_base, stats_ptr, dq_base,
            stride_qt, stride_dot, stride_dqt, cols, lo, unmasked, q_len, shift, scale, inv_len, HEAD_DIM, VALUE_DIM,
            D_PAD, DV_PAD, D_B, DV_B, BLOCK_M, True, SILU, ADD_DQ, TMA, DQ_TMA)
        dk, dk_b, dv, dv_b = _dkdv_blocks(
            dk, dk_b, dv, dv_b, k, k_b, v, v_b, q_desc, do_desc, qb_desc, dob_desc, dq_desc, stats_desc, q_row,
            head * HEAD_DIM, head * VALUE_DIM, stats_row, delta_offset, q_base, do_base, stats_ptr, dq_base,
            stride_qt, stride_dot, stride_dqt, cols, unmasked, q_len, q_len, shift, scale, inv_len, HEAD_DIM,
            VALUE_DIM, D_PAD, DV_PAD, D_B, DV_B, BLOCK_M, False, SILU, ADD_DQ, TMA, DQ_TMA)
        dk_base = dk_ptr + kv_start * stride_dkt + head * stride_dkh
        _store_rows(dk_base, (dk * scale).to(dk_ptr.dtype.element_ty), cols, stride_dkt, col_ok, HEAD_DIM - D_B, D_PAD)
        dv_base = dv_ptr + kv_start * stride_dvt + head * stride_dvh
        _store_rows(dv_base, dv.to(dv_ptr.dtype.element_ty), cols, stride_dvt, col_ok, VALUE_DIM - DV_B, DV_PAD)
        if D_B > 0:
            _store_rows(dk_base + D_PAD, (dk_b * scale).to(dk_ptr.dtype.element_ty), cols, stride_dkt, col_ok, D_B,
                        D_B)
        if DV_B > 0:
            _store_rows(dv_base + DV_PAD, dv_b.to(dv_ptr.dtype.element_ty), cols, stride_dvt, col_ok, DV_B, DV_B)
