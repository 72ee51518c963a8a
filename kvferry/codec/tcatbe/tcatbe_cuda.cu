// tca-tbe header, check and decode kernels (format v1, see FORMAT.md). Compiled at run time by
// NVRTC through CuPy; the per-byte, per-lane and header functions also compile as plain C++
// (tests/codec/test_tcatbe_cuda_host.py runs them on the CPU against the numpy reference).
//
// A decode is two kernels and one wait: `check` checks the frame's header on the device (block
// 0; so the GPU starts without waiting for the host to read it), leaving the stream offsets in a
// scratch block, and the streams against each other (all blocks); `decode` writes the values if
// it found nothing wrong, and copies the verdict (a word of the scratch block) to mapped host
// memory, which the host reads once after its wait.
//
// Decode: a lane takes one byte of a tile's bit-planes at a time (8 elements, 16 bytes out), so
// the 32 lanes of a warp read neighbouring bitmaps, SIGNMAN and FALLBACK bytes and write 512
// contiguous bytes, one 16-byte store each. A lane finds its SIGNMAN start from its tile's
// offsets and the popcount of the in-window bits below its byte, loads the (up to 8) SIGNMAN
// bytes as two aligned 8-byte words and the (up to 4) fallback values likewise, and builds the
// output with byte permutes (prmt) whose selectors it computes from the plane bytes with a few
// multiplies. (Per-block tables of selectors bound the kernel on shared-memory reads and their
// bank conflicts: L1 86% busy; without them L1 is 29% busy and more warps fit.) A byte with more than 4 fallback elements, or the tensor's last partial
// byte, takes a slower path that stores element by element. Blocks stay resident and take spans
// of bytes in turn; every thread reads the verdict word first and does nothing if it is set.
//
// With block ids, element e lands in block `block_ids[e / block_elems]` of the cache (rows of
// `block_stride` elements): decode writes straight into the scattered blocks.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// Compile-time tuning (cuda.py's TUNING): TCA_STORE_CS 1 marks the output stores evict-first
// (st.global.cs); TCA_MINB (TCA_MINB_BLOCKS, with block ids) is the blocks per SM the registers
// must allow; TCA_CHECK_TILES the tiles a thread of the check kernel takes at a time.
#ifndef TCA_STORE_CS
#define TCA_STORE_CS 1
#endif
#ifndef TCA_CHECK_TILES
#define TCA_CHECK_TILES 4
#endif

#ifdef __CUDACC__
#define TCA_FN __device__ __forceinline__
#define LDG(p) __ldg(p)
TCA_FN void store16(u16* dst, uint4 v) {
    if constexpr (TCA_STORE_CS) __stcs((uint4*)dst, v);
    else *(uint4*)dst = v;
}
// prmt without __byte_perm's masking of the selectors: a selector nibble with bit 3 set then
// replicates a sign bit, which only ever lands in bytes that a later prmt discards.
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
static inline u64 __umul64hi(u64 a, u64 b) { return (u64)(((unsigned __int128)a * b) >> 64); }
static inline void store16(u16* dst, uint4 v) { *(uint4*)dst = v; }
static inline u32 prmt(u32 x, u32 y, u32 s) {  // PTX's default mode, sign replication included
    u64 v = ((u64)y << 32) | x;
    u32 r = 0;
    for (int n = 0; n < 4; ++n) {
        u32 sel = (s >> (4 * n)) & 15;
        u32 byte = (u32)(v >> (8 * (sel & 7))) & 0xFF;
        if (sel & 8) byte = byte & 0x80 ? 0xFF : 0;
        r |= byte << (8 * n);
    }
    return r;
}
#endif

#define THREADS 256

// The header check's findings, u64 words after the verdict word (two int slots) of the scratch block.
enum Param { P_OFFSETS = 0, P_N = 5, P_TILES = 6, P_IN_WINDOW = 7, P_WINDOW_LOW = 8, P_GAPS = 9, P_WORDS = 17 };
// Verdict bits (cuda.py's): streams inconsistent, an id outside the cache, a repeated id, and a
// header this path does not take (the host parses it then, to raise its error or decode it).
enum Flag { BAD_FRAME = 1, BAD_ID = 2, REPEATED_ID = 4, FLAG_HOST = 8 };
#define HEADER_SIZE 112

