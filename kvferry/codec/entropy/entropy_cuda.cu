// Entropy codec kernels: one warp per chunk, lane k of the warp is the chunk's rANS lane k.
// The bytes are reference.py's (FORMAT.md, "entropy"); refills and emissions are ordered by
// lane with one ballot each, exactly the reference's order.
//
// Each chunk is a chain of 1024 dependent steps; with 32 warps an SM (registers and the tables
// allow no more) the SM issues an instruction nearly every cycle, so the instructions a step
// bound the coders (Nsight: ~3.2 of 4 issued a cycle). The fast builds (FAST = 1, and
// entropy_decode_fast) keep the tables in shared memory, take each element's table from the
// per-position table, divide by the frequency with a multiply (Granlund-Montgomery), keep a
// window of 96 words in registers so that a refill is a shuffle, pack or unpack the raw bits
// of a step's 32 elements as whole 32-bit words, and drop the per-lane tests in whole steps.
// The generic builds read the tables from global memory and also take periods too long for a
// per-position table.
//
// All integer kernel parameters are 64-bit: the host passes every argument as 8 bytes.
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define FULL 0xffffffffu
#define STATE_LOW 65536u
#define DEPTH 4  // steps between the encoder loading a step's inputs and coding it
#define SLOT_HEAD (DEPTH * 64)  // words a slot has before the chunk's: a group's worst overflow

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
// Each chunk is coded from its last step to its first into its slot (`stride` words apart: a
// head of SLOT_HEAD words, then the chunk's cap), filled from the end backwards so that the
// words land in decode order; counts[c] = words used, or the chunk's cap when they would not
// fit, and then the slot holds the chunk's symbols packed from the head's end (a stored
// chunk, states 0). Whether the words fit is tested once a group of DEPTH steps (at most 64
// words a step spill into the head), not at every emission. The raw bits go straight to
// their stream. Elements come from src (ids null) or from blocks src + ids[b] * block
// elements (block a multiple of 32).
template <int S, int R, int EB, int FAST>
__global__ void __launch_bounds__(1024, 1) entropy_encode(
    const void* __restrict__ src, const i64* __restrict__ ids, i64 block, i64 n, i64 chunk_, i64 nchunks_, i64 M_,
    const uint2* __restrict__ enc_g, i64 enc_words, const u8* __restrict__ ptab, const u8* __restrict__ cmap,
    i64 period, i64 tc, i64 cc, const u32* __restrict__ ptab4, u16* __restrict__ slots, i64 stride,
    u32* __restrict__ counts, u32* __restrict__ states, u32* __restrict__ raw)
{
    typedef typename Elem<EB>::T T;
    extern __shared__ uint2 enc_s[];
    if (FAST) {
        load_shared((u32*)enc_s, (const u32*)enc_g, (int)enc_words);
        __syncthreads();
    }
    const TableOf tab{ptab, cmap, period, tc, cc};
    const int chunk = (int)chunk_, nchunks = (int)nchunks_, M = (int)M_;
    const int lane = threadIdx.x & 31;
    const u32 below = (1u << lane) - 1, esc_limit = 1u << (32 - S), top = 1u << M;
    const Packer<R ? R : 1> rpack(lane);
    const int warps = (gridDim.x * blockDim.x) >> 5;
    for (int c = (int)((blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5); c < nchunks; c += warps) {
        const i64 first = (i64)c * chunk;
        const int here = (int)(n - first < chunk ? n - first : chunk);
        const int my_cap = (here * S + 15) / 16;
        const int steps = (here + 31) >> 5;
        u16* slot = slots + (i64)c * stride + SLOT_HEAD;
        u32* rc = raw + (first >> 5) * R;  // this chunk's raw words
        // A cursor that loads each step's elements and tables DEPTH steps before the coder
        // takes them (the coder's chain of steps waits on nothing else): the step it loads
        // next (sl), its block, offset in the block, this lane's element and position in the
        // period.
        const i64 last = first + ((i64)(steps - 1) << 5);
        i64 blk = ids ? last / block : 0;
        int off = ids ? (int)(last - blk * block) : (steps - 1) << 5;  // ids null: in the chunk
        const T* sp = (const T*)src + (ids ? ids[blk] * block + off : last) + lane;
        typedef typename Pos<FAST>::T P;
        P j = (P)((last + lane) % period);
        const P per = (P)period;
        int sl = steps - 1;
        // `inner`: a literal true where the step loaded is whole and not the chunk's first.
        auto load = [&](u32& bits, int& t, const bool inner) {
            if (!inner && sl < 0) return;
            bits = inner || (sl << 5) + lane < here ? (u32)*sp : 0u;
            t = FAST ? ptab[j] : tab.at(j);
            if (inner || sl > 0) {
                off -= 32;
                sp -= 32;
                while (off < 0) {  // into the block before (a loop: the compiler predicates an if)
                    off += (int)block;
                    blk--;
                    sp = (const T*)src + ids[blk] * block + off + lane;
                }
                if (lane == 0 && off >= 512) prefetch_l2(sp - 512);
                j -= 32;
                if (FAST) { if (j < 0) j += per; } else { while (j < 0) j += per; }
            }
            sl--;
        };
        // An inner step whose table is byte `b` of w4, the word of ptab4 (where the host built
        // it) that holds the tables of the group's DEPTH loads: one load where there were four.
        u32 w4 = 0;
        auto load_wide = [&](u32& bits, int& t, const int b) {
            bits = (u32)*sp;
            t = (w4 >> (8 * b)) & 0xff;
            off -= 32;
            sp -= 32;
            while (off < 0) {
                off += (int)block;
                blk--;
                sp = (const T*)src + ids[blk] * block + off + lane;
            }
            if (lane == 0 && off >= 512) prefetch_l2(sp - 512);
            sl--;
        };
        u32 bq[DEPTH];
        int tq[DEPTH];
#pragma unroll
        for (int u = 0; u < DEPTH; u++) load(bq[u], tq[u], false);
        int p = my_cap;
        u32 x = STATE_LOW;
        // One step. `v` is a literal true in the groups of whole steps, which then drop the
        // per-lane tests.
        auto code = [&](const int u, const int s, const bool v, const bool inner, const bool wide) {
            const u32 bits = bq[u];
            const int t = tq[u];
            if (wide) load_wide(bq[u], tq[u], DEPTH - 1 - u);
            else load(bq[u], tq[u], inner);
            const u32 sym = bits >> R;
            const uint2 e = FAST ? enc_s[(t << S) | sym] : enc_g[(t << S) | sym];
            const u32 cum = e.y & 0x3fffu, comp = (e.y >> 14) & 0x3fffu, l = e.y >> 28;
            const bool escaped = v && cum == comp;
            if (__any_sync(FULL, escaped)) {  // the symbol's own bits, coded before the escape
                const bool out = escaped && x >= esc_limit;
                const u32 mask = __ballot_sync(FULL, out);
                const int kk = __popc(mask);
                if (out) { slot[p - kk + __popc(mask & below)] = (u16)x; x >>= 16; }
                p -= kk;
                if (escaped) x = (x << S) + sym;
            }
            const bool out = v && (x >> (32 - M)) + comp >= top;  // x >= f << (32 - M)
            const u32 mask = __ballot_sync(FULL, out);
            const int kk = __popc(mask);
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
        };
        const int whole = here >> 5;  // steps with all 32 elements
        for (int s0 = steps - 1; s0 >= 0 && p >= 0; s0 -= DEPTH) {
            if (FAST && ptab4 && s0 >= 2 * DEPTH && s0 < whole) {
                // j is step s0 - DEPTH's position; the word at step s0 - 2 DEPTH + 1's holds
                // the tables of steps s0 - 2 DEPTH + 1 .. s0 - DEPTH (period >= 128).
                P jb = j - 32 * (DEPTH - 1);
                if (jb < 0) jb += per;
                w4 = ptab4[jb];
#pragma unroll
                for (int u = 0; u < DEPTH; u++) code(u, s0 - u, true, true, true);
                j = jb - 32;
                if (j < 0) j += per;
            } else if (s0 >= 2 * DEPTH && s0 < whole) {  // loads steps s0 - DEPTH - u >= 1
#pragma unroll
                for (int u = 0; u < DEPTH; u++) code(u, s0 - u, true, true, false);
            } else if (s0 >= DEPTH - 1 && s0 < whole) {
#pragma unroll
                for (int u = 0; u < DEPTH; u++) code(u, s0 - u, true, false, false);
            } else {
#pragma unroll
                for (int u = 0; u < DEPTH; u++) {
                    const int s = s0 - u;
                    if (s < 0) break;
                    code(u, s, (s << 5) + lane < here, false, false);
                }
            }
        }
        const bool stored = p <= 0;
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

// The checks of the few bytes outside a frame's streams: every padding byte (gaps[2k] its
// first byte, gaps[2k+1] how many, at most 16) zero, and the raw stream's last byte's unused
// bits. One warp; sets err (the decode's first kernel, so nothing zeroes it before).
__device__ void check_padding(const u8* frame, const i64* gaps, i64 last_raw, i64 used_bits, int* err)
{
    const int k = threadIdx.x & 31;
    bool bad = false;
    for (int g = 0; g < 5; g++) bad |= k < gaps[2 * g + 1] && frame[gaps[2 * g] + k];
    if (k == 0 && used_bits) bad |= (frame[last_raw] >> used_bits) != 0;
    bad = __any_sync(FULL, bad);
    if (k == 0) *err = bad ? 1 : 0;
}

// Inclusive sums of the chunks' word counts, cum[c] = counts[0] + ... + counts[c], in one
// block of 1024 threads (8 counts a thread a tile): a launch where torch's cumsum costs the
// host several times that. Where err is given (decode), warp 0 first checks the padding.
extern "C" __global__ void __launch_bounds__(1024) entropy_scan(
    const u32* __restrict__ counts, i64 n, i64* __restrict__ cum, const u8* __restrict__ frame, i64 g0, i64 l0,
    i64 g1, i64 l1, i64 g2, i64 l2, i64 g3, i64 l3, i64 g4, i64 l4, i64 last_raw, i64 used_bits, int* err)
{
    __shared__ i64 sums[32];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    if (err && warp == 0) {
        const i64 gaps[10] = {g0, l0, g1, l1, g2, l2, g3, l3, g4, l4};
        check_padding(frame, gaps, last_raw, used_bits, err);
    }
    i64 carry = 0;
    for (i64 tile = 0; tile < n; tile += 8 * 1024) {
        const i64 at = tile + (i64)t * 8;
        u32 v[8];
        i64 mine = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            v[k] = at + k < n ? counts[at + k] : 0u;
            mine += v[k];
        }
        i64 x = mine;  // inclusive over the warp's threads
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const i64 y = __shfl_up_sync(FULL, x, d);
            if (lane >= d) x += y;
        }
        if (lane == 31) sums[warp] = x;
        __syncthreads();
        if (warp == 0) {
            i64 w = sums[lane];
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const i64 y = __shfl_up_sync(FULL, w, d);
                if (lane >= d) w += y;
            }
            sums[lane] = w;
        }
        __syncthreads();
        i64 run = carry + (warp ? sums[warp - 1] : 0) + x - mine;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            run += v[k];
            if (at + k < n) cum[at + k] = run;
        }
        carry += sums[31];
        __syncthreads();
    }
}

