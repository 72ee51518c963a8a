// SplitZip kernels (format v1, see FORMAT.md). Compiled at run time by NVRTC through CuPy.
//
// Every thread handles *groups* of 8 elements: 8 elements of R residual bits fill exactly R bytes
// and 8 codes of C bits exactly C bytes, so groups never share an output byte. A subgroup of
// LANES lanes of a warp owns a whole chunk (chunk % 8 == 0), which keeps escape counting and
// ordering inside it: no atomics, no block barriers, and escapes come out in element order.
// Each lane takes UNROLL groups per pass and issues all their loads before using the first.
//
// Template parameters: TOTAL (element bits, 16 or 8), E (exponent bits), C (code bits).
// bfloat16 (16, 8, 4) has a byte-parallel path (prmt); the generic path serves every format and
// defines what the fast path must equal. Elements are read from a flat tensor or, for the
// paged-KV API, from whole blocks of `block_elems` elements picked by `block_ids` out of a
// cache (block_ids == nullptr: flat).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define THREADS 128
#define GROUP 8
#ifndef LANES
#define LANES 16
#endif
#ifndef UNROLL
#define UNROLL (128 / LANES)  // a subgroup pass spans LANES * 8 * UNROLL = 1024 elements
#endif
#ifndef MINB
#define MINB 1
#endif
// Cache hints for the streamed data, chosen at compile time (`bench/codec_gpu.py --sweep`):
// LOAD_HINT 0 plain, 1 evict-first (ld.global.cs), 2 read-only path (ld.global.nc), 3 plain with
// an L2 prefetch of 256 bytes;
// STORE_HINT 0 plain, 1 evict-first (st.global.cs).
#ifndef LOAD_HINT
#define LOAD_HINT 1
#endif
#ifndef STORE_HINT
#define STORE_HINT 1
#endif
#define SPAN (LANES * GROUP * UNROLL)

// With ENC_WIDE, a bfloat16 lane takes two adjacent groups per encode step: 16 bytes of
// residuals and 8 of codes are stored in one access instead of two. (The same for decode's
// loads measured 10-15% slower on an H200 and was removed.)
#ifndef ENC_WIDE
#define ENC_WIDE 0
#endif

// Element index of a lane's k-th group in the pass at element `seg` (u64 from the tensor's
// start, u32 from a chunk's); W adjacent groups per lane per step.
template <int W, typename I>
__device__ __forceinline__ I group_index(I seg, int k, int sublane) {
    return seg + (((I)(k / W) * LANES + sublane) * W + (k % W)) * GROUP;
}

template <int TOTAL, int E, int C>
struct Width { enum { W = (ENC_WIDE && TOTAL == 16 && E == 8 && C == 4) ? 2 : 1 }; };

