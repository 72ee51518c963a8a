// tca-tbe check and decode kernels (format v1, see FORMAT.md). Compiled at run time by NVRTC
// through CuPy; the per-byte and per-lane functions also compile as plain C++
// (tests/codec/test_tcatbe_cuda_host.py runs them on the CPU against the numpy reference).
//
// Decode: a lane takes one byte of a tile's bit-planes at a time (8 elements, 16 bytes out), so
// the 32 lanes of a warp read neighbouring bitmaps, SIGNMAN and FALLBACK bytes and write 512
// contiguous bytes, one 16-byte store each. A lane finds its SIGNMAN start from its tile's
// offsets and the popcount of the in-window bits below its byte, loads the (up to 8) SIGNMAN
// bytes as two aligned 8-byte words and the (up to 4) fallback values likewise, and builds the
// output with byte permutes (prmt): per-block tables indexed by a plane byte give the 3-bit codes
// spread to one byte each, and tables indexed by the in-window mask give each pair of elements
// its SIGNMAN bytes, fallback bytes and which of the two it takes. A byte with more than 4
// fallback elements, or the tensor's last partial byte, takes a slower path that stores element
// by element. Blocks stay resident and take spans of bytes in turn, so the tables are built once
// per block; every thread reads the check kernel's flag first and does nothing if it is set.
//
// With block ids, element e lands in block `block_ids[e / block_elems]` of the cache (rows of
// `block_stride` elements): decode writes straight into the scattered blocks.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// Compile-time tuning (cuda.py's TUNING): TCA_STORE_CS 1 marks the output stores evict-first
// (st.global.cs); TCA_MINB is the blocks per SM the registers must allow.
#ifndef TCA_STORE_CS
#define TCA_STORE_CS 1
#endif

#ifdef __CUDACC__
#define TCA_FN __device__ __forceinline__
#define LDG(p) __ldg(p)
TCA_FN void store16(u16* dst, uint4 v) {
    if constexpr (TCA_STORE_CS) __stcs((uint4*)dst, v);
    else *(uint4*)dst = v;
}
// prmt without __byte_perm's masking of the selectors (whose nibbles here are all 0..7).
TCA_FN u32 prmt(u32 x, u32 y, u32 s) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(y), "r"(s));
    return r;
}
#else  // a host build of the per-byte functions, for the tests
#define TCA_FN static inline
#define LDG(p) (*(p))
struct uint4 { u32 x, y, z, w; };
static inline u32 __popc(u32 x) { return (u32)__builtin_popcount(x); }
static inline u32 __popcll(u64 x) { return (u32)__builtin_popcountll(x); }
static inline u32 __funnelshift_r(u32 lo, u32 hi, u32 shift) {
    return (u32)((((u64)hi << 32) | lo) >> (shift & 31));
}
static inline void store16(u16* dst, uint4 v) { *(uint4*)dst = v; }
static inline u32 prmt(u32 x, u32 y, u32 s) {
    u64 v = ((u64)y << 32) | x;
    u32 r = 0;
    for (int n = 0; n < 4; ++n) r |= (u32)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
    return r;
}
#endif

#define THREADS 256

// Per-block tables, built from the frame's window before decoding.
struct Tables {
    u64 code[3][256];  // code[k][p]: bit j of plane-k byte p as bit k of byte j; code[0] adds window_low
    uint4 sel[256];    // per in-window mask byte, pair i: SIGNMAN selector (low 16 bits), merge (high 16)
    uint4 aux[256];    // x, y: pairs' selectors into the fallback window (16 bits each); z, w: minus the
                       // mask's bits spread to bytes (elements 0..3, 4..7)
};

// Bit j of the byte v moved to bit 8j.
TCA_FN u64 spread8(u32 v) {
    u64 x = v & 0xFF;
    x = (x | (x << 28)) & 0x0000000F0000000FULL;
    x = (x | (x << 14)) & 0x0003000300030003ULL;
    return (x | (x << 7)) & 0x0101010101010101ULL;
}