// CRC32C tables for slicing by 4: crc_table[k][e] is byte e followed by k zero bytes.
TCA_FN void crc_entry(u32* table, u32 e) {
    u32 v = e;
    for (int k = 0; k < 8; k++) v = (v >> 1) ^ (0x82F63B78u & (0u - (v & 1u)));  // reflected CRC32C
    table[e] = v;
}

TCA_FN void crc_extend(u32* table, u32 k, u32 e) {
    const u32 v = table[256 * (k - 1) + e];
    table[256 * k + e] = (v >> 8) ^ table[v & 0xFF];
}

// Whether the header (its 28 little-endian words) is one parse_header (format.py) accepts for a
// frame of frame_size bytes, of wire_id, holding n elements (and the expected shape when
// expected_ndim < 255), without a stream CRC unless the caller verified it; if so, the stream
// offsets and what the check and decode kernels need go to params.
TCA_FN bool parse_header(const u32* words, const u32* crc_table, u64 frame_size, u64 n, u32 wire_id,
                         u32 expected_ndim, const u64* expected, u32 crc_verified, u64* params) {
    if (frame_size < HEADER_SIZE || n == 0) return false;
    u32 crc = 0xFFFFFFFFu;
    for (int w = 0; w < 27; w++) {
        crc ^= words[w];
        crc = crc_table[768 + (crc & 0xFF)] ^ crc_table[512 + ((crc >> 8) & 0xFF)]
              ^ crc_table[256 + ((crc >> 16) & 0xFF)] ^ crc_table[crc >> 24];
    }
    auto byte = [&](int offset) { return (words[offset / 4] >> (8 * (offset % 4))) & 0xFF; };
    auto u64_at = [&](int offset) { return (u64)words[offset / 4] | ((u64)words[offset / 4 + 1] << 32); };
    const u32 flags = byte(10), ndim = byte(8), window_low = byte(9);
    const u64 numel = u64_at(12), in_window = u64_at(84), fallback = u64_at(92);
    bool ok = (crc ^ 0xFFFFFFFFu) == words[27] && words[0] == 0x5A46564Bu  // "KVFZ"
              && (words[1] & 0xFFFFFF) == (1u | 6u << 16) && byte(7) == wire_id && byte(11) == 0
              && words[25] == 0 && (flags == 0 ? words[26] == 0 : flags == 1 && crc_verified)
              && window_low <= 249 && ndim <= 8 && numel == n && n < (1ull << 48) && in_window <= n
              && fallback == n - in_window && (expected_ndim == 255 || ndim == expected_ndim);
    u64 product = 1;
    for (u32 i = 0; i < 8 && ok; i++) {
        const u64 d = u64_at(20 + 8 * i);
        if (i >= ndim) {
            ok = d == 0;
        } else {  // n > 0: a zero or overflowing dimension is wrong (without a division)
            ok = d != 0 && __umul64hi(product, d) == 0 && product * d <= n
                 && (expected_ndim == 255 || d == expected[i]);
            product *= d;
        }
    }
    if (!ok || product != n) return false;
    const u64 tiles = (n + 63) / 64;
    const u64 lengths[5] = {24 * tiles, 8 * ((tiles + 1023) / 1024), 2 * tiles, in_window, 2 * fallback};
    u64 end = HEADER_SIZE, total = HEADER_SIZE, filled = HEADER_SIZE;
    u32 gaps = 0;
    for (int i = 0; i < 5; i++) {
        const u64 offset = (end + 15) & ~15ull;
        params[P_OFFSETS + i] = offset;
        end = offset + lengths[i];
        if (lengths[i]) {
            if (offset > filled) {  // the zero bytes between the streams (format.padding_ranges)
                params[P_GAPS + 2 * gaps] = filled;
                params[P_GAPS + 2 * gaps + 1] = offset;
                gaps++;
            }
            filled = total = end;
        }
    }
    for (u32 g = gaps; g < 4; g++) params[P_GAPS + 2 * g] = params[P_GAPS + 2 * g + 1] = 0;
    params[P_N] = n;
    params[P_TILES] = tiles;
    params[P_IN_WINDOW] = in_window;
    params[P_WINDOW_LOW] = window_low;
    return total == frame_size;
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
    u32 p0, p1, p2, m;   // plane bytes (bits 0..7; higher bits are other bytes'), in-window mask
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

// A lane's byte located: its plane bytes (bits 0..7 of each word; higher bits are other bytes')
// and where its values start in the span's SIGNMAN.
struct Located {
    u32 p0, p1, p2, start;
};

// `shift` is 8 times the byte's place in its tile, `below` = (1 << shift) - 1.
TCA_FN Located locate(const Planes& p, u32 shift, u64 below) {
    return Located{(u32)(p.b0 >> shift), (u32)(p.b1 >> shift), (u32)(p.b2 >> shift),
                   p.start + __popcll((p.b0 | p.b1 | p.b2) & below)};
}

// The located byte whose first element is element e of the span (e < left), to go to dst: load
// the aligned words holding its SIGNMAN bytes and, on the fast path (all 8 elements in the
// tensor, at most 4 of them fallback), its fallback values; only words holding a wanted byte
// are read.
TCA_FN Byte fetch(const Span& sp, const Located& p, u32 e, u16* dst) {
    const u32 start = p.start;
    Byte y;
    y.dst = dst;
    y.p0 = p.p0;
    y.p1 = p.p1;
    y.p2 = p.p2;
    y.m = (y.p0 | y.p1 | y.p2) & 0xFF;
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

// Four elements of a byte (a half: elements 4h .. 4h+3) as two pairs of 16-bit values: out[0]
// elements 4h, 4h+1 and out[1] the next two. q0..q2 hold the half's plane bits at bits 4h..4h+3,
// qm its in-window bits, below the in-window elements before the half, and code the nibbles
// 8h .. 8h+7 (0x76543210 or 0xFEDCBA98: an element's two bytes in an 8-byte window).
//
// Bit j of a nibble goes to bit 8j by a multiply (the partial products do not overlap), so byte
// j of the half gets the code of element j and its in-window bit; a multiply by 0x01010100 sums
// the in-window bits below each element (its rank r in the SIGNMAN window). A prmt selector is
// then one multiply away: 0x11 r takes SIGNMAN byte r twice (sign, mantissa), 2j - 2r and
// 2j - 2r + 1 are fallback value j - r's bytes, and 0x7654 - 0x44 in (per pair) takes the coded
// bytes of in-window elements and the fallback bytes of the others. No nibble borrows (r <= j).
TCA_FN void decode_half(u32 q0, u32 q1, u32 q2, u32 qm, u32 below, u32 code, u32 wide, u32 sm_lo, u32 sm_hi,
                        u32 fb_lo, u32 fb_hi, u32 h, u32* out) {
    const u32 S = 0x00204081u;
    const u32 lanes = h ? 0x10101010u : 0x01010101u;
    const u32 mask = h ? 0xF0u : 0x0Fu;
    u32 c = ((q0 & mask) * S & lanes) | ((q1 & mask) * (S << 1) & (lanes << 1)) | ((q2 & mask) * (S << 2) & (lanes << 2));
    u32 in = (qm & mask) * S & lanes;
    if (h) {
        c >>= 4;
        in >>= 4;
    }
    const u32 exponents = c - in + wide;  // per byte: window_low + code - 1 in the window, window_low outside
    const u32 rank = in * 0x01010100u + below * 0x01010101u;
    const u32 sm_sel = rank * 0x11u;
    const u32 fb_sel = code - 2 * sm_sel;
    const u32 merge = 0x76547654u - 0x44u * in;
#pragma unroll
    for (u32 i = 0; i < 2; ++i) {
        const u32 sh = 16 * i;
        u32 signman = prmt(sm_lo, sm_hi, sm_sel >> sh) & 0x807F807Fu;
        u32 coded = prmt(exponents, 0, i ? 0x4342 : 0x4140) * 128 + signman;
        out[i] = prmt(coded, prmt(fb_lo, fb_hi, fb_sel >> sh), merge >> sh);
    }
}

// The byte's 8 elements into y.dst (16-byte aligned on the fast path). wide: window_low in
// every byte.
TCA_FN void finish(const Byte& y, u32 wide) {
    u32 sm_lo, sm_hi, fb_lo, fb_hi;
    window(y.w0, y.w1, y.so, sm_lo, sm_hi);
    window(y.g0, y.g1, (u32)(u64)y.f & 7, fb_lo, fb_hi);
    u32 out[4];
    decode_half(y.p0, y.p1, y.p2, y.m, 0, 0x76543210u, wide, sm_lo, sm_hi, fb_lo, fb_hi, 0, out);
    decode_half(y.p0, y.p1, y.p2, y.m, __popc(y.m & 0xF), 0xFEDCBA98u, wide, sm_lo, sm_hi, fb_lo, fb_hi, 1, out + 2);
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
// of THREADS bytes, the next run's planes loaded before this run's values are fetched (planes two
// runs ahead with the values prefetched one run ahead was slower: more registers, fewer resident
// warps). BLOCKS: element e goes to block block_ids[e / block_elems] (rows of block_stride
// elements; block_elems < 2^31) instead of out + e.
template <bool BLOCKS>
TCA_FN void decode_span(u32 wide, const Span& sp, u16* out, const i64* block_ids, u64 block_elems,
                        u64 block_stride, u64 base, u32 lane, u32 runs) {
    const u32 step = THREADS / 8;  // tiles from one byte of a lane to its next
    u32 shift = (lane & 7) * 8;
    u64 below = (1ULL << shift) - 1;
    const u64* planes = sp.bitmaps + 3 * (lane >> 3);
    const u16* tile = sp.tiles + (lane >> 3);
    u32 end = sp.left < runs * 8 * THREADS ? sp.left : runs * 8 * THREADS;  // the span's elements
    u32 e = 8 * lane;
    if (e >= end) return;
    u16* const cache = out;
    u32 block = 0, offset = 0;  // BLOCKS: the block and the element in it where the lane's next byte lands
    if constexpr (BLOCKS) {
        u64 first = base * 8 + e, b = first / block_elems;
        block = (u32)b;
        offset = (u32)(first - b * block_elems);
        out += (u64)LDG(block_ids + block) * block_stride + offset;
    } else {
        out += base * 8 + e;
    }
    Planes next = load_planes(planes, tile);
    for (; e < end; e += 8 * THREADS) {
        Planes cur = next;
        planes += 3 * step;
        tile += step;
        if (e + 8 * THREADS < end) next = load_planes(planes, tile);  // the lane's next byte's planes
        u16* dst = out;
        out += 8 * THREADS;
        if constexpr (BLOCKS) {  // the next byte's block, read only where it changes
            offset += 8 * THREADS;
            if (offset >= (u32)block_elems && e + 8 * THREADS < end) {
                do {
                    offset -= (u32)block_elems;
                    ++block;
                } while (offset >= (u32)block_elems);
                out = cache + (u64)LDG(block_ids + block) * block_stride + offset;
            }
        }
        finish(fetch(sp, locate(cur, shift, below), e, dst), wide);
    }
}

#ifdef __CUDACC__

#ifndef TCA_MINB
#define TCA_MINB 6
#endif
#ifndef TCA_MINB_BLOCKS
#define TCA_MINB_BLOCKS 5
#endif

// Blocks take spans of runs * THREADS bytes in turn (span k, k + gridDim.x, ...). Reads and
// writes no output if the verdict (`verdict`, set by `check`) is set. Thread 0 copies the verdict
// to `host` (mapped pinned memory: the host reads it after the stream's wait, with no copy behind
// the kernel) and zeroes the other verdict slot, the next call's (this one is still being read).
template <bool BLOCKS>
__global__ void __launch_bounds__(THREADS, BLOCKS ? TCA_MINB_BLOCKS : TCA_MINB) decode(
    const u8* frame, const u64* scratch, const int* verdict, int* other, int* host,
    u16* out, const i64* block_ids, u64 block_elems, u64 block_stride, u32 runs) {
    const int bad = LDG(verdict);  // written by the kernel before this one: no need for a volatile read
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *(volatile int*)host = bad;
        __threadfence_system();
        *other = 0;
    }
    if (bad) return;
    const u64* params = scratch + 1;
    const u64* bitmaps = (const u64*)(frame + LDG(params + P_OFFSETS));
    const u64* groups = (const u64*)(frame + LDG(params + P_OFFSETS + 1));
    const u16* tiles = (const u16*)(frame + LDG(params + P_OFFSETS + 2));
    const u8* signman = frame + LDG(params + P_OFFSETS + 3);
    const u16* fallback = (const u16*)(frame + LDG(params + P_OFFSETS + 4));
    const u64 n = LDG(params + P_N);
    const u32 wide = (u32)LDG(params + P_WINDOW_LOW) * 0x01010101u;
    u64 spans = ((n + 7) / 8 + (u64)runs * THREADS - 1) / ((u64)runs * THREADS);
    for (u64 span = blockIdx.x; span < spans; span += gridDim.x) {
        u64 base = span * runs * THREADS;
        Span sp = make_span(bitmaps, groups, tiles, signman, fallback, n, base >> 3);
        decode_span<BLOCKS>(wide, sp, out, block_ids, block_elems, block_stride, base, threadIdx.x, runs);
    }
}

// Whether tile t's offsets agree with its in-window mask: its count is what the next tile's
// start (or in_window, after the last) says, a group's first tile starts its group, no codes
// lie past the end of the tensor.
TCA_FN bool tile_wrong(u64 t, u64 mask, u64 start, u32 rel, u64 following, u64 n) {
    u64 limit = n - 64 * t;  // elements of the tensor in this tile, >= 1
    return (limit < 64 && (mask >> limit) != 0) || following - start != __popcll(mask)
           || ((t & 1023) == 0 && rel != 0) || (t == 0 && start != 0);
}

// The header and the streams, one launch. Block 0 checks the header (parse_header; FLAG_HOST if
// it declines it) and writes the parameters the decode kernel reads; a separate header kernel
// before this one cost its launch and ~5 us on the GPU's path (H200). Every block checks its
// tiles meanwhile, from the offsets of the first three streams, which depend on n alone (the host
// passes them, having checked that they end inside the frame), and the header's in-window count
// for the last tile: a malformed header cannot make it read outside the frame, and whatever it
// finds then is moot (FLAG_HOST sends the frame to the host).
//
// TCA_CHECK_TILES tiles a thread at a time (their bitmaps in 16-byte loads), threads striding
// over the tiles (cuda.py launches a thread per TCA_CHECK_TILES tiles: one resident wave striding
// over them was no faster, H200 1 GiB 0.064 ms against 0.061). Sets BAD_FRAME when a tile
// disagrees with its offsets (tile_wrong) or (block 0, the header accepted) when the bytes
// between streams are not zero. With block ids, thread i also checks ids[i], ids[i + stride],
// ...: BAD_ID if outside 0..nblocks-1, REPEATED_ID if an earlier-seen id repeats it (`seen`: a
// bit per block, zeroed before the launch). The verdict slot is zero at the start (decode zeroes it).
extern "C" __global__ void __launch_bounds__(THREADS, 4) check(
    const u8* frame, u64 frame_size, u64 n, u32 wire_id, u32 expected_ndim, u64 s0, u64 s1, u64 s2, u64 s3,
    u64 s4, u64 s5, u64 s6, u64 s7, u32 crc_verified, u64* scratch, int* verdict, const i64* ids, u64 nids,
    u64 nblocks, u64 groups_at, u64 tiles_at) {
    __shared__ u32 crc_table[4 * 256];
    __shared__ u32 words[HEADER_SIZE / 4];
    __shared__ int header_ok;
    u64* params = scratch + 1;
    if (blockIdx.x == 0) {
        crc_entry(crc_table, threadIdx.x);
        if (threadIdx.x < HEADER_SIZE / 4 && frame_size >= HEADER_SIZE) words[threadIdx.x] = ((const u32*)frame)[threadIdx.x];
        for (u32 k = 1; k < 4; k++) {
            __syncthreads();
            crc_extend(crc_table, k, threadIdx.x);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            const u64 expected[8] = {s0, s1, s2, s3, s4, s5, s6, s7};
            header_ok = parse_header(words, crc_table, frame_size, n, wire_id, expected_ndim, expected, crc_verified,
                                     params);
            if (!header_ok) atomicOr(verdict, FLAG_HOST);
        }
        __syncthreads();  // the parameters (global, plain loads below) and header_ok
    }
    u32* seen = (u32*)(scratch + 1 + P_WORDS);
    const u64 tiles = (n + 63) / 64;
    const u64 in_window = LDG((const u32*)frame + 21) | (u64)LDG((const u32*)frame + 22) << 32;  // bytes 84..91
    const u64* bitmaps = (const u64*)(frame + HEADER_SIZE);
    const u64* groups = (const u64*)(frame + groups_at);
    const u16* tiles_rel = (const u16*)(frame + tiles_at);
    constexpr u32 K = TCA_CHECK_TILES;
    static_assert(K == 1 || K == 2 || K == 4 || K == 8, "tiles a check thread takes");
    const u64 first = (u64)blockIdx.x * THREADS + threadIdx.x, stride = (u64)gridDim.x * THREADS;
    int wrong = 0;
    for (u64 t0 = first * K; t0 < tiles; t0 += stride * K) {
        if (t0 + K <= tiles) {
            u64 b[3 * K];
            u32 rel[K];
            if constexpr (K == 1) {
                b[0] = LDG(bitmaps + 3 * t0), b[1] = LDG(bitmaps + 3 * t0 + 1), b[2] = LDG(bitmaps + 3 * t0 + 2);
                rel[0] = LDG(tiles_rel + t0);
            } else {
#pragma unroll
                for (u32 i = 0; i < 3 * K / 2; ++i) {
                    ulonglong2 v = LDG((const ulonglong2*)(bitmaps + 3 * t0) + i);
                    b[2 * i] = v.x, b[2 * i + 1] = v.y;
                }
                if constexpr (K == 2) {
                    u32 v = LDG((const u32*)(tiles_rel + t0));
                    rel[0] = v & 0xFFFF, rel[1] = v >> 16;
                } else if constexpr (K == 8) {
                    uint4 v = LDG((const uint4*)(tiles_rel + t0));
                    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (u32 i = 0; i < K; ++i) rel[i] = (w[i / 2] >> (16 * (i & 1))) & 0xFFFF;
                } else {
                    u64 v = LDG((const u64*)(tiles_rel + t0));
#pragma unroll
                    for (u32 i = 0; i < K; ++i) rel[i] = (u32)(v >> (16 * i)) & 0xFFFF;
                }
            }
            const u64 group = LDG(groups + (t0 >> 10));  // one group: K divides 1024
            const u64 following = t0 + K < tiles ? LDG(groups + ((t0 + K) >> 10)) + LDG(tiles_rel + t0 + K) : in_window;
#pragma unroll
            for (u32 i = 0; i < K; ++i) {
                u64 mask = b[3 * i] | b[3 * i + 1] | b[3 * i + 2];
                wrong |= tile_wrong(t0 + i, mask, group + rel[i], rel[i], i + 1 < K ? group + rel[i + 1] : following, n);
            }
        } else {
            for (u64 t = t0; t < tiles; ++t) {
                u64 mask = LDG(bitmaps + 3 * t) | LDG(bitmaps + 3 * t + 1) | LDG(bitmaps + 3 * t + 2);
                u32 rel = LDG(tiles_rel + t);
                u64 following = t + 1 < tiles ? LDG(groups + ((t + 1) >> 10)) + LDG(tiles_rel + t + 1) : in_window;
                wrong |= tile_wrong(t, mask, LDG(groups + (t >> 10)) + rel, rel, following, n);
            }
        }
    }
    if (blockIdx.x == 0 && threadIdx.x < 64 && header_ok) {  // each gap is under 16 bytes
        const u32 i = threadIdx.x >> 4;
        const u64 at = params[P_GAPS + 2 * i] + (threadIdx.x & 15);
        if (at < params[P_GAPS + 2 * i + 1] && frame[at]) wrong = 1;
    }
    for (u64 i = first; i < nids; i += stride) {
        i64 id = LDG(ids + i);
        if (id < 0 || (u64)id >= nblocks) wrong |= BAD_ID;
        else if (atomicOr(seen + (id >> 5), 1u << (id & 31)) & (1u << (id & 31))) wrong |= REPEATED_ID;
    }
    if (wrong) atomicOr(verdict, wrong);
}

#endif
