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

// Inclusive prefix sum across the warp.
__device__ __forceinline__ u32 warp_inclusive_scan(u32 v, int lane) {
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        u32 y = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += y;
    }
    return v;
}

// Each warp owns whole chunks; a thread takes UNROLL groups per pass with all loads issued
// before the first is used, so each thread keeps several 16-byte loads in flight.
#define UNROLL 4
#define WARPS (THREADS / 32)
#define WARP_SPAN (32 * GROUP * UNROLL)

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
    const int lane = threadIdx.x & 31;
    const u64 nwarps = (u64)gridDim.x * WARPS;

    for (u64 c = (u64)blockIdx.x * WARPS + (threadIdx.x >> 5); c < nchunks; c += nwarps) {
        u64 start = c * chunk;
        u64 end = min(start + chunk, n);
        u32 running = 0;
        for (u64 seg = start; seg < end; seg += WARP_SPAN) {
            u32 bits[UNROLL][GROUP];
            int valid[UNROLL];
#pragma unroll
            for (int k = 0; k < UNROLL; k++) {
                u64 i = seg + ((u64)k * 32 + lane) * GROUP;
                valid[k] = i < end ? (int)min((u64)GROUP, end - i) : 0;
                if (valid[k]) load_group<TOTAL>(x, block_ids, block_elems, i, valid[k], bits[k]);
            }
#pragma unroll
            for (int k = 0; k < UNROLL; k++) {
                u64 i = seg + ((u64)k * 32 + lane) * GROUP;
                u64 rlo = 0, rhi = 0, codes = 0;
                u32 escmask = 0;
                u32 exps = 0, exps_hi = 0;  // 8 exponents as bytes, for the rare escape spill
#pragma unroll
                for (int j = 0; j < GROUP; j++) {
                    bool in = j < valid[k];
                    u32 b = in ? bits[k][j] : 0u;
                    u32 e = (b >> M) & ((1u << E) - 1);
                    u64 r = (((b >> (TOTAL - 1)) & 1u) << M) | (b & ((1u << M) - 1));
                    u32 m = table[e];
                    if (j < 4) exps |= e << (8 * j); else exps_hi |= e << (8 * (j - 4));
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
                if (valid[k]) {
                    u64 g = i / GROUP;
                    store_bits<R>(residual_out + g * R, rlo, rhi, (valid[k] * R + 7) / 8);
                    store_bits<C>(codes_out + g * C, codes, 0, (valid[k] * C + 7) / 8);
                }
                u32 mine = __popc(escmask);
                u32 incl = warp_inclusive_scan(mine, lane);
                u32 total = __shfl_sync(0xffffffffu, incl, 31);
                if (mine) {
                    u64 slot = start + running + incl - mine;
                    for (int j = 0; j < GROUP; j++) {
                        if (escmask & (1u << j)) {
                            spill_pos[slot] = (u16)(i + j - start);
                            spill_val[slot] = (u8)((j < 4 ? exps >> (8 * j) : exps_hi >> (8 * (j - 4))) & 0xFF);
                            slot++;
                        }
                    }
                }
                running += total;
            }
        }
        if (lane == 0) {
            counts16_out[2 * c] = (u8)running;
            counts16_out[2 * c + 1] = (u8)(running >> 8);
            counts32_out[c] = running;
        }
    }
}