// Table entries for byte value v. With the mask m: element j's SIGNMAN byte is byte r_j (in-window
// elements before it) of its 8-byte window, its fallback value half f_j = j - r_j of its 4-half
// window. Byte j of code[0][p0] + code[1][p1] + code[2][p2] - spread8(m) is window_low + code - 1
// for an in-window element and window_low for another: every byte stays in 0..255, so the sums
// of 32-bit halves never carry between bytes.
TCA_FN void build_entry(Tables* tb, u32 v, u32 window_low) {
    u64 s = spread8(v);
    tb->code[0][v] = s + (u64)window_low * 0x0101010101010101ULL;
    tb->code[1][v] = s << 1;
    tb->code[2][v] = s << 2;
    u32 r[8], f[8], in[8], below = 0;
    for (u32 j = 0; j < 8; ++j) {
        in[j] = (v >> j) & 1;
        r[j] = below;
        f[j] = j - below;
        below += in[j];
    }
    u32 sel[4], fsel[4];
    for (u32 i = 0; i < 4; ++i) {
        u32 lo = 2 * i, hi = 2 * i + 1;
        u32 sm = r[lo] | r[lo] << 4 | r[hi] << 8 | r[hi] << 12;  // the byte twice: sign high, mantissa low
        u32 merge = (in[lo] ? 0x10u : 0x54u) | (in[hi] ? 0x3200u : 0x7600u);
        u32 flo = in[lo] ? 0 : ((2 * f[lo]) & 7) | ((2 * f[lo] + 1) & 7) << 4;
        u32 fhi = in[hi] ? 0 : ((2 * f[hi]) & 7) << 8 | ((2 * f[hi] + 1) & 7) << 12;
        sel[i] = sm | merge << 16;
        fsel[i] = flo | fhi;
    }
    tb->sel[v] = uint4{sel[0], sel[1], sel[2], sel[3]};
    tb->aux[v] = uint4{fsel[0] | fsel[1] << 16, fsel[2] | fsel[3] << 16, 0u - (u32)s, 0u - (u32)(s >> 32)};
}

// The streams seen from a span of consecutive tiles inside one group (1024 tiles): SIGNMAN from
// the group's first in-window element, FALLBACK from the span's first fallback element less the
// group's in-window elements before the span. A byte's offsets in them then fit 32 bits.
struct Span {
    const u64* bitmaps;   // the span's first tile
    const u16* tiles;     // the span's first tile
    const u8* signman;    // + TILES[t] + in-window elements of tile t below the byte
    const u16* fallback;  // + (element of the span) - TILES[t] - ... (may be negative)
    u32 left;             // elements of the tensor from the span's start (clamped to 2^32 - 16)
};

TCA_FN Span make_span(const u64* bitmaps, const u64* groups, const u16* tiles, const u8* signman,
                      const u16* fallback, u64 n, u64 first_tile) {
    u64 group_start = LDG(groups + (first_tile >> 10));  // in-window elements before the group
    u64 left = n - 64 * first_tile;
    Span sp;
    sp.bitmaps = bitmaps + 3 * first_tile;
    sp.tiles = tiles + first_tile;
    sp.signman = signman + group_start;
    sp.fallback = fallback + (64 * first_tile - group_start);
    sp.left = left < 0xFFFFFFF0ULL ? (u32)left : 0xFFFFFFF0u;
    return sp;
}

// One byte on its way: where it goes, its plane bytes, and the words its values lie in.
struct Byte {
    u16* dst;            // where its 8 elements go
    const u16* f;        // first FALLBACK value
    u32 p0, p1, p2, m;   // plane bytes, in-window mask
    u32 valid, fast, so; // elements in the tensor (1..8); all 8 there, at most 4 fallback; SIGNMAN start % 8
    u64 w0, w1, g0, g1;
};

// A tile's three 64-bit planes and its TILES entry, as loaded.
struct Planes {
    u64 b0, b1, b2;
    u32 start;
};

TCA_FN Planes load_planes(const u64* planes, const u16* tile) {
    return Planes{LDG(planes), LDG(planes + 1), LDG(planes + 2), LDG(tile)};
}

// The byte of the tile `p` whose first element is element e of the span (e < left), to go to
// dst: find where its values start and load the aligned words holding its SIGNMAN bytes and, on
// the fast path (all 8 elements in the tensor, at most 4 of them fallback), its fallback values;
// only words holding a wanted byte are read. `shift` is 8 times the byte's place in its tile,
// `below` = (1 << shift) - 1.
TCA_FN Byte fetch(const Span& sp, const Planes& p, u32 e, u32 shift, u64 below, u16* dst) {
    u32 start = p.start + __popcll((p.b0 | p.b1 | p.b2) & below);
    Byte y;
    y.dst = dst;
    y.p0 = (u32)(p.b0 >> shift) & 0xFF;
    y.p1 = (u32)(p.b1 >> shift) & 0xFF;
    y.p2 = (u32)(p.b2 >> shift) & 0xFF;
    y.m = y.p0 | y.p1 | y.p2;
    u32 c = __popc(y.m), left = sp.left - e;
    y.valid = left >= 8 ? 8 : left;
    u32 nf = y.valid - c;
    y.fast = y.valid == 8 && nf <= 4;
    const u8* s = sp.signman + start;
    y.so = (u32)(u64)s & 7;
    y.f = sp.fallback + (int)(e - start);
    const u64* sm = (const u64*)((u64)s & ~7ULL);
    const u64* fb = (const u64*)((u64)y.f & ~7ULL);
    y.w0 = c ? LDG(sm) : 0;
    y.w1 = y.so + c > 8 ? LDG(sm + 1) : 0;
    y.g0 = y.fast && nf ? LDG(fb) : 0;
    y.g1 = y.fast && (((u32)(u64)y.f & 7) >> 1) + nf > 4 ? LDG(fb + 1) : 0;
    return y;
}

