// Entropy codec kernels: one warp per chunk, lane k of the warp is the chunk's rANS lane k.
// The bytes are reference.py's (FORMAT.md, "entropy"); refills and emissions are ordered by
// lane with one ballot each, exactly the reference's order.
#define FULL 0xffffffffu
#define STATE_LOW 65536u

struct Geo { long long period, tc, c; };

__device__ __forceinline__ int table_of(const unsigned char* cmap, long long i, Geo g) {
    long long j = i % g.period;
    return cmap[(j / g.tc) * g.c + j % g.c];
}

// Table of element i: from ptab (the table of each position of one period) when the host
// built it, else from the context map. j is i mod period, kept by the caller.
__device__ __forceinline__ int table_at(const unsigned char* ptab, const unsigned char* cmap, long long i,
                                        long long j, Geo g) {
    return ptab ? ptab[j] : table_of(cmap, i, g);
}

__device__ __forceinline__ long long advance(long long j, long long period) {
    j += 32;
    while (j >= period) j -= period;
    return j;
}

// R-bit field k of an LSB-first bit stream of `len` bytes.
__device__ __forceinline__ unsigned int field(const unsigned char* __restrict__ stream, long long len, long long k, int R) {
    long long bit = k * R;
    long long byte = bit >> 3;
    unsigned int v = 0;
    for (int b = 0; b < 3; b++) if (byte + b < len) v |= (unsigned int)stream[byte + b] << (8 * b);
    return (v >> (bit & 7)) & ((1u << R) - 1);
}

// Decode the symbols of every coded chunk (stored chunks are left to the host: counts == cap).
// Writes only out[i] for i < n; err gets 1 on any inconsistency.
extern "C" __global__ void entropy_decode(
    const unsigned short* __restrict__ words, const long long* __restrict__ starts,
    const unsigned int* __restrict__ states, const unsigned char* __restrict__ stored,
    const unsigned short* __restrict__ slot_sym, const unsigned short* __restrict__ freq,
    const unsigned short* __restrict__ cum, const unsigned char* __restrict__ cmap,
    long long period, long long tc, long long c, long long n, int chunk, int nchunks, int M, int S, int alpha,
    const unsigned char* __restrict__ ptab, const unsigned char* __restrict__ rawstream, long long rawlen, int R,
    int elem_bytes, unsigned char* __restrict__ out, int* __restrict__ err)
{
    int warp = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
    int lane = threadIdx.x & 31;
    if (warp >= nchunks || stored[warp]) return;
    Geo g{period, tc, c};
    long long ptr = starts[warp], end = starts[warp + 1];
    unsigned int x = states[(long long)warp * 32 + lane];
    bool bad = x < STATE_LOW;
    long long base = (long long)warp * chunk;
    int steps = chunk >> 5;
    unsigned int slot_mask = (1u << M) - 1, esc = 1u << S;
    unsigned int below = (1u << lane) - 1;
    long long j = (base + lane) % period;
    for (int s = 0; s < steps; s++, j = advance(j, period)) {
        long long i = base + ((long long)s << 5) + lane;
        bool v = i < n;
        if (!__any_sync(FULL, v)) break;
        unsigned int sym = 0;
        int t = 0;
        if (v) {
            t = table_at(ptab, cmap, i, j, g);
            unsigned int slot = x & slot_mask;
            sym = slot_sym[((long long)t << M) + slot];
            unsigned int f = freq[t * alpha + sym], cm = cum[t * alpha + sym];
            x = f * (x >> M) + slot - cm;
        }
        bool need = v && x < STATE_LOW;
        unsigned int mask = __ballot_sync(FULL, need);
        if (need) {
            long long idx = ptr + __popc(mask & below);
            if (idx < end) x = (x << 16) | words[idx]; else bad = true;
        }
        ptr += __popc(mask);
        bool e = v && sym == esc;
        if (__any_sync(FULL, e)) {
            if (e) {
                unsigned int raw = x & (esc - 1);
                x >>= S;
                if (freq[t * alpha + raw] != 0) bad = true;
                sym = raw;
            }
            need = e && x < STATE_LOW;
            mask = __ballot_sync(FULL, need);
            if (need) {
                long long idx = ptr + __popc(mask & below);
                if (idx < end) x = (x << 16) | words[idx]; else bad = true;
            }
            ptr += __popc(mask);
        }
        if (v) {
            unsigned int el = (sym << R) | (R ? field(rawstream, rawlen, i, R) : 0u);
            if (elem_bytes == 2) ((unsigned short*)out)[i] = (unsigned short)el; else out[i] = (unsigned char)el;
        }
    }
    if (x != STATE_LOW || ptr != end) bad = true;
    if (__any_sync(FULL, bad) && lane == 0) atomicOr(err, 1);
}

