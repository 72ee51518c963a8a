// Entropy codec kernels: one warp per chunk, lane k of the warp is the chunk's rANS lane k.
// The bytes are reference.py's (FORMAT.md, "entropy"); refills and emissions are ordered by
// lane with one ballot each, exactly the reference's order.
//
// Each chunk is a chain of 1024 dependent steps, so a step's latency and instruction count
// bound the kernels. The fast builds (FAST = 1) keep the tables in shared memory (one block of
// 32 warps per SM), take each element's table from the per-position table, divide by the
// frequency with a multiply (Granlund-Montgomery), keep a window of 96 words in registers so
// that a refill is a shuffle, and pack or unpack the raw bits of a step's 32 elements as whole
// 32-bit words. The generic builds read the tables from global memory and also take periods
// too long for a per-position table.
//
// All integer kernel parameters are 64-bit: the host passes every argument as 8 bytes.
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define FULL 0xffffffffu
#define STATE_LOW 65536u
#define DEPTH 4  // steps between the encoder loading a step's inputs and coding it

// Table of the element at position j of the period (j = i mod period): per-position table
// when the host built one, else from the context map. The fast builds take only periods of
// 32 or more elements with a per-position table, so that j stays an int stepped without loops.
struct TableOf {
    const u8* ptab;
    const u8* cmap;
    i64 period, tc, c;
    __device__ __forceinline__ int at(i64 j) const { return ptab ? ptab[j] : cmap[(j / tc) * c + j % c]; }
};

// Packing of B-bit fields, 32 per step (one per lane, LSB first in lane order), into B words:
// the lanes whose fields start in one word OR their low parts together (a segmented scan
// down the lanes, log steps), and the first lane of each segment adds the spill of the lane
// before it and writes the word.
template <int B>
struct Packer {
    static constexpr int SEG = (32 + B - 1) / B + 1;  // most lanes a segment can have
    int sh, w;
    bool writer;
    u32 same1, same2, same4;  // lane + d starts in this lane's word (as all-ones masks)
    __device__ __forceinline__ explicit Packer(int lane) {
        sh = (lane * B) & 31;
        w = (lane * B) >> 5;
        writer = lane == 0 || (((lane - 1) * B) >> 5) != w;
        same1 = lane + 1 < 32 && (((lane + 1) * B) >> 5) == w ? FULL : 0u;
        same2 = lane + 2 < 32 && (((lane + 2) * B) >> 5) == w ? FULL : 0u;
        same4 = lane + 4 < 32 && (((lane + 4) * B) >> 5) == w ? FULL : 0u;
    }
    // The word this lane writes (meaningful where `writer`).
    __device__ __forceinline__ u32 word(u32 v, int lane) const {
        u32 lo = v << sh;
        const u32 hi = __funnelshift_l(v, 0u, sh);
        lo |= __shfl_down_sync(FULL, lo, 1) & same1;
        if (SEG > 2) lo |= __shfl_down_sync(FULL, lo, 2) & same2;
        if (SEG > 4) lo |= __shfl_down_sync(FULL, lo, 4) & same4;
        const u32 prev_hi = __shfl_up_sync(FULL, hi, 1);
        return lo | (lane ? prev_hi : 0u);
    }
};

// This lane's B-bit field of a step whose words lane k holds in `v`: bits [lane*B, lane*B+B).
template <int B>
__device__ __forceinline__ u32 unpack_field(u32 v, int lane) {
    const int bit = lane * B;
    const u32 lo = __shfl_sync(FULL, v, bit >> 5), hi = __shfl_sync(FULL, v, (bit >> 5) + 1);
    return __funnelshift_r(lo, hi, bit & 31) & ((1u << B) - 1);
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}