// The frame around the raw stream, placed from the word total (cum: inclusive sums of the
// counts) on the device so that the host need not read it first: the frame starts where its
// raw stream lands on the coder's (buf + raw_at). Writes the frame's first bytes from
// `prefix` (the header with no words, then the tables and map up to the counts), the header
// completed: the word stream's length (a u64 at words_length_at) and the CRC32C of its first
// `body` bytes after them; then counts and states, each chunk's words from the tail of its
// slot, and the zero padding after the counts and after the words. One warp per chunk.
extern "C" __global__ void entropy_assemble(
    const u16* __restrict__ slots, const u32* __restrict__ counts, const u32* __restrict__ states,
    const i64* __restrict__ cum, i64 cap, i64 cap_last, i64 stride, i64 nchunks, u8* __restrict__ buf, i64 raw_at,
    const u8* __restrict__ prefix, i64 body, i64 words_length_at, i64 prefix_len, i64 counts_at, i64 states_at,
    i64 words_at, i64 has_raw)
{
    const int lane = threadIdx.x & 31;
    const i64 total = cum[nchunks - 1];
    const i64 words_end = words_at + 2 * total;
    const i64 raw_off = (words_end + 15) & ~(i64)15;
    u8* frame = buf + raw_at - raw_off;
    if (blockIdx.x == 0) {  // the header (CRC32C, reflected 0x82F63B78, as google_crc32c)
        __shared__ u32 crc_table[256];
        for (int i = threadIdx.x; i < 256; i += blockDim.x) {
            u32 v = i;
            for (int b = 0; b < 8; b++) v = (v >> 1) ^ (0x82F63B78u & (0u - (v & 1u)));
            crc_table[i] = v;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            const unsigned long long length = 2ull * (unsigned long long)total;
            u32 crc = FULL;
            for (int k = 0; k < (int)body; k++) {
                const int at = k - (int)words_length_at;
                const u8 b = at >= 0 && at < 8 ? (u8)(length >> (8 * at)) : prefix[k];
                frame[k] = b;
                crc = crc_table[(crc ^ b) & 0xff] ^ (crc >> 8);
            }
            crc = ~crc;
            for (int k = 0; k < 4; k++) frame[body + k] = (u8)(crc >> (8 * k));
        }
    }
    const i64 threads = (i64)gridDim.x * blockDim.x, me = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    for (i64 k = body + 4 + me; k < prefix_len; k += threads) frame[k] = prefix[k];
    const i64 warps = threads >> 5;
    for (i64 c = me >> 5; c < nchunks; c += warps) {
        const u32 cnt = counts[c];
        const i64 my_cap = c == nchunks - 1 ? cap_last : cap;
        if (lane == 0) ((u32*)(frame + counts_at))[c] = cnt;
        ((u32*)(frame + states_at))[c * 32 + lane] = states[c * 32 + lane];
        // The words as 32-bit pairs of the destination: a leading and a trailing word alone,
        // each pair one aligned source word or two shifted (a read may pass the slot's end by
        // one word: the scratch has room).
        const u16* from = slots + c * stride + SLOT_HEAD + (my_cap - cnt);
        u16* to = (u16*)(frame + words_at) + (cum[c] - cnt);
        const int dp = (int)(((size_t)to >> 1) & 1), rest = (int)cnt - dp;
        if (dp && lane == 0 && cnt) to[0] = from[0];
        if (rest <= 0) continue;
        const int q = (int)(((size_t)(from + dp) >> 1) & 1), pairs = rest >> 1;
        const u32* fa = (const u32*)(from + dp - q);
        u32* to32 = (u32*)(to + dp);
        for (int i = lane; i < pairs; i += 256) {  // 1 KiB a warp in flight
            u32 v[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const int k = i + 32 * u;
                v[u] = k < pairs ? (q ? __funnelshift_r(fa[k], fa[k + 1], 16) : fa[k]) : 0u;
            }
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (i + 32 * u < pairs) to32[i + 32 * u] = v[u];
        }
        if ((rest & 1) && lane == 0) to[dp + 2 * pairs] = from[dp + 2 * pairs];
    }
    const i64 pad1_at = counts_at + 4 * nchunks, pad1 = states_at - pad1_at;
    const i64 pad2 = has_raw ? raw_off - words_end : 0;
    if (blockIdx.x == 0 && threadIdx.x < 16) {
        if (threadIdx.x < pad1) frame[pad1_at + threadIdx.x] = 0;
        if (threadIdx.x < pad2) frame[words_end + threadIdx.x] = 0;
    }
}