// Encode each chunk into its slot of `cap` words, filled from the end backwards so that the
// words land in decode order; counts[c] = words used, or cap when they would not fit (then
// the host stores the chunk). states get the final states.
extern "C" __global__ void entropy_encode(
    const unsigned char* __restrict__ elems, int elem_bytes, int R,
    const unsigned short* __restrict__ freq, const unsigned short* __restrict__ cum,
    const unsigned char* __restrict__ cmap,
    long long period, long long tc, long long c, long long n, int chunk, int nchunks, int M, int S, int alpha,
    int cap, unsigned short* __restrict__ slots, unsigned int* __restrict__ counts, unsigned int* __restrict__ states,
    const unsigned char* __restrict__ ptab)
{
    int warp = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
    int lane = threadIdx.x & 31;
    if (warp >= nchunks) return;
    Geo g{period, tc, c};
    long long base = (long long)warp * chunk;
    long long elems_here = n - base < chunk ? n - base : chunk;
    int my_cap = (int)((elems_here * S + 15) / 16);
    unsigned short* slot = slots + (long long)warp * cap;
    int p = my_cap;  // words go to slot[p-k .. p)
    bool overflow = false;
    unsigned int x = STATE_LOW;
    unsigned int esc = 1u << S;
    unsigned int below = (1u << lane) - 1;
    int steps = (int)((elems_here + 31) >> 5);
    long long j = (base + ((long long)(steps - 1) << 5) + lane) % period;
    for (int s = steps - 1; s >= 0 && !overflow; s--, j -= 32) {
        while (j < 0) j += period;
        long long i = base + ((long long)s << 5) + lane;
        bool v = i < n;
        unsigned int sym = 0, f = 1, cm = 0;
        bool e = false;
        if (v) {
            unsigned int bits = elem_bytes == 2 ? ((const unsigned short*)elems)[i] : elems[i];
            sym = bits >> R;
            int t = table_at(ptab, cmap, i, j, g);
            f = freq[t * alpha + sym];
            e = f == 0;
            unsigned int coded = e ? esc : sym;
            f = freq[t * alpha + coded];
            cm = cum[t * alpha + coded];
        }
        if (__any_sync(FULL, e)) {
            bool out = e && x >= (1u << (32 - S));
            unsigned int mask = __ballot_sync(FULL, out);
            int k = __popc(mask);
            if (p - k < 0) { overflow = true; break; }
            if (out) { slot[p - k + __popc(mask & below)] = (unsigned short)(x & 0xffff); x >>= 16; }
            p -= k;
            if (e) x = (x << S) + sym;
        }
        bool out = v && x >= (f << (32 - M));
        unsigned int mask = __ballot_sync(FULL, out);
        int k = __popc(mask);
        if (p - k < 0) { overflow = true; break; }
        if (out) { slot[p - k + __popc(mask & below)] = (unsigned short)(x & 0xffff); x >>= 16; }
        p -= k;
        if (v) x = ((x / f) << M) + x % f + cm;
    }
    int used = my_cap - p;
    bool stored_chunk = overflow || used >= my_cap;
    states[(long long)warp * 32 + lane] = stored_chunk ? 0u : x;
    if (lane == 0) counts[warp] = stored_chunk ? (unsigned int)my_cap : (unsigned int)used;
}

// Each chunk's words (the tail of its slot) to their place in the word stream.
extern "C" __global__ void entropy_gather(const unsigned short* __restrict__ slots, const unsigned int* __restrict__ counts,
    const long long* __restrict__ starts, const int* __restrict__ caps_last, int cap, int nchunks,
    unsigned short* __restrict__ words)
{
    int warp = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
    int lane = threadIdx.x & 31;
    if (warp >= nchunks) return;
    int my_cap = warp == nchunks - 1 ? caps_last[0] : cap;
    unsigned int cnt = counts[warp];
    if (cnt >= (unsigned int)my_cap) return;  // stored chunk: the host writes it
    const unsigned short* src = slots + (long long)warp * cap + (my_cap - cnt);
    unsigned short* dst = words + starts[warp];
    for (unsigned int k = lane; k < cnt; k += 32) dst[k] = src[k];
}

// The raw stream: R-bit fields (the low R bits of each element), 8 elements -> R bytes per thread.
extern "C" __global__ void entropy_pack_raw(const unsigned char* __restrict__ elems, int elem_bytes, int R, long long n,
    unsigned char* __restrict__ raw, long long rawlen)
{
    long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long first = g * 8;
    if (first >= n) return;
    unsigned long long lo = 0, hi = 0;
    for (int k = 0; k < 8; k++) {
        long long i = first + k;
        if (i >= n) break;
        unsigned long long v = (elem_bytes == 2 ? ((const unsigned short*)elems)[i] : elems[i]) & ((1u << R) - 1);
        int pos = k * R;
        if (pos < 64) { lo |= v << pos; if (pos + R > 64) hi |= v >> (64 - pos); }
        else hi |= v << (pos - 64);
    }
    long long at = g * R;
    for (int b = 0; b < R; b++) {
        if (at + b >= rawlen) break;
        raw[at + b] = (unsigned char)(b < 8 ? (lo >> (8 * b)) : (hi >> (8 * (b - 8))));
    }
}
