// SplitZip kernels (format v1, see FORMAT.md). Compiled at run time by NVRTC through CuPy.
//
// Every thread handles a *group* of 8 elements: 8 elements of R residual bits fill exactly R
// bytes and 8 codes of C bits exactly C bytes, so groups never share an output byte. A block
// owns whole chunks (chunk % 8 == 0), which keeps escape counting and ordering inside the block:
// no atomics, and escapes come out in element order, as the format requires.
//
// Template parameters: TOTAL (element bits, 16 or 8), E (exponent bits), C (code bits).
// Elements are read either from a flat tensor or, for the paged-KV API, from whole blocks of
// `block_elems` elements picked by `block_ids` out of a cache (block_ids == nullptr: flat).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define THREADS 128
#define GROUP 8
#define SEGMENT (THREADS * GROUP)

template <int TOTAL>
struct Elem;
template <>
struct Elem<16> { typedef u16 T; typedef uint4 Vec; };
template <>
struct Elem<8> { typedef u8 T; typedef uint2 Vec; };

// Element index -> byte address, flat or through the block table.
template <int TOTAL>
__device__ __forceinline__ typename Elem<TOTAL>::T* elem_ptr(u8* base, const i64* block_ids,
                                                           u64 block_elems, u64 i) {
    typedef typename Elem<TOTAL>::T T;
    if (block_ids == nullptr) return reinterpret_cast<T*>(base) + i;
    u64 b = i / block_elems;
    return reinterpret_cast<T*>(base) + (u64)block_ids[b] * block_elems + (i - b * block_elems);
}

// Load 8 elements starting at element i (zero beyond `valid`).
template <int TOTAL>
__device__ __forceinline__ void load_group(u8* base, const i64* ids, u64 block_elems, u64 i,
                                           int valid, u32 (&bits)[GROUP]) {
    typedef typename Elem<TOTAL>::T T;
    typedef typename Elem<TOTAL>::Vec V;
    T* p = elem_ptr<TOTAL>(base, ids, block_elems, i);
    if (valid == GROUP && (reinterpret_cast<u64>(p) % sizeof(V)) == 0) {
        V v = *reinterpret_cast<const V*>(p);
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int j = 0; j < GROUP; j++) bits[j] = e[j];
    } else {
#pragma unroll
        for (int j = 0; j < GROUP; j++) bits[j] = j < valid ? (u32)p[j] : 0u;
    }
}

template <int TOTAL>
__device__ __forceinline__ void store_group(u8* base, const i64* ids, u64 block_elems, u64 i,
                                            int valid, const u32 (&bits)[GROUP]) {
    typedef typename Elem<TOTAL>::T T;
    typedef typename Elem<TOTAL>::Vec V;
    T* p = elem_ptr<TOTAL>(base, ids, block_elems, i);
    if (valid == GROUP && (reinterpret_cast<u64>(p) % sizeof(V)) == 0) {
        V v;
        T* e = reinterpret_cast<T*>(&v);
#pragma unroll
        for (int j = 0; j < GROUP; j++) e[j] = (T)bits[j];
        *reinterpret_cast<V*>(p) = v;
    } else {
        for (int j = 0; j < valid; j++) p[j] = (T)bits[j];
    }
}

// Write the first `nbytes` bytes of a little-endian 128-bit value (lo, hi) at p.
template <int K>
__device__ __forceinline__ void store_bits(u8* p, u64 lo, u64 hi, int nbytes) {
    if (K == 8 && nbytes == 8) { *reinterpret_cast<u64*>(p) = lo; return; }
    if (K == 4 && nbytes == 4) { *reinterpret_cast<u32*>(p) = (u32)lo; return; }
    for (int j = 0; j < nbytes; j++) p[j] = (u8)(j < 8 ? lo >> (8 * j) : hi >> (8 * (j - 8)));
}

template <int K>
__device__ __forceinline__ void load_bits(const u8* p, u64& lo, u64& hi) {
    if (K == 8) { lo = *reinterpret_cast<const u64*>(p); hi = 0; return; }
    if (K == 4) { lo = *reinterpret_cast<const u32*>(p); hi = 0; return; }
    lo = 0; hi = 0;
    for (int j = 0; j < K; j++) {
        u64 b = p[j];
        if (j < 8) lo |= b << (8 * j); else hi |= b << (8 * (j - 8));
    }
}