// ---------------------------------------------------------------------------------------
// Decode. Tables: the symbol of each (table, slot), and f | cum << 16 of each (table, symbol).
// A chunk's place in the word stream, checked against its count and capacity (the same on every
// lane); false, with err set, if they disagree.
struct Span { i64 start, first; int here, steps, len; bool stored; };

__device__ __forceinline__ bool chunk_span(int c, int lane, const u32* __restrict__ counts,
                                           const i64* __restrict__ cum, i64 total_words, int nchunks, int chunk,
                                           i64 cap, i64 cap_last, i64 n, int* __restrict__ err, Span& sp)
{
    const u32 cnt = counts[c];
    const int my_cap = (int)(c == nchunks - 1 ? cap_last : cap);
    const i64 end = cum[c], start = end - (int)cnt;
    if (cnt > (u32)my_cap || start < 0 || end > total_words || (c == nchunks - 1 && end != total_words)) {
        if (lane == 0) atomicOr(err, 1);
        return false;
    }
    sp.start = start;
    sp.first = (i64)c * chunk;
    sp.here = (int)(n - sp.first < chunk ? n - sp.first : chunk);
    sp.steps = (sp.here + 31) >> 5;
    sp.len = (int)cnt;
    sp.stored = sp.len == my_cap;
    return true;
}