// 8 bytes starting at byte `offset` (0..7) of the 16 little-endian bytes lo, hi.
TCA_FN void window(u64 lo, u64 hi, u32 offset, u32& a, u32& b) {
    u32 x0 = (u32)lo, x1 = (u32)(lo >> 32), x2 = (u32)hi, x3 = (u32)(hi >> 32);
    bool up = offset & 4;
    u32 y0 = up ? x1 : x0, y1 = up ? x2 : x1, y2 = up ? x3 : x2;
    u32 shift = (offset & 3) * 8;
    a = __funnelshift_r(y0, y1, shift);
    b = __funnelshift_r(y1, y2, shift);
}

// The byte's 8 elements into y.dst (16-byte aligned on the fast path).
TCA_FN void finish(const Tables& tb, const Byte& y) {
    u64 t0 = tb.code[0][y.p0], t1 = tb.code[1][y.p1], t2 = tb.code[2][y.p2];
    uint4 sel = tb.sel[y.m], aux = tb.aux[y.m];
    u32 code_lo = (u32)t0 + (u32)t1 + (u32)t2 + aux.z;  // window_low + code - 1 per in-window byte
    u32 code_hi = (u32)(t0 >> 32) + (u32)(t1 >> 32) + (u32)(t2 >> 32) + aux.w;
    u32 sm_lo, sm_hi, fb_lo, fb_hi;
    window(y.w0, y.w1, y.so, sm_lo, sm_hi);
    window(y.g0, y.g1, (u32)(u64)y.f & 7, fb_lo, fb_hi);
    u32 sels[4] = {sel.x, sel.y, sel.z, sel.w};
    u32 fsels[4] = {aux.x, aux.x >> 16, aux.y, aux.y >> 16};
    u32 out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 signman = prmt(sm_lo, sm_hi, sels[i]) & 0x807F807Fu;
        u32 exponent = prmt(i < 2 ? code_lo : code_hi, 0, (i & 1) ? 0x4342 : 0x4140);
        u32 coded = exponent * 128 + signman;
        out[i] = prmt(coded, prmt(fb_lo, fb_hi, fsels[i]), sels[i] >> 16);
    }
    if (y.fast) {
        store16(y.dst, uint4{out[0], out[1], out[2], out[3]});
        return;
    }
    const u16* f = y.f;
#pragma unroll
    for (u32 j = 0; j < 8; ++j) {
        if (j < y.valid) y.dst[j] = (y.m >> j) & 1 ? (u16)(out[j >> 1] >> (16 * (j & 1))) : LDG(f++);
    }
}

// Lane `lane` of a block decodes its bytes of the span that starts at byte `base` of the tensor
// (a multiple of THREADS; the span's runs * THREADS bytes lie inside one group): one byte per run
// of THREADS bytes, the next run's planes loaded before this run's values are fetched. BLOCKS:
// element e goes to block block_ids[e / block_elems] (rows of block_stride elements) instead of
// out + e.
template <bool BLOCKS>
TCA_FN void decode_span(const Tables& tb, const Span& sp, u16* out, const i64* block_ids, u64 block_elems,
                        u64 block_stride, u64 base, u32 lane, u32 runs) {
    const u32 step = THREADS / 8;  // tiles from one byte of a lane to its next
    u32 shift = (lane & 7) * 8;
    u64 below = (1ULL << shift) - 1;
    const u64* planes = sp.bitmaps + 3 * (lane >> 3);
    const u16* tile = sp.tiles + (lane >> 3);
    u32 end = sp.left < runs * 8 * THREADS ? sp.left : runs * 8 * THREADS;  // the span's elements
    u32 e = 8 * lane;
    if (e >= end) return;
    u64 block = 0, offset = 0;  // BLOCKS: where the lane's next byte lands
    if constexpr (BLOCKS) {
        u64 first = base * 8 + e;
        block = first / block_elems;
        offset = first - block * block_elems;
    } else {
        out += base * 8 + e;
    }
    Planes next = load_planes(planes, tile);
    for (; e < end; e += 8 * THREADS) {
        Planes cur = next;
        planes += 3 * step;
        tile += step;
        if (e + 8 * THREADS < end) next = load_planes(planes, tile);  // the lane's next byte's planes
        u16* dst;
        if constexpr (BLOCKS) {
            dst = out + (u64)LDG(block_ids + block) * block_stride + offset;
            for (offset += 8 * THREADS; offset >= block_elems; offset -= block_elems) ++block;
        } else {
            dst = out;
            out += 8 * THREADS;
        }
        finish(tb, fetch(sp, cur, e, shift, below, dst));
    }
}