// Exclusive prefix sum over the block; returns the block total through `total`.
__device__ __forceinline__ u32 block_exclusive_scan(u32 v, u32& total) {
    __shared__ u32 warp_sums[THREADS / 32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 x = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        u32 y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    u32 before = 0;
    total = 0;
#pragma unroll
    for (int w = 0; w < THREADS / 32; w++) {
        u32 s = warp_sums[w];
        if (w < warp) before += s;
        total += s;
    }
    __syncthreads();  // warp_sums is reused by the next call
    return before + x - v;
}

// Dense pass: residual and code streams, per-chunk escape counts, and each chunk's escapes
// spilled in order to spill_pos/spill_val at the chunk's first element index.
template <int TOTAL, int E, int C>
__global__ void __launch_bounds__(THREADS)
encode_dense(u8* x, const i64* block_ids, u64 block_elems, u64 n, u32 chunk, u64 nchunks,
             const u8* marked_table, u8* residual_out, u8* codes_out, u8* counts16_out,
             u32* counts32_out, u16* spill_pos, u8* spill_val) {
    constexpr int M = TOTAL - 1 - E;
    constexpr int R = TOTAL - E;
    constexpr u32 SIZE = 1u << C;
    __shared__ u8 table[1 << E];
    for (int t = threadIdx.x; t < (1 << E); t += THREADS) table[t] = marked_table[t];
    __syncthreads();

    for (u64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        u64 start = c * chunk;
        u64 end = min(start + chunk, n);
        u32 running = 0;
        for (u64 seg = start; seg < end; seg += SEGMENT) {
            u64 i = seg + (u64)threadIdx.x * GROUP;
            int valid = i < end ? (int)min((u64)GROUP, end - i) : 0;
            u32 bits[GROUP];
            u64 rlo = 0, rhi = 0, codes = 0;
            u32 escmask = 0;
            u8 exps[GROUP];
            if (valid) load_group<TOTAL>(x, block_ids, block_elems, i, valid, bits);
#pragma unroll
            for (int j = 0; j < GROUP; j++) {
                u32 b = valid ? bits[j] : 0u;
                u32 e = (b >> M) & ((1u << E) - 1);
                u64 r = (((b >> (TOTAL - 1)) & 1u) << M) | (b & ((1u << M) - 1));
                u32 m = table[e];
                bool in = j < valid;
                exps[j] = (u8)e;
                if (in && m == SIZE) escmask |= 1u << j;
                codes |= (u64)(in ? (m & (SIZE - 1)) : 0u) << (C * j);
                int s = R * j;
                if (s < 64) {
                    rlo |= r << s;
                    if (s + R > 64) rhi |= r >> (64 - s);
                } else {
                    rhi |= r << (s - 64);
                }
            }
            if (valid) {
                u64 g = i / GROUP;
                store_bits<R>(residual_out + g * R, rlo, rhi, (valid * R + 7) / 8);
                store_bits<C>(codes_out + g * C, codes, 0, (valid * C + 7) / 8);
            }
            u32 total;
            u32 mine = __popc(escmask);
            u32 before = block_exclusive_scan(mine, total);
            if (mine) {
                u64 slot = start + running + before;
                for (int j = 0; j < GROUP; j++) {
                    if (escmask & (1u << j)) {
                        spill_pos[slot] = (u16)(i + j - start);
                        spill_val[slot] = exps[j];
                        slot++;
                    }
                }
            }
            running += total;
        }
        if (threadIdx.x == 0) {
            counts16_out[2 * c] = (u8)running;
            counts16_out[2 * c + 1] = (u8)(running >> 8);
            counts32_out[c] = running;
        }
    }
}

// Escape compaction: copy each chunk's spilled escapes to their place in the frame.
extern "C" __global__ void __launch_bounds__(THREADS)
gather_escapes(const u32* counts32, const i64* inclusive, u64 nchunks, u32 chunk,
               const u16* spill_pos, const u8* spill_val, u16* pos_out, u8* val_out) {
    for (u64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        u32 count = counts32[c];
        if (count == 0) continue;
        u64 off = (u64)inclusive[c] - count;
        u64 src = c * chunk;
        for (u32 t = threadIdx.x; t < count; t += THREADS) {
            pos_out[off + t] = spill_pos[src + t];
            val_out[off + t] = spill_val[src + t];
        }
    }
}

// Decode validation: everything the decode kernel indexes by. Sets bits of *flags:
// 1 count > chunk length, 2 counts overrun the escape total, 4 position outside chunk,
// 8 positions not increasing, 16 escape value too wide, 32 counts do not sum to the total.
template <int E>
__global__ void __launch_bounds__(THREADS)
validate_escapes(const u8* counts16, const i64* inclusive, u64 nchunks, u64 n, u32 chunk,
                 u64 total, const u8* pos_bytes, const u8* val, u32* flags) {
    for (u64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        u32 count = counts16[2 * c] | ((u32)counts16[2 * c + 1] << 8);
        u64 start = c * chunk;
        u32 len = (u32)min((u64)chunk, n - start);
        u64 end_off = (u64)inclusive[c];
        if (threadIdx.x == 0) {
            if (count > len) atomicOr(flags, 1u);
            if (end_off > total) atomicOr(flags, 2u);
            if (c == nchunks - 1 && end_off != total) atomicOr(flags, 32u);
        }
        if (count > len || end_off > total) continue;
        u64 off = end_off - count;
        for (u32 t = threadIdx.x; t < count; t += THREADS) {
            u64 k = off + t;
            u32 p = pos_bytes[2 * k] | ((u32)pos_bytes[2 * k + 1] << 8);
            if (p >= len) atomicOr(flags, 4u);
            if (t > 0) {
                u32 q = pos_bytes[2 * k - 2] | ((u32)pos_bytes[2 * k - 1] << 8);
                if (p <= q) atomicOr(flags, 8u);
            }
            if (val[k] >> E) atomicOr(flags, 16u);
        }
    }
}

// Decode: dense table lookup for every element of a chunk, then the chunk's escapes overwrite
// their exponents. Escape streams were validated first, so every write is in bounds.
template <int TOTAL, int E, int C>
__global__ void __launch_bounds__(THREADS)
decode_chunks(const u8* residual_in, const u8* codes_in, const u8* counts16, const i64* inclusive,
              const u16* pos_in, const u8* val_in, const u8* codebook, u64 n, u32 chunk, u64 nchunks,
              u8* out, const i64* block_ids, u64 block_elems) {
    constexpr int M = TOTAL - 1 - E;
    constexpr int R = TOTAL - E;
    constexpr u32 SIZE = 1u << C;
    __shared__ u32 table[SIZE];
    if (threadIdx.x < SIZE) table[threadIdx.x] = codebook[threadIdx.x];
    __syncthreads();

    for (u64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        u64 start = c * chunk;
        u64 end = min(start + chunk, n);
        for (u64 seg = start; seg < end; seg += SEGMENT) {
            u64 i = seg + (u64)threadIdx.x * GROUP;
            if (i >= end) continue;
            int valid = (int)min((u64)GROUP, end - i);
            u64 g = i / GROUP;
            u64 rlo, rhi, clo, chi;
            if (valid == GROUP) {
                load_bits<R>(residual_in + g * R, rlo, rhi);
                load_bits<C>(codes_in + g * C, clo, chi);
            } else {
                // The streams end at the last valid bit: read only the bytes that exist.
                rlo = rhi = clo = chi = 0;
                int rb = (valid * R + 7) / 8, cb = (valid * C + 7) / 8;
                for (int j = 0; j < rb; j++) {
                    u64 b = residual_in[g * R + j];
                    if (j < 8) rlo |= b << (8 * j); else rhi |= b << (8 * (j - 8));
                }
                for (int j = 0; j < cb; j++) clo |= (u64)codes_in[g * C + j] << (8 * j);
            }
            u32 bits[GROUP];
#pragma unroll
            for (int j = 0; j < GROUP; j++) {
                int s = R * j;
                u64 r;
                if (s + R <= 64) r = rlo >> s;
                else if (s < 64) r = (rlo >> s) | (rhi << (64 - s));
                else r = rhi >> (s - 64);
                u32 res = (u32)r & ((1u << R) - 1);
                u32 e = table[(clo >> (C * j)) & (SIZE - 1)];
                bits[j] = ((res >> M) << (TOTAL - 1)) | (e << M) | (res & ((1u << M) - 1));
            }
            store_group<TOTAL>(out, block_ids, block_elems, i, valid, bits);
        }
        u32 count = counts16[2 * c] | ((u32)counts16[2 * c + 1] << 8);
        if (count == 0) continue;
        __syncthreads();  // the chunk's dense writes are visible to the whole block
        u64 off = (u64)inclusive[c] - count;
        constexpr u32 EMASK = ((1u << E) - 1) << M;
        typedef typename Elem<TOTAL>::T T;
        for (u32 t = threadIdx.x; t < count; t += THREADS) {
            T* p = elem_ptr<TOTAL>(out, block_ids, block_elems, start + pos_in[off + t]);
            *p = (T)((*p & ~EMASK) | ((u32)val_in[off + t] << M));
        }
    }
}