// LOAD_HINT 3: a plain load that asks L2 to fetch the whole 256-byte sector group around it.
__device__ __forceinline__ u32 load_l2_256(const u32* p) {
    u32 v;
    asm("ld.global.L2::256B.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u64 load_l2_256(const u64* p) {
    u64 v;
    asm("ld.global.L2::256B.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 load_l2_256(const uint2* p) {
    uint2 v;
    asm("ld.global.L2::256B.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 load_l2_256(const uint4* p) {
    uint4 v;
    asm("ld.global.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

template <typename T>
__device__ __forceinline__ T load_streamed(const T* p) {
    if constexpr (LOAD_HINT == 1) return __ldcs(p);
    else if constexpr (LOAD_HINT == 2) return __ldg(p);
    else if constexpr (LOAD_HINT == 3) return load_l2_256(p);
    else return *p;
}

template <typename T>
__device__ __forceinline__ void store_streamed(T* p, T v) {
    if constexpr (STORE_HINT == 1) __stcs(p, v);
    else *p = v;
}
#define SUBGROUPS (THREADS / LANES)
#define SCAN_THREADS 1024  // threads of the scanning kernels: a chunk (or SCAN_ITEMS) each

template <int TOTAL>
struct Elem;
template <>
struct Elem<16> { typedef u16 T; typedef uint4 Vec; enum { WORDS = 4 }; };
template <>
struct Elem<8> { typedef u8 T; typedef uint2 Vec; enum { WORDS = 2 }; };

// The block that holds element i. 32-bit division is several times cheaper, and it is the
// common case.
__device__ __forceinline__ u64 block_of(u64 i, u64 block_elems) {
    return ((i | block_elems) >> 32) ? i / block_elems : (u64)((u32)i / (u32)block_elems);
}

// Element index -> address, flat or through the block table.
template <int TOTAL>
__device__ __forceinline__ typename Elem<TOTAL>::T* elem_ptr(u8* base, const i64* block_ids,
                                                           u64 block_elems, u64 i) {
    typedef typename Elem<TOTAL>::T T;
    if (block_ids == nullptr) return reinterpret_cast<T*>(base) + i;
    const u64 b = block_of(i, block_elems);
    return reinterpret_cast<T*>(base) + (u64)block_ids[b] * block_elems + (i - b * block_elems);
}

// Addressing within one chunk: when the chunk lies inside one block (always for flat tensors,
// and for caches whose blocks hold whole chunks) the block lookup happens once per chunk.
template <int TOTAL>
struct ChunkAddr {
    typedef typename Elem<TOTAL>::T T;
    T* chunk_ptr;  // element `start`, or nullptr when the chunk spans blocks
    u8* base;
    const i64* ids;
    u64 block_elems, start;
    __device__ __forceinline__ ChunkAddr(u8* base_, const i64* ids_, u64 block_elems_, u64 start_, u32 chunk)
        : base(base_), ids(ids_), block_elems(block_elems_), start(start_) {
        chunk_ptr = (ids == nullptr || block_elems % chunk == 0) ? elem_ptr<TOTAL>(base, ids, block_elems, start) : nullptr;
    }
    __device__ __forceinline__ T* operator()(u64 i) const {
        return chunk_ptr ? chunk_ptr + (i - start) : elem_ptr<TOTAL>(base, ids, block_elems, i);
    }
};

// The 8 elements from element i as packed little-endian words (zero beyond `valid`).
template <int TOTAL>
__device__ __forceinline__ void load_group(const typename Elem<TOTAL>::T* p, int valid,
                                           u32 (&w)[Elem<TOTAL>::WORDS]) {
    typedef typename Elem<TOTAL>::T T;
    typedef typename Elem<TOTAL>::Vec V;
    if (valid == GROUP && (reinterpret_cast<u64>(p) % sizeof(V)) == 0) {
        V v = load_streamed(reinterpret_cast<const V*>(p));  // streamed once
        const u32* vw = reinterpret_cast<const u32*>(&v);
#pragma unroll
        for (int k = 0; k < Elem<TOTAL>::WORDS; k++) w[k] = vw[k];
    } else {
#pragma unroll
        for (int k = 0; k < Elem<TOTAL>::WORDS; k++) w[k] = 0;
        // Unrolled with constant indices: a run-time index would move w to local memory.
#pragma unroll
        for (int j = 0; j < GROUP; j++)
            if (j < valid) w[j * TOTAL / 32] |= (u32)p[j] << ((j * TOTAL) % 32);
    }
}

template <int TOTAL>
__device__ __forceinline__ u32 element(const u32 (&w)[Elem<TOTAL>::WORDS], int j) {
    return (w[j * TOTAL / 32] >> ((j * TOTAL) % 32)) & ((1u << TOTAL) - 1);
}

template <int TOTAL>
__device__ __forceinline__ void store_group(typename Elem<TOTAL>::T* p, int valid,
                                            const u32 (&w)[Elem<TOTAL>::WORDS]) {
    typedef typename Elem<TOTAL>::T T;
    typedef typename Elem<TOTAL>::Vec V;
    if (valid == GROUP && (reinterpret_cast<u64>(p) % sizeof(V)) == 0) {
        V v;
        u32* vw = reinterpret_cast<u32*>(&v);
#pragma unroll
        for (int k = 0; k < Elem<TOTAL>::WORDS; k++) vw[k] = w[k];
        store_streamed(reinterpret_cast<V*>(p), v);
    } else {
#pragma unroll
        for (int j = 0; j < GROUP; j++)
            if (j < valid) p[j] = (T)element<TOTAL>(w, j);
    }
}

// Write the first `nbytes` bytes of a little-endian 128-bit value (lo, hi) at p.
template <int K>
__device__ __forceinline__ void store_bits(u8* p, u64 lo, u64 hi, int nbytes) {
    if (K == 8 && nbytes == 8) { store_streamed(reinterpret_cast<u64*>(p), lo); return; }
    if (K == 4 && nbytes == 4) { store_streamed(reinterpret_cast<u32*>(p), (u32)lo); return; }
    for (int j = 0; j < nbytes; j++) p[j] = (u8)(j < 8 ? lo >> (8 * j) : hi >> (8 * (j - 8)));
}

// Read the group's bytes of a K-bit stream (only the `nbytes` that exist for a partial group).
template <int K>
__device__ __forceinline__ void load_bits(const u8* p, int nbytes, u64& lo, u64& hi) {
    hi = 0;
    if (K == 8 && nbytes == 8) { lo = load_streamed(reinterpret_cast<const u64*>(p)); return; }
    if (K == 4 && nbytes == 4) { lo = load_streamed(reinterpret_cast<const u32*>(p)); return; }
    lo = 0;
    for (int j = 0; j < nbytes; j++) {
        u64 b = p[j];
        if (j < 8) lo |= b << (8 * j); else hi |= b << (8 * (j - 8));
    }
}

// Inclusive prefix sum across the lanes of one subgroup.
__device__ __forceinline__ u32 subgroup_inclusive_scan(u32 v, int sublane, u32 mask) {
#pragma unroll
    for (int d = 1; d < LANES; d <<= 1) {
        u32 y = __shfl_up_sync(mask, v, d, LANES);
        if (sublane >= d) v += y;
    }
    return v;
}

__device__ __forceinline__ u32 subgroup_mask() {
    return LANES == 32 ? 0xffffffffu : (((1u << LANES) - 1) << (threadIdx.x & 31 & ~(LANES - 1)));
}

// One group through the codebook: residual bits, packed codes, escape mask and raw exponents
// (as bytes, for the rare spill).
template <int TOTAL, int E, int C>
__device__ __forceinline__ void encode_group(const u32 (&w)[Elem<TOTAL>::WORDS], int valid, const u8* table,
                                             u64& rlo, u64& rhi, u32& codes, u32& escmask, u32 (&exps)[2]) {
    constexpr int M = TOTAL - 1 - E;
    constexpr int R = TOTAL - E;
    constexpr u32 SIZE = 1u << C;
    if constexpr (TOTAL == 16 && E == 8 && C == 4) {
        // bfloat16, four elements per 32-bit word pair: gather low and high bytes, then the
        // residual (sign | 7 mantissa bits) and exponent bytes come out four at a time.
        u32 lo0 = __byte_perm(w[0], w[1], 0x6420), hi0 = __byte_perm(w[0], w[1], 0x7531);
        u32 lo1 = __byte_perm(w[2], w[3], 0x6420), hi1 = __byte_perm(w[2], w[3], 0x7531);
        u32 r0 = (hi0 & 0x80808080u) | (lo0 & 0x7F7F7F7Fu);
        u32 r1 = (hi1 & 0x80808080u) | (lo1 & 0x7F7F7F7Fu);
        exps[0] = ((hi0 << 1) & 0xFEFEFEFEu) | ((lo0 >> 7) & 0x01010101u);
        exps[1] = ((hi1 << 1) & 0xFEFEFEFEu) | ((lo1 >> 7) & 0x01010101u);
        u32 m[GROUP];
#pragma unroll
        for (int j = 0; j < GROUP; j++) m[j] = table[__byte_perm(exps[j >> 2], 0, 0x4440 | (j & 3))];
        u32 any = 0, packed = 0;
#pragma unroll
        for (int j = 0; j < GROUP; j++) {
            any |= m[j];
            packed |= m[j] << (4 * j);
        }
        codes = packed;
        escmask = 0;
        if (any & SIZE) {  // rare: some exponent is outside the codebook (marked with SIZE)
            packed = 0;
#pragma unroll
            for (int j = 0; j < GROUP; j++) {
                bool in = j < valid;
                if (in && m[j] == SIZE) escmask |= 1u << j;
                packed |= (in ? m[j] & (SIZE - 1) : 0u) << (4 * j);
            }
            codes = packed;
        } else if (valid < GROUP) {
            codes &= (1u << (4 * valid)) - 1;
        }
        rlo = (u64)r0 | ((u64)r1 << 32);
        rhi = 0;
        if (valid < GROUP) rlo &= (1ull << (8 * valid)) - 1;
        return;
    }
    rlo = 0; rhi = 0; codes = 0; escmask = 0; exps[0] = 0; exps[1] = 0;
#pragma unroll
    for (int j = 0; j < GROUP; j++) {
        bool in = j < valid;
        u32 b = element<TOTAL>(w, j);
        u32 e = (b >> M) & ((1u << E) - 1);
        u64 r = (((b >> (TOTAL - 1)) & 1u) << M) | (b & ((1u << M) - 1));
        u32 m = table[e];
        exps[j >> 2] |= e << (8 * (j & 3));
        if (in && m == SIZE) escmask |= 1u << j;
        codes |= (in ? (m & (SIZE - 1)) : 0u) << (C * j);
        int s = R * j;
        if (s < 64) {
            rlo |= r << s;
            if (s + R > 64) rhi |= r >> (64 - s);
        } else {
            rhi |= r << (s - 64);
        }
    }
}

// True (in every lane of the subgroup) when a block id under elements [start, end) lies outside
// the cache: ids are checked on the device, before the blocks they name are read or written.
__device__ __forceinline__ bool chunk_ids_bad(const i64* block_ids, u64 block_elems, u64 nblocks, u64 start,
                                              u64 end, int sublane, u32 mask) {
    bool bad = false;
    for (u64 b = start / block_elems + sublane; b <= (end - 1) / block_elems; b += LANES)
        bad |= (u64)block_ids[b] >= nblocks;  // a negative id reads as a huge one
    return __any_sync(mask, bad);
}

// Dense pass (any chunk from first_chunk on, any alignment, chunks across blocks; encode_lean
// takes the common case): residual and code streams, per-chunk escape counts, and each
// chunk's first spill_cap escapes spilled in order to spill_pos/spill_val from c * spill_cap
// (the tail finds the escapes of a chunk with more in the source again: scratch stays at 3/8
// of a byte an element, where room for every element cost 3 bytes). A chunk whose blocks do
// not exist counts -(n + 1), which makes the escape total negative: the tail pass then writes
// nothing and reports a length of -1.
template <int TOTAL, int E, int C>
__global__ void __launch_bounds__(THREADS, MINB)
encode_dense(u8* x, const i64* block_ids, u64 block_elems, u64 nblocks, u64 n, u32 chunk, u64 nchunks,
             u64 first_chunk, const u8* marked_table, u8* residual_out, u8* codes_out, u8* counts16_out,
             i64* counts_out, u16* spill_pos, u8* spill_val, u32 spill_cap) {
    constexpr int R = TOTAL - E;
    constexpr int WORDS = Elem<TOTAL>::WORDS;
    constexpr int W = Width<TOTAL, E, C>::W;
    __shared__ u8 table[1 << E];
    for (int t = threadIdx.x; t < (1 << E); t += THREADS) table[t] = marked_table[t];
    __syncthreads();
    const int sublane = threadIdx.x % LANES;
    const u32 mask = subgroup_mask();
    const u64 nsub = (u64)gridDim.x * SUBGROUPS;

    for (u64 c = first_chunk + (u64)blockIdx.x * SUBGROUPS + threadIdx.x / LANES; c < nchunks; c += nsub) {
        u64 start = c * chunk;
        u64 end = min(start + chunk, n);
        if (block_ids != nullptr && chunk_ids_bad(block_ids, block_elems, nblocks, start, end, sublane, mask)) {
            if (sublane == 0) counts_out[c] = -(i64)(n + 1);
            continue;
        }
        const ChunkAddr<TOTAL> at(x, block_ids, block_elems, start, chunk);
        u32 running = 0;
        for (u64 seg = start; seg < end; seg += SPAN) {
            u32 w[UNROLL][WORDS];
            int valid[UNROLL];
#pragma unroll
            for (int k = 0; k < UNROLL; k++) {
                u64 i = group_index<W>(seg, k, sublane);
                valid[k] = i < end ? (int)min((u64)GROUP, end - i) : 0;
                if (valid[k]) load_group<TOTAL>(at(i), valid[k], w[k]);
            }
#pragma unroll
            for (int k = 0; k < UNROLL; k += W) {
                u64 rlo[W], rhi[W];
                u32 codes[W], escmask[W], exps[W][2];
                u32 mine = 0;
#pragma unroll
                for (int v = 0; v < W; v++) {
                    rlo[v] = rhi[v] = 0;
                    codes[v] = escmask[v] = exps[v][0] = exps[v][1] = 0;
                    if (valid[k + v])
                        encode_group<TOTAL, E, C>(w[k + v], valid[k + v], table, rlo[v], rhi[v], codes[v], escmask[v], exps[v]);
                    mine += __popc(escmask[v]);
                }
                const u64 g0 = group_index<W>(seg, k, sublane) / GROUP;
                if (W == 2 && valid[k] == GROUP && valid[k + W - 1] == GROUP) {
                    store_streamed(reinterpret_cast<uint4*>(residual_out + g0 * R),
                                   make_uint4((u32)rlo[0], (u32)(rlo[0] >> 32), (u32)rlo[W - 1], (u32)(rlo[W - 1] >> 32)));
                    store_streamed(reinterpret_cast<uint2*>(codes_out + g0 * C), make_uint2(codes[0], codes[W - 1]));
                } else {
#pragma unroll
                    for (int v = 0; v < W; v++) {
                        if (!valid[k + v]) continue;
                        store_bits<R>(residual_out + (g0 + v) * R, rlo[v], rhi[v], (valid[k + v] * R + 7) / 8);
                        store_bits<C>(codes_out + (g0 + v) * C, codes[v], 0, (valid[k + v] * C + 7) / 8);
                    }
                }
                u32 total = __reduce_add_sync(mask, mine);
                if (total) {  // rare: order this step's escapes across the subgroup
                    u32 incl = subgroup_inclusive_scan(mine, sublane, mask);
                    u64 slot = c * spill_cap + running + incl - mine;
                    const u64 spill_end = (c + 1) * spill_cap;
#pragma unroll
                    for (int v = 0; v < W; v++) {
                        const u64 i = (g0 + v) * GROUP;
#pragma unroll
                        for (int j = 0; j < GROUP; j++) {
                            if (escmask[v] & (1u << j)) {
                                if (slot < spill_end) {
                                    spill_pos[slot] = (u16)(i + j - start);
                                    spill_val[slot] = (u8)(exps[v][j >> 2] >> (8 * (j & 3)));
                                }
                                slot++;
                            }
                        }
                    }
                }
                running += total;
            }
        }
        if (sublane == 0) {
            counts16_out[2 * c] = (u8)running;
            counts16_out[2 * c + 1] = (u8)(running >> 8);
            counts_out[c] = running;
        }
    }
}

// Prefix sums of per-chunk escape counts in one pass: each block of VALIDATE_THREADS threads takes
// a tile of SCAN_ITEMS consecutive chunks per thread, in the order blocks start (a ticket, so
// every earlier tile belongs to a block already running), scans it, and finds the sum of all
// earlier tiles by a decoupled look-back over the sums they publish. `status` (a word per tile)
// and the ticket start zeroed.
#ifndef SCAN_ITEMS
#define SCAN_ITEMS 4
#endif
#ifndef VALIDATE_THREADS
#define VALIDATE_THREADS 1024
#endif
#define SCAN_TILE (VALIDATE_THREADS * SCAN_ITEMS)
#define TILE_AGGREGATE (1ull << 62)  // status word: the tile's own sum is known
#define TILE_PREFIX (1ull << 63)     // status word: the sum through the end of the tile is known
#define TILE_VALUE (TILE_AGGREGATE - 1)

// Sum of `value` over the threads of the block (of BLOCK threads) before this one, and over all.
template <int BLOCK>
__device__ __forceinline__ u64 block_exclusive_sum(u64 value, u64& block_total) {
    __shared__ u64 warp_totals[BLOCK / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 inclusive = value;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        u64 y = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += y;
    }
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    // Every warp scans the warp totals itself: lane w holds warp w's.
    u64 totals = lane < BLOCK / 32 ? warp_totals[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        u64 y = __shfl_up_sync(0xffffffffu, totals, d);
        if (lane >= d) totals += y;
    }
    block_total = __shfl_sync(0xffffffffu, totals, 31);
    const u64 before_warp = warp ? __shfl_sync(0xffffffffu, totals, warp - 1) : 0;
    return before_warp + inclusive - value;
}

// Sum of every tile before `tile`, found by the first warp and shared with the block. Tiles
// finish their own sums at about the same time, so a look-back mostly finds aggregates, not
// prefixes: each lane reads LOOKBACK_WORDS predecessors' status words at once (their loads in
// flight together), the warp stops at the nearest word that holds a full prefix, and otherwise
// adds all the aggregates and moves a window back. Each word holds a flag and a value together,
// so one 64-bit access publishes or reads both.
#define LOOKBACK_WORDS 4
__device__ __forceinline__ u64 tile_exclusive_prefix(u64* status, u64 tile, u64 tile_total) {
    __shared__ u64 prefix;
    if (threadIdx.x < 32) {
        volatile u64* words = status;
        const int lane = threadIdx.x;
        if (lane == 0 && tile > 0) words[tile] = TILE_AGGREGATE | tile_total;
        u64 sum = 0;
        bool found = false;
        for (i64 newest = (i64)tile - 1; newest >= 0 && !found; newest -= 32 * LOOKBACK_WORDS) {
            u64 word[LOOKBACK_WORDS];
#pragma unroll
            for (int k = 0; k < LOOKBACK_WORDS; k++) {
                const i64 j = newest - (k * 32 + lane);
                word[k] = j >= 0 ? words[j] : TILE_PREFIX;  // before tile 0: an empty prefix
            }
#pragma unroll
            for (int k = 0; k < LOOKBACK_WORDS; k++) {
                while (word[k] == 0) word[k] = words[newest - (k * 32 + lane)];
            }
#pragma unroll
            for (int k = 0; k < LOOKBACK_WORDS; k++) {
                if (found) break;
                const u32 prefixed = __ballot_sync(0xffffffffu, (word[k] & TILE_PREFIX) != 0);
                const int stop = prefixed ? __ffs(prefixed) - 1 : 31;
                u64 value = lane <= stop ? word[k] & TILE_VALUE : 0;
#pragma unroll
                for (int d = 16; d > 0; d >>= 1) value += __shfl_xor_sync(0xffffffffu, value, d);
                sum += value;
                found = prefixed != 0;
            }
        }
        if (lane == 0) {
            words[tile] = TILE_PREFIX | (sum + tile_total);
            prefix = sum;
        }
    }
    __syncthreads();
    return prefix;
}

// Escapes before this thread's first chunk, its chunks' counts summing to `local` (the block's
// tile is scanned together).
__device__ __forceinline__ u64 scan_exclusive(u64 local, u64* status, u64 tile) {
    u64 tile_total;
    const u64 before = block_exclusive_sum<VALIDATE_THREADS>(local, tile_total);
    return tile_exclusive_prefix(status, tile, tile_total) + before;
}

// What decode_header found in a frame's header, for the kernels after it: chunk, chunk count,
// escape total, the five stream offsets, and the codebook's 16 bytes (u64 words).
#define P_CHUNK 0
#define P_NCHUNKS 1
#define P_ESCAPES 2
#define P_OFFSETS 3
#define P_CODEBOOK 8
#define PARAM_WORDS 10

// The streams of a frame, where decode_header found them.
struct FrameStreams {
    const u8* residual;
    const u8* codes;
    const u8* counts16;
    const u16* pos;
    const u8* val;
    __device__ __forceinline__ FrameStreams(const u8* frame, const u64* params)
        : residual(frame + params[P_OFFSETS]), codes(frame + params[P_OFFSETS + 1]),
          counts16(frame + params[P_OFFSETS + 2]), pos(reinterpret_cast<const u16*>(frame + params[P_OFFSETS + 3])),
          val(frame + params[P_OFFSETS + 4]) {}
};
#define FLAG_HOST 512u  // decode_header: the host must parse this frame; nothing else runs

__device__ __forceinline__ u64 le_bytes(const u8* p, int n) {
    u64 v = 0;
    for (int b = 0; b < n; b++) v |= (u64)p[b] << (8 * b);
    return v;
}

// Decode's header check, on the device, so that a decode need not wait for the host to read and
// parse the header before the GPU starts. It accepts exactly the frames that parse_header
// (format.py) accepts and that this path decodes as the caller expects: of the expected dtype
// and element count (and shape, when expected_ndim < 255), stored or coded with a chunk size the
// kernels take (one that divides whole_chunk_blocks, unless 0: decode_lean's blocks hold whole
// chunks) and escape counts within the scratch, no stream checksum unless the host already
// verified it. A stored frame gets chunk 0 in params. Anything else sets FLAG_HOST: the kernels
// after it write nothing, and the host parses the frame itself, to raise its precise error or
// to decode it another way.
__global__ void __launch_bounds__(32)
decode_header(const u8* frame, u64 frame_size, u32 dtype_id, u32 E, u32 C, u32 R, u32 itemsize, u64 n,
              u32 expected_ndim,
              u64 s0, u64 s1, u64 s2, u64 s3, u64 s4, u64 s5, u64 s6, u64 s7, u64 max_nchunks,
              u64 whole_chunk_blocks, u32 stream_crc_verified, u64* params, u32* flags, u64* zeroed, u64 nzeroed) {
    // The scratch words that start zeroed (the verdict among them), when the host left them to
    // this kernel: one call fewer on the host before the GPU starts.
    for (u64 i = threadIdx.x; i < nzeroed; i += 32) zeroed[i] = 0;
    // CRC32C tables for slicing by 4 (crc_table[k][e]: byte e followed by k zero bytes): the
    // header's 39 words take 39 dependent steps instead of 156.
    __shared__ u32 crc_table[4][256];
    __shared__ u32 words[40];  // the header, read once by the warp: the checks below are serial
    for (u32 e = threadIdx.x; e < 256; e += 32) {
        u32 v = e;
        for (int k = 0; k < 8; k++) v = (v >> 1) ^ (0x82F63B78u & (0u - (v & 1u)));  // reflected CRC32C
        crc_table[0][e] = v;
    }
    if (frame_size >= 160) {  // the frame is 16-byte aligned
        for (u32 w = threadIdx.x; w < 40; w += 32) words[w] = reinterpret_cast<const u32*>(frame)[w];
    }
    for (int k = 1; k < 4; k++) {
        __syncwarp();
        for (u32 e = threadIdx.x; e < 256; e += 32) {
            const u32 v = crc_table[k - 1][e];
            crc_table[k][e] = (v >> 8) ^ crc_table[0][v & 0xFF];
        }
    }
    __syncwarp();
    if (threadIdx.x != 0) return;
    bool ok = frame_size >= 160 && n > 0;
    frame = reinterpret_cast<const u8*>(words);
    // Aligned little-endian fields of the header, from its words.
    auto u32_at = [&](int offset) { return words[offset / 4]; };
    auto u64_at = [&](int offset) { return (u64)words[offset / 4] | ((u64)words[offset / 4 + 1] << 32); };
    if (ok) {
        u32 crc = 0xFFFFFFFFu;
        for (int w = 0; w < 39; w++) {
            crc ^= words[w];
            crc = crc_table[3][crc & 0xFF] ^ crc_table[2][(crc >> 8) & 0xFF] ^ crc_table[1][(crc >> 16) & 0xFF]
                  ^ crc_table[0][crc >> 24];
        }
        ok = (crc ^ 0xFFFFFFFFu) == words[39];
    }
    const u32 header_flags = ok ? frame[10] : 0;
    const bool coded = ok && frame[6] == 1;  // else stored (codec 0): the raw elements follow the header
    const u64 chunk = ok ? u32_at(12) : 0;
    ok = ok && frame[0] == 'K' && frame[1] == 'V' && frame[2] == 'F' && frame[3] == 'Z'
         && le_bytes(frame + 4, 2) == 1 && frame[6] <= 1 && frame[7] == dtype_id && frame[8] <= 8
         && frame[9] == (coded ? C : 0) && (header_flags == 0 || (header_flags == 1 && stream_crc_verified))
         && frame[11] == 0 && u64_at(16) == n
         && (coded ? chunk >= GROUP && chunk % GROUP == 0 && chunk < (1u << 15) : chunk == 0);
    if (ok) {  // the shape: its product is n, unused dimensions are 0, and it is the expected one
        const u64 expected[8] = {s0, s1, s2, s3, s4, s5, s6, s7};
        const u32 ndim = frame[8];
        u64 product = 1;
        for (u32 i = 0; i < 8; i++) {
            const u64 d = u64_at(24 + 8 * i);
            if (i >= ndim) {
                ok = ok && d == 0;
                continue;
            }
            // n > 0: a zero or overflowing dim is wrong (product * d > n, without a division)
            if (d == 0 || __umul64hi(product, d) != 0 || product * d > n) ok = false;
            else product *= d;
            if (expected_ndim < 255) ok = ok && d == expected[i];
        }
        ok = ok && product == n && (expected_ndim == 255 || ndim == expected_ndim);
    }
    if (ok) {  // the codebook: 2^C distinct exponents below 2^E, the rest zero (all zero if stored)
        u32 seen[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (u32 i = 0; i < 16; i++) {
            const u32 e = frame[88 + i];
            if (!coded || i >= (1u << C)) {
                ok = ok && e == 0;
            } else {
                ok = ok && e < (1u << E) && !(seen[e >> 5] & (1u << (e & 31)));
                seen[e >> 5] |= 1u << (e & 31);
            }
        }
    }
    const u64 escapes = ok ? u64_at(104) : 0;
    const u64 nchunks = ok && coded ? (n + chunk - 1) / chunk : 0;
    u64 offsets[5];
    if (ok) {  // stream lengths as the format defines them, offsets, and the frame's size
        u64 lengths[5] = {(n * R + 7) / 8, (n * C + 7) / 8, 2 * nchunks, 2 * escapes, escapes};
        if (!coded) {
            ok = escapes == 0;
            lengths[0] = n * itemsize;
            lengths[1] = 0;
        }
        u64 end = 160, total = 160;
        for (int i = 0; i < 5; i++) {
            ok = ok && u64_at(112 + 8 * i) == lengths[i];
            offsets[i] = (end + 15) & ~15ull;
            end = offsets[i] + lengths[i];
            if (lengths[i]) total = end;
        }
        ok = ok && escapes <= n && nchunks <= max_nchunks && total == frame_size
             && (header_flags || u32_at(152) == 0) && (!coded || whole_chunk_blocks % chunk == 0);
    }
    if (!ok) {
        *flags |= FLAG_HOST;
        return;
    }
    params[P_CHUNK] = chunk;
    params[P_NCHUNKS] = nchunks;
    params[P_ESCAPES] = escapes;
    for (int i = 0; i < 5; i++) params[P_OFFSETS + i] = offsets[i];
    params[P_CODEBOOK] = u64_at(88);
    params[P_CODEBOOK + 1] = u64_at(96);
}

// The escapes of a thread's SCAN_ITEMS consecutive chunks, which lie together from `first`:
// each position inside its chunk (of lens[k] elements) and above the one before it in that
// chunk, each value within E bits. Read in batches whose loads are in flight together: one at a
// time, each a trip to memory, they were the validation kernel's long pole.
#define ESCAPE_BATCH 8
static_assert(SCAN_ITEMS == 4, "validate_escapes reads a thread's four 16-bit counts as one word");
template <int E>
__device__ __forceinline__ u32 check_escapes(const u16* pos_in, const u8* val_in, u64 first,
                                             const u32 (&count)[SCAN_ITEMS], const u32 (&lens)[SCAN_ITEMS]) {
    u32 ends[SCAN_ITEMS], sum = 0;
#pragma unroll
    for (int k = 0; k < SCAN_ITEMS; k++) ends[k] = sum += count[k];
    u32 bad = 0, previous = 0;
    for (u32 t0 = 0; t0 < sum; t0 += ESCAPE_BATCH) {
        u32 p[ESCAPE_BATCH], v[ESCAPE_BATCH];
#pragma unroll
        for (int j = 0; j < ESCAPE_BATCH; j++) {
            p[j] = v[j] = 0;
            if (t0 + j < sum) {
                p[j] = pos_in[first + t0 + j];
                v[j] = val_in[first + t0 + j];
            }
        }
#pragma unroll
        for (int j = 0; j < ESCAPE_BATCH; j++) {
            const u32 t = t0 + j;
            if (t >= sum) break;
            u32 len = 0;
            bool opens = false;  // the first escape of its chunk
#pragma unroll
            for (int k = 0; k < SCAN_ITEMS; k++) {
                const u32 begin = k ? ends[k - 1] : 0;
                if (t >= begin && t < ends[k]) {
                    len = lens[k];
                    opens = t == begin;
                }
            }
            if (p[j] >= len) bad |= 4u;
            if (!opens && p[j] <= previous) bad |= 8u;
            if (v[j] >> E) bad |= 16u;
            previous = p[j];
        }
    }
    return bad;
}

// Decode validation, with the escape offsets: writes inclusive[c] (escapes through chunk c) and
// checks everything the decode kernel indexes by. Sets bits of *flags:
// 1 count > chunk length, 2 counts overrun the escape total, 4 position outside chunk,
// 8 positions not increasing, 16 escape value too wide, 32 counts do not sum to the total,
// 64 a block id outside the cache, 128 a block id repeated (seen: a zeroed bitmap of nblocks bits).
// Blocks take tiles by ticket until none is left, so any grid covers any chunk count.
template <int E>
__global__ void __launch_bounds__(VALIDATE_THREADS)
validate_escapes(const u8* frame, const u64* params, i64* inclusive, u64 n, const i64* block_ids, u64 nids,
                 u64 nblocks, u32* seen, u32* flags, u64* status, u32* ticket) {
    if (*flags & FLAG_HOST) return;  // decode_header ran just before, on the same stream
    const u64 chunk = params[P_CHUNK], nchunks = params[P_NCHUNKS], total = params[P_ESCAPES];
    const FrameStreams in(frame, params);
    const u64 stride = (u64)gridDim.x * VALIDATE_THREADS;
    for (u64 k = (u64)blockIdx.x * VALIDATE_THREADS + threadIdx.x; k < nids; k += stride) {
        u64 id = (u64)block_ids[k];
        if (id >= nblocks) {
            atomicOr(flags, 64u);
        } else if (atomicOr(seen + (id >> 5), 1u << (id & 31)) & (1u << (id & 31))) {
            atomicOr(flags, 128u);
        }
    }
    // Tiles by ticket. A block draws its next ticket as it starts a tile, so that the draw's round
    // trip overlaps the tile's work; a tile drawn ahead still waits only on earlier tiles, each
    // held by a running block.
    __shared__ u32 drawn[2];
    if (threadIdx.x == 0) drawn[0] = atomicAdd(ticket, 1u);
    __syncthreads();
    for (int turn = 0;; turn ^= 1) {
        const u64 tile = drawn[turn];
        if (tile * SCAN_TILE >= nchunks) break;
        if (threadIdx.x == 0) drawn[turn ^ 1] = atomicAdd(ticket, 1u);  // every thread read it last turn
        const u64 first = tile * SCAN_TILE + (u64)threadIdx.x * SCAN_ITEMS;
        u32 count[SCAN_ITEMS], lens[SCAN_ITEMS];
        u64 local = 0;
        if (first + SCAN_ITEMS <= nchunks) {  // the thread's counts in one load (the stream is 16-byte aligned)
            const u64 packed = *reinterpret_cast<const u64*>(in.counts16 + 2 * first);
#pragma unroll
            for (int k = 0; k < SCAN_ITEMS; k++) count[k] = (u32)(packed >> (16 * k)) & 0xFFFFu;
        } else {
#pragma unroll
            for (int k = 0; k < SCAN_ITEMS; k++) {
                const u64 c = first + k;
                count[k] = c < nchunks ? in.counts16[2 * c] | ((u32)in.counts16[2 * c + 1] << 8) : 0;
            }
        }
#pragma unroll
        for (int k = 0; k < SCAN_ITEMS; k++) local += count[k];
        const u64 before = scan_exclusive(local, status, tile);
        u64 end_off = before;
        u32 bad = 0;
#pragma unroll
        for (int k = 0; k < SCAN_ITEMS; k++) {
            const u64 c = first + k;
            lens[k] = 0;
            if (c >= nchunks) continue;
            end_off += count[k];
            inclusive[c] = (i64)end_off;
            lens[k] = (u32)min(chunk, n - c * chunk);
            if (count[k] > lens[k]) bad |= 1u;
            if (end_off > total) bad |= 2u;
            if (c == nchunks - 1 && end_off != total) bad |= 32u;
        }
        if (!(bad & 3u)) bad |= check_escapes<E>(in.pos, in.val, before, count, lens);  // in bounds: no 2
        if (bad) atomicOr(flags, bad);
        __syncthreads();  // the next ticket is visible to every thread
    }
}

// One group back from its residual bits and codes.
template <int TOTAL, int E, int C>
__device__ __forceinline__ void decode_group(u64 rlo, u64 rhi, u32 codes, const u32* table, const u32 (&book)[4],
                                             u32 (&w)[Elem<TOTAL>::WORDS]) {
    constexpr int M = TOTAL - 1 - E;
    constexpr int R = TOTAL - E;
    constexpr u32 SIZE = 1u << C;
    if constexpr (TOTAL == 16 && E == 8 && C == 4) {
        // bfloat16: the 16-byte codebook sits in four registers; prmt looks up four codes at
        // once (bit 3 of each code picks the upper eight entries), then the bytes interleave.
#pragma unroll
        for (int half = 0; half < 2; half++) {
            u32 c4 = (codes >> (16 * half)) & 0xFFFF;
            u32 sel = c4 & 0x7777;
            u32 lo = __byte_perm(book[0], book[1], sel), hi = __byte_perm(book[2], book[3], sel);
            u32 e = __byte_perm(lo, hi, 0x3210 | ((c4 >> 1) & 0x4444));
            u32 r = (u32)(rlo >> (32 * half));
            u32 hb = (r & 0x80808080u) | ((e >> 1) & 0x7F7F7F7Fu);
            u32 lb = ((e << 7) & 0x80808080u) | (r & 0x7F7F7F7Fu);
            w[2 * half] = __byte_perm(lb, hb, 0x5140);
            w[2 * half + 1] = __byte_perm(lb, hb, 0x7362);
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < Elem<TOTAL>::WORDS; k++) w[k] = 0;
#pragma unroll
    for (int j = 0; j < GROUP; j++) {
        int s = R * j;
        u64 r;
        if (s + R <= 64) r = rlo >> s;
        else if (s < 64) r = (rlo >> s) | (rhi << (64 - s));
        else r = rhi >> (s - 64);
        u32 res = (u32)r & ((1u << R) - 1);
        u32 e = table[(codes >> (C * j)) & (SIZE - 1)];
        u32 bits = ((res >> M) << (TOTAL - 1)) | (e << M) | (res & ((1u << M) - 1));
        w[j * TOTAL / 32] |= bits << ((j * TOTAL) % 32);
    }
}

// The chunk's escapes overwrite the exponents its dense pass wrote (escape streams validated).
template <int TOTAL, int E, typename Addr>
__device__ __forceinline__ void patch_escapes(const Addr& at, u64 start, u32 count, u64 end_off,
                                              const u16* pos_in, const u8* val_in, int sublane, u32 mask) {
    constexpr int M = TOTAL - 1 - E;
    constexpr u32 EMASK = ((1u << E) - 1) << M;
    typedef typename Elem<TOTAL>::T T;
    __syncwarp(mask);  // the chunk's dense writes are visible to the whole subgroup
    const u64 off = end_off - count;
    for (u32 t = sublane; t < count; t += LANES) {
        T* p = at(start + pos_in[off + t]);
        *p = (T)((*p & ~EMASK) | ((u32)val_in[off + t] << M));
    }
}

// Decode of chunk c: dense table lookup for every element, then the escapes.
template <int TOTAL, int E, int C>
__device__ __forceinline__ void decode_chunk(u64 c, const u8* residual_in, const u8* codes_in, const u8* counts16,
                                             const i64* inclusive, const u16* pos_in, const u8* val_in, u64 n,
                                             u32 chunk, u8* out, const i64* block_ids, u64 block_elems,
                                             const u32* table, const u32 (&book)[4], int sublane, u32 mask) {
    constexpr int R = TOTAL - E;
    constexpr int WORDS = Elem<TOTAL>::WORDS;
    u64 start = c * chunk;
    u64 end = min(start + chunk, n);
    const ChunkAddr<TOTAL> at(out, block_ids, block_elems, start, chunk);
    // Loaded up front, with the streams, so the escape check does not wait on memory.
    u32 count = counts16[2 * c] | ((u32)counts16[2 * c + 1] << 8);
    for (u64 seg = start; seg < end; seg += SPAN) {
        u64 rlo[UNROLL], rhi[UNROLL], clo[UNROLL];
        int valid[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            u64 i = seg + ((u64)k * LANES + sublane) * GROUP;
            valid[k] = i < end ? (int)min((u64)GROUP, end - i) : 0;
            u64 g = i / GROUP, unused;
            rlo[k] = rhi[k] = clo[k] = 0;
            if (valid[k]) {
                load_bits<R>(residual_in + g * R, (valid[k] * R + 7) / 8, rlo[k], rhi[k]);
                load_bits<C>(codes_in + g * C, (valid[k] * C + 7) / 8, clo[k], unused);
            }
        }
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            if (!valid[k]) continue;
            u64 i = seg + ((u64)k * LANES + sublane) * GROUP;
            u32 w[WORDS];
            decode_group<TOTAL, E, C>(rlo[k], rhi[k], (u32)clo[k], table, book, w);
            store_group<TOTAL>(at(i), valid[k], w);
        }
    }
    if (count) patch_escapes<TOTAL, E>(at, start, count, (u64)inclusive[c], pos_in, val_in, sublane, mask);
}

// The codebook in shared memory (generic path) and packed into four registers (bfloat16 path).
template <int C>
__device__ __forceinline__ void load_codebook(const u8* codebook, u32* table, u32 (&book)[4]) {
    constexpr u32 SIZE = 1u << C;
    if (threadIdx.x < SIZE) table[threadIdx.x] = codebook[threadIdx.x];
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 4; k++) {
        book[k] = 0;
        for (int j = 0; j < 4 && 4 * k + j < (int)SIZE; j++) book[k] |= (table[4 * k + j] & 0xFF) << (8 * j);
    }
}

// A stored frame (decode_header put chunk 0 in params): the raw elements follow the header.
template <int TOTAL>
__device__ __forceinline__ void copy_stored(const u8* frame, u64 n, u8* out, const i64* block_ids, u64 block_elems) {
    const u64 stride = (u64)gridDim.x * THREADS;
    for (u64 g = (u64)blockIdx.x * THREADS + threadIdx.x; g * GROUP < n; g += stride) {
        const u64 i = g * GROUP;
        const int valid = (int)min((u64)GROUP, n - i);
        u32 w[Elem<TOTAL>::WORDS];
        load_group<TOTAL>(reinterpret_cast<const typename Elem<TOTAL>::T*>(frame + 160) + i, valid, w);
        store_group<TOTAL>(elem_ptr<TOTAL>(out, block_ids, block_elems, i), valid, w);
    }
}

// Decode: every chunk through decode_chunk. Escape streams were validated first (a bad frame
// sets *flags and nothing is written), so every write is in bounds.
template <int TOTAL, int E, int C>
__global__ void __launch_bounds__(THREADS, MINB)
decode_chunks(const u8* frame, const u64* params, const i64* inclusive, u64 n, u8* out, const i64* block_ids,
              u64 block_elems, const u32* flags) {
    // decode_header and validate_escapes ran just before on the same stream: a bad frame
    // writes nothing.
    if (*flags) return;
    const u32 chunk = (u32)params[P_CHUNK];
    if (chunk == 0) {
        copy_stored<TOTAL>(frame, n, out, block_ids, block_elems);
        return;
    }
    const u64 nchunks = params[P_NCHUNKS];
    const FrameStreams in(frame, params);
    const u8* codebook = reinterpret_cast<const u8*>(params + P_CODEBOOK);
    __shared__ u32 table[1u << C];
    u32 book[4];
    load_codebook<C>(codebook, table, book);
    const int sublane = threadIdx.x % LANES;
    const u32 mask = subgroup_mask();
    const u64 nsub = (u64)gridDim.x * SUBGROUPS;
    for (u64 c = (u64)blockIdx.x * SUBGROUPS + threadIdx.x / LANES; c < nchunks; c += nsub)
        decode_chunk<TOTAL, E, C>(c, in.residual, in.codes, in.counts16, inclusive, in.pos, in.val, n, chunk, out,
                                  block_ids, block_elems, table, book, sublane, mask);
}

// ---- The common case, lean ----
// Most calls encode whole chunks of whole passes (chunk % SPAN == 0) from vector-aligned
// elements and decode into vector-aligned memory, every chunk inside one cache block. For
// those, encode_lean and decode_lean address a chunk through one pointer and 32-bit offsets,
// without the per-group checks of encode_dense and decode_chunks: 60% of their instructions
// (the general kernels ran at ~70% of DRAM bandwidth, issue- and latency-bound, by Nsight
// Compute). With a queued grid (CHUNKS_PER_WARP) they run at the speed of a kernel that only
// moves the same bytes. The host picks the kernel; both write the same bytes. Capped at 64
// registers: lower caps spill.
#ifndef ENC_LEAN_MINB
#define ENC_LEAN_MINB 8
#endif
#ifndef DEC_LEAN_MINB
#define DEC_LEAN_MINB 8
#endif

// The chunk's first element, flat or inside its block (the chunk lies in one block); nullptr
// when the block id lies outside the cache.
template <typename T>
__device__ __forceinline__ T* chunk_start(T* base, const i64* block_ids, u64 block_elems, u64 nblocks, u64 start) {
    if (block_ids == nullptr) return base + start;
    const u64 b = block_of(start, block_elems);
    const u64 id = (u64)block_ids[b];
    return id < nblocks ? base + id * block_elems + (start - b * block_elems) : nullptr;
}

// Element index -> address inside one chunk that starts at `first`.
template <typename T>
struct InChunk {
    T* first;
    u64 start;
    __device__ __forceinline__ T* operator()(u64 i) const { return first + (i - start); }
};

// Encode streams whose groups are not whole words (float16 residuals: 11 bytes a group; float8:
// 3) pass through shared memory in encode_lean. Written to global memory a byte at a time, each
// byte was a partial store (float16 encode ran at 530 GB/s, 1520 staged); a subgroup now moves
// its pass's bytes (LANES * UNROLL groups) with 16-byte stores. Decode reads such streams a
// byte at a time still: L1 merges the loads, and staging them measured slower.
template <int K>
struct Staged { enum { value = K % 4 != 0, BYTES = K % 4 != 0 ? LANES * UNROLL * K : 0 }; };

// The K bytes of a group (little-endian lo, hi) into the stage.
template <int K>
__device__ __forceinline__ void stage_bits(u8* p, u64 lo, u64 hi) {
#pragma unroll
    for (int j = 0; j < K; j++) p[j] = (u8)(j < 8 ? lo >> (8 * j) : hi >> (8 * (j - 8)));
}

// A full pass's staged bytes to `out` (16-byte aligned: a pass is 128 * K bytes).
template <int K>
__device__ __forceinline__ void flush_stage(const u8* stage, u8* out, int sublane, u32 mask) {
    __syncwarp(mask);
    for (int i = sublane; i < Staged<K>::BYTES / 16; i += LANES)
        store_streamed(reinterpret_cast<uint4*>(out) + i, reinterpret_cast<const uint4*>(stage)[i]);
    __syncwarp(mask);
}

// encode_dense for whole chunks (chunk % SPAN == 0) of 16-byte aligned elements, each inside
// one block; same outputs.
template <int TOTAL, int E, int C>
__global__ void __launch_bounds__(THREADS, ENC_LEAN_MINB)
encode_lean(const u8* x, const i64* block_ids, u64 block_elems, u64 nblocks, u64 n, u32 chunk, u64 nchunks,
            const u8* marked_table, u8* residual_out, u8* codes_out, u8* counts16_out, i64* counts_out,
            u16* spill_pos, u8* spill_val, u32 spill_cap) {
    constexpr int R = TOTAL - E;
    constexpr int WORDS = Elem<TOTAL>::WORDS;
    constexpr int W = Width<TOTAL, E, C>::W;
    typedef typename Elem<TOTAL>::T T;
    typedef typename Elem<TOTAL>::Vec V;
    __shared__ u8 table[1 << E];
    __shared__ __align__(16) u8 stages[SUBGROUPS][Staged<R>::BYTES + Staged<C>::BYTES + 16];
    for (int t = threadIdx.x; t < (1 << E); t += THREADS) table[t] = marked_table[t];
    __syncthreads();
    const int sublane = threadIdx.x % LANES;
    const u32 mask = subgroup_mask();
    u8* stage_r = stages[threadIdx.x / LANES];
    u8* stage_c = stage_r + Staged<R>::BYTES;
    const u64 nsub = (u64)gridDim.x * SUBGROUPS;
    for (u64 c = (u64)blockIdx.x * SUBGROUPS + threadIdx.x / LANES; c < nchunks; c += nsub) {
        const u64 start = c * chunk;
        const T* src = chunk_start(reinterpret_cast<const T*>(x), block_ids, block_elems, nblocks, start);
        if (src == nullptr) {  // as encode_dense: the escape total turns negative
            if (sublane == 0) counts_out[c] = -(i64)(n + 1);
            continue;
        }
        u8* residual = residual_out + start / GROUP * R;
        u8* codes_at = codes_out + start / GROUP * C;
        u32 running = 0;
        for (u32 seg = 0; seg < chunk; seg += SPAN) {
            u32 w[UNROLL][WORDS];
#pragma unroll
            for (int k = 0; k < UNROLL; k++) {
                const V v = load_streamed(reinterpret_cast<const V*>(src + group_index<W>(seg, k, sublane)));
                const u32* vw = reinterpret_cast<const u32*>(&v);
#pragma unroll
                for (int j = 0; j < WORDS; j++) w[k][j] = vw[j];
            }
#pragma unroll
            for (int k = 0; k < UNROLL; k += W) {
                u64 rlo[W], rhi[W];
                u32 codes[W], escmask[W], exps[W][2];
                u32 mine = 0;
#pragma unroll
                for (int v = 0; v < W; v++) {
                    encode_group<TOTAL, E, C>(w[k + v], GROUP, table, rlo[v], rhi[v], codes[v], escmask[v], exps[v]);
                    mine += __popc(escmask[v]);
                }
                const u32 g0 = group_index<W>(seg, k, sublane) / GROUP;  // group within the chunk
                if constexpr (W == 2) {
                    store_streamed(reinterpret_cast<uint4*>(residual + g0 * R),
                                   make_uint4((u32)rlo[0], (u32)(rlo[0] >> 32), (u32)rlo[1], (u32)(rlo[1] >> 32)));
                    store_streamed(reinterpret_cast<uint2*>(codes_at + g0 * C), make_uint2(codes[0], codes[1]));
                } else {
#pragma unroll
                    for (int v = 0; v < W; v++) {
                        const u32 in_pass = g0 + v - seg / GROUP;
                        if constexpr (Staged<R>::value) stage_bits<R>(stage_r + in_pass * R, rlo[v], rhi[v]);
                        else store_bits<R>(residual + (g0 + v) * R, rlo[v], rhi[v], R);
                        if constexpr (Staged<C>::value) stage_bits<C>(stage_c + in_pass * C, codes[v], 0);
                        else store_bits<C>(codes_at + (g0 + v) * C, codes[v], 0, C);
                    }
                }
                const u32 total = __reduce_add_sync(mask, mine);
                if (total) {  // rare: order this step's escapes across the subgroup
                    const u32 incl = subgroup_inclusive_scan(mine, sublane, mask);
                    u64 slot = c * spill_cap + running + incl - mine;
                    const u64 spill_end = (c + 1) * spill_cap;
#pragma unroll
                    for (int v = 0; v < W; v++) {
#pragma unroll
                        for (int j = 0; j < GROUP; j++) {
                            if (escmask[v] & (1u << j)) {
                                if (slot < spill_end) {
                                    spill_pos[slot] = (u16)((g0 + v) * GROUP + j);
                                    spill_val[slot] = (u8)(exps[v][j >> 2] >> (8 * (j & 3)));
                                }
                                slot++;
                            }
                        }
                    }
                }
                running += total;
            }
            if constexpr (Staged<R>::value) flush_stage<R>(stage_r, residual + seg / GROUP * R, sublane, mask);
            if constexpr (Staged<C>::value) flush_stage<C>(stage_c, codes_at + seg / GROUP * C, sublane, mask);
        }
        if (sublane == 0) {
            counts16_out[2 * c] = (u8)running;
            counts16_out[2 * c + 1] = (u8)(running >> 8);
            counts_out[c] = running;
        }
    }
}

// The rare steps of decode_lean, out of line: inlined, they raised the whole kernel's register
// count (and so lowered its occupancy) by a third.
template <int TOTAL, int E, int C>
__device__ __noinline__ void decode_partial_group(const u8* residual, const u8* codes_at, int valid, const u32* table,
                                                  const u32 (&book)[4], typename Elem<TOTAL>::T* dst) {
    constexpr int R = TOTAL - E;
    u64 lo, hi, codes, unused;
    load_bits<R>(residual, (valid * R + 7) / 8, lo, hi);
    load_bits<C>(codes_at, (valid * C + 7) / 8, codes, unused);
    u32 w[Elem<TOTAL>::WORDS];
    decode_group<TOTAL, E, C>(lo, hi, (u32)codes, table, book, w);
    store_group<TOTAL>(dst, valid, w);
}

template <int TOTAL, int E>
__device__ __noinline__ void lean_patch_escapes(typename Elem<TOTAL>::T* dst, u32 count, u64 end_off,
                                                const u16* pos_in, const u8* val_in, int sublane, u32 mask) {
    patch_escapes<TOTAL, E>(InChunk<typename Elem<TOTAL>::T>{dst, 0}, 0, count, end_off, pos_in, val_in, sublane, mask);
}

// decode_chunks into vector-aligned memory, every chunk inside one block (decode_header
// declines other frames for this kernel); any chunk size, a partial last group included.
template <int TOTAL, int E, int C>
__global__ void __launch_bounds__(THREADS, DEC_LEAN_MINB)
decode_lean(const u8* frame, const u64* params, const i64* inclusive, u64 n, u8* out, const i64* block_ids,
            u64 block_elems, const u32* flags) {
    constexpr int R = TOTAL - E;
    constexpr int WORDS = Elem<TOTAL>::WORDS;
    constexpr int STEP = LANES * UNROLL;  // groups per pass
    typedef typename Elem<TOTAL>::T T;
    typedef typename Elem<TOTAL>::Vec V;
    if (*flags) return;  // decode_header and validate_escapes ran just before: a bad frame writes nothing
    const u32 chunk = (u32)params[P_CHUNK];
    if (chunk == 0) {
        copy_stored<TOTAL>(frame, n, out, block_ids, block_elems);
        return;
    }
    const u64 nchunks = params[P_NCHUNKS];
    const FrameStreams in(frame, params);
    __shared__ u32 table[1u << C];
    u32 book[4];
    load_codebook<C>(reinterpret_cast<const u8*>(params + P_CODEBOOK), table, book);
    const int sublane = threadIdx.x % LANES;
    const u32 mask = subgroup_mask();
    const u64 nsub = (u64)gridDim.x * SUBGROUPS;
    for (u64 c = (u64)blockIdx.x * SUBGROUPS + threadIdx.x / LANES; c < nchunks; c += nsub) {
        const u64 start = c * chunk;
        const u32 len = (u32)min((u64)chunk, n - start);
        T* dst = chunk_start(reinterpret_cast<T*>(out), block_ids, block_elems, ~0ull, start);  // ids validated
        const u8* residual = in.residual + start / GROUP * R;
        const u8* codes_at = in.codes + start / GROUP * C;
        const u32 count = in.counts16[2 * c] | ((u32)in.counts16[2 * c + 1] << 8);
        const u32 groups = len / GROUP;
        for (u32 seg = 0; seg < groups; seg += STEP) {
            u64 rlo[UNROLL], rhi[UNROLL];
            u32 clo[UNROLL];
#pragma unroll
            for (int k = 0; k < UNROLL; k++) {
                const u32 g = seg + k * LANES + sublane;
                u64 lo = 0, unused;
                if (g < groups) {  // byte loads where groups are not whole words: L1 merges them
                    load_bits<R>(residual + g * R, R, rlo[k], rhi[k]);
                    load_bits<C>(codes_at + g * C, C, lo, unused);
                }
                clo[k] = (u32)lo;
            }
#pragma unroll
            for (int k = 0; k < UNROLL; k++) {
                const u32 g = seg + k * LANES + sublane;
                if (g < groups) {
                    u32 w[WORDS];
                    decode_group<TOTAL, E, C>(rlo[k], rhi[k], clo[k], table, book, w);
                    V v;
                    u32* vw = reinterpret_cast<u32*>(&v);
#pragma unroll
                    for (int j = 0; j < WORDS; j++) vw[j] = w[j];
                    store_streamed(reinterpret_cast<V*>(dst + g * GROUP), v);
                }
            }
        }
        if (len % GROUP && sublane == 0)  // the frame's last elements, fewer than a group
            decode_partial_group<TOTAL, E, C>(residual + groups * R, codes_at + groups * C, len % GROUP, table, book,
                                              dst + groups * GROUP);
        if (count) lean_patch_escapes<TOTAL, E>(dst, count, (u64)inclusive[c], in.pos, in.val, sublane, mask);
    }
}

// Encode's escape counts summed per tile of SCAN_THREADS chunks, a block per tile, so that the
// tail pass finds every chunk's offset without a scan. A pass of its own: atomics in the dense
// pass needed the sums zeroed first, a call the host made before the dense pass could start.
__global__ void __launch_bounds__(SCAN_THREADS)
sum_tiles(const i64* counts, u64 nchunks, i64* tile_sums) {
    __shared__ i64 warp_sums[SCAN_THREADS / 32];
    const u64 c = (u64)blockIdx.x * SCAN_THREADS + threadIdx.x;
    i64 sum = c < nchunks ? counts[c] : 0;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sum;
    __syncthreads();
    if (threadIdx.x >= 32) return;
    sum = warp_sums[threadIdx.x];
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
    if (threadIdx.x == 0) tile_sums[blockIdx.x] = sum;
}

// The end of encode, on the device, so the host need not learn the escape total X before the
// frame is complete. A block per tile of SCAN_THREADS chunks, a thread per chunk:
//  - warp 0 adds up sum_tiles' tile sums: X, and the escapes before this tile (a negative
//    X means bad block ids: nothing is written and the length is -1); a block scan adds the
//    escapes before each chunk within the tile;
//  - the value stream's offset, align16(pos_off + 2X), follows from X;
//  - if the coded frame is smaller than a stored one, each thread copies its chunk's spilled
//    escapes to their place (or, for a chunk with more than spill_cap, finds them again in the
//    source: marked_table marks an escaping exponent with `mark`) and block 0 zeroes the
//    (< 16-byte) padding gaps before streams;
//  - otherwise the raw elements are copied after the header (over the dense streams);
//  - block 0 picks the coded or stored header template (built by the host with X = 0), patches
//    X, the escape-stream lengths and the header CRC32C, and writes the frame's length.
// Two blocks per SM (32 registers): a tile per block, all in one wave for 256M elements.
#define TAIL_BATCH 4  // fewer than ESCAPE_BATCH: 32 registers

// The escapes of the `len` elements from `start`, found in the source (out of line: the tail's
// common path keeps its registers).
template <int TOTAL>
__device__ __noinline__ void find_escapes_again(const u8* x, const i64* block_ids, u64 block_elems, u64 start, u32 len,
                                                const u8* marked_table, u32 exp_bits, u32 mark, u16* pos_out,
                                                u8* val_out) {
    const u32 shift = TOTAL - 1 - exp_bits;
    u32 k = 0;
    for (u32 i = 0; i < len; i++) {
        const u32 bits = *elem_ptr<TOTAL>(const_cast<u8*>(x), block_ids, block_elems, start + i);
        const u32 e = (bits >> shift) & ((1u << exp_bits) - 1);
        if (marked_table[e] == mark) {
            pos_out[k] = (u16)i;
            val_out[k] = (u8)e;
            k++;
        }
    }
}
template <int TOTAL>
__global__ void __launch_bounds__(SCAN_THREADS, 2)
encode_tail(const i64* counts, const i64* tile_sums, u64 ntiles, u64 nchunks, u32 chunk, const u16* spill_pos,
            const u8* spill_val, u32 spill_cap, const u8* marked_table, u32 exp_bits, u32 mark, u8* x,
            const i64* block_ids, u64 block_elems, u64 n, u8* frame, u64 counts_end, u64 pos_off, u64 stored_total,
            u64 gap0, u64 gap1, const u8* templates, i64* length_out) {
    __shared__ u8 head[160];
    __shared__ i64 sums[2];  // escapes before this tile, and in all tiles
    const u32 t = threadIdx.x;
    const u64 tile = blockIdx.x;
    if (t < 32) {
        i64 before = 0, all = 0;
        for (u64 j = t; j < ntiles; j += 32) {
            const i64 v = tile_sums[j];
            all += v;
            if (j < tile) before += v;
        }
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) {
            before += __shfl_xor_sync(0xffffffffu, before, d);
            all += __shfl_xor_sync(0xffffffffu, all, d);
        }
        if (t == 0) {
            sums[0] = before;
            sums[1] = all;
        }
    }
    __syncthreads();
    if (sums[1] < 0) {  // encode_dense found a block id outside the cache
        if (blockIdx.x == 0 && t == 0) *length_out = -1;
        return;
    }
    const u64 escapes = (u64)sums[1];
    const u64 c = tile * SCAN_THREADS + t;
    const u32 count = c < nchunks ? (u32)counts[c] : 0;
    u64 tile_total;
    const u64 off = (u64)sums[0] + block_exclusive_sum<SCAN_THREADS>(count, tile_total);
    const u64 pos_end = pos_off + 2 * escapes;
    const u64 val_off = (pos_end + 15) & ~15ull;
    const u64 coded_total = escapes ? val_off + escapes : counts_end;
    const bool coded = coded_total < stored_total;

    if (blockIdx.x == 0) {
        __shared__ u32 crc_change;
        for (u32 b = t; b < 160; b += SCAN_THREADS) head[b] = templates[(coded ? 0 : 160) + b];
        if (coded && t < 64) {
            u32 lane = t & 15, which = t >> 4;
            u64 s = which == 0 ? gap0 : which == 1 ? gap1 : escapes == 0 ? 0 : which == 2 ? counts_end : pos_end;
            if (s && s + lane < ((s + 15) & ~15ull)) frame[s + lane] = 0;
        }
        if (t < 32) {
            // CRC32C is affine: patching X into the coded template (whose CRC is for X = 0)
            // changes the CRC by the XOR of a precomputed word per set bit of X.
            const u32* crc_deltas = reinterpret_cast<const u32*>(templates + 320);
            u32 change = 0;
            if (coded && ((escapes >> t) & 1)) change ^= crc_deltas[t];
            if (coded && ((escapes >> (t + 32)) & 1)) change ^= crc_deltas[t + 32];
#pragma unroll
            for (int d = 16; d > 0; d >>= 1) change ^= __shfl_xor_sync(0xffffffffu, change, d);
            if (t == 0) crc_change = change;
        }
        __syncthreads();
        if (t == 0) {
            if (coded) {
                for (int b = 0; b < 8; b++) {
                    head[104 + b] = (u8)(escapes >> (8 * b));
                    head[136 + b] = (u8)((2 * escapes) >> (8 * b));
                    head[144 + b] = (u8)(escapes >> (8 * b));
                }
                for (int b = 0; b < 4; b++) head[156 + b] ^= (u8)(crc_change >> (8 * b));
            }
            *length_out = (i64)(coded ? coded_total : stored_total);
        }
        __syncthreads();
        for (u32 b = t; b < 160; b += SCAN_THREADS) frame[b] = head[b];
    }

    if (coded) {
        u16* pos_out = reinterpret_cast<u16*>(frame + pos_off);
        u8* val_out = frame + val_off;
        const u64 src = c * spill_cap;
        if (count > spill_cap)  // rare: more than the spill holds
            find_escapes_again<TOTAL>(x, block_ids, block_elems, c * chunk, (u32)min((u64)chunk, n - c * chunk),
                                      marked_table, exp_bits, mark, pos_out + off, val_out + off);
        for (u32 k0 = 0; k0 < (count > spill_cap ? 0 : count); k0 += TAIL_BATCH) {  // loads in flight together
            u16 p[TAIL_BATCH];
            u8 v[TAIL_BATCH];
#pragma unroll
            for (int j = 0; j < TAIL_BATCH; j++) {
                if (k0 + j < count) {
                    p[j] = spill_pos[src + k0 + j];
                    v[j] = spill_val[src + k0 + j];
                }
            }
#pragma unroll
            for (int j = 0; j < TAIL_BATCH; j++) {
                if (k0 + j < count) {
                    pos_out[off + k0 + j] = p[j];
                    val_out[off + k0 + j] = v[j];
                }
            }
        }
    } else {
        const u64 stride = (u64)gridDim.x * SCAN_THREADS;
        for (u64 g = tile * SCAN_THREADS + t; g * GROUP < n; g += stride) {
            u64 i = g * GROUP;
            int valid = (int)min((u64)GROUP, n - i);
            u32 w[Elem<TOTAL>::WORDS];
            load_group<TOTAL>(elem_ptr<TOTAL>(x, block_ids, block_elems, i), valid, w);
            store_group<TOTAL>(reinterpret_cast<typename Elem<TOTAL>::T*>(frame + 160) + i, valid, w);
        }
    }
}