// A streamed word, its 256-byte neighbourhood brought into L2 on a miss.
__device__ __forceinline__ u32 ld_stream(const u32* p) {
    u32 v;
    asm volatile("ld.global.nc.L2::256B.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

template <int FAST> struct Pos { typedef i64 T; };
template <> struct Pos<1> { typedef int T; };

// Copies `words` 32-bit words of a table into shared memory.
__device__ __forceinline__ void load_shared(u32* dst, const u32* src, int words) {
    for (int k = threadIdx.x; k < words; k += blockDim.x) dst[k] = src[k];
}

template <int EB> struct Elem;
template <> struct Elem<1> { typedef u8 T; };
template <> struct Elem<2> { typedef u16 T; };

// ---------------------------------------------------------------------------------------
// Encode. The encode table has an entry per (table, symbol < 2**S), the escape's entry for a
// symbol its table lacks: x = magic for x / f, y = cum | (2**M - f) << 14 | ceil(log2 f) << 28.
// An entry is the escape's exactly when cum == 2**M - f (the escape is the last symbol).
//
// Each chunk is coded from its last step to its first into its slot of `cap` words, filled
// from the end backwards so that the words land in decode order; counts[c] = words used, or
// the chunk's cap when they would not fit, and then the slot holds the chunk's symbols
// packed (a stored chunk, states 0). The raw bits go straight to their stream. Elements come
// from src (ids null) or from blocks src + ids[b] * block elements (block a multiple of 32).
template <int S, int R, int EB, int FAST>
__global__ void __launch_bounds__(1024, 1) entropy_encode(
    const void* __restrict__ src, const i64* __restrict__ ids, i64 block, i64 n, i64 chunk_, i64 nchunks_, i64 M_,
    const uint2* __restrict__ enc_g, i64 enc_words, const u8* __restrict__ ptab, const u8* __restrict__ cmap,
    i64 period, i64 tc, i64 cc, u16* __restrict__ slots, i64 cap_, u32* __restrict__ counts,
    u32* __restrict__ states, u32* __restrict__ raw)
{
    typedef typename Elem<EB>::T T;
    extern __shared__ uint2 enc_s[];
    if (FAST) {
        load_shared((u32*)enc_s, (const u32*)enc_g, (int)enc_words);
        __syncthreads();
    }
    const TableOf tab{ptab, cmap, period, tc, cc};
    const int chunk = (int)chunk_, nchunks = (int)nchunks_, M = (int)M_, cap = (int)cap_;
    const int lane = threadIdx.x & 31;
    const u32 below = (1u << lane) - 1, esc_limit = 1u << (32 - S), top = 1u << M;
    const Packer<R ? R : 1> rpack(lane);
    const int warps = (gridDim.x * blockDim.x) >> 5;
    for (int c = (int)((blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5); c < nchunks; c += warps) {
        const i64 first = (i64)c * chunk;
        const int here = (int)(n - first < chunk ? n - first : chunk);
        const int my_cap = (here * S + 15) / 16;
        const int steps = (here + 31) >> 5;
        u16* slot = slots + (i64)c * cap;
        u32* rc = raw + (first >> 5) * R;  // this chunk's raw words
        // A cursor that loads each step's elements and tables DEPTH steps before the coder
        // takes them (the coder's chain of steps waits on nothing else): the step it loads
        // next (sl), its block, offset in the block, elements and position in the period.
        const i64 last = first + ((i64)(steps - 1) << 5);
        i64 blk = ids ? last / block : 0;
        int off = ids ? (int)(last - blk * block) : (steps - 1) << 5;  // ids null: in the chunk
        const T* sp = (const T*)src + (ids ? ids[blk] * block + off : last);
        typedef typename Pos<FAST>::T P;
        P j = (P)((last + lane) % period);
        const P per = (P)period;
        int sl = steps - 1;
        auto load = [&](u32& bits, int& t) {
            if (sl < 0) return;
            bits = (sl << 5) + lane < here ? (u32)sp[lane] : 0u;
            t = FAST ? ptab[j] : tab.at(j);
            if (sl > 0) {
                off -= 32;
                sp -= 32;
                while (off < 0) {  // into the block before (a loop: the compiler predicates an if)
                    off += (int)block;
                    blk--;
                    sp = (const T*)src + ids[blk] * block + off;
                }
                if (lane == 0 && off >= 512) prefetch_l2(sp - 512);
                j -= 32;
                if (FAST) { if (j < 0) j += per; } else { while (j < 0) j += per; }
            }
            sl--;
        };
        u32 bq[DEPTH];
        int tq[DEPTH];
#pragma unroll
        for (int u = 0; u < DEPTH; u++) load(bq[u], tq[u]);
        int p = my_cap;
        bool overflow = false;
        u32 x = STATE_LOW;
        // One step; false when the chunk's words would overflow its slot. `v` is a literal
        // true in the groups of whole steps, which then drop the per-lane tests.
        auto code = [&](const int u, const int s, const bool v) {
            const u32 bits = bq[u];
            const int t = tq[u];
            load(bq[u], tq[u]);
            const u32 sym = bits >> R;
            const uint2 e = FAST ? enc_s[(t << S) | sym] : enc_g[(t << S) | sym];
            const u32 cum = e.y & 0x3fffu, comp = (e.y >> 14) & 0x3fffu, l = e.y >> 28;
            const bool escaped = v && cum == comp;
            if (__any_sync(FULL, escaped)) {  // the symbol's own bits, coded before the escape
                const bool out = escaped && x >= esc_limit;
                const u32 mask = __ballot_sync(FULL, out);
                const int kk = __popc(mask);
                if (p - kk < 0) return false;
                if (out) { slot[p - kk + __popc(mask & below)] = (u16)x; x >>= 16; }
                p -= kk;
                if (escaped) x = (x << S) + sym;
            }
            const bool out = v && (x >> (32 - M)) + comp >= top;  // x >= f << (32 - M)
            const u32 mask = __ballot_sync(FULL, out);
            const int kk = __popc(mask);
            if (p - kk < 0) return false;
            const u32 xs = out ? x >> 16 : x;
            if (out) slot[p - kk + __popc(mask & below)] = (u16)x;
            p -= kk;
            const u32 t1 = __umulhi(xs, e.x), sh1 = min(l, 1u);
            const u32 q = (t1 + ((xs - t1) >> sh1)) >> (l - sh1);
            x = v ? xs + cum + q * comp : xs;  // (x / f) << M  +  x % f  +  cum
            if (R) {
                const u32 word = rpack.word(v ? bits & ((1u << R) - 1) : 0u, lane);
                if (rpack.writer) rc[s * R + rpack.w] = word;
            }
            return true;
        };
        const int whole = here >> 5;  // steps with all 32 elements
        for (int s0 = steps - 1; s0 >= 0 && !overflow; s0 -= DEPTH) {
            if (s0 >= DEPTH - 1 && s0 < whole) {
#pragma unroll
                for (int u = 0; u < DEPTH; u++)
                    if (!code(u, s0 - u, true)) { overflow = true; break; }
            } else {
#pragma unroll
                for (int u = 0; u < DEPTH; u++) {
                    const int s = s0 - u;
                    if (s < 0) break;
                    if (!code(u, s, (s << 5) + lane < here)) { overflow = true; break; }
                }
            }
        }
        const bool stored = overflow || p == 0;
        states[(i64)c * 32 + lane] = stored ? 0u : x;
        if (lane == 0) counts[c] = stored ? (u32)my_cap : (u32)(my_cap - p);
        if (!stored) continue;
        // A stored chunk (rare): its symbols packed from the slot's start, and the raw bits
        // of the steps the coder did not reach.
        const Packer<S> spack(lane);
        blk = ids ? first / block : 0;
        off = ids ? (int)(first - blk * block) : 0;
        for (int s = 0; s < steps; s++) {
            const int k = (s << 5) + lane;
            const T* at = (const T*)src + (ids ? ids[blk] * block + off : first + (s << 5));
            const u32 bits = k < here ? (u32)at[lane] : 0u;
            const u32 word = spack.word(bits >> R, lane);
            if (spack.writer) ((u32*)slot)[s * S + spack.w] = word;
            if (R) {
                const u32 rword = rpack.word(bits & ((1u << R) - 1), lane);
                if (rpack.writer) rc[s * R + rpack.w] = rword;
            }
            off += 32;
            if (ids && off == block) { off = 0; blk++; }
        }
    }
}

// The frame around the raw stream: counts and states to their streams, each chunk's words
// from the tail of its slot to the word stream (cum: inclusive sums of the counts), and the
// zero padding after the counts and after the words. One warp per chunk.
extern "C" __global__ void entropy_assemble(
    const u16* __restrict__ slots, const u32* __restrict__ counts, const u32* __restrict__ states,
    const i64* __restrict__ cum, i64 cap, i64 cap_last, i64 nchunks, u8* __restrict__ frame, i64 counts_at,
    i64 states_at, i64 words_at, i64 pad1_at, i64 pad1, i64 pad2_at, i64 pad2)
{
    const int lane = threadIdx.x & 31;
    const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 c = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; c < nchunks; c += warps) {
        const u32 cnt = counts[c];
        const i64 my_cap = c == nchunks - 1 ? cap_last : cap;
        if (lane == 0) ((u32*)(frame + counts_at))[c] = cnt;
        ((u32*)(frame + states_at))[c * 32 + lane] = states[c * 32 + lane];
        const u16* from = slots + c * cap + (my_cap - cnt);
        u16* to = (u16*)(frame + words_at) + (cum[c] - cnt);
        for (u32 k = lane; k < cnt; k += 128) {
            u16 a = from[k], b = 0, d = 0, e = 0;
            if (k + 32 < cnt) b = from[k + 32];
            if (k + 64 < cnt) d = from[k + 64];
            if (k + 96 < cnt) e = from[k + 96];
            to[k] = a;
            if (k + 32 < cnt) to[k + 32] = b;
            if (k + 64 < cnt) to[k + 64] = d;
            if (k + 96 < cnt) to[k + 96] = e;
        }
    }
    if (blockIdx.x == 0 && threadIdx.x < 16) {
        if (threadIdx.x < pad1) frame[pad1_at + threadIdx.x] = 0;
        if (threadIdx.x < pad2) frame[pad2_at + threadIdx.x] = 0;
    }
}

// ---------------------------------------------------------------------------------------
// Decode. Tables: the symbol of each (table, slot), and f | cum << 16 of each (table, symbol).
// Every chunk, coded or stored, is decoded into `out` (fresh memory: the caller copies it
// on only if err stays 0). err gets 1 on any inconsistency; the checks are the reference's,
// plus the frame's padding and the raw stream's unused bits.
template <int S, int R, int EB, int FAST>
__global__ void __launch_bounds__(1024, 1) entropy_decode(
    const u16* __restrict__ words, i64 total_words, const u32* __restrict__ counts, const i64* __restrict__ cum,
    const u32* __restrict__ states, const u16* __restrict__ slot_g, const u32* __restrict__ fc_g, i64 slot_words,
    i64 fc_words, const u8* __restrict__ ptab, const u8* __restrict__ cmap, i64 period, i64 tc, i64 cc, i64 n,
    i64 chunk_, i64 nchunks_, i64 cap_, i64 cap_last_, i64 M_, const u32* __restrict__ raw, i64 raw_words,
    u8* __restrict__ out_, int* __restrict__ err)
{
    typedef typename Elem<EB>::T T;
    constexpr u32 ESC = 1u << S;
    constexpr int ALPHA = (1 << S) + 1;
    extern __shared__ u32 dec_s[];
    const u16* slot_tab = slot_g;
    const u32* fc = fc_g;
    if (FAST) {
        load_shared(dec_s, fc_g, (int)fc_words);
        load_shared(dec_s + fc_words, (const u32*)slot_g, (int)slot_words);
        __syncthreads();
        fc = dec_s;
        slot_tab = (const u16*)(dec_s + fc_words);
    }
    const TableOf tab{ptab, cmap, period, tc, cc};
    const int chunk = (int)chunk_, nchunks = (int)nchunks_, M = (int)M_;
    const int lane = threadIdx.x & 31;
    const u32 below = (1u << lane) - 1, slot_mask = (1u << M) - 1;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    for (int c = (int)((blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5); c < nchunks; c += warps) {
        const u32 cnt = counts[c];
        const int my_cap = (int)(c == nchunks - 1 ? cap_last_ : cap_);
        const i64 end = cum[c], start = end - (int)cnt;
        bool bad = cnt > (u32)my_cap || start < 0 || end > total_words
                   || (c == nchunks - 1 && end != total_words);
        if (bad) {  // the same on every lane
            if (lane == 0) atomicOr(err, 1);
            continue;
        }
        const i64 first = (i64)c * chunk;
        const int here = (int)(n - first < chunk ? n - first : chunk);
        const int steps = (here + 31) >> 5;
        const int len = (int)cnt;
        const u16* wc = words + start;  // this chunk's words
        const u32* rc = raw + (first >> 5) * R;  // and raw words: R a step
        const int rlast = R ? (int)min((i64)(steps + 1) * R, raw_words - (first >> 5) * R) - 1 : 0;
        T* oc = (T*)out_ + first;
        u32 x = states[(i64)c * 32 + lane];
        if (len == my_cap) {  // stored: the symbols packed, S bits each
            bad = x != 0;
            for (int s = 0; s < steps; s++) {
                const int k = (s << 5) + lane;
                const int bit = k * S, at = bit >> 4;
                const u32 pair = (at < len ? (u32)wc[at] : 0u) | (at + 1 < len ? (u32)wc[at + 1] : 0u) << 16;
                const u32 sym = (pair >> (bit & 15)) & (ESC - 1);
                u32 rv = 0;
                if (R) rv = unpack_field<R ? R : 1>(lane <= R ? rc[min(s * R + lane, rlast)] : 0u, lane);
                if (k < here) oc[k] = (T)(sym << R | rv);
            }
        } else {
            bad = x < STATE_LOW;
            // Window of the chunk's next words: lane k holds words base+k, base+32+k and
            // base+64+k; the next unread word is base + pos, pos < 32.
            int base = 0, pos = 0;
            u32 w0 = lane < len ? wc[lane] : 0u, w1 = lane + 32 < len ? wc[lane + 32] : 0u;
            u32 w2 = lane + 64 < len ? wc[lane + 64] : 0u;
            // Position in the period (an int in the fast builds: periods there are < 2**27).
            typedef typename Pos<FAST>::T P;
            P j = (P)((first + lane) % period);
            const P per = (P)period;
            // The next step's table, and raw words two steps ahead (lanes 0..R hold a step's
            // words and the next step's first). Loading further ahead measured slower.
            int t_next = FAST ? ptab[j] : tab.at(j);
            const u32* rp = rc + lane;
            const int rlim = rlast - lane;
            u32 raw_next = R && lane <= R ? ld_stream(rp + min(0, rlim)) : 0u;
            u32 raw_next2 = R && lane <= R ? ld_stream(rp + min(R, rlim)) : 0u;
            T* op = oc + lane;
            for (int s = 0, k = lane; s < steps; s++, k += 32, op += 32) {
                const bool v = k < here;
                const int t = t_next;
                const u32 raw_here = raw_next;
                j += 32;
                if (FAST) { if (j >= per) j -= per; } else { while (j >= per) j -= per; }
                t_next = FAST ? ptab[j] : tab.at(j);
                if (R) {
                    raw_next = raw_next2;
                    if (lane <= R) raw_next2 = ld_stream(rp + min((s + 2) * R, rlim));
                }
                const u32 slot = x & slot_mask;
                u32 sym = slot_tab[((u32)t << M) | slot];
                const u32 e = fc[t * ALPHA + sym];
                if (v) x = (e & 0xffffu) * (x >> M) + slot - (e >> 16);
                bool need = v && x < STATE_LOW;
                u32 mask = __ballot_sync(FULL, need);
                int idx = pos + __popc(mask & below);
                u32 a = __shfl_sync(FULL, w0, idx & 31), b = __shfl_sync(FULL, w1, idx & 31);
                if (need) x = x << 16 | (idx < 32 ? a : b);
                pos += __popc(mask);
                if (pos >= 32) {
                    pos -= 32; base += 32; w0 = w1; w1 = w2;
                    w2 = base + 64 + lane < len ? wc[base + 64 + lane] : 0u;
                }
                const bool escaped = v && sym == ESC;
                if (__any_sync(FULL, escaped)) {
                    if (escaped) {
                        const u32 symbol = x & (ESC - 1);
                        x >>= S;
                        if (fc[t * ALPHA + symbol] & 0xffffu) bad = true;  // non-canonical escape
                        sym = symbol;
                    }
                    need = escaped && x < STATE_LOW;
                    mask = __ballot_sync(FULL, need);
                    idx = pos + __popc(mask & below);
                    a = __shfl_sync(FULL, w0, idx & 31);
                    b = __shfl_sync(FULL, w1, idx & 31);
                    if (need) x = x << 16 | (idx < 32 ? a : b);
                    pos += __popc(mask);
                    if (pos >= 32) {
                        pos -= 32; base += 32; w0 = w1; w1 = w2;
                        w2 = base + 64 + lane < len ? wc[base + 64 + lane] : 0u;
                    }
                }
                const u32 rv = R ? unpack_field<R ? R : 1>(raw_here, lane) : 0u;
                if (v) *op = (T)(sym << R | rv);
            }
            bad |= x != STATE_LOW || base + pos != len;
        }
        if (__any_sync(FULL, bad) && lane == 0) atomicOr(err, 1);
    }
}

// The fast decode (tables in shared memory, per-position table ids): the generic kernel's
// bytes and checks, with fewer instructions a step, which bound it. Steps go in groups of G
// whose raw words (G * R <= 32) one load brings into the warp, lane k holding word k, so that
// each step's fields are two shuffles from fixed lanes; a group whose steps are all inside the
// chunk drops the per-lane validity tests; a refill is one shuffle (a lane at or past the
// window's read position gives its first word, one before it its second).
template <int S, int R, int EB>
__global__ void __launch_bounds__(1024, 1) entropy_decode_fast(
    const u16* __restrict__ words, i64 total_words, const u32* __restrict__ counts, const i64* __restrict__ cum,
    const u32* __restrict__ states, const u16* __restrict__ slot_g, const u32* __restrict__ fc_g, i64 slot_words,
    i64 fc_words_, const u8* __restrict__ ptab, const u8* __restrict__ cmap, i64 period, i64 tc, i64 cc, i64 n,
    i64 chunk_, i64 nchunks_, i64 cap_, i64 cap_last_, i64 M_, const u32* __restrict__ raw, i64 raw_words,
    u8* __restrict__ out_, int* __restrict__ err)
{
    typedef typename Elem<EB>::T T;
    constexpr u32 ESC = 1u << S;
    constexpr int ALPHA = (1 << S) + 1;
    constexpr int G = R > 8 ? 2 : 4;  // steps a group
    extern __shared__ u32 dec_s[];
    const int fc_words = (int)fc_words_;
    load_shared(dec_s, fc_g, fc_words);
    load_shared(dec_s + fc_words, (const u32*)slot_g, (int)slot_words);
    __syncthreads();
    const u32* fc = dec_s;
    const u16* slot_tab = (const u16*)(dec_s + fc_words);
    const int chunk = (int)chunk_, nchunks = (int)nchunks_, M = (int)M_, per = (int)period;
    const int lane = threadIdx.x & 31;
    const u32 below = (1u << lane) - 1, slot_mask = (1u << M) - 1;
    const int rl = (lane * (R ? R : 1)) >> 5, rsh = (lane * R) & 31;  // this lane's raw field: word, shift
    const int warps = (gridDim.x * blockDim.x) >> 5;
    for (int c = (int)((blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5); c < nchunks; c += warps) {
        const u32 cnt = counts[c];
        const int my_cap = (int)(c == nchunks - 1 ? cap_last_ : cap_);
        const i64 end = cum[c], start = end - (int)cnt;
        bool bad = cnt > (u32)my_cap || start < 0 || end > total_words
                   || (c == nchunks - 1 && end != total_words);
        if (bad) {  // the same on every lane
            if (lane == 0) atomicOr(err, 1);
            continue;
        }
        const i64 first = (i64)c * chunk;
        const int here = (int)(n - first < chunk ? n - first : chunk);
        const int steps = (here + 31) >> 5;
        const int len = (int)cnt;
        const u16* wc = words + start;
        const u32* rc = raw + (first >> 5) * R;
        const int rlast = R ? (int)min((i64)(steps + G) * R, raw_words - (first >> 5) * R) - 1 : 0;
        T* oc = (T*)out_ + first;
        u32 x = states[(i64)c * 32 + lane];
        if (len == my_cap) {  // stored: the symbols packed, S bits each
            bad = x != 0;
            for (int s = 0; s < steps; s++) {
                const int k = (s << 5) + lane;
                const int bit = k * S, at = bit >> 4;
                const u32 pair = (at < len ? (u32)wc[at] : 0u) | (at + 1 < len ? (u32)wc[at + 1] : 0u) << 16;
                const u32 sym = (pair >> (bit & 15)) & (ESC - 1);
                u32 rv = 0;
                if (R) rv = unpack_field<R ? R : 1>(lane <= R ? rc[min(s * R + lane, rlast)] : 0u, lane);
                if (k < here) oc[k] = (T)(sym << R | rv);
            }
        } else {
            bad = x < STATE_LOW;
            int base = 0, pos = 0;  // window: lane k holds words base+k, +32+k, +64+k; next unread base+pos
            u32 w0 = lane < len ? wc[lane] : 0u, w1 = lane + 32 < len ? wc[lane + 32] : 0u;
            u32 w2 = lane + 64 < len ? wc[lane + 64] : 0u;
            auto refill = [&](const bool need) {
                const u32 mask = __ballot_sync(FULL, need);
                const int idx = pos + __popc(mask & below);
                const u32 w = __shfl_sync(FULL, lane >= pos ? w0 : w1, idx & 31);
                if (need) x = x << 16 | w;
                pos += __popc(mask);
                if (pos >= 32) {
                    pos -= 32; base += 32; w0 = w1; w1 = w2;
                    w2 = base + 64 + lane < len ? wc[base + 64 + lane] : 0u;
                }
            };
            int j = (int)((first + lane) % period);
            int tq[G];
#pragma unroll
            for (int u = 0; u < G; u++) {
                tq[u] = ptab[j];
                j += 32;
                if (j >= per) j -= per;
            }
            u32 rw_next = R && lane < G * R ? ld_stream(rc + min(lane, rlast)) : 0u;
            T* op = oc + lane;
            auto step = [&](const int t, const u32 rw, const int u, const bool v) {
                const u32 slot = x & slot_mask;
                u32 sym = slot_tab[((u32)t << M) | slot];
                const u32 e = fc[t * ALPHA + sym];
                if (v) x = (e & 0xffffu) * (x >> M) + slot - (e >> 16);
                refill(v && x < STATE_LOW);
                const bool escaped = v && sym == ESC;
                if (__any_sync(FULL, escaped)) {
                    if (escaped) {
                        const u32 symbol = x & (ESC - 1);
                        x >>= S;
                        if (fc[t * ALPHA + symbol] & 0xffffu) bad = true;  // non-canonical escape
                        sym = symbol;
                    }
                    refill(escaped && x < STATE_LOW);
                }
                u32 rv = 0;
                if (R) {
                    const u32 lo = __shfl_sync(FULL, rw, rl + u * R), hi = __shfl_sync(FULL, rw, rl + u * R + 1);
                    rv = __funnelshift_r(lo, hi, rsh) & ((1u << (R ? R : 1)) - 1);
                }
                if (v) op[u << 5] = (T)(sym << R | rv);
            };
            const int groups = (steps + G - 1) / G;
            for (int g = 0; g < groups; g++, op += G << 5) {
                const u32 rw = rw_next;
                if (R && lane < G * R) rw_next = ld_stream(rc + min((g + 1) * G * R + lane, rlast));
                int t[G];
#pragma unroll
                for (int u = 0; u < G; u++) {
                    t[u] = tq[u];
                    tq[u] = ptab[j];
                    j += 32;
                    if (j >= per) j -= per;
                }
                if ((g + 1) * (G << 5) <= here) {
#pragma unroll
                    for (int u = 0; u < G; u++) step(t[u], rw, u, true);
                } else {
#pragma unroll
                    for (int u = 0; u < G; u++) step(t[u], rw, u, ((g * G + u) << 5) + lane < here);
                }
            }
            bad |= x != STATE_LOW || base + pos != len;
        }
        if (__any_sync(FULL, bad) && lane == 0) atomicOr(err, 1);
    }
}

// The checks of the few bytes outside the streams: every padding byte (gaps[2k] its first
// byte, gaps[2k+1] how many, at most 16) zero, and the raw stream's last byte's unused bits.
extern "C" __global__ void entropy_check_padding(const u8* frame, i64 g0, i64 l0, i64 g1, i64 l1, i64 g2, i64 l2,
                                                 i64 g3, i64 l3, i64 g4, i64 l4, i64 last_raw, i64 used_bits,
                                                 int* err)
{
    const int k = threadIdx.x;
    bool bad = (k < l0 && frame[g0 + k]) || (k < l1 && frame[g1 + k]) || (k < l2 && frame[g2 + k])
               || (k < l3 && frame[g3 + k]) || (k < l4 && frame[g4 + k]);
    if (k == 0 && used_bits) bad |= (frame[last_raw] >> used_bits) != 0;
    if (bad) atomicOr(err, 1);
}

// Decoded elements into their blocks (dst + ids[b] * block_bytes, or dst itself when ids is
// null and there is one block) in 16-byte pieces, unless err is set.
extern "C" __global__ void entropy_scatter(const uint4* __restrict__ src, u8* __restrict__ dst,
                                           const i64* __restrict__ ids, i64 block_bytes, i64 nblocks,
                                           const int* __restrict__ err)
{
    if (*(volatile const int*)err) return;
    const i64 pieces = block_bytes >> 4;
    for (i64 b = blockIdx.y; b < nblocks; b += gridDim.y) {
        const uint4* from = src + b * pieces;
        uint4* to = (uint4*)(dst + (ids ? ids[b] : b) * block_bytes);
        for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < pieces; k += (i64)gridDim.x * blockDim.x)
            to[k] = from[k];
    }
}