// Escape compaction: copy each chunk's spilled escapes to their place in the frame, and zero
// the (at most 15-byte) padding gaps before streams. The escape total X is read on the device,
// so the value stream's offset, align16(pos_off + 2X), is computed here and the host need not
// wait for X before launching. Nothing is written when the coded frame would not be smaller
// than a stored one (the host then writes a stored frame): the buffer is only sized for that.
extern "C" __global__ void __launch_bounds__(THREADS)
gather_escapes(const u32* counts32, const i64* inclusive, u64 nchunks, u32 chunk,
               const u16* spill_pos, const u8* spill_val, u8* frame, u64 counts_end, u64 pos_off,
               u64 stored_total, u64 gap0, u64 gap1) {
    const u64 escapes = nchunks ? (u64)inclusive[nchunks - 1] : 0;
    const u64 pos_end = pos_off + 2 * escapes;
    const u64 val_off = (pos_end + 15) & ~15ull;
    const u64 coded_total = escapes ? val_off + escapes : counts_end;
    if (coded_total >= stored_total) return;
    // Gaps before codes and counts come from the host; those before the escape streams exist
    // only when there are escapes.
    if (blockIdx.x == 0 && threadIdx.x < 64) {
        u32 t = threadIdx.x & 15, which = threadIdx.x >> 4;
        u64 s = which == 0 ? gap0 : which == 1 ? gap1 : escapes == 0 ? 0 : which == 2 ? counts_end : pos_end;
        if (s && s + t < ((s + 15) & ~15ull)) frame[s + t] = 0;
    }
    u16* pos_out = reinterpret_cast<u16*>(frame + pos_off);
    u8* val_out = frame + val_off;
    const int lane = threadIdx.x & 31;
    for (u64 c = (u64)blockIdx.x * WARPS + (threadIdx.x >> 5); c < nchunks; c += (u64)gridDim.x * WARPS) {
        u32 count = counts32[c];
        if (count == 0) continue;
        u64 off = (u64)inclusive[c] - count;
        u64 src = c * chunk;
        for (u32 t = lane; t < count; t += 32) {
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
    const int lane = threadIdx.x & 31;
    for (u64 c = (u64)blockIdx.x * WARPS + (threadIdx.x >> 5); c < nchunks; c += (u64)gridDim.x * WARPS) {
        u32 count = counts16[2 * c] | ((u32)counts16[2 * c + 1] << 8);
        u64 start = c * chunk;
        u32 len = (u32)min((u64)chunk, n - start);
        u64 end_off = (u64)inclusive[c];
        if (lane == 0) {
            if (count > len) atomicOr(flags, 1u);
            if (end_off > total) atomicOr(flags, 2u);
            if (c == nchunks - 1 && end_off != total) atomicOr(flags, 32u);
        }
        if (count == 0 || count > len || end_off > total) continue;
        u64 off = end_off - count;
        for (u32 t = lane; t < count; t += 32) {
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
              u8* out, const i64* block_ids, u64 block_elems, const u32* flags) {
    constexpr int M = TOTAL - 1 - E;
    constexpr int R = TOTAL - E;
    constexpr u32 SIZE = 1u << C;
    // validate_escapes ran just before on the same stream: a bad frame writes nothing.
    if (*flags) return;
    __shared__ u32 table[SIZE];
    if (threadIdx.x < SIZE) table[threadIdx.x] = codebook[threadIdx.x];
    __syncthreads();
    const int lane = threadIdx.x & 31;

    for (u64 c = (u64)blockIdx.x * WARPS + (threadIdx.x >> 5); c < nchunks; c += (u64)gridDim.x * WARPS) {
        u64 start = c * chunk;
        u64 end = min(start + chunk, n);
        // Loaded up front, with the streams, so the escape check does not wait on memory.
        u32 count = counts16[2 * c] | ((u32)counts16[2 * c + 1] << 8);
        for (u64 seg = start; seg < end; seg += WARP_SPAN) {
            u64 rlo[UNROLL], rhi[UNROLL], clo[UNROLL];
            int valid[UNROLL];
#pragma unroll
            for (int k = 0; k < UNROLL; k++) {
                u64 i = seg + ((u64)k * 32 + lane) * GROUP;
                valid[k] = i < end ? (int)min((u64)GROUP, end - i) : 0;
                u64 g = i / GROUP;
                rlo[k] = rhi[k] = clo[k] = 0;
                if (valid[k] == GROUP) {
                    u64 chi;
                    load_bits<R>(residual_in + g * R, rlo[k], rhi[k]);
                    load_bits<C>(codes_in + g * C, clo[k], chi);
                } else if (valid[k]) {
                    // The streams end at the last valid bit: read only the bytes that exist.
                    int rb = (valid[k] * R + 7) / 8, cb = (valid[k] * C + 7) / 8;
                    for (int j = 0; j < rb; j++) {
                        u64 b = residual_in[g * R + j];
                        if (j < 8) rlo[k] |= b << (8 * j); else rhi[k] |= b << (8 * (j - 8));
                    }
                    for (int j = 0; j < cb; j++) clo[k] |= (u64)codes_in[g * C + j] << (8 * j);
                }
            }
#pragma unroll
            for (int k = 0; k < UNROLL; k++) {
                if (!valid[k]) continue;
                u64 i = seg + ((u64)k * 32 + lane) * GROUP;
                u32 bits[GROUP];
#pragma unroll
                for (int j = 0; j < GROUP; j++) {
                    int s = R * j;
                    u64 r;
                    if (s + R <= 64) r = rlo[k] >> s;
                    else if (s < 64) r = (rlo[k] >> s) | (rhi[k] << (64 - s));
                    else r = rhi[k] >> (s - 64);
                    u32 res = (u32)r & ((1u << R) - 1);
                    u32 e = table[(clo[k] >> (C * j)) & (SIZE - 1)];
                    bits[j] = ((res >> M) << (TOTAL - 1)) | (e << M) | (res & ((1u << M) - 1));
                }
                store_group<TOTAL>(out, block_ids, block_elems, i, valid[k], bits);
            }
        }
        if (count == 0) continue;
        __syncwarp();  // the chunk's dense writes are visible to the whole warp
        u64 off = (u64)inclusive[c] - count;
        constexpr u32 EMASK = ((1u << E) - 1) << M;
        typedef typename Elem<TOTAL>::T T;
        for (u32 t = lane; t < count; t += 32) {
            T* p = elem_ptr<TOTAL>(out, block_ids, block_elems, start + pos_in[off + t]);
            *p = (T)((*p & ~EMASK) | ((u32)val_in[off + t] << M));
        }
    }
}