#ifdef __CUDACC__

#ifndef TCA_MINB
#define TCA_MINB 5
#endif

// Blocks take spans of runs * THREADS bytes in turn (span k, k + gridDim.x, ...), so the tables
// are built once per block. Reads and writes nothing if *bad is set.
template <bool BLOCKS>
__global__ void __launch_bounds__(THREADS, TCA_MINB) decode(
    const u64* bitmaps, const u64* groups, const u16* tiles, const u8* signman, const u16* fallback, u16* out,
    const i64* block_ids, u64 block_elems, u64 block_stride, const int* bad, u64 n, u32 window_low, u32 runs) {
    __shared__ Tables tb;
    if (*(volatile const int*)bad) return;
    for (u32 v = threadIdx.x; v < 256; v += THREADS) build_entry(&tb, v, window_low);
    __syncthreads();
    u64 spans = ((n + 7) / 8 + (u64)runs * THREADS - 1) / ((u64)runs * THREADS);
    for (u64 span = blockIdx.x; span < spans; span += gridDim.x) {
        u64 base = span * runs * THREADS;
        Span sp = make_span(bitmaps, groups, tiles, signman, fallback, n, base >> 3);
        decode_span<BLOCKS>(tb, sp, out, block_ids, block_elems, block_stride, base, threadIdx.x, runs);
    }
}

// One thread per tile: sets bit 0 of *bad when a tile's offsets disagree with the popcounts of
// its bitmaps, when codes lie past the end of the tensor, or (block 0) when the bytes between
// streams (gap_begin[i] .. gap_end[i] of the frame, each under 16 bytes) are not zero. With block
// ids, thread i also checks ids[i]: bit 1 if it is outside 0..nblocks-1, bit 2 if an earlier-seen
// id repeats it (`seen`: a zeroed bit per block).
extern "C" __global__ void __launch_bounds__(THREADS) check(
    const u64* bitmaps, const u64* groups, const u16* tiles_rel, const u8* frame, int* bad, u64 n, u64 tiles,
    u64 in_window, u64 gap0, u64 end0, u64 gap1, u64 end1, u64 gap2, u64 end2, u64 gap3, u64 end3,
    const i64* ids, u64 nids, u64 nblocks, u32* seen) {
    u64 t = (u64)blockIdx.x * THREADS + threadIdx.x;
    int wrong = 0;
    if (t < tiles) {
        u64 mask = LDG(bitmaps + 3 * t) | LDG(bitmaps + 3 * t + 1) | LDG(bitmaps + 3 * t + 2);
        u64 limit = n - 64 * t;  // elements of the tensor in this tile, >= 1
        u32 rel = LDG(tiles_rel + t);
        u64 start = LDG(groups + (t >> 10)) + rel;
        u64 following = t + 1 < tiles ? LDG(groups + ((t + 1) >> 10)) + LDG(tiles_rel + t + 1) : in_window;
        wrong = (limit < 64 && (mask >> limit) != 0) || following - start != __popcll(mask)
                || ((t & 1023) == 0 && rel != 0) || (t == 0 && start != 0);
    }
    if (blockIdx.x == 0 && threadIdx.x < 64) {
        u32 i = threadIdx.x >> 4;
        u64 begin = i == 0 ? gap0 : i == 1 ? gap1 : i == 2 ? gap2 : gap3;
        u64 end = i == 0 ? end0 : i == 1 ? end1 : i == 2 ? end2 : end3;
        u64 at = begin + (threadIdx.x & 15);
        if (at < end && frame[at]) wrong = 1;
    }
    if (t < nids) {
        i64 id = LDG(ids + t);
        if (id < 0 || (u64)id >= nblocks) wrong |= 2;
        else if (atomicOr(seen + (id >> 5), 1u << (id & 31)) & (1u << (id & 31))) wrong |= 4;
    }
    if (wrong) atomicOr(bad, wrong);
}

#endif
