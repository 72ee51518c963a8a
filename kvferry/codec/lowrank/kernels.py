"""lowrank's Triton kernels (imported only when a GPU path or the interpreter runs them); the
arithmetic is ``reference.py``'s, step for step. Launch with ``enable_fp_fusion=False``."""

import triton
import triton.language as tl


@triton.jit
def bf16_bits(f):
    b = f.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(f != f, 0x7FC0, r).to(tl.uint16)


@triton.jit
def encode_kernel(x_ptr, rot_ptr, mean_ptr, rank_ptr, bits_ptr, coef_pre_ptr, code_pre_ptr,
                  coef_ptr, params_ptr, codes_ptr, M,
                  D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = rows < M
    r = tl.load(rank_ptr + g)
    i = tl.arange(0, HALF)
    ke = 2 * i
    ko = 2 * i + 1
    me = ke < r
    mo = ko < r
    acc_e = tl.zeros([BLOCK, HALF], dtype=tl.float32)
    acc_o = tl.zeros([BLOCK, HALF], dtype=tl.float32)
    xrow = x_ptr + (g * M + rows) * D
    for j in range(D):
        xj = tl.load(xrow + j, mask=live, other=0.0).to(tl.float32)
        xc = xj - tl.load(mean_ptr + g * D + j)
        rrow = rot_ptr + (g * D + j) * D
        re = tl.load(rrow + ke, mask=me, other=0.0)
        ro = tl.load(rrow + ko, mask=mo, other=0.0)
        acc_e = acc_e + xc[:, None] * re[None, :]
        acc_o = acc_o + xc[:, None] * ro[None, :]
    if QUANT:
        inf = float("inf")
        lo = tl.minimum(tl.min(tl.where(me[None, :], acc_e, inf), axis=1),
                        tl.min(tl.where(mo[None, :], acc_o, inf), axis=1))
        hi = tl.maximum(tl.max(tl.where(me[None, :], acc_e, -inf), axis=1),
                        tl.max(tl.where(mo[None, :], acc_o, -inf), axis=1))
        has = r > 0
        lo = tl.where(has, lo, 0.0)
        hi = tl.where(has, hi, 0.0)
        z16 = lo.to(tl.float16)
        z = z16.to(tl.float32)
        bits = tl.load(bits_ptr + g)
        qmax = ((1 << bits) - 1).to(tl.float32)
        s16 = tl.math.div_rn(hi - z, tl.zeros_like(hi) + qmax).to(tl.float16)
        s = s16.to(tl.float32)
        ok = (s > 0.0) & (s < inf)
        sd = tl.where(ok, s, 1.0)
        magic = 12582912.0
        qe = tl.math.div_rn(acc_e - z[:, None], tl.zeros_like(acc_e) + sd[:, None])
        qo = tl.math.div_rn(acc_o - z[:, None], tl.zeros_like(acc_o) + sd[:, None])
        qe = (qe + magic) - magic
        qo = (qo + magic) - magic
        qe = tl.minimum(tl.maximum(qe, 0.0), qmax)
        qo = tl.minimum(tl.maximum(qo, 0.0), qmax)
        qe = tl.where(ok[:, None] & me[None, :], qe, 0.0).to(tl.int32)
        qo = tl.where(ok[:, None] & mo[None, :], qo, 0.0).to(tl.int32)
        pbase = params_ptr + (g * M + rows) * 2
        tl.store(pbase, s16, mask=live)
        tl.store(pbase + 1, z16, mask=live)
        nb = (r * bits + 7) // 8
        cbase = codes_ptr + tl.load(code_pre_ptr + g) * M + rows * nb
        if bits == 8:
            tl.store(cbase[:, None] + ke[None, :], qe.to(tl.uint8), mask=live[:, None] & me[None, :])
            tl.store(cbase[:, None] + ko[None, :], qo.to(tl.uint8), mask=live[:, None] & mo[None, :])
        else:
            tl.store(cbase[:, None] + i[None, :], (qe | (qo << 4)).to(tl.uint8),
                     mask=live[:, None] & me[None, :])
    else:
        cbase = coef_ptr + tl.load(coef_pre_ptr + g) * M + rows * r
        tl.store(cbase[:, None] + ke[None, :], bf16_bits(acc_e), mask=live[:, None] & me[None, :])
        tl.store(cbase[:, None] + ko[None, :], bf16_bits(acc_o), mask=live[:, None] & mo[None, :])


@triton.jit
def decode_kernel(coef_ptr, params_ptr, codes_ptr, rot_t_ptr, mean_ptr, rank_ptr, bits_ptr, coef_pre_ptr,
                  code_pre_ptr, out_ptr, M, D: tl.constexpr, DPAD: tl.constexpr, BLOCK: tl.constexpr,
                  QUANT: tl.constexpr, BF16: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = rows < M
    r = tl.load(rank_ptr + g)
    cols = tl.arange(0, DPAD)
    cmask = cols < D
    acc = tl.zeros([BLOCK, DPAD], dtype=tl.float32)
    if QUANT:
        pbase = params_ptr + (g * M + rows) * 2
        s = tl.load(pbase, mask=live, other=0.0).to(tl.float32)
        z = tl.load(pbase + 1, mask=live, other=0.0).to(tl.float32)
        bits = tl.load(bits_ptr + g)
        nb = (r * bits + 7) // 8
        cbase = codes_ptr + tl.load(code_pre_ptr + g) * M + rows * nb
        for k in range(0, r):
            byte = tl.load(cbase + (k * bits) // 8, mask=live, other=0).to(tl.int32)
            q = (byte >> ((k * bits) % 8)) & ((1 << bits) - 1)
            c = q.to(tl.float32) * s
            c = c + z
            rk = tl.load(rot_t_ptr + (g * D + k) * D + cols, mask=cmask, other=0.0)
            acc = acc + c[:, None] * rk[None, :]
    else:
        cbase = coef_ptr + tl.load(coef_pre_ptr + g) * M + rows * r
        for k in range(0, r):
            w = tl.load(cbase + k, mask=live, other=0).to(tl.uint32)
            c = (w << 16).to(tl.float32, bitcast=True)
            rk = tl.load(rot_t_ptr + (g * D + k) * D + cols, mask=cmask, other=0.0)
            acc = acc + c[:, None] * rk[None, :]
    y = acc + tl.load(mean_ptr + g * D + cols, mask=cmask, other=0.0)[None, :]
    if BF16:
        out = bf16_bits(y)
    else:
        out = tl.where(y != y, 0x7E00, y.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)).to(tl.uint16)
    tl.store(out_ptr + ((g * M + rows) * D)[:, None] + cols[None, :], out,
             mask=live[:, None] & cmask[None, :])