// A stored chunk: the symbols packed, S bits each, beside their raw fields; true (bad) if its
// state is not 0.
template <int S, int R, typename T>
__device__ __forceinline__ bool decode_stored(const u16* __restrict__ wc, int len, const u32* __restrict__ rc,
                                              int rlast, T* __restrict__ oc, int here, int steps, int lane, u32 x)
{
    constexpr u32 ESC = 1u << S;
    for (int s = 0; s < steps; s++) {
        const int k = (s << 5) + lane;
        const int bit = k * S, at = bit >> 4;
        const u32 pair = (at < len ? (u32)wc[at] : 0u) | (at + 1 < len ? (u32)wc[at + 1] : 0u) << 16;
        const u32 sym = (pair >> (bit & 15)) & (ESC - 1);
        u32 rv = 0;
        if (R) rv = unpack_field<R ? R : 1>(lane <= R ? rc[min(s * R + lane, rlast)] : 0u, lane);
        if (k < here) oc[k] = (T)(sym << R | rv);
    }
    return x != 0;
}

// This is the generic build (tables in global memory); entropy_decode_fast below the fast one.
// Every chunk, coded or stored, is decoded into `out` (fresh memory: the caller copies it
// on only if err stays 0). err gets 1 on any inconsistency; the checks are the reference's,
// plus the frame's padding and the raw stream's unused bits.
template <int S, int R, int EB>
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
    const u16* slot_tab = slot_g;
    const u32* fc = fc_g;
    const TableOf tab{ptab, cmap, period, tc, cc};
    const int chunk = (int)chunk_, nchunks = (int)nchunks_, M = (int)M_;
    const int lane = threadIdx.x & 31;
    const u32 below = (1u << lane) - 1, slot_mask = (1u << M) - 1;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    for (int c = (int)((blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5); c < nchunks; c += warps) {
        Span sp;
        if (!chunk_span(c, lane, counts, cum, total_words, nchunks, chunk, cap_, cap_last_, n, err, sp)) continue;
        const i64 first = sp.first, start = sp.start;
        const int here = sp.here, steps = sp.steps, len = sp.len;
        bool bad;
        const u16* wc = words + start;  // this chunk's words
        const u32* rc = raw + (first >> 5) * R;  // and raw words: R a step
        const int rlast = R ? (int)min((i64)(steps + 1) * R, raw_words - (first >> 5) * R) - 1 : 0;
        T* oc = (T*)out_ + first;
        u32 x = states[(i64)c * 32 + lane];
        if (sp.stored) {
            bad = decode_stored<S, R>(wc, len, rc, rlast, oc, here, steps, lane, x);
        } else {
            bad = x < STATE_LOW;
            // Window of the chunk's next words: lane k holds words base+k, base+32+k and
            // base+64+k; the next unread word is base + pos, pos < 32.
            int base = 0, pos = 0;
            u32 w0 = lane < len ? wc[lane] : 0u, w1 = lane + 32 < len ? wc[lane + 32] : 0u;
            u32 w2 = lane + 64 < len ? wc[lane + 64] : 0u;
            i64 j = (first + lane) % period;  // position in the period
            // The next step's table, and raw words two steps ahead (lanes 0..R hold a step's
            // words and the next step's first). Loading further ahead measured slower.
            int t_next = tab.at(j);
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
                while (j >= period) j -= period;
                t_next = tab.at(j);
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

// The fast decode (tables in shared memory): the generic kernel's bytes and checks, with fewer
// instructions a step, which bound it. Steps go in groups of G whose raw words (G * R <= 32)
// one load brings into the warp, lane k holding word k, so that each step's fields are two
// shuffles from fixed lanes, and whose table ids one load brings (ptab4[j]: the tables of
// positions j, j + 32, j + 64, j + 96 of the period, a byte each); a group whose steps are all
// inside the chunk drops the per-lane validity tests; a refill is one shuffle (a lane at or
// past the window's read position gives its first word, one before it its second).
template <int S, int R, int EB>
__global__ void __launch_bounds__(1024, 1) entropy_decode_fast(
    const u16* __restrict__ words, i64 total_words, const u32* __restrict__ counts, const i64* __restrict__ cum,
    const u32* __restrict__ states, const u16* __restrict__ slot_g, const u32* __restrict__ fc_g, i64 slot_words,
    i64 fc_words_, const u32* __restrict__ ptab4, const u8* __restrict__ cmap, i64 period, i64 tc, i64 cc, i64 n,
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
        Span sp;
        if (!chunk_span(c, lane, counts, cum, total_words, nchunks, chunk, cap_, cap_last_, n, err, sp)) continue;
        const i64 first = sp.first, start = sp.start;
        const int here = sp.here, steps = sp.steps, len = sp.len;
        bool bad;
        const u16* wc = words + start;
        const u32* rc = raw + (first >> 5) * R;
        const int rlast = R ? (int)min((i64)(steps + G) * R, raw_words - (first >> 5) * R) - 1 : 0;
        T* oc = (T*)out_ + first;
        u32 x = states[(i64)c * 32 + lane];
        if (sp.stored) {
            bad = decode_stored<S, R>(wc, len, rc, rlast, oc, here, steps, lane, x);
        } else {
            bad = x < STATE_LOW;
            int base = 0, pos = 0;  // window: lane k holds words base+k, +32+k, +64+k; next unread base+pos
            u32 w0 = lane < len ? wc[lane] : 0u, w1 = lane + 32 < len ? wc[lane + 32] : 0u;
            u32 w2 = lane + 64 < len ? wc[lane + 64] : 0u;
            auto refill = [&](const bool need) {  // a shuffle reads its lane index mod 32
                const u32 mask = __ballot_sync(FULL, need);
                const int idx = pos + __popc(mask & below);
                const u32 w = __shfl_sync(FULL, lane >= pos ? w0 : w1, idx);
                if (need) x = __byte_perm(x, w, 0x1054);  // x << 16 | w
                pos += __popc(mask);
                if (pos >= 32) {
                    pos -= 32; base += 32; w0 = w1; w1 = w2;
                    w2 = base + 64 + lane < len ? wc[base + 64 + lane] : 0u;
                }
            };
            // The tables of a group's steps, one byte each, in one word of ptab4 (period >= 128).
            int j = (int)((first + lane) % period);
            u32 tv_next = ptab4[j];
            j += G << 5;
            if (j >= per) j -= per;
            // Every lane loads (those past the group's G * R words a word they ignore).
            const u32* rp = rc + lane;
            const int rlim = rlast - lane;
            u32 rw_next = R ? ld_stream(rp + min(0, rlim)) : 0u;
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
                const u32 rw = rw_next, tv = tv_next;
                if (R) rw_next = ld_stream(rp + min((g + 1) * G * R, rlim));
                tv_next = ptab4[j];
                j += G << 5;
                if (j >= per) j -= per;
                if ((g + 1) * (G << 5) <= here) {
#pragma unroll
                    for (int u = 0; u < G; u++) step((tv >> (8 * u)) & 0xff, rw, u, true);
                } else {
#pragma unroll
                    for (int u = 0; u < G; u++) step((tv >> (8 * u)) & 0xff, rw, u, ((g * G + u) << 5) + lane < here);
                }
            }
            bad |= x != STATE_LOW || base + pos != len;
        }
        if (__any_sync(FULL, bad) && lane == 0) atomicOr(err, 1);
    }
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
