// Entropy codec kernels: one warp per chunk, lane k of the warp is the chunk's Huffman lane k.
// The bytes are reference.py's (FORMAT.md, "entropy"); words are taken at refill points by
// lane with one ballot each, exactly the reference's order.
//
// Each chunk is a chain of dependent steps and the SM issues an instruction nearly every
// cycle, so the instructions a step bound the coders: a decoded symbol is one lookup of the
// window's top CODE_BITS bits and a shift, and a refill (a ballot and a shuffle) serves a
// segment of three steps. The fast builds (FAST = 1, 2) keep the tables in shared memory; the
// generic builds read them from global memory.
//
// All integer kernel parameters are 64-bit: the host passes every argument as 8 bytes.
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define FULL 0xffffffffu

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

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}

// A load whose value is never used: it brings p's line into the caches (measured a little
// better than a prefetch instruction for the encoder's elements) and stalls nothing.
__device__ __forceinline__ void touch(const void* p) {
    asm volatile("{ .reg .u32 t; ld.global.nc.u32 t, [%0]; }" :: "l"((size_t)p & ~(size_t)3));
}

// A streamed word, its 256-byte neighbourhood brought into L2 on a miss.
__device__ __forceinline__ u32 ld_stream(const u32* p) {
    u32 v;
    asm volatile("ld.global.nc.L2::256B.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// Copies `words` 32-bit words of a table into shared memory.
__device__ __forceinline__ void load_shared(u32* dst, const u32* src, int words) {
    for (int k = threadIdx.x; k < words; k += blockDim.x) dst[k] = src[k];
}

template <int EB> struct Elem;
template <> struct Elem<1> { typedef u8 T; };
template <> struct Elem<2> { typedef u16 T; };

// ---------------------------------------------------------------------------------------
// Shared by both coders. A chunk is one warp; lane k codes elements 32 s + k (step s). Steps go
// in groups of GROUP steps, a group in segments of SEGMENT steps (the last one shorter); a refill
// point precedes each segment, and follows a segment's codes where any lane escaped. At a refill
// point each lane whose window holds fewer than `need` bits takes the chunk's next word (lanes
// in order): one ballot, one shuffle. Whole groups of whole steps whose period has a ptab4
// (tables of positions j, j + 32, j + 64, j + 96 a byte each) are unrolled with constant segment
// lengths and no per-lane tests (FULL); the rest (a chunk's short last group, other periods)
// take the same code with tests.
#define CODE_BITS 10
#define LEN_BITS 4
#define SEGMENT 3
#define GROUP 32
#define ESC_FLAG 0x80000000u

// The tables of this lane's elements, four steps a word of ptab4 (whole groups; period >= 128),
// loaded eight steps ahead of their use: a load's latency would otherwise stall the chain.
// Position j's word is ptab4[j], or with COMPACT (the FAST = 2 builds) ptab4[((j >> hi) << lo)
// | (j & (2**lo - 1))]: a word per context of a block of 2**(hi - lo) token rows of 2**lo
// positions (a multiple of 128). A cache block's period of a million positions needs that:
// its 65,536 contexts' words stay in the caches, where a word per position missed them. The
// index costs a register the other builds keep.
template <bool COMPACT>
struct TableCursor {
    const u32* ptab4;
    int j;  // this lane's position in the period eight steps after the next
    u32 a, b;  // the next two words
    u32 word;  // the one in use
    // per, hi and lo are kernel parameters, passed down so that they take no registers.
    __device__ __forceinline__ u32 at(const i64 hi, const i64 lo) const {
        return ptab4[COMPACT ? ((j >> (int)hi) << (int)lo) | (j & ((1 << (int)lo) - 1)) : j];
    }
    __device__ __forceinline__ void start(int from, const i64 per, const i64 hi, const i64 lo) {
        j = from;
        a = at(hi, lo);
        advance(per);
        b = at(hi, lo);
        advance(per);
    }
    __device__ __forceinline__ void advance(const i64 per) {
        j += 128;
        if (j >= (int)per) j -= (int)per;
    }
    // The tables of the next four steps, a byte each.
    __device__ __forceinline__ u32 four(const i64 per, const i64 hi, const i64 lo) {
        const u32 v = a;
        a = b;
        b = at(hi, lo);
        advance(per);
        return v;
    }
    // The tables of the segment of `sl` steps at step s0 of a whole group (both constants once
    // unrolled), a byte each: a word of ptab4 every four steps.
    __device__ __forceinline__ u32 segment(const int s0, const int sl, const i64 per, const i64 hi, const i64 lo) {
        u32 t3 = 0;
#pragma unroll
        for (int u = 0; u < SEGMENT; u++) {
            if (u < sl) {
                const int st = s0 + u;
                if ((st & 3) == 0) word = four(per, hi, lo);
                t3 |= ((word >> (8 * (st & 3))) & 0xffu) << (8 * u);
            }
        }
        return t3;
    }
};

// The table of each step one by one (short groups, and periods without ptab4).
struct TableSteps {
    TableOf tab;
    i64 j;  // this lane's position in the period at the next step
    __device__ __forceinline__ int next() {
        const int t = tab.at(j);
        j += 32;
        while (j >= tab.period) j -= tab.period;
        return t;
    }
};

// ---------------------------------------------------------------------------------------
// Encode. The encode table has an entry per (table, symbol < 2**S): code | length << 16, and
// ESC_FLAG with the escape's code for a symbol the table lacks (its S bits follow the
// segment's codes). Each lane keeps its unwritten bits (the low pb bits of acc), what a
// decoder's window would hold (nb), and the slots it reserved at refill points for its next
// words (q0, q1: at most two are open); a word is written to its slot once complete. Slots
// past the chunk's cap are not written: the chunk is then stored (count = cap, its symbols
// packed from the slot's start). The raw fields go straight to their stream: per group, lane
// k's fields packed LSB first into words 32 w + k (`raw_chunk` words a whole chunk).
template <int S, int R, int EB, int FAST>
__global__ void __launch_bounds__(1024, 1) entropy_encode(
    const void* __restrict__ src, const i64* __restrict__ ids, i64 block, i64 n, i64 chunk_, i64 nchunks_,
    const u32* __restrict__ enc_g, i64 enc_words, const u8* __restrict__ ptab, const u8* __restrict__ cmap,
    i64 period, i64 tc, i64 cc, const u32* __restrict__ ptab4, i64 p4hi, i64 p4lo, u32* __restrict__ slots,
    i64 stride,
    u32* __restrict__ counts, u32* __restrict__ raw, i64 raw_chunk, const int* __restrict__ err)
{
    if (err && *(volatile const int*)err) return;  // block ids the check refused: read nothing
    typedef typename Elem<EB>::T T;
    constexpr int RW = R ? R : 1;
    extern __shared__ u32 enc_s[];
    if (FAST) {
        load_shared(enc_s, enc_g, (int)enc_words);
        __syncthreads();
    }
    const u32* enc = FAST ? enc_s : enc_g;
    const int chunk = (int)chunk_, nchunks = (int)nchunks_;
    const int lane = threadIdx.x & 31;
    const u32 below = (1u << lane) - 1;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    for (int c = (int)((blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5); c < nchunks; c += warps) {
        const i64 first = (i64)c * chunk;
        const int here = (int)(n - first < chunk ? n - first : chunk);
        const int my_cap = (here * S + 31) >> 5;
        const int steps = (here + 31) >> 5;
        u32* slot = slots + (i64)c * stride;
        u32* rc = raw + (i64)c * raw_chunk + lane;
        i64 blk = ids ? first / block : 0;
        int off = ids ? (int)(first - blk * block) : 0;
        const i64 nblocks = ids ? n / block : 0;
        const T* sp = (const T*)src + (ids ? ids[blk] * block + off : first) + lane;
        // This lane's element of the next step not yet loaded (0 where v is false), and on.
        auto load_next = [&](const bool v) {
            const u32 bits = v ? (u32)*sp : 0u;
            sp += 32;
            if (ids) {
                off += 32;
                if (off == (int)block) {
                    off = 0;
                    blk++;
                    if (blk < nblocks) sp = (const T*)src + ids[blk] * block + lane;
                }
            }
            return bits;
        };
        TableCursor<FAST == 2> tcur{ptab4};
        if (FAST && ptab4) tcur.start((int)((first + lane) % period), period, p4hi, p4lo);
        int pos = 0, nb = 0, q0 = -1, q1 = -1, pb = 0;
        unsigned long long acc = 0;
        auto reserve = [&](const bool need) {
            const u32 mask = __ballot_sync(FULL, need);
            const int r = pos + __popc(mask & below);
            if (need) {
                if (q0 < 0) q0 = r; else q1 = r;
                nb += 32;
            }
            pos += __popc(mask);
        };
        auto append = [&](const u32 code, const int len) {
            acc = acc << len | code;
            pb += len;
            nb -= len;
        };
        auto flush = [&]() {
            if (pb >= 32) {
                pb -= 32;
                if (q0 < my_cap) slot[q0] = (u32)(acc >> pb);
                q0 = q1;
                q1 = -1;
            }
        };
        // One segment of `len` steps from step s whose elements are `in` (loaded ahead); `full`:
        // every lane of every step is in the chunk and the tables come from t3 (a byte a step);
        // `exact`: the chunk's last group, whose refills take what the codes need. Hands back the
        // steps' raw fields.
        auto segment = [&](const int s, const int len, const bool full, const u32 t3, TableSteps* ts, const u32* in,
                           u32* fields, const bool exact) {
            const int before = nb;  // the window a decoder has at this refill point
            int used = 0;
            u32 escs = 0;
#pragma unroll
            for (int u = 0; u < SEGMENT; u++) {
                if (u < len) {
                    const bool v = full || ((s + u) << 5) + lane < here;
                    const int t = full ? (int)((t3 >> (8 * u)) & 0xff) : ts->next();
                    fields[u] = R ? in[u] & ((1u << RW) - 1) : 0u;
                    const u32 e = enc[(t << S) | (in[u] >> R)];
                    const int l = v ? (int)((e >> 16) & 0xff) : 0;
                    acc = acc << l | (v ? e & 0xffffu : 0u);
                    pb += l;
                    used += l;
                    if (v && (e & ESC_FLAG)) escs |= 1u << u;
                }
            }
            nb -= used;
            reserve(exact ? used > before : before < CODE_BITS * len);
            flush();
            if (__any_sync(FULL, escs != 0)) {
                const int esc_bits = S * __popc(escs);
                reserve(exact ? esc_bits > nb : nb < S * len);
#pragma unroll
                for (int u = 0; u < SEGMENT; u++)
                    if (u < len && (escs >> u & 1u)) append(in[u] >> R, S);
                flush();
            }
        };
        for (int g = 0; g < steps; g += GROUP) {
            const int gl = min(GROUP, steps - g);
            u32* rg = rc + (i64)g * R;  // this group's raw words: 32 R per whole group before it
            if (FAST && ptab4 && g + GROUP < steps) {  // a whole group, not the chunk's last
                u32 rw[RW], cur[SEGMENT], nxt[SEGMENT];
#pragma unroll
                for (int w = 0; w < RW; w++) rw[w] = 0;
#pragma unroll
                for (int u = 0; u < SEGMENT; u++) cur[u] = load_next(true);
                // Lane k brings the row of the step 32 + k steps on into the caches (the next group's).
                if (!ids || off + ((GROUP + lane) << 5) < (int)block) touch(sp + ((GROUP + lane - 1) << 5));
#pragma unroll
                for (int k = 0; k < (GROUP + SEGMENT - 1) / SEGMENT; k++) {
                    const int s0 = k * SEGMENT, sl = min(SEGMENT, GROUP - s0);
                    const int nl = min(SEGMENT, GROUP - s0 - sl);  // the next segment's steps
#pragma unroll
                    for (int u = 0; u < SEGMENT; u++)
                        if (u < nl) nxt[u] = load_next(true);
                    u32 fields[SEGMENT];
                    segment(g + s0, sl, true, tcur.segment(s0, sl, period, p4hi, p4lo), nullptr, cur, fields, false);
#pragma unroll
                    for (int u = 0; u < SEGMENT; u++) cur[u] = nxt[u];
#pragma unroll
                    for (int u = 0; u < SEGMENT; u++) {
                        if (R && u < sl) {
                            const int bit = R * (s0 + u), w = bit >> 5, sh = bit & 31;
                            rw[w] |= fields[u] << sh;
                            if (sh + R > 32) rw[w + 1] |= fields[u] >> (32 - sh);
                            if (sh + R >= 32) rg[32 * w] = rw[w];  // word w is complete
                        }
                    }
                }
            } else {
                TableSteps tsteps{TableOf{ptab, cmap, period, tc, cc}, (first + lane + ((i64)g << 5)) % period};
                unsigned long long racc = 0;
                int rbits = 0, rword = 0;
                for (int s0 = 0; s0 < gl; s0 += SEGMENT) {
                    const int sl = min(SEGMENT, gl - s0);
                    u32 in[SEGMENT], fields[SEGMENT];
#pragma unroll
                    for (int u = 0; u < SEGMENT; u++)
                        if (u < sl) in[u] = load_next(((g + s0 + u) << 5) + lane < here);
                    segment(g + s0, sl, false, 0u, &tsteps, in, fields, g + GROUP >= steps);
                    if (R) {
#pragma unroll
                        for (int u = 0; u < SEGMENT; u++) {
                            if (u >= sl) break;
                            racc |= (unsigned long long)fields[u] << rbits;
                            rbits += R;
                            if (rbits >= 32) {
                                rg[32 * rword++] = (u32)racc;
                                racc >>= 32;
                                rbits -= 32;
                            }
                        }
                    }
                }
                if (R && rbits) rg[32 * rword] = (u32)racc;
            }
        }
        if (q0 >= 0 && q0 < my_cap) slot[q0] = (u32)(acc << (32 - pb));
        if (q1 >= 0 && q1 < my_cap) slot[q1] = 0u;
        const bool stored = pos >= my_cap;
        if (lane == 0) counts[c] = stored ? (u32)my_cap : (u32)pos;
        if (!stored) continue;
        // A stored chunk (rare): its symbols packed from the slot's start.
        const Packer<S> spack(lane);
        blk = ids ? first / block : 0;
        off = ids ? (int)(first - blk * block) : 0;
        __syncwarp();
        for (int s = 0; s < steps; s++) {
            const int k = (s << 5) + lane;
            const T* at = (const T*)src + (ids ? ids[blk] * block + off : first + (s << 5));
            const u32 bits = k < here ? (u32)at[lane] : 0u;
            const u32 word = spack.word(bits >> R, lane);
            if (spack.writer && s * S + spack.w < my_cap) slot[s * S + spack.w] = word;
            off += 32;
            if (ids && off == block) { off = 0; blk++; }
        }
    }
}

// The frame around the raw stream, placed from the word total (cum: inclusive sums of the
// counts) on the device so that the host need not read it first: the frame starts where its
// raw stream lands on the coder's (buf + raw_at). Writes the frame's first bytes from
// `prefix` (the header with no words, then the tables and map up to the counts), the header
// completed: the word stream's length (a u64 at words_length_at) and the CRC32C of its first
// `body` bytes after them; then the counts, each chunk's words from its slot, and the zero
// padding after the counts and after the words. One warp per chunk.
extern "C" __global__ void entropy_assemble(
    const u32* __restrict__ slots, const u32* __restrict__ counts, const i64* __restrict__ cum, i64 stride,
    i64 nchunks, u8* __restrict__ buf, i64 raw_at, const u8* __restrict__ prefix, i64 body, i64 words_length_at,
    i64 prefix_len, i64 counts_at, i64 words_at, i64 has_raw, const int* __restrict__ err)
{
    if (err && *(volatile const int*)err) return;  // the coder did not run: no total to place a frame by
    const int lane = threadIdx.x & 31;
    const i64 total = cum[nchunks - 1];
    const i64 words_end = words_at + 4 * total;
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
            const unsigned long long length = 4ull * (unsigned long long)total;
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
    u32* words = (u32*)(frame + words_at);
    for (i64 c = me >> 5; c < nchunks; c += warps) {
        const int cnt = (int)counts[c];
        if (lane == 0) ((u32*)(frame + counts_at))[c] = (u32)cnt;
        const u32* from = slots + c * stride;
        u32* to = words + (cum[c] - cnt);
        for (int i = lane; i < cnt; i += 256) {  // 1 KiB a warp in flight
            u32 v[8];
#pragma unroll
            for (int u = 0; u < 8; u++) v[u] = i + 32 * u < cnt ? from[i + 32 * u] : 0u;
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (i + 32 * u < cnt) to[i + 32 * u] = v[u];
        }
    }
    const i64 pad1_at = counts_at + 4 * nchunks, pad1 = words_at - pad1_at;
    const i64 pad2 = has_raw ? raw_off - words_end : 0;
    if (blockIdx.x == 0 && threadIdx.x < 16) {
        if (threadIdx.x < pad1) frame[pad1_at + threadIdx.x] = 0;
        if (threadIdx.x < pad2) frame[words_end + threadIdx.x] = 0;
    }
}

// ---------------------------------------------------------------------------------------
// Decode. The lookup table has 2**CODE_BITS entries a table: symbol << LEN_BITS | length of
// the code the next CODE_BITS bits start with (0: none, a corrupt stream). A lane's window is
// hi:lo, its unread bits at the top (nb of them); the chunk's next words sit in w0, w1, w2
// (lane k holds words base + k, + 32, + 64; the next unread is base + pos). Every chunk, coded
// or stored, is decoded into `out` (fresh memory: the caller copies it on only if err stays
// 0). err gets 1 on any inconsistency: a code the table lacks, a non-canonical escape, a chunk
// reading past its words or leaving some unread, non-zero bits after a lane's last code.
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

// Raw field of step s of this lane (rc: the chunk's raw words plus the lane), read from global
// memory: the stored chunks' and the short groups' way.
template <int R>
__device__ __forceinline__ u32 raw_field(const u32* __restrict__ rc, int s) {
    const int g = s & ~(GROUP - 1), bit = R * (s - g), w = bit >> 5, sh = bit & 31;
    const u32* rg = rc + (i64)g * R;
    const u32 lo = rg[32 * w], hi = sh + R > 32 ? rg[32 * (w + 1)] : 0u;
    return __funnelshift_r(lo, hi, sh) & ((1u << R) - 1);
}

// Whether the bits of this lane's last raw word of the short group at step g (gl steps) past
// its fields are zero.
template <int R>
__device__ __forceinline__ bool raw_tail_clean(const u32* __restrict__ rc, int g, int gl) {
    const int bits = gl * R, words = (bits + 31) >> 5, used = bits - 32 * (words - 1);
    return used == 32 || (rc[(i64)g * R + 32 * (words - 1)] >> used) == 0;
}

// A stored chunk: the symbols packed, S bits each, beside their raw fields; true if a raw bit
// outside the elements is set.
template <int S, int R, typename T>
__device__ __forceinline__ bool decode_stored(const u32* __restrict__ wc, int len, const u32* __restrict__ rc,
                                              T* __restrict__ oc, int here, int steps, int lane)
{
    constexpr u32 ESC = 1u << S;
    bool bad = false;
    for (int s = 0; s < steps; s++) {
        const int k = (s << 5) + lane;
        const int bit = k * S, at = bit >> 5;
        const u32 lo = at < len ? wc[at] : 0u, hi = at + 1 < len ? wc[at + 1] : 0u;
        const u32 sym = __funnelshift_r(lo, hi, bit & 31) & (ESC - 1);
        const u32 rv = R ? raw_field<R ? R : 1>(rc, s) : 0u;
        if (k < here) oc[k] = (T)(sym << R | rv);
        else bad |= rv != 0;
    }
    const int g = (steps - 1) & ~(GROUP - 1);
    if (R && steps - g < GROUP) bad |= !raw_tail_clean<R ? R : 1>(rc, g, steps - g);
    return bad;
}

template <int S, int R, int EB, int FAST>
__global__ void __launch_bounds__(1024, 1) entropy_decode(
    const u32* __restrict__ words, i64 total_words, const u32* __restrict__ counts, const i64* __restrict__ cum,
    const u16* __restrict__ lut_g, i64 lut_words, const u32* __restrict__ enc_g, const u32* __restrict__ ptab4,
    i64 p4hi, i64 p4lo,
    const u8* __restrict__ ptab, const u8* __restrict__ cmap, i64 period, i64 tc, i64 cc, i64 n, i64 chunk_,
    i64 nchunks_, i64 cap_, i64 cap_last_, const u32* __restrict__ raw, i64 raw_chunk, u8* __restrict__ out_,
    int* __restrict__ err)
{
    typedef typename Elem<EB>::T T;
    constexpr u32 ESC = 1u << S;
    constexpr int RW = R ? R : 1;
    extern __shared__ u32 dec_s[];
    if (FAST) {
        load_shared(dec_s, (const u32*)lut_g, (int)lut_words);
        __syncthreads();
    }
    const u16* lut = FAST ? (const u16*)dec_s : lut_g;
    const int chunk = (int)chunk_, nchunks = (int)nchunks_;
    const int lane = threadIdx.x & 31;
    const u32 below = (1u << lane) - 1;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    for (int c = (int)((blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5); c < nchunks; c += warps) {
        Span sp;
        if (!chunk_span(c, lane, counts, cum, total_words, nchunks, chunk, cap_, cap_last_, n, err, sp)) continue;
        const i64 first = sp.first;
        const int here = sp.here, steps = sp.steps, len = sp.len;
        const u32* wc = words + sp.start;
        const u32* rc = raw + (i64)c * raw_chunk + lane;
        T* oc = (T*)out_ + first;
        if (sp.stored) {
            const bool bad = decode_stored<S, R>(wc, len, rc, oc, here, steps, lane);
            if (__any_sync(FULL, bad) && lane == 0) atomicOr(err, 1);
            continue;
        }
        bool bad = false;
        int base = 0, pos = 0, nb = 0;
        u32 hi = 0, lo = 0;
        u32 w0 = lane < len ? wc[lane] : 0u, w1 = lane + 32 < len ? wc[lane + 32] : 0u;
        u32 w2 = lane + 64 < len ? wc[lane + 64] : 0u;
        auto refill = [&](const bool need) {  // a shuffle reads its lane index mod 32
            const u32 mask = __ballot_sync(FULL, need);
            const int idx = pos + __popc(mask & below);
            const u32 w = __shfl_sync(FULL, lane >= pos ? w0 : w1, idx & 31);
            if (need) {
                hi |= w >> nb;
                lo |= __funnelshift_r(0u, w, nb);
                nb += 32;
            }
            pos += __popc(mask);
            if (pos >= 32) {
                pos -= 32; base += 32; w0 = w1; w1 = w2;
                w2 = base + 64 + lane < len ? wc[base + 64 + lane] : 0u;
            }
        };
        TableCursor<FAST == 2> tcur{ptab4};
        if (FAST && ptab4) tcur.start((int)((first + lane) % period), period, p4hi, p4lo);
        T* op = oc + lane;
        // The symbols of one segment of `sl` steps from step s; `full`: every lane of every step
        // in the chunk, tables from t3 (a byte a step); `exact`: the chunk's last group, whose
        // refills take what the codes need (learnt by decoding them from the window first: past
        // its unread bits the window is zero, so a code that does not fit reads as longer).
        auto segment = [&](const int s, const int sl, const bool full, const u32 t3, TableSteps* ts, u32* syms,
                           const bool exact) {
            int tabs[SEGMENT];
#pragma unroll
            for (int u = 0; u < SEGMENT; u++)
                if (u < sl) tabs[u] = full ? (int)((t3 >> (8 * u)) & 0xff) : ts->next();
            if (exact) {
                u32 th = hi, tl = lo;
                int used = 0;
#pragma unroll
                for (int u = 0; u < SEGMENT; u++) {
                    if (u < sl && ((s + u) << 5) + lane < here) {
                        const u32 e = lut[(tabs[u] << CODE_BITS) | (th >> (32 - CODE_BITS))];
                        const u32 l = e & ((1u << LEN_BITS) - 1);
                        used += e ? (int)l : 64;
                        th = __funnelshift_l(tl, th, l);
                        tl <<= l;
                    }
                }
                refill(used > nb);
            } else {
                refill(nb < CODE_BITS * sl);
            }
            bool esc_any = false;
            int escs = 0;
#pragma unroll
            for (int u = 0; u < SEGMENT; u++) {
                if (u < sl) {
                    const bool v = full || ((s + u) << 5) + lane < here;
                    const int t = tabs[u];
                    const u32 e = lut[(t << CODE_BITS) | (hi >> (32 - CODE_BITS))];
                    u32 l = e & ((1u << LEN_BITS) - 1);
                    if (!full && !v) l = 0;
                    bad |= (full || v) && e == 0;
                    hi = __funnelshift_l(lo, hi, l);
                    lo <<= l;
                    nb -= (int)l;
                    syms[u] = full || v ? e >> LEN_BITS : 0u;
                    esc_any |= syms[u] == ESC;
                    escs += syms[u] == ESC;
                }
            }
            if (__any_sync(FULL, esc_any)) {
                refill(exact ? S * escs > nb : nb < S * sl);
#pragma unroll
                for (int u = 0; u < SEGMENT; u++) {
                    if (u < sl && syms[u] == ESC) {
                        const u32 symbol = hi >> (32 - S);
                        hi = __funnelshift_l(lo, hi, S);
                        lo <<= S;
                        nb -= S;
                        if (!(enc_g[(tabs[u] << S) | symbol] & ESC_FLAG)) bad = true;  // non-canonical escape
                        syms[u] = symbol;
                    }
                }
            }
        };
        for (int g = 0; g < steps; g += GROUP) {
            const int gl = min(GROUP, steps - g);
            if (FAST && ptab4 && g + GROUP < steps) {  // a whole group, not the chunk's last
                u32 rw[RW];
#pragma unroll
                for (int w = 0; w < RW; w++) rw[w] = R ? ld_stream(rc + (i64)g * R + 32 * w) : 0u;
                if (R && lane < R) prefetch_l2(rc + (i64)(g + GROUP) * R + 31 * lane);  // the next group's line `lane`
#pragma unroll
                for (int k = 0; k < (GROUP + SEGMENT - 1) / SEGMENT; k++) {
                    const int s0 = k * SEGMENT, sl = min(SEGMENT, GROUP - s0);
                    u32 syms[SEGMENT];
                    segment(g + s0, sl, true, tcur.segment(s0, sl, period, p4hi, p4lo), nullptr, syms, false);
#pragma unroll
                    for (int u = 0; u < SEGMENT; u++) {
                        if (u < sl) {
                            u32 rv = 0;
                            if (R) {
                                const int bit = R * (s0 + u), w = bit >> 5, sh = bit & 31;
                                rv = sh + R > 32 ? __funnelshift_r(rw[w], rw[w + 1 < RW ? w + 1 : w], sh) : rw[w] >> sh;
                                rv &= (1u << RW) - 1;
                            }
                            op[(g + s0 + u) << 5] = (T)(syms[u] << R | rv);
                        }
                    }
                }
            } else {
                TableSteps tsteps{TableOf{ptab, cmap, period, tc, cc}, (first + lane + ((i64)g << 5)) % period};
                for (int s0 = 0; s0 < gl; s0 += SEGMENT) {
                    const int sl = min(SEGMENT, gl - s0);
                    u32 syms[SEGMENT];
                    segment(g + s0, sl, false, 0u, &tsteps, syms, g + GROUP >= steps);
                    for (int u = 0; u < sl; u++) {
                        const int st = g + s0 + u;
                        const u32 rv = R ? raw_field<RW>(rc, st) : 0u;
                        if ((st << 5) + lane < here) op[st << 5] = (T)(syms[u] << R | rv);
                        else bad |= rv != 0;
                    }
                }
                if (R && gl < GROUP) bad |= !raw_tail_clean<RW>(rc, g, gl);
            }
        }
        bad |= base + pos != len || hi != 0 || lo != 0;
        if (__any_sync(FULL, bad) && lane == 0) atomicOr(err, 1);
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

// Block ids checked on the device, so that launching work on them needs no host read: every
// id in 0..blocks-1 (else err |= 2) and, where `hits` (zeroed, one int a block) is given, none
// twice (else err |= 4). One block of threads; `reset` first zeroes err (the encoder's).
extern "C" __global__ void entropy_check_ids(const i64* __restrict__ ids, i64 n, i64 blocks,
                                             int* __restrict__ hits, int* __restrict__ err, i64 reset)
{
    if (reset) {
        if (threadIdx.x == 0) *err = 0;
        __syncthreads();
    }
    int bad = 0;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        const i64 id = ids[i];
        if (id < 0 || id >= blocks) bad |= 2;
        else if (hits && atomicAdd(hits + id, 1) > 0) bad |= 4;
    }
    if (bad) atomicOr(err, bad);
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
