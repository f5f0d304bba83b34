/* CPU kernels for decode-sized products: a GEMM over pre-packed weights, a fused MoE, decode
 * attention over the paged KV cache, the norms, rotary and routing around them, and a whole
 * decoder layer for decode steps.
 *
 * Legend: M = rows of activations (tokens), N = output features, K = input features,
 * T = tokens, E = experts on this rank, Ktop = experts per token, H = hidden, I = expert
 * intermediate size (this rank's share). VW = floats per SIMD register (8 with AVX2, 16 with
 * AVX-512), NR = 2 * VW = columns of one packed panel, MR = rows of one register tile.
 *
 * Why: torch's CPU matmul (MKL) repacks the weight operand on every call; with a handful of rows
 * (decode: one row per sequence, or a few per expert) that repacking is most of the cost, and the
 * weights stream at half the memory bandwidth. Here the weights are packed once, at load time, into
 * the order the register tile reads them, so a product with few rows reads every weight byte
 * exactly once, in order:
 *
 *     packed[p][k][j] = W[p * NR + j][k]      p < ceil(N / NR), k < K, j < NR (zero padding)
 *
 * The register tile computes an MR x NR block of y = x W^T with MR * 2 vector accumulators: for
 * each k, two weight vectors are loaded (and widened to float32 from bfloat16 or int8) and each of
 * the MR rows' x[m][k] is broadcast and multiplied into them. Weights are float32, bfloat16 or
 * int8 (with one float32 scale per output feature, applied once to the sum). Activations and
 * accumulation are float32 (but for AMX tiles: bfloat16 pairs, `panel_rows_amx`, and int8 products'
 * activations as three int8 parts under a scale per row, `panel_rows_amx_i8`).
 *
 * Threads: OpenMP, the same runtime torch uses (the library is loaded after torch, so libgomp.so.1
 * resolves to torch's copy and both share one pool). Work is split by column panels, so threads
 * never write the same output element.
 *
 * Written with GCC vector extensions (intrinsics only to widen bfloat16 and int8 loads): the same
 * source compiles to AVX-512, AVX2 or plain SSE2 code for the machine it is built on (-march=native).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#define MR 12
#elif defined(__AVX__)
#define VW 8
#define MR 6
#else
#define VW 4
#define MR 4
#endif
#define NR (2 * VW)
#ifndef PF_DIST
#define PF_DIST 256 /* bytes ahead that a few-row product prefetches each weight stream (0: none) */
#endif
#define KC 512 /* k chunk when a panel is reused by several row tiles: NR x KC weights stay in L1/L2 */
/* k chunk of a bfloat16 panel that several blocks of 16 rows read through AMX tiles in place: 256 KB
 * of it stay in L2 between the blocks (all of K at once read 16k-deep panels from L3 for each block:
 * 1.15-1.2x slower at 64-192 rows, docs/benchmarks.md); a multiple of 32, so only a product's last
 * chunk can end in a partial block of pairs */
#define KC_AMX 4096
#define INFINITY_F __builtin_inff()
#define NAN_F __builtin_nanf("")

/* On a CPU with AVX512-BF16, a product with more rows than FEW_ROWS multiplies bfloat16 weights by
 * its activations rounded to bfloat16, two k at a time with vdpbf16ps: one instruction does 32
 * multiply-adds where an FMA does 16, and the weights need no widening. (Products of two bfloat16
 * are exact in float32; sums are float32, denormals flushed to zero as the instruction does.) This
 * is how llama.cpp multiplies BF16 weights, and what torch's bfloat16 matmul rounds to. Its panels
 * hold rows k and k + 1 of a panel's NR columns as the (k, k + 1) pairs those instructions read:
 * row 2j of a panel holds columns 0-15 of k = 2j and 2j + 1 side by side, row 2j + 1 columns 16-31,
 *
 *     packed[p][2j + h][2c + t] = W[p * NR + 16h + c][2j + t]     (h, t in {0, 1}, c < 16)
 *
 * and an odd K's last row holds its NR columns in order (kernels/cpu_gemm.py `pair_panels`). So a
 * vdpbf16ps takes a row as it is, and 16 pairs of rows 2j (or 2j + 1), 128 bytes apart, are an
 * AMX B tile in memory: the tiles read the weights where they lie (`panel_rows_amx`).
 * A product with few rows, bound by reading its weights, widens each row's two halves (k, then
 * k + 1) to float32, with its activations in float32 (`tile_np`): the same products, added in the
 * same order, as a panel in column order gives. Without AVX512-BF16, bfloat16 panels keep the
 * columns in order, one row of k to a row, and are widened to float32. */
#if defined(__AVX512BF16__) && VW == 16
#define BF16_PAIRS 1
#else
#define BF16_PAIRS 0
#endif
#define PAIRED(wt) (BF16_PAIRS && (wt) == W_BF16)

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef int8_t vb __attribute__((vector_size(VW)));

/* Weight types. W_I8Q: int8 panels stored as AMX-INT8 reads them (`I8_QUADS` builds, K a multiple
 * of 4): each 4 rows of k a block of 128 bytes, columns 0-15 then 16-31, each column's 4 k side by
 * side (element (k, j) at (k / 4) 128 + (j / 16) 64 + (j % 16) 4 + k % 4), so that the tiles load
 * them where they lie. */
enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2, W_I8Q = 3 };
#define IS_I8(wt) ((wt) == W_I8 || (wt) == W_I8Q)
#define QROW_PAD 16 /* rows of room after an array of `quant_row` rows */
#if BF16_PAIRS && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && \
    defined(__AVX512VBMI__) && defined(__AVX512VNNI__) && NR == 32
#define I8_QUADS 1
#else
#define I8_QUADS 0
#endif

/* The element of a quad-stored int8 panel (W_I8Q) at flat index i = k NR + j. */
static inline int64_t quad_at(int64_t i) {
    const int64_t k = i / NR, j = i % NR;
    return (k >> 2) * 4 * NR + (j >> 4) * 64 + (j & 15) * 4 + (k & 3);
}

#define INLINE static inline __attribute__((always_inline))

INLINE vf load_f(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store_f(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* x in every lane (vbroadcastss from memory, with no scalar arithmetic before it) */
#if VW == 16
INLINE vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#elif VW == 8
INLINE vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }
#else
INLINE vf splat(float x) { return (vf){x, x, x, x}; }
#endif

/* VW weights starting at element `i` of a packed panel, widened to float32. */
INLINE vf load_w(const void *w, int64_t i, const int wt) {
    if (wt == W_F32) return load_f((const float *)w + i);
    if (wt == W_BF16) { /* bfloat16 = the high half of a float32 */
#if VW == 16
        __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i)));
        return (vf)_mm512_slli_epi32(x, 16);
#elif VW == 8 && defined(__AVX2__)
        __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
        return (vf)_mm256_slli_epi32(x, 16);
#else
        vh h;
        memcpy(&h, (const uint16_t *)w + i, sizeof h);
        return (vf)(__builtin_convertvector(h, vi) << 16);
#endif
    }
#if VW == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)w + i))));
#elif VW == 8 && defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)w + i))));
#else
    vb b;
    memcpy(&b, (const int8_t *)w + i, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
#endif
}

/* One weight (or cached key/value) at element i, widened to float32 (tails of vector loops). */
INLINE float load_w1(const void *w, int64_t i, const int wt) {
    if (wt == W_F32) return ((const float *)w)[i];
    if (wt == W_I8) return (float)((const int8_t *)w)[i];
    if (wt == W_I8Q) return (float)((const int8_t *)w)[quad_at(i)];
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline int elem_size(int wt) { return wt == W_F32 ? 4 : wt == W_BF16 ? 2 : 1; }

int mm_bf16_pairs(void) { return BF16_PAIRS; }
int mm_i8_quads(void) { return I8_QUADS; }

/* The element of a paired bfloat16 panel (K rows of k) that holds row k of column c. */
static inline int64_t paired_at(int64_t k, int64_t c, int64_t K) {
    if (k >= K - K % 2) return k * NR + c; /* an odd last row: in order */
    return (k - k % 2 + c / (NR / 2)) * NR + 2 * (c % (NR / 2)) + k % 2;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if BF16_PAIRS
/* One row of K activations as ceil(K / 2) bfloat16 pairs (k even in the low half; an odd K's last
 * pair has zero in the high half), rounded to nearest even. */
static void pair_row(const float *x, int64_t K, uint32_t *out) {
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) /* cvtne2ps: the second operand's 16 to the low half */
        _mm512_storeu_si512(out + k / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k)));
    for (; k < K; k += 2)
        out[k / 2] = to_bf16(x[k]) | (k + 1 < K ? (uint32_t)to_bf16(x[k + 1]) << 16 : 0u);
}

/* rows[m] (K activations each) -> a fresh [M][ceil(K / 2)] array of pairs; NULL when memory runs out. */
static uint32_t *pair_rows(int64_t M, int64_t K, const float *const *rows) {
    const int64_t kp = (K + 1) / 2;
    uint32_t *out = malloc(sizeof(uint32_t) * (M * kp > 0 ? M * kp : 1));
    if (out)
        for (int64_t m = 0; m < M; m++) pair_row(rows[m], K, out + m * kp);
    return out;
}
#endif

/* The prefetch policy (`mm_set_prefetch`, chosen by timing when kernels/cpu_gemm.py loads this
 * library): whether weights read once are prefetched PF_DIST ahead (pf_nta, `prefetch_nta`), and
 * from how many rows a one-tile product also fetches the next panel into L2 (pf_next_rows,
 * `prefetch_next`).
 * On Zen 3 and Zen 4 both paid (1, 8); on a Xeon with a 480 MB L3 the non-temporal prefetches
 * made products of 1-7 rows 1.5-4x slower, and (0, 4) was the fastest at every row count. */
static int pf_nta = 1, pf_next_rows = 8;

void mm_set_prefetch(int nta, int next_rows) {
    pf_nta = nta;
    pf_next_rows = next_rows;
}

/* Weights read once (a product with no more rows than one register tile): row k's panel bytes
 * PF_DIST ahead, prefetched non-temporally. On the machines measured (docs/benchmarks.md) this reads
 * faster than the hardware prefetchers alone, and a decode step's weights, which no later call
 * reads again before they are evicted, no longer push its activations and the interpreter's
 * working set out of L2 and L3. Not for panels that several row tiles reuse. */
INLINE void prefetch_nta(const void *w, int64_t k, const int wt) {
    const int es = elem_size(wt);
    for (int l = 0; l < NR * es; l += 64) __builtin_prefetch((const char *)w + k * NR * es + PF_DIST + l, 0, 0);
}

/* Row k of the next panel (`next`, at the same k as this tile's panel) into L2 while a tile reads
 * row k of its own. A panel that several row tiles reuse is read from memory by its first tile, at
 * up to two cache lines per handful of FMAs: faster than one core's share of the memory system when
 * the other core streams weights too (two pipeline stages). So the first tile fetches the next
 * panel, and the next panel's first tile finds it in L2 (docs/benchmarks.md, "The next panel
 * prefetched, and decode attention that fetches ahead"). A panel that one tile of 8-12 rows reads
 * once gains too: its own lines, fetched a short distance ahead (`prefetch_nta`), kept it waiting
 * on memory at 7-12 GB/s; with the next panel on its way into L2 as well, 1.1-1.5x (docs/
 * benchmarks.md, "The next panel for one-tile products"). One tile of 4-7 rows is left out there
 * (it measured 0.87-1.33x on one thread, 0.93-0.98x on two on Zen 4; `pf_next_rows` above), and
 * the few-row streams (`tile_np`) do not fetch the next panel. */
INLINE void prefetch_next(const char *next, int64_t k, const int es) {
    for (int l = 0; l < NR * es; l += 64) __builtin_prefetch(next + k * NR * es + l, 0, 2);
}

/* Epilogue modes of a tile. */
enum { OUT_STORE = 0, OUT_ADD = 1, OUT_ADD_SCALED = 2 };

/* A panel's per-column scales (int8), or ones. */
INLINE void col_scales(const float *scale, vf *s0, vf *s1) {
    *s0 = scale ? load_f(scale) : splat(1.0f);
    *s1 = scale ? load_f(scale + VW) : splat(1.0f);
}

/* A tile row's two result vectors (times the column scales and a row factor) into c[0:ncols]. */
INLINE void put(vf r0, vf r1, vf s0, vf s1, float g, float *c, int ncols, int mode) {
    r0 *= s0;
    r1 *= s1;
    if (mode == OUT_ADD_SCALED) {
        r0 *= splat(g);
        r1 *= splat(g);
    }
    if (ncols == NR) {
        if (mode != OUT_STORE) {
            r0 += load_f(c);
            r1 += load_f(c + VW);
        }
        store_f(c, r0);
        store_f(c + VW, r1);
    } else {
        float tmp[NR];
        store_f(tmp, r0);
        store_f(tmp + VW, r1);
        for (int j = 0; j < ncols; j++) c[j] = mode == OUT_STORE ? tmp[j] : c[j] + tmp[j];
    }
}

/* `put` for one half of a tile row: r (times s, and g for OUT_ADD_SCALED) into c[0:n] (n > 0). */
INLINE void put16(vf r, vf s, float g, float *c, int n, int mode) {
    r *= s;
    if (mode == OUT_ADD_SCALED) r *= splat(g);
    if (n >= VW) {
        if (mode != OUT_STORE) r += load_f(c);
        store_f(c, r);
    } else {
        float tmp[VW];
        store_f(tmp, r);
        for (int j = 0; j < n; j++) c[j] = mode == OUT_STORE ? tmp[j] : c[j] + tmp[j];
    }
}

/* One MR' x NR tile (MR' = mr <= MR rows): c[i][0:ncols] (op)= sum_k a[i][k] * w[k][0:ncols].
 *
 * a[i]: row i's activations, from k = 0 of this chunk. w: the panel at k = 0 of this chunk.
 * c[i]: row i's output at this panel's first column. scale: per-column factor (int8) or NULL.
 * rowscale: per-row factor for OUT_ADD_SCALED (the MoE router weights), else NULL.
 * once: no other tile reads this panel (prefetch it non-temporally); next: the next panel at this
 * chunk's first k, to bring into L2 (`prefetch_next`), or NULL.
 * Constant mr and wt make the compiler emit one fully unrolled variant per case. */
INLINE void tile(const int mr, const int wt, int64_t kc, const float *const *a, const void *w, float *const *c,
                 int ncols, const float *scale, const float *rowscale, int mode, int once, const char *next) {
    vf acc[MR][2], acc2[MR][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = acc2[i][0] = acc2[i][1] = (vf){0};
    int64_t k = 0;
#if !PF_DIST
    (void)once;
#endif
    if (mr <= 3) {
        /* few rows: two independent accumulator sets (even and odd k) hide the FMA latency */
        for (; k + 1 < kc; k += 2) {
#if PF_DIST
            if (once && pf_nta) {
                prefetch_nta(w, k, wt);
                prefetch_nta(w, k + 1, wt);
            }
#endif
            vf b0 = load_w(w, k * NR, wt), b1 = load_w(w, k * NR + VW, wt);
            vf d0 = load_w(w, (k + 1) * NR, wt), d1 = load_w(w, (k + 1) * NR + VW, wt);
            for (int i = 0; i < mr; i++) {
                vf x0 = splat(a[i][k]), x1 = splat(a[i][k + 1]);
                acc[i][0] += x0 * b0;
                acc[i][1] += x0 * b1;
                acc2[i][0] += x1 * d0;
                acc2[i][1] += x1 * d1;
            }
        }
    }
    for (; k < kc; k++) {
#if PF_DIST
        if (once && pf_nta) prefetch_nta(w, k, wt);
#endif
        if (next) prefetch_next(next, k, elem_size(wt));
        vf b0 = load_w(w, k * NR, wt), b1 = load_w(w, k * NR + VW, wt);
        for (int i = 0; i < mr; i++) {
            vf x = splat(a[i][k]);
            acc[i][0] += x * b0;
            acc[i][1] += x * b1;
        }
    }
    vf s0, s1;
    col_scales(scale, &s0, &s1);
    for (int i = 0; i < mr; i++)
        put(acc[i][0] + acc2[i][0], acc[i][1] + acc2[i][1], s0, s1, rowscale ? rowscale[i] : 1.0f, c[i], ncols, mode);
}

/* Few rows (mr <= 3) against np panels at once. One stream through memory reaches about three
 * quarters of the read bandwidth that four concurrent ones do on the CPUs measured
 * (docs/benchmarks.md), and a decode step with few rows is bound by reading its weights: so the
 * panels of a few-row product are read np at a time, np streams apart.
 * w[j], coff[j], ncols[j], scale[j]: panel j's weights, column offset in each c[i], valid columns
 * and int8 scales (or NULL). */
INLINE void tile_np(const int mr, const int np, const int wt, int64_t kc, const float *const *a,
                    const char *const *w, float *const *c, const int64_t *coff, const int *ncols,
                    const float *const *scale, const float *rowscale, int mode, const int paired) {
    vf acc[3][4][2];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np; j++) acc[i][j][0] = acc[i][j][1] = (vf){0};
    int64_t k = 0;
#if BF16_PAIRS
    if (paired) { /* rows k and k + 1 at once: each 32-bit lane holds a column's (k, k + 1) pair */
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
        for (; k + 1 < kc; k += 2) {
            vf x0[3], x1[3];
            for (int i = 0; i < mr; i++) {
                x0[i] = splat(a[i][k]);
                x1[i] = splat(a[i][k + 1]);
            }
            for (int j = 0; j < np; j++) {
#if PF_DIST
                if (pf_nta) {
                    prefetch_nta(w[j], k, wt);
                    prefetch_nta(w[j], k + 1, wt);
                }
#endif
                const uint16_t *w16 = (const uint16_t *)w[j];
                const __m512i v0 = _mm512_loadu_si512(w16 + k * NR), v1 = _mm512_loadu_si512(w16 + (k + 1) * NR);
                /* k's weights (the low halves) and k + 1's, of columns 0-15 and 16-31 */
                const vf e0 = (vf)_mm512_slli_epi32(v0, 16), e1 = (vf)_mm512_slli_epi32(v1, 16),
                         o0 = (vf)_mm512_and_si512(v0, high), o1 = (vf)_mm512_and_si512(v1, high);
                for (int i = 0; i < mr; i++) {
                    acc[i][j][0] += x0[i] * e0;
                    acc[i][j][1] += x0[i] * e1;
                    acc[i][j][0] += x1[i] * o0;
                    acc[i][j][1] += x1[i] * o1;
                }
            }
        }
    }
#else
    (void)paired;
#endif
    for (; k < kc; k++) { /* (a paired panel's odd last row: its columns in order) */
        vf x[3];
        for (int i = 0; i < mr; i++) x[i] = splat(a[i][k]);
        for (int j = 0; j < np; j++) {
#if PF_DIST
            if (pf_nta) prefetch_nta(w[j], k, wt);
#endif
            const vf b0 = load_w(w[j], k * NR, wt), b1 = load_w(w[j], k * NR + VW, wt);
            for (int i = 0; i < mr; i++) {
                acc[i][j][0] += x[i] * b0;
                acc[i][j][1] += x[i] * b1;
            }
        }
    }
    for (int j = 0; j < np; j++) {
        vf s0, s1;
        col_scales(scale[j], &s0, &s1);
        for (int i = 0; i < mr; i++)
            put(acc[i][j][0], acc[i][j][1], s0, s1, rowscale ? rowscale[i] : 1.0f, c[i] + coff[j], ncols[j], mode);
    }
}

#if BF16_PAIRS
/* `tile` for bfloat16 pairs: a[i] row i's activation pairs from this chunk's first pair; w the
 * panel there (kc rows of k, paired as above); no scales (bfloat16 has none). */
INLINE void tile_pairs(const int mr, int64_t kc, const uint32_t *const *a, const uint16_t *w, float *const *c,
                       int ncols, const float *rowscale, int mode, int once, const char *next) {
    __m512 acc[MR][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k += 2) {
#if PF_DIST
        if (once && pf_nta) { /* rows k and k + 1 */
            prefetch_nta(w, k, W_BF16);
            prefetch_nta(w, k + 1, W_BF16);
        }
#else
        (void)once;
#endif
        if (next) { /* rows k and k + 1 of the next panel */
            prefetch_next(next, k, 2);
            if (k + 1 < kc) prefetch_next(next, k + 1, 2);
        }
        __m512bh b0, b1; /* (k, k + 1) pairs of columns 0-15 and 16-31 */
        if (k + 1 < kc) {
            b0 = (__m512bh)_mm512_loadu_si512(w + k * NR);
            b1 = (__m512bh)_mm512_loadu_si512(w + (k + 1) * NR);
        } else { /* an odd last row, its columns in order: (k, 0) pairs */
            b0 = (__m512bh)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + k * NR)));
            b1 = (__m512bh)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + k * NR + VW)));
        }
        for (int i = 0; i < mr; i++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[i][k / 2]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, b1);
        }
    }
    const vf one = splat(1.0f);
    for (int i = 0; i < mr; i++)
        put((vf)acc[i][0], (vf)acc[i][1], one, one, rowscale ? rowscale[i] : 1.0f, c[i], ncols, mode);
}

static void tile_pairs_dispatch(int mr, int64_t kc, const uint32_t *const *a, const uint16_t *w, float *const *c,
                                int ncols, const float *rowscale, int mode, int once, const char *next) {
#define PAIRS_CASE(MRV) \
    case MRV: tile_pairs(MRV, kc, a, w, c, ncols, rowscale, mode, once, next); break;
    switch (mr) {
        PAIRS_CASE(1) PAIRS_CASE(2) PAIRS_CASE(3) PAIRS_CASE(4) PAIRS_CASE(5) PAIRS_CASE(6) PAIRS_CASE(7)
        PAIRS_CASE(8) PAIRS_CASE(9) PAIRS_CASE(10) PAIRS_CASE(11) PAIRS_CASE(12)
    }
}

#endif

/* CASES(WT) with the weight type as a compile-time constant. */
#define BY_WEIGHT_TYPE(CASES) \
    if (wt == W_F32) {        \
        CASES(W_F32)          \
    } else if (wt == W_BF16) { \
        CASES(W_BF16)         \
    } else {                  \
        CASES(W_I8)           \
    }

/* A tile with mr and wt as compile-time constants. */
#define TILE_CASE(MRV, WT) \
    case MRV: tile(MRV, WT, kc, a, w, c, ncols, scale, rowscale, mode, once, next); break;

static void tile_dispatch(int mr, int wt, int64_t kc, const float *const *a, const void *w, float *const *c,
                          int ncols, const float *scale, const float *rowscale, int mode, int once,
                          const char *next) {
#define TILE_SWITCH(WT)                                                                             \
    switch (mr) {                                                                                   \
        TILE_CASE(1, WT) TILE_CASE(2, WT) TILE_CASE(3, WT) TILE_CASE(4, WT) TILE_CASES_5(WT)        \
    }
#if MR >= 12
#define TILE_CASES_5(WT)                                                                                 \
    TILE_CASE(5, WT) TILE_CASE(6, WT) TILE_CASE(7, WT) TILE_CASE(8, WT) TILE_CASE(9, WT) TILE_CASE(10, WT) \
    TILE_CASE(11, WT) TILE_CASE(12, WT)
#elif MR >= 6
#define TILE_CASES_5(WT) TILE_CASE(5, WT) TILE_CASE(6, WT)
#else
#define TILE_CASES_5(WT)
#endif
    BY_WEIGHT_TYPE(TILE_SWITCH)
}

#if BF16_PAIRS && defined(__AMX_TILE__) && defined(__AMX_BF16__) && NR == 32
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
/* int8 weights through AMX-INT8 tiles, in quads or re-laid into them by byte permutes (AVX512-VBMI),
 * and through AVX512-VNNI below the tiles (`I8_QUADS`): every CPU with AMX-BF16 so far has all three */
#define HAVE_AMX_I8 I8_QUADS
/* AMX tiles for products of paired bfloat16 weights, and of int8 ones, with amx_min_rows rows or
 * more, where the CPU has AMX-BF16 and the kernel lets this process use it (`mm_set_amx`): one
 * tdpbf16ps multiplies 16 rows by 32 k by 16 columns, 16 times the multiply-adds of a vdpbf16ps,
 * which a Xeon runs at half the rate of its FMAs. A block of 16 rows, and 32 k of a panel as the two
 * B tiles (the (k, k + 1) pairs of columns 0-15 and 16-31: a bfloat16 panel's rows where they lie),
 * accumulate in two float32 tiles: the sums are those of vdpbf16ps up to the order they are added
 * in. int8 weights go through AMX-INT8 (`panel_rows_amx_i8`): tdpbssd multiplies 16 rows by 64 k by
 * 16 columns of int8 into int32 sums, exactly, with the activations as three int8 parts
 * (`quant_row`). */
static int amx_min_rows = 0; /* 0: off */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* 1 where AMX tiles may be used here (the kernel's permission asked for once), else 0 */
int mm_amx_available(void) {
    static int state = 0; /* 0: not asked, 1: yes, -1: no */
    if (!state) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state > 0;
}

/* The tiles' configuration: all eight 16 rows of 64 bytes (bfloat16 products use 0-4, int8 ones
 * 0-6). Loading it takes about 70 ns, as long as a few products of a panel, so each thread loads it
 * once per parallel region of a product that may take the tiles (`tiles_new_product`, before
 * each of mm_gemm's and mm_moe's: what ran on a thread between two of them, torch's oneDNN, may
 * have configured the tiles its own way; nothing else runs on it during one), not once per panel. */
static uint64_t tile_epoch = 1;
static __thread uint64_t tile_cfg_epoch = 0; /* (0: never configured; the epoch starts at 1 and never wraps) */

static void tiles_new_product(void) { __atomic_add_fetch(&tile_epoch, 1, __ATOMIC_RELAXED); }

/* (a constant: _tile_loadconfig's operand is declared as 8 bytes, so stores into a local one may be
 * dropped by the compiler) */
static const TileConfig tile_cfg __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

INLINE void tiles_configure(void) {
    const uint64_t epoch = __atomic_load_n(&tile_epoch, __ATOMIC_RELAXED);
    if (tile_cfg_epoch == epoch) return;
    _tile_loadconfig(&tile_cfg);
    tile_cfg_epoch = epoch;
}

#if HAVE_AMX_I8
/* An activation row for int8 weights through AMX tiles (`quant_row`): its two scales (float32) at
 * the start of QROW_HEAD bytes, then three parts of qrow_k(K) int8 each, zeros from K on (the tiles
 * read 64 k at a time). qrow_words: the row's size in 32-bit words. */
#define QROW_HEAD 64
INLINE int64_t qrow_k(int64_t K) { return (K + 63) / 64 * 64; }
INLINE int64_t qrow_words(int64_t K) { return (QROW_HEAD + 3 * qrow_k(K)) / 4; }

/* One row of K activations as scales s, s2 and three int8 parts a, b, c with x = s2 s (a + b / 254 +
 * c / 254^2): s = max|x'| / 127 for x' = x / s2 (s2 = 2^-100 where max|x| < 2^-100, so that s and
 * 127 / s stay normal floats; else 1); a is x' / s rounded, b what that left times 254 rounded, c
 * what that left times 254 rounded. The parts hold x within s2 s (1 / 2 / 254^2 + 2^-24 127) <=
 * 2^-23 max|x| (the truncation after c, and the rounding of x' / s), and the products of int8
 * weights by them are exact int32 sums: a product is within 2^-21 max|x| sum|w| of the float64 one
 * (adding the float32 roundings of the parts' sums and the epilogue's multiplications, each within
 * 2^-24 of at most max|x| sum|w|). A row with a NaN gets a NaN scale; one with an infinity (and no
 * NaN) the scale +inf and a = the infinities' signs, zeros elsewhere (`panel_rows_amx_i8` then
 * gives each column what float32 sums give: +-inf, or NaN where an infinity meets a zero weight or
 * the infinities' products have both signs); a row of zeros the scale 0. */
static void quant_row(const float *x, int64_t K, uint32_t *row) {
    const int64_t kq = qrow_k(K);
    int8_t *a = (int8_t *)row + QROW_HEAD, *b = a + kq, *c = b + kq;
    memset(a, 0, 3 * kq);
    /* (16 elements at a time, the last 16 masked: zeros past K, which the parts hold anyway) */
#define QROW_LOAD(k) \
    _mm512_maskz_loadu_ps(K - (k) >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - (k))) - 1u), x + (k))
    __m512 mx = _mm512_setzero_ps();
    __mmask16 nan = 0;
    int64_t k;
    for (k = 0; k < K; k += 16) {
        const __m512 v = QROW_LOAD(k);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(_mm512_abs_ps(v), mx);
    }
    const float m = _mm512_reduce_max_ps(mx);
    float *scale = (float *)row;
    scale[1] = 1.0f;
    if (nan || m == 0.0f || m - m != 0.0f) { /* NaN, zeros, or an infinity */
        scale[0] = nan ? NAN_F : m == 0.0f ? 0.0f : INFINITY_F;
        if (!nan && m != 0.0f)
            for (k = 0; k < K; k++) a[k] = x[k] == INFINITY_F ? 1 : x[k] == -INFINITY_F ? -1 : 0;
        return;
    }
    const float pre = m < 0x1p-100f ? 0x1p100f : 1.0f; /* (exact: x' = x * pre) */
    const float s = m * pre / 127.0f;
    scale[0] = s;
    scale[1] = 1.0f / pre;
    const __m512 vpre = _mm512_set1_ps(pre), vs = _mm512_set1_ps(s), f254 = _mm512_set1_ps(254.0f);
    const int near = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (k = 0; k < K; k += 16) { /* (the stores stay within qrow_k(K), a multiple of 64) */
        const __m512 t = _mm512_div_ps(_mm512_mul_ps(QROW_LOAD(k), vpre), vs);
        const __m512 ta = _mm512_roundscale_ps(t, near);
        const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, ta), f254);
        const __m512 rb = _mm512_roundscale_ps(r, near);
        const __m512 rc = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(r, rb), f254), near);
        /* (|ta|, |rb|, |rc| <= 127 but for rounding at the edges: saturated to int8) */
        _mm_storeu_si128((__m128i *)(a + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(ta)));
        _mm_storeu_si128((__m128i *)(b + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rb)));
        _mm_storeu_si128((__m128i *)(c + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rc)));
    }
#undef QROW_LOAD
}

/* rows[m] (K activations each) -> a fresh [M][qrow_words(K)] array of `quant_row` rows, with room
 * for QROW_PAD rows more (`panel_rows_amx_i8` loads 16 rows from any row on); NULL when memory runs
 * out. */
static uint32_t *quant_rows(int64_t M, int64_t K, const float *const *rows) {
    const int64_t w = qrow_words(K);
    uint32_t *out = aligned_alloc(64, sizeof(uint32_t) * (M + QROW_PAD) * w);
    if (out)
        for (int64_t m = 0; m < M; m++) quant_row(rows[m], K, out + m * w);
    return out;
}

/* A row with an infinity (`quant_row`: a its infinities' signs over kc k) times columns j0 .. j0 + 15
 * of an int8 panel chunk (w, rows NR apart, or in quads: W_I8Q), as float32 sums give it: per
 * column, NaN where an infinity meets a zero weight or the infinities' products have both signs,
 * else +-inf by their sign, 0 where the chunk holds no infinity (the finite elements weigh nothing
 * beside them). */
static void inf_row(int64_t kc, const int8_t *a, const int8_t *w, int quads, int j0, float *out) {
    for (int j = 0; j < 16; j++) {
        int pos = 0, neg = 0, zero = 0;
        for (int64_t k = 0; k < kc; k++) {
            if (!a[k]) continue;
            const int q = w[quads ? quad_at(k * NR + j0 + j) : k * NR + j0 + j];
            zero |= q == 0;
            pos |= (q > 0) == (a[k] > 0) && q != 0;
            neg |= (q > 0) != (a[k] > 0) && q != 0;
        }
        out[j] = zero || (pos && neg) ? NAN_F : pos ? INFINITY_F : neg ? -INFINITY_F : 0.0f;
    }
}

/* 16 columns' exact int32 sums of a row's three parts (a, b, c: `quant_row`) -> s2 s (a + b / 254 +
 * c / 254^2) in float32; sx the row's scales (s, s2). */
INLINE __m512 parts_sum(__m512i a, __m512i b, __m512i c, const float *sx) {
    const __m512 part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(1.0f / 64516.0f),
                                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), _mm512_set1_ps(1.0f / 254.0f),
                                                        _mm512_cvtepi32_ps(a)));
    /* (s first: the product times s2 rounds only where the result is below 2^-126) */
    return _mm512_mul_ps(_mm512_mul_ps(part, _mm512_set1_ps(sx[0])), _mm512_set1_ps(sx[1]));
}

/* rows x kc against one int8 panel through AMX-INT8 tiles (kc <= KC, from k0, a multiple of 64): for
 * each block of 16 rows and each 16 of the panel's columns, three int32 tiles sum each part of the
 * rows (`quant_row` rows at rb, rb[i] row i's start) times the weights over the chunk, 64 k at a time
 * (tdpbssd: exact); then s (a + b / 254 + c / 254^2) in float32 is what `put` scales and stores. The
 * weights are re-laid once per call into the B tiles' order (each row of a tile: 4 k of 16 columns,
 * from 128 bytes of the panel by two byte permutes), zeros past kc; the next panel is prefetched
 * meanwhile (next, or NULL). */
__attribute__((noinline)) static void panel_rows_amx_i8(int64_t rows, int64_t k0, int64_t kc, int64_t kq,
                                                        const char *const *rb, const int8_t *w, int quads,
                                                        float *const *c, int ncols, const float *scale,
                                                        const float *rowscale, int mode, const char *next) {
    static __thread int8_t bt[KC / 64][2][16][64] __attribute__((aligned(64)));
    static __thread int8_t at[3][16][64] __attribute__((aligned(64)));
    static __thread int32_t ct[3][16][16] __attribute__((aligned(64)));
    static __thread float sums[16][NR] __attribute__((aligned(64)));
    tiles_configure(); /* tiles 0-2 the parts' sums, 3-5 the parts, 6 the weights */
    /* byte 4 j + t of a B tile's row: row t (of 4) and column j (of 16, +16 for the second tile) of
     * the panel's 4 rows of 32 bytes, which two 64-byte loads hold (rows 0-1, then 2-3) */
#define Q4(j, c) (j) + (c), 32 + (j) + (c), 64 + (j) + (c), 96 + (j) + (c)
#define Q16(c)                                                                                            \
    Q4(0, c), Q4(1, c), Q4(2, c), Q4(3, c), Q4(4, c), Q4(5, c), Q4(6, c), Q4(7, c), Q4(8, c), Q4(9, c),     \
        Q4(10, c), Q4(11, c), Q4(12, c), Q4(13, c), Q4(14, c), Q4(15, c)
    static const uint8_t relay[2][64] __attribute__((aligned(64))) = {{Q16(0)}, {Q16(16)}};
#undef Q16
#undef Q4
    const __m512i idx0 = _mm512_load_si512(relay[0]), idx1 = _mm512_load_si512(relay[1]);
    const int64_t blocks = (kc + 63) / 64;
    /* a quad panel's (W_I8Q) whole blocks are B tiles where they lie (rows 128 bytes apart), its
     * partial last one is copied (zeros past kc, a multiple of 4); a panel in rows is re-laid */
    const int64_t direct = quads ? kc / 64 : 0;
    for (int64_t b = direct; b < blocks; b++)
        for (int j = 0; j < 16; j++) {
            const int64_t k = 64 * b + 4 * j;
            if (quads) {
                for (int h = 0; h < 2; h++)
                    _mm512_store_si512(bt[b][h][j],
                                       k < kc ? _mm512_loadu_si512(w + k * NR + 64 * h) : _mm512_setzero_si512());
                continue;
            }
            __m512i lo, hi;
            if (k + 4 <= kc) {
                lo = _mm512_loadu_si512(w + k * NR);
                hi = _mm512_loadu_si512(w + (k + 2) * NR);
            } else { /* past kc: zeros */
                const int64_t n = k < kc ? (kc - k) * NR : 0; /* bytes of the 4 rows that are there */
                lo = _mm512_maskz_loadu_epi8(n >= 64 ? ~0ULL : (1ULL << n) - 1, w + k * NR);
                hi = n > 64 ? _mm512_maskz_loadu_epi8((1ULL << (n - 64)) - 1, w + (k + 2) * NR)
                            : _mm512_setzero_si512();
            }
            _mm512_store_si512(bt[b][0][j], _mm512_permutex2var_epi8(lo, idx0, hi));
            _mm512_store_si512(bt[b][1][j], _mm512_permutex2var_epi8(lo, idx1, hi));
        }
    vf s0, s1;
    col_scales(scale, &s0, &s1);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int mr = rows - r0 < 16 ? (int)(rows - r0) : 16;
        /* rows one after another (a product's own rows, an expert's rows in slot order) load as the A
         * tiles where they are, 16 rows whatever mr: the arrays that hold them (`quant_rows`, mm_moe's)
         * have room for 16 rows more, whose sums land in C rows nobody reads */
        const int64_t step = QROW_HEAD + 3 * kq;
        int spaced = 1;
        for (int i = 1; spaced && i < mr; i++) spaced = rb[r0 + i] - rb[r0] == i * step;
        for (int half = 0; half < 2; half++) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t at_k = QROW_HEAD + k0 + 64 * b; /* the block's first byte in a row's part a */
                if (spaced) {
                    _tile_loadd(3, rb[r0] + at_k, step);
                    _tile_loadd(4, rb[r0] + at_k + kq, step);
                    _tile_loadd(5, rb[r0] + at_k + 2 * kq, step);
                } else {
                    for (int part = 0; part < 3; part++)
                        for (int i = 0; i < 16; i++)
                            _mm512_store_si512(at[part][i], i < mr ? _mm512_loadu_si512(rb[r0 + i] + at_k + part * kq)
                                                                   : _mm512_setzero_si512());
                    _tile_loadd(3, at[0], 64);
                    _tile_loadd(4, at[1], 64);
                    _tile_loadd(5, at[2], 64);
                }
                if (next && r0 == 0) /* the next panel's rows of this block, half of them on each pass */
                    for (int64_t k = 64 * b + 32 * half; k < 64 * b + 32 * half + 32 && k < kc; k += 2)
                        prefetch_next(next, k, 1);
                if (b < direct)
                    _tile_loadd(6, w + 64 * b * NR + 64 * half, 4 * NR);
                else
                    _tile_loadd(6, bt[b][half], 64);
                _tile_dpbssd(0, 3, 6);
                _tile_dpbssd(1, 4, 6);
                _tile_dpbssd(2, 5, 6);
            }
            _tile_stored(0, ct[0], 64);
            _tile_stored(1, ct[1], 64);
            _tile_stored(2, ct[2], 64);
            for (int i = 0; i < mr; i++) {
                const float *sx = (const float *)rb[r0 + i];
                if (sx[0] == INFINITY_F) {
                    inf_row(kc, (const int8_t *)rb[r0 + i] + QROW_HEAD + k0, w, quads, 16 * half, sums[i] + 16 * half);
                    continue;
                }
                _mm512_store_ps(sums[i] + 16 * half, parts_sum(_mm512_load_si512(ct[0][i]), _mm512_load_si512(ct[1][i]),
                                                               _mm512_load_si512(ct[2][i]), sx));
            }
        }
        for (int i = 0; i < mr; i++)
            put(load_f(sums[i]), load_f(sums[i] + VW), s0, s1, rowscale ? rowscale[r0 + i] : 1.0f, c[r0 + i], ncols,
                mode);
    }
}
#endif

#if HAVE_AMX_I8
/* The products of int8 quad panels (W_I8Q) with fewer rows than AMX tiles take (or all of them,
 * where this process may not use the tiles): AVX512-VNNI's vpdpbusd multiplies 4 k of 16 columns
 * (one 64-byte half of a quad block, as it lies) by 4 k of a row's part (`quant_row`), broadcast,
 * into exact int32 sums. It multiplies unsigned bytes by signed ones: the weights go in as w + 128
 * (their sign bit flipped), so each sum also holds 128 times the part's sum over the chunk, taken off
 * before the epilogue, which is panel_rows_amx_i8's: the same bounds, the same special rows.
 *
 * mr rows (rb[i]: row i's `quant_row` row, parts kq apart, from k0) times one panel chunk (w, at k0)
 * over kc k (a multiple of 4, at most VNNI_KC): both halves of its columns (nh 2, mr <= 4), or half
 * h0's 16 (nh 1, mr <= 8): three sums a row and 16 columns, at most 24 of the 32 vector registers.
 * c[i]: row i's output at the panel; scale, rowscale, mode as `tile`; next: the panel read after this
 * one, prefetched into L2, or NULL; once: prefetch this one PF_DIST ahead (pf_nta). */
#define VNNI_KC 32768 /* (each sum within kc 255 127 < 2^31) */
INLINE void tile_vnni(const int mr, const int nh, int h0, int64_t kc, int64_t k0, int64_t kq, const char *const *rb,
                      const char *w, float *const *c, int ncols, const float *scale, const float *rowscale,
                      int mode, int once, const char *next) {
    /* (every loop over the sums unrolled, so that they stay in registers) */
    __m512i acc[8][3][2];
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 3
        for (int p = 0; p < 3; p++)
#pragma GCC unroll 2
            for (int h = 0; h < nh; h++) acc[i][p][h] = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
#if !PF_DIST
    (void)once;
#endif
    for (int64_t k = 0; k < kc; k += 4) {
        if (next) { /* (the block's 128 bytes: rows k .. k + 3) */
            prefetch_next(next, k, 1);
            prefetch_next(next, k + 2, 1);
        }
#if PF_DIST
        if (once && pf_nta) {
            prefetch_nta(w, k, W_I8);
            prefetch_nta(w, k + 2, W_I8);
        }
#endif
        __m512i wv[2];
#pragma GCC unroll 2
        for (int h = 0; h < nh; h++)
            wv[h] = _mm512_xor_si512(_mm512_loadu_si512(w + k * NR + 64 * (nh == 2 ? h : h0)), flip);
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++)
#pragma GCC unroll 3
            for (int p = 0; p < 3; p++) { /* (4 k of the part, broadcast from memory) */
                int32_t v;
                memcpy(&v, rb[i] + QROW_HEAD + k0 + p * kq + k, 4);
                const __m512i x = _mm512_set1_epi32(v);
#pragma GCC unroll 2
                for (int h = 0; h < nh; h++) acc[i][p][h] = _mm512_dpbusd_epi32(acc[i][p][h], wv[h], x);
            }
    }
    int32_t sums32[8][3][2][16] __attribute__((aligned(64)));
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 3
        for (int p = 0; p < 3; p++)
#pragma GCC unroll 2
            for (int h = 0; h < nh; h++) _mm512_store_si512(sums32[i][p][h], acc[i][p][h]);
    const __m512i ones = _mm512_set1_epi8(1);
    vf s0, s1;
    col_scales(scale, &s0, &s1);
    for (int i = 0; i < mr; i++) {
        const float *sx = (const float *)rb[i];
        const int8_t *ra = (const int8_t *)rb[i] + QROW_HEAD + k0;
        /* 128 times each part's sum over the chunk (its zeros past K included: a chunk ends at K or
         * on a multiple of 64) */
        __m512i off[3];
        for (int p = 0; p < 3; p++) {
            __m512i t = _mm512_setzero_si512();
            for (int64_t k = 0; k < kc; k += 64) t = _mm512_dpbusd_epi32(t, ones, _mm512_loadu_si512(ra + p * kq + k));
            off[p] = _mm512_set1_epi32(128 * _mm512_reduce_add_epi32(t));
        }
        float sums[NR] __attribute__((aligned(64)));
        for (int hh = 0; hh < nh; hh++) {
            const int h = nh == 2 ? hh : h0; /* (sums32's half hh holds column half h) */
            if (sx[0] == INFINITY_F) {
                inf_row(kc, ra, (const int8_t *)w, 1, 16 * h, sums + 16 * h);
                continue;
            }
            __m512i part[3];
            for (int p = 0; p < 3; p++) part[p] = _mm512_sub_epi32(_mm512_load_si512(sums32[i][p][hh]), off[p]);
            _mm512_store_ps(sums + 16 * h, parts_sum(part[0], part[1], part[2], sx));
        }
        const float g = rowscale ? rowscale[i] : 1.0f;
        if (nh == 2)
            put(load_f(sums), load_f(sums + VW), s0, s1, g, c[i], ncols, mode);
        else if (ncols > 16 * h0)
            put16(load_f(sums + 16 * h0), h0 ? s1 : s0, g, c[i] + 16 * h0, ncols - 16 * h0, mode);
    }
}

/* rows (any number) against one int8 quad panel chunk through `tile_vnni`: up to 4 rows in one
 * pass over all 32 columns, more in blocks of 8 rows, one pass per half (the second from L1). a[i]
 * row i's `quant_row` row; the rest as `panel_rows` hands it (k0, kc <= VNNI_KC, qrow_k(K), the
 * panel at k0, outputs at the panel, mode, once, next). */
__attribute__((noinline)) static void panel_rows_vnni(int64_t rows, int64_t k0, int64_t kc, int64_t kq,
                                                      const char *const *a, const char *w, float *const *c,
                                                      int ncols, const float *scale, const float *rowscale,
                                                      int mode, int once, const char *next) {
#define VNNI_ROWS(MRV, NH, H) \
    case MRV: tile_vnni(MRV, NH, H, kc, k0, kq, a + r0, w, c + r0, ncols, scale, rs, mode, on, nx); break;
    if (rows <= 4) {
        const int64_t r0 = 0;
        const float *rs = rowscale;
        const char *nx = next;
        const int on = once;
        switch (rows) { VNNI_ROWS(1, 2, 0) VNNI_ROWS(2, 2, 0) VNNI_ROWS(3, 2, 0) VNNI_ROWS(4, 2, 0) }
        return;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        const int mr = rows - r0 < 8 ? (int)(rows - r0) : 8;
        const float *rs = rowscale ? rowscale + r0 : NULL;
        for (int h = 0; h < 2; h++) {
            const char *nx = r0 == 0 && h == 0 ? next : NULL;
            const int on = once && r0 == 0 && h == 0;
            switch (mr) {
                VNNI_ROWS(1, 1, h) VNNI_ROWS(2, 1, h) VNNI_ROWS(3, 1, h) VNNI_ROWS(4, 1, h)
                VNNI_ROWS(5, 1, h) VNNI_ROWS(6, 1, h) VNNI_ROWS(7, 1, h) VNNI_ROWS(8, 1, h)
            }
        }
    }
#undef VNNI_ROWS
}

#endif

/* rows x kc against one paired bfloat16 panel through AMX tiles (a chunk of up to KC_AMX, or all of
 * K, at most its last, partial block re-laid); as `tile_pairs` for each block of 16 rows. a[i]: row
 * i's pairs from this chunk's first; w the panel there; next: the panel read after this one,
 * prefetched by the first block of rows as it reads this one (as `tile_pairs` does), or NULL. */
/* (out of line: inlined into panel_rows, it slowed the register tiles of every other product) */
__attribute__((noinline)) static void panel_rows_amx(int64_t rows, int64_t kc, const uint32_t *const *a,
                                                     const char *w, float *const *c, int ncols,
                                                     const float *rowscale, int mode, const char *next) {
    static __thread uint32_t bt[2][16][16] __attribute__((aligned(64))); /* a partial last block, re-laid */
    static __thread uint32_t at[16][16] __attribute__((aligned(64)));    /* an A tile, copied */
    static __thread float ct[16][NR] __attribute__((aligned(64)));
    const int es = 2;
    tiles_configure(); /* tiles 0-1 C, 2 A, 3-4 B */
    const int64_t kp = (kc + 1) / 2, blocks = (kp + 15) / 16;
    /* the panel's blocks of 16 whole pairs are B tiles where they lie (rows 128 bytes apart); a
     * partial last one is re-laid in bt, zeros past kc */
    const uint16_t *w16 = (const uint16_t *)w;
    const int64_t direct = kc / 32;
    for (int64_t b = direct; b < blocks; b++)
        for (int p = 0; p < 16; p++) {
            const int64_t k = 2 * (b * 16 + p);
            if (next && k < kc) { /* the next panel's rows k and k + 1, as `tile_pairs` */
                prefetch_next(next, k, es);
                if (k + 1 < kc) prefetch_next(next, k + 1, es);
            }
            __m512i r0 = _mm512_setzero_si512(), r1 = _mm512_setzero_si512();
            if (k + 1 < kc) { /* paired already */
                r0 = _mm512_loadu_si512(w16 + k * NR);
                r1 = _mm512_loadu_si512(w16 + (k + 1) * NR);
            } else if (k < kc) { /* an odd last row, its columns in order: (k, 0) pairs */
                r0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w16 + k * NR)));
                r1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w16 + k * NR + VW)));
            }
            _mm512_store_si512(bt[0][p], r0);
            _mm512_store_si512(bt[1][p], r1);
        }
    const vf ones = splat(1.0f);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int mr = rows - r0 < 16 ? (int)(rows - r0) : 16;
        /* 16 rows the same distance apart (a product's own pairs, an expert's rows in a slot-ordered
         * array) load as the A tile where they are: no copy */
        const int64_t step = mr == 16 ? a[r0 + 1] - a[r0] : 0;
        int spaced = step > 0;
        for (int i = 2; spaced && i < 16; i++) spaced = a[r0 + i] - a[r0] == i * step;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n = kp - b * 16 < 16 ? kp - b * 16 : 16;
            if (b < direct) {
                if (next && r0 == 0) /* the next panel's rows of this block (re-laid blocks fetch theirs above) */
                    for (int64_t k = 32 * b; k < 32 * b + 32; k++) prefetch_next(next, k, es);
                _tile_loadd(3, w16 + 32 * b * NR, 2 * NR * 2);
                _tile_loadd(4, w16 + (32 * b + 1) * NR, 2 * NR * 2);
            } else {
                _tile_loadd(3, bt[0], 64);
                _tile_loadd(4, bt[1], 64);
            }
            if (spaced && n == 16) {
                _tile_loadd(2, a[r0] + b * 16, step * 4);
            } else {
                for (int i = 0; i < 16; i++) {
                    if (i < mr && n == 16) {
                        _mm512_store_si512(at[i], _mm512_loadu_si512(a[r0 + i] + b * 16));
                    } else {
                        _mm512_store_si512(at[i], _mm512_setzero_si512());
                        if (i < mr) memcpy(at[i], a[r0 + i] + b * 16, sizeof(uint32_t) * n);
                    }
                }
                _tile_loadd(2, at, 64);
            }
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, ct, NR * sizeof(float));
        _tile_stored(1, &ct[0][VW], NR * sizeof(float));
        for (int i = 0; i < mr; i++)
            put(load_f(ct[i]), load_f(ct[i] + VW), ones, ones, rowscale ? rowscale[r0 + i] : 1.0f, c[r0 + i], ncols,
                mode);
    }
}
#else
#define HAVE_AMX 0
#define HAVE_AMX_I8 0
static const int amx_min_rows = 0;
int mm_amx_available(void) { return 0; }
#endif

/* Whether a product of `rows` rows of weights of type wt goes through AMX tiles: paired bfloat16
 * weights with min_rows rows or more, int8 ones with AMX_I8Q_ROWS (quads) or AMX_I8_ROWS (in rows)
 * too (amx_min_rows, read once by each product: its rows are quantized for int8 weights by that
 * reading, `quant_row`). With the panels in quads (no re-lay) and 16 rows loaded where they lie
 * whatever the block's rows, an expert layer of the bench model takes the tiles' time from 5 rows to
 * 16 on the Xeon of docs/benchmarks.md (0.81-0.86 ms); `tile_vnni` is faster up to 4 rows
 * (0.51-0.66 ms) and slower from 5 (1.03-1.35 ms). Panels in rows (K not a multiple of 4) are
 * re-laid on every call, which cost more than the tiles save up to 7 rows against the register
 * tiles (the same layer: 1.44-1.46 against 1.22-1.24 ms at 4 rows, 1.49-1.52 against 1.37-1.40 at
 * 6, 1.55-1.64 against 1.64 at 8). */
#define AMX_I8Q_ROWS 5
#define AMX_I8_ROWS 8

/* From how many rows products of int8 weights in rows (W_I8) take AMX tiles (1 << 30: never, in
 * this build); quads from AMX_I8Q_ROWS. */
int mm_amx_i8_rows(void) { return HAVE_AMX_I8 ? AMX_I8_ROWS : 1 << 30; }
INLINE int amx_takes(int wt, int64_t rows, int min_rows) {
    return HAVE_AMX && min_rows && rows >= min_rows &&
           (PAIRED(wt) || (HAVE_AMX_I8 && IS_I8(wt) && rows >= (wt == W_I8Q ? AMX_I8Q_ROWS : AMX_I8_ROWS)));
}

/* Products of paired bfloat16 or int8 weights with this many rows or more through AMX tiles (0: none). */
void mm_set_amx(int min_rows) {
#if HAVE_AMX
    amx_min_rows = min_rows > 0 && mm_amx_available() ? min_rows : 0;
#else
    (void)min_rows;
#endif
}

/* Every row of `rows` against one packed panel (K x NR): row tiles of MR, k in chunks of KC when
 * several tiles reuse the panel. a[r], c[r]: row r's activations (float32, or bfloat16 pairs where
 * the weights are PAIRED, or `quant_row` rows where AMX tiles take int8 weights: `amx_takes`) and
 * output (at the panel). next: the panel read after this one (by this thread, unless this one ends
 * its share), prefetched into L2 by the first tile when several tiles reuse this one or it has 8
 * rows or more, or NULL. amx: AMX tiles for every row (`amx_takes`). */
static void panel_rows(int64_t rows, int64_t K, const void *const *a, const char *panel, int wt,
                       float *const *c, int ncols, const float *scale, const float *rowscale, int mode,
                       const char *next, int amx) {
    /* (KC is even: a chunk starts on a pair. AMX tiles keep a bfloat16 product's sums in C tiles over
     * KC_AMX k, or all of K for one block of 16 rows: its B tiles are read in place, not re-laid) */
    int64_t kstep = amx && !IS_I8(wt) ? (rows > 16 ? KC_AMX : K) : rows > MR || amx ? KC : K;
#if HAVE_AMX_I8
    if (wt == W_I8Q && kstep > VNNI_KC) kstep = VNNI_KC;
#endif
    /* (KC is a multiple of 64: an int8 chunk starts on a block of AMX-INT8's 64 k) */
    const int es = elem_size(wt);
    for (int64_t k0 = 0; k0 < K; k0 += kstep) {
        const int64_t kc = K - k0 < kstep ? K - k0 : kstep;
        /* partial sums of later chunks add to the first chunk's; scales and router weights are
         * linear, so applying them per chunk gives the same sum */
        const int m = k0 == 0 ? mode : (mode == OUT_STORE ? OUT_ADD : mode);
        for (int64_t r0 = 0; r0 < rows; r0 += MR) {
            const int mr = rows - r0 < MR ? (int)(rows - r0) : MR;
            const float *rs = rowscale ? rowscale + r0 : NULL;
            /* (quads always fetch the next panel: `few_for`) */
            const char *nx = next && r0 == 0 && (rows > MR || rows >= pf_next_rows || wt == W_I8Q)
                                 ? next + k0 * NR * es
                                 : NULL;
#if BF16_PAIRS
            if (HAVE_AMX && amx) {
#if HAVE_AMX
                if (IS_I8(wt)) {
#if HAVE_AMX_I8
                    panel_rows_amx_i8(rows, k0, kc, qrow_k(K), (const char *const *)a,
                                      (const int8_t *)panel + k0 * NR, wt == W_I8Q, c, ncols, scale, rowscale, m, nx);
#endif
                } else {
                    const uint32_t *ap[rows > 0 ? rows : 1];
                    for (int64_t i = 0; i < rows; i++) ap[i] = (const uint32_t *)a[i] + k0 / 2;
                    panel_rows_amx(rows, kc, ap, panel + k0 * NR * es, c, ncols, rowscale, m, nx);
                }
#endif
                break; /* (every row of this chunk) */
            }
#if HAVE_AMX_I8
            if (wt == W_I8Q) { /* every row of this chunk, through AVX512-VNNI */
                panel_rows_vnni(rows, k0, kc, qrow_k(K), (const char *const *)a, panel + k0 * NR, c, ncols, scale,
                                rowscale, m, rows <= MR, nx);
                break;
            }
#endif
            if (PAIRED(wt)) {
                const uint32_t *ap[MR];
                for (int i = 0; i < mr; i++) ap[i] = (const uint32_t *)a[r0 + i] + k0 / 2;
                tile_pairs_dispatch(mr, kc, ap, (const uint16_t *)(panel + k0 * NR * es), c + r0, ncols, rs, m,
                                    rows <= MR, nx);
                continue;
            }
#endif
            const float *ap[MR];
            for (int i = 0; i < mr; i++) ap[i] = (const float *)a[r0 + i] + k0;
            tile_dispatch(mr, wt, kc, ap, panel + k0 * NR * es, c + r0, ncols, scale, rs, m, rows <= MR, nx);
        }
    }
}

#define FEW_ROWS 3 /* up to this many rows, panels are read several at a time (tile_np) */

int mm_few_rows(void) { return FEW_ROWS; }
/* Up to how many rows a product of weight type wt reads its panels as streams (`few_rows`): int8
 * quads never; their products of 1-3 rows (`panel_rows_vnni`), each panel read as the next one is
 * fetched into L2, are 1.35-2.2x faster than streams on the Xeon of docs/benchmarks.md. */
INLINE int few_for(int wt) { return wt == W_I8Q ? 0 : FEW_ROWS; }

static void tile_np_dispatch(int mr, int np, int wt, int64_t kc, const float *const *a, const char *const *w,
                             float *const *c, const int64_t *coff, const int *ncols, const float *const *scale,
                             const float *rowscale, int mode) {
#define NP_CASE(MRV, NPV, WT)                                                               \
    if (mr == MRV && np == NPV) {                                                           \
        tile_np(MRV, NPV, WT, kc, a, w, c, coff, ncols, scale, rowscale, mode, PAIRED(WT)); \
        return;                                                                             \
    }
#define NP_CASES(WT)                                                                                     \
    NP_CASE(1, 1, WT) NP_CASE(1, 2, WT) NP_CASE(1, 3, WT) NP_CASE(1, 4, WT) NP_CASE(2, 1, WT)           \
    NP_CASE(2, 2, WT) NP_CASE(3, 1, WT) NP_CASE(3, 2, WT)
    BY_WEIGHT_TYPE(NP_CASES)
}

/* rows <= FEW_ROWS rows against the panels p0 .. p1 - 1 of one packed weight (K x NR panels at w):
 * the range is cut into np runs read side by side (4 streams for one row, 2 for two or three).
 * Outputs c[i] + p * NR, valid columns up to N; scale: per column (int8) or NULL. Activations are
 * float32 whatever the weights (a PAIRED panel's rows are widened like any other's, tile_np). Not
 * for int8 quads (`few_for`). */
static void few_rows(int rows, int64_t K, const float *const *a, const char *w, int wt, int64_t p0, int64_t p1,
                     int64_t N, float *const *c, const float *scale, const float *rowscale, int mode) {
    const int np = rows == 1 ? 4 : 2;
    const int64_t n = p1 - p0, run = (n + np - 1) / np, stride = K * NR * elem_size(wt);
    for (int64_t i = 0; i < run; i++) {
        const char *wp[4];
        const float *sp[4];
        int64_t coff[4];
        int nc[4], cnt = 0;
        for (int j = 0; j < np; j++) {
            const int64_t p = p0 + j * run + i;
            if (p >= p1) break;
            wp[cnt] = w + p * stride;
            sp[cnt] = scale ? scale + p * NR : NULL;
            coff[cnt] = p * NR;
            nc[cnt] = N - p * NR < NR ? (int)(N - p * NR) : NR;
            cnt++;
        }
        tile_np_dispatch(rows, cnt, wt, K, a, wp, c, coff, nc, sp, rowscale, mode);
    }
}

/* This thread's share [lo, hi) of n items, in contiguous runs. */
static void my_range(int64_t n, int64_t *lo, int64_t *hi) {
    int t = 0, nt = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    *lo = n * t / nt;
    *hi = n * (t + 1) / nt;
}

int mm_simd_width(void) { return VW; }
int mm_panel_width(void) { return NR; }
int mm_tile_rows(void) { return MR; }


/* y[M, N] = x[M, K] @ W^T (* scale per column). x rows ldx apart, y rows ldy apart (float32).
 * w: packed [ceil(N / NR)][K][NR] of weight type wt; scale: [ceil(N / NR) * NR] or NULL. */
int mm_gemm(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const void *w, int wt,
            const float *scale, float *y, int64_t ldy, int nthreads) {
    const int64_t panels = (N + NR - 1) / NR, pstride = K * NR * elem_size(wt);
    /* row blocks keep the activations of one pass (MC rows x K) in L2 */
    const int64_t MC = 96;
    const void **ap = malloc(sizeof(void *) * (M > 0 ? M : 1)); /* float32 rows, or bfloat16 pairs */
    float **cp = malloc(sizeof(float *) * (M > 0 ? M : 1));
    void *pairs = NULL; /* the rows as bfloat16 pairs, for PAIRED weights */
    const void **ap2 = NULL; /* the rows as int8 parts (`quant_row`), for int8 weights AMX tiles take */
    int rc = 0;
    if (!ap || !cp) {
        rc = -1;
        goto done;
    }
    for (int64_t m = 0; m < M; m++) {
        ap[m] = x + m * ldx;
        cp[m] = y + m * ldy;
    }
#if BF16_PAIRS
    if (PAIRED(wt) && M > FEW_ROWS) { /* (a few rows read the pairs widened: few_rows) */
        const int64_t kp = (K + 1) / 2;
        if (!(pairs = pair_rows(M, K, (const float *const *)ap))) {
            rc = -1;
            goto done;
        }
        for (int64_t m = 0; m < M; m++) ap[m] = (const uint32_t *)pairs + m * kp;
    }
#endif
    const int amx_rows = amx_min_rows; /* (read once: the rows are quantized by this reading) */
#if HAVE_AMX_I8
    if (wt == W_I8Q || (amx_takes(wt, M < MC ? M : MC, amx_rows) && IS_I8(wt))) { /* (quads: always, tile_vnni) */
        if (!(ap2 = malloc(sizeof(void *) * M)) || !(pairs = quant_rows(M, K, (const float *const *)ap))) {
            rc = -1;
            goto done;
        }
        for (int64_t m = 0; m < M; m++) ap2[m] = (const uint32_t *)pairs + m * qrow_words(K);
    }
#endif
    if (M <= few_for(wt)) { /* bound by reading the weights: each thread a contiguous share of panels */
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && panels > 1)
        {
            int64_t lo, hi;
            my_range(panels, &lo, &hi);
            few_rows((int)M, K, (const float *const *)ap, (const char *)w, wt, lo, hi, N, cp, scale, NULL, OUT_STORE);
        }
        goto done;
    }
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t mc = M - m0 < MC ? M - m0 : MC;
#if HAVE_AMX
        tiles_new_product();
#endif
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && panels > 1)
        for (int64_t p = 0; p < panels; p++) {
            float *cpp[MC];
            for (int64_t i = 0; i < mc; i++) cpp[i] = cp[m0 + i] + p * NR;
            const int ncols = N - p * NR < NR ? (int)(N - p * NR) : NR;
            const int amx = amx_takes(wt, mc, amx_rows);
            panel_rows(mc, K, ((amx || wt == W_I8Q) && ap2 ? ap2 : ap) + m0, (const char *)w + p * pstride, wt, cpp,
                       ncols, scale ? scale + p * NR : NULL, NULL, OUT_STORE,
                       p + 1 < panels ? (const char *)w + (p + 1) * pstride : NULL, amx);
        }
    }
done:
    free(ap);
    free(ap2);
    free(cp);
    free(pairs);
    return rc;
}

/* mask ? a : b, lane by lane */
INLINE vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* e^x over VW lanes: Cephes' expf polynomial (about 1 ulp). */
INLINE vf vexp(vf x) {
    /* clamped so e^x stays finite and normal; NaN compares false both ways and passes through */
    x = vselect(x < splat(-87.0f), splat(-87.0f), x);
    x = vselect(x > splat(88.0f), splat(88.0f), x);
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = (x * splat(1.44269504088896341f) + magic) - magic;
    vf r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    vf z = r * r;
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * z + r + splat(1.0f);
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)e;
}

/* out = SiLU(g) * u = g / (1 + e^-g) * u */
static void silu_mul(const float *g, const float *u, float *out, int64_t n) {
    int64_t j = 0;
    for (; j + VW <= n; j += VW) {
        vf x = load_f(g + j);
        store_f(out + j, x / (splat(1.0f) + vexp(-x)) * load_f(u + j));
    }
    if (j < n) {
        float gt[VW] = {0}, ut[VW] = {0}, ot[VW];
        memcpy(gt, g + j, (n - j) * 4);
        memcpy(ut, u + j, (n - j) * 4);
        vf x = load_f(gt);
        store_f(ot, x / (splat(1.0f) + vexp(-x)) * load_f(ut));
        memcpy(out + j, ot, (n - j) * 4);
    }
}

/* The routed experts of one MoE layer:
 *   out[t] = sum_k topk_w[t, k] * W2[e] (silu(W1[e] x[t]) * W3[e] x[t]),  e = topk_ids[t, k] - offset
 * for the experts this rank holds (0 <= e < E); other rows are skipped (expert parallelism: other
 * ranks add theirs in the all-reduce).
 *
 * x [T, H], out [T, H] float32 (out is overwritten). w13: per expert a packed [2I -> panels][H][NR]
 * (gate rows, then up rows), w13 experts w13_stride elements apart; w2: per expert packed
 * [H -> panels][I][NR]. s13 [E][ceil(2I/NR) * NR], s2 [E][ceil(H/NR) * NR]: int8 scales, else NULL.
 * wt, wt2: w13's and w2's weight types (the same but for int8, whose quads need K a multiple of 4).
 *
 * Rows are grouped by expert; phase 1 runs (expert, w13 panel) items in parallel, then SiLU-and-mul,
 * then phase 2 runs w2's column panels in parallel, each over every expert, adding router-weighted
 * results straight into out (a thread owns its columns of every token: no two threads write the
 * same element). Returns 0, or -1 when memory runs out. */
int mm_moe(int64_t T, int64_t H, int64_t I, int64_t Ktop, const float *x, const int64_t *topk_ids,
           const float *topk_w, int64_t E, int64_t offset, const void *w13, const float *s13, const void *w2,
           const float *s2, int wt, int wt2, float *out, int nthreads) {
#if HAVE_AMX
    tiles_new_product();
#endif
    const int es = elem_size(wt);
    const int64_t p13 = (2 * I + NR - 1) / NR, p2 = (H + NR - 1) / NR;
    const int64_t w13_stride = p13 * H * NR, w2_stride = p2 * I * NR; /* elements per expert */
    const int64_t hp = (H + 1) / 2, ip = (I + 1) / 2; /* bfloat16 pairs of a row of x, of act */
    const int64_t rows_max = T * Ktop;

    int64_t *count = calloc(E + 1, sizeof(int64_t)); /* count[e + 1]: rows of expert e; then offsets */
    int64_t *tok = malloc(sizeof(int64_t) * (rows_max ? rows_max : 1));
    float *gate_w = malloc(sizeof(float) * (rows_max ? rows_max : 1));
    float *h = malloc(sizeof(float) * (rows_max ? rows_max : 1) * 2 * I);
    float *act = malloc(sizeof(float) * (rows_max ? rows_max : 1) * I);
    /* each row's x and act in float32 (ax, actp), and where an expert's product multiplies bfloat16
     * pairs (more than FEW_ROWS rows of PAIRED weights) as pairs too (ax2, actp2) */
    const float **ax = malloc(sizeof(float *) * (rows_max ? rows_max : 1));
    const void **ax2 = malloc(sizeof(void *) * (rows_max ? rows_max : 1));
    float **hrow = malloc(sizeof(float *) * (rows_max ? rows_max : 1));
    const float **actp = malloc(sizeof(float *) * (rows_max ? rows_max : 1));
    const void **actp2 = malloc(sizeof(void *) * (rows_max ? rows_max : 1));
    uint32_t *xpairs = NULL, *actpairs = NULL;
    float **outp = malloc(sizeof(float *) * (rows_max ? rows_max : 1));
    int64_t *items = malloc(sizeof(int64_t) * (E * p13 > 0 ? E * p13 : 1)); /* >= experts x chunks */
    int rc = 0;
    if (!count || !tok || !gate_w || !h || !act || !ax || !ax2 || !hrow || !actp || !actp2 || !outp || !items) {
        rc = -1;
        goto done;
    }
    memset(out, 0, sizeof(float) * T * H);

    /* group rows by expert, in token order within an expert (a counting sort) */
    for (int64_t r = 0; r < rows_max; r++) {
        int64_t e = topk_ids[r] - offset;
        if (e >= 0 && e < E) count[e + 1]++;
    }
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e];
    {
        int64_t *fill = malloc(sizeof(int64_t) * (E ? E : 1));
        if (!fill) {
            rc = -1;
            goto done;
        }
        memcpy(fill, count, sizeof(int64_t) * E);
        for (int64_t r = 0; r < rows_max; r++) {
            int64_t e = topk_ids[r] - offset;
            if (e < 0 || e >= E) continue;
            int64_t slot = fill[e]++;
            tok[slot] = r / Ktop;
            gate_w[slot] = topk_w[r];
        }
        free(fill);
    }
    const int64_t rows = count[E];
    /* AMX tiles for an expert's batch of rows (the setting read once); int8 weights' rows for them
     * as int8 parts (`quant_row`: xpairs and actpairs then hold those rows, qrow_words apart) */
    const int amx_rows = amx_min_rows;
    int quant = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = count[e + 1] - count[e];
        quant |= IS_I8(wt) && amx_takes(wt, n < MR * 8 ? n : MR * 8, amx_rows);
    }
    quant |= wt == W_I8Q || wt2 == W_I8Q; /* (quads take `quant_row` rows at any count: tile_vnni) */
#if HAVE_AMX_I8 /* (words from a row to the next) */
    const int64_t xs = quant ? qrow_words(H) : hp, as = quant ? qrow_words(I) : ip;
#else
    const int64_t xs = hp, as = ip;
#endif
#if BF16_PAIRS
    int many = 0; /* an expert's product with more than FEW_ROWS rows multiplies bfloat16 pairs */
    for (int64_t e = 0; e < E; e++) many |= count[e + 1] - count[e] > FEW_ROWS;
    if (quant || (PAIRED(wt) && many)) {
        /* each row's x as pairs (or `quant_row` rows) in slot order: an expert's rows lie one after another
         * (AMX tiles load them where they are) */
        const int64_t pad = quant ? QROW_PAD : 0; /* (as `quant_rows`) */
        xpairs = aligned_alloc(64, (sizeof(uint32_t) * (rows + pad) * xs + 64) / 64 * 64);
        actpairs = aligned_alloc(64, (sizeof(uint32_t) * (rows + pad) * as + 64) / 64 * 64);
        if (!xpairs || !actpairs) {
            rc = -1;
            goto done;
        }
        for (int64_t s = 0; s < rows; s++) {
#if HAVE_AMX_I8
            if (quant) {
                quant_row(x + tok[s] * H, H, xpairs + s * xs);
                continue;
            }
#endif
            pair_row(x + tok[s] * H, H, xpairs + s * hp);
        }
    }
#endif
    for (int64_t s = 0; s < rows; s++) {
        ax[s] = x + tok[s] * H;
        ax2[s] = xpairs ? (const void *)(xpairs + s * xs) : ax[s];
        hrow[s] = h + s * 2 * I;
        actp[s] = act + s * I;
        actp2[s] = actpairs ? (const void *)(actpairs + s * as) : actp[s];
        outp[s] = out + tok[s] * H;
    }
    /* phase 1 items: (expert, run of CHUNK panels); a few-row expert reads its run's panels as
     * concurrent streams (few_rows) */
    const int64_t CHUNK = 16, chunks = (p13 + CHUNK - 1) / CHUNK;
    int64_t n_items = 0;
    for (int64_t e = 0; e < E; e++)
        if (count[e + 1] > count[e])
            for (int64_t q = 0; q < chunks; q++) items[n_items++] = e * chunks + q;

#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float *cp[MR * 8];
        /* phase 1: h = x W13^T per expert */
#pragma omp for schedule(static)
        for (int64_t it = 0; it < n_items; it++) {
            const int64_t e = items[it] / chunks, q = items[it] % chunks;
            const int64_t r0 = count[e], n = count[e + 1] - count[e];
            const int64_t pa = q * CHUNK, pb = pa + CHUNK < p13 ? pa + CHUNK : p13;
            const char *we = (const char *)w13 + e * w13_stride * es;
            const float *se = s13 ? s13 + e * p13 * NR : NULL;
            if (n <= few_for(wt)) {
                few_rows((int)n, H, ax + r0, we, wt, pa, pb, 2 * I, hrow + r0, se, NULL, OUT_STORE);
                continue;
            }
            for (int64_t p = pa; p < pb; p++) {
                const int ncols = 2 * I - p * NR < NR ? (int)(2 * I - p * NR) : NR;
                for (int64_t b = 0; b < n; b += MR * 8) {
                    const int64_t nb = n - b < MR * 8 ? n - b : MR * 8;
                    for (int64_t i = 0; i < nb; i++) cp[i] = hrow[r0 + b + i] + p * NR;
                    const int amx = amx_takes(wt, nb, amx_rows);
                    panel_rows(nb, H, (amx || PAIRED(wt) || wt == W_I8Q ? ax2 : (const void **)ax) + r0 + b,
                               we + p * H * NR * es,
                               wt, cp, ncols, se ? se + p * NR : NULL, NULL, OUT_STORE,
                               b == 0 && p + 1 < p13 ? we + (p + 1) * H * NR * es : NULL, amx);
                }
            }
        }
        /* act = silu(gate) * up */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            silu_mul(h + r * 2 * I, h + r * 2 * I + I, act + r * I, I);
#if HAVE_AMX_I8
            if (quant) {
                quant_row(act + r * I, I, actpairs + r * as);
                continue;
            }
#endif
#if BF16_PAIRS
            if (actpairs) pair_row(act + r * I, I, actpairs + r * ip);
#endif
        }
        /* phase 2: out[t] += w * act W2^T; each thread a contiguous run of out's column panels, over
         * every expert (no two threads write the same element) */
        int64_t lo, hi;
        my_range(p2, &lo, &hi);
        for (int64_t e = 0; e < E; e++) {
            const int64_t r0 = count[e], n = count[e + 1] - count[e];
            if (n == 0) continue;
            const char *we = (const char *)w2 + e * w2_stride * es;
            const float *se = s2 ? s2 + e * p2 * NR : NULL;
            if (n <= few_for(wt2)) {
                few_rows((int)n, I, actp + r0, we, wt2, lo, hi, H, outp + r0, se, gate_w + r0, OUT_ADD_SCALED);
                continue;
            }
            for (int64_t p = lo; p < hi; p++) {
                const int ncols = H - p * NR < NR ? (int)(H - p * NR) : NR;
                for (int64_t b = 0; b < n; b += MR * 8) {
                    const int64_t nb = n - b < MR * 8 ? n - b : MR * 8;
                    for (int64_t i = 0; i < nb; i++) cp[i] = outp[r0 + b + i] + p * NR;
                    const int amx = amx_takes(wt2, nb, amx_rows);
                    panel_rows(nb, I, (amx || PAIRED(wt2) || wt2 == W_I8Q ? actp2 : (const void **)actp) + r0 + b,
                               we + p * I * NR * es, wt2, cp, ncols, se ? se + p * NR : NULL, gate_w + r0 + b,
                               OUT_ADD_SCALED,
                               b == 0 && p + 1 < hi ? we + (p + 1) * I * NR * es : NULL, amx);
                }
            }
        }
    }
done:
    free(count);
    free(tok);
    free(gate_w);
    free(h);
    free(act);
    free(ax);
    free(ax2);
    free(hrow);
    free(actp);
    free(actp2);
    free(outp);
    free(items);
    free(xpairs);
    free(actpairs);
    return rc;
}

/* The sum of a vector's lanes. */
INLINE float hsum(vf v) {
#if VW == 16
    return _mm512_reduce_add_ps((__m512)v);
#elif VW == 8 && defined(__AVX2__)
    __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
#else
    float t = 0.0f;
    for (int j = 0; j < VW; j++) t += v[j];
    return t;
#endif
}

/* Sum of n floats, read as the kernels read weights (vector loads, four concurrent sequential
 * streams per thread, several accumulators each): `bench model` times it to measure the machine's
 * read bandwidth for its roofline. */
float mm_read_sum(const float *p, int64_t n, int nthreads) {
    float total = 0.0f;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1) reduction(+ : total)
    {
        int64_t lo, hi;
        my_range(n, &lo, &hi);
        const int64_t run = (hi - lo) / (4 * 2 * VW) * (2 * VW); /* four runs of whole vector pairs */
        vf a[4][2];
        for (int j = 0; j < 4; j++) a[j][0] = a[j][1] = (vf){0};
        for (int64_t i = 0; i < run; i += 2 * VW)
            for (int j = 0; j < 4; j++) {
                a[j][0] += load_f(p + lo + j * run + i);
                a[j][1] += load_f(p + lo + j * run + i + VW);
            }
        vf v = a[0][0] + a[0][1] + a[1][0] + a[1][1] + a[2][0] + a[2][1] + a[3][0] + a[3][1];
        float part = hsum(v);
        for (int64_t i = lo + 4 * run; i < hi; i++) part += p[i];
        total += part;
    }
    return total;
}

/* What decode attention fetches ahead: the next block's key rows, then its value rows (rows of len
 * bytes, row bytes apart), a few cache lines (step) for every key each kv head of the item scores,
 * so that the fetches spread over the first half of the block's work. Into L2 (prefetcht2): with a
 * whole block's lines in flight, fetching into L1 stalled on its few miss buffers
 * (docs/benchmarks.md, "Decode attention in one pass"). */
typedef struct {
    const char *k, *v;
    int64_t row, len, rows, step;
    int64_t at, line; /* the row the next fetch is in (rows of keys, then rows of values), its line */
} fetcher;

INLINE void fetch_some(fetcher *f) {
    for (int64_t c = 0; c < f->step && f->at < 2 * f->rows; c++) {
        const char *start = (f->at < f->rows ? f->k + f->at * f->row : f->v + (f->at - f->rows) * f->row);
        const uintptr_t first = (uintptr_t)start & ~(uintptr_t)63;
        __builtin_prefetch((const char *)(first + 64 * f->line), 0, 1);
        if (first + 64 * ++f->line >= (uintptr_t)start + f->len) {
            f->at++;
            f->line = 0;
        }
    }
}

/* Decode attention's scores for the gc (<= 8) query heads that share one kv head, over the n keys of
 * a block: out[g * ld + o] = q_g . k_o * scale, with q_g at q + g * D and k_o at k + o * row (D
 * elements of kv_type). Each key's row is read (and widened) once for all gc heads. Each key fetches
 * a few lines ahead (f). */
INLINE void att_scores_t(const int kv_type, const int64_t D, const int64_t gc, const float *restrict q,
                         const char *k, int64_t row, int64_t n, float scale, float *restrict out, int64_t ld,
                         fetcher *f) {
    const int64_t DV = D / VW * VW;
    for (int64_t o = 0; o < n; o++) {
        fetch_some(f);
        const char *kp = k + o * row;
        vf a[8];
        for (int g = 0; g < 8; g++)
            if (g < gc) a[g] = (vf){0};
        for (int64_t d = 0; d < DV; d += VW) {
            const vf kv = load_w(kp, d, kv_type);
            for (int g = 0; g < 8; g++)
                if (g < gc) a[g] += load_f(q + g * D + d) * kv;
        }
        for (int g = 0; g < 8; g++)
            if (g < gc) {
                float dot = hsum(a[g]);
                for (int64_t d = DV; d < D; d++) dot += q[g * D + d] * load_w1(kp, d, kv_type);
                out[g * ld + o] = dot * scale;
            }
    }
}

/* acc_g[d] += sum_o p_g[o] v_o[d] for the gc (<= 8) heads that share one kv head (p_g at p + g * ld,
 * acc_g at acc + g * D), over the n value rows of a block (v_o at v + o * row, D elements of
 * kv_type): a few vectors of d for every head held in registers across the block's keys, in key
 * order, then added to acc; each value vector is read (and widened) once for all gc heads. */
INLINE void att_values_t(const int kv_type, const int64_t D, const int64_t gc, const float *restrict p, int64_t ld,
                         const char *v, int64_t row, int64_t n, float *restrict acc) {
    const int64_t DV = D / VW * VW;
    const int cw = VW == 16 ? (gc > 4 ? 2 : 4) : (gc > 4 ? 1 : 2); /* vectors of d at a time (registers) */
    for (int64_t d = 0; d < DV; d += cw * VW) {
        const int64_t m = DV - d < cw * VW ? (DV - d) / VW : cw;
        vf a[8][4];
        for (int g = 0; g < 8; g++)
            for (int c = 0; c < 4; c++)
                if (g < gc && c < m) a[g][c] = (vf){0};
        for (int64_t o = 0; o < n; o++) {
            const char *vp = v + o * row;
            vf val[4];
            for (int c = 0; c < 4; c++)
                if (c < m) val[c] = load_w(vp, d + c * VW, kv_type);
            for (int g = 0; g < 8; g++)
                if (g < gc) {
                    const vf pg = splat(p[g * ld + o]);
                    for (int c = 0; c < 4; c++)
                        if (c < m) a[g][c] += pg * val[c];
                }
        }
        for (int g = 0; g < 8; g++)
            for (int c = 0; c < 4; c++)
                if (g < gc && c < m) store_f(acc + g * D + d + c * VW, load_f(acc + g * D + d + c * VW) + a[g][c]);
    }
    for (int64_t d = DV; d < D; d++)
        for (int g = 0; g < gc; g++) {
            float t = 0.0f;
            for (int64_t o = 0; o < n; o++) t += p[g * ld + o] * load_w1(v + o * row, d, kv_type);
            acc[g * D + d] += t;
        }
}

/* ... specialised where the type, the head size (64 or 128: every model here but the tests' tiny ones)
 * and the heads sharing a kv head (1, 2, 4, 6 or 8, up to 8 at a time) are known, so that the loops
 * unroll and the sums stay in registers; other shapes run the same code with them as variables */
#define ATT_GROUPS(CALL, T, DD)                                                                           \
    for (int64_t g0 = 0; g0 < G; g0 += 8) {                                                              \
        const int64_t gc = G - g0 < 8 ? G - g0 : 8;                                                      \
        switch (gc) {                                                                                    \
        case 1: CALL(T, DD, 1); break;                                                                   \
        case 2: CALL(T, DD, 2); break;                                                                   \
        case 4: CALL(T, DD, 4); break;                                                                   \
        case 6: CALL(T, DD, 6); break;                                                                   \
        case 8: CALL(T, DD, 8); break;                                                                   \
        default: CALL(T, DD, gc);                                                                        \
        }                                                                                                \
    }
#define ATT_SHAPES(CALL, T)                                                                               \
    if (D == 64) {                                                                                       \
        ATT_GROUPS(CALL, T, 64)                                                                          \
    } else if (D == 128) {                                                                               \
        ATT_GROUPS(CALL, T, 128)                                                                         \
    } else {                                                                                             \
        for (int64_t g0 = 0; g0 < G; g0 += 8) CALL(T, D, G - g0 < 8 ? G - g0 : 8);                       \
    }

static void att_scores(int kv_type, int64_t D, int64_t G, const float *q, const char *k, int64_t row, int64_t n,
                       float scale, float *out, int64_t ld, fetcher *f) {
#define SCORES(T, DD, GG) att_scores_t(T, DD, GG, q + g0 * D, k, row, n, scale, out + g0 * ld, ld, f)
    if (kv_type == W_F32) {
        ATT_SHAPES(SCORES, W_F32);
    } else {
        ATT_SHAPES(SCORES, W_BF16);
    }
#undef SCORES
}

static void att_values(int kv_type, int64_t D, int64_t G, const float *p, int64_t ld, const char *v, int64_t row,
                       int64_t n, float *acc) {
#define VALUES(T, DD, GG) att_values_t(T, DD, GG, p + g0 * ld, ld, v, row, n, acc + g0 * D)
    if (kv_type == W_F32) {
        ATT_SHAPES(VALUES, W_F32);
    } else {
        ATT_SHAPES(VALUES, W_BF16);
    }
#undef VALUES
}
#undef ATT_SHAPES
#undef ATT_GROUPS

/* Decode attention over the paged KV cache: one query token per sequence.
 *
 * Legend: S = sequences, h = query heads, kvh = kv heads, G = h / kvh (heads sharing a kv head),
 * D = head_dim, L_s = keys of sequence s (its cached tokens plus this step's, already written).
 *
 * q [S, h, D] float32 (row s: sequence s's new token; rows ldq apart, heads D apart), out [S, h, D]
 * float32 (rows ldo apart).
 * k_cache, v_cache [num_blocks, block_size, kvh, D] (float32 or bfloat16, kv_type as W_*).
 * block_tables [S, max_blocks] int64: sequence s's key i lives in block block_tables[s][i / block_size]
 * at slot i % block_size. kv_len [S]: L_s.
 *
 * For each sequence (the parallel work items; with several threads and few sequences, each
 * sequence's kv heads in parts, so that every thread has a few items), one pass over its blocks
 * with a running softmax (as flash-decoding does): per block and head j, scores q_j . k_i * scale
 * for the block's keys (each key and value vector read and widened once for the heads that share
 * its kv head, one lane sum per score), the running maximum raised where the block's is higher (the
 * sums so far scaled by exp(old - new); a block whose scores are all -inf so far weighs 0),
 * p_i = exp(score_i - max) added to the running total and p_i v_i to the head's sums; out_j = sums /
 * total at the end. Each block's keys and values are read once, one after the other, and the
 * per-thread scratch is a block's scores and the sums (h x (block_size + D)).
 *
 * A decode step's keys and values are rarely still in cache, and a sequence's blocks lie anywhere in
 * the pool, where no hardware prefetcher follows them: so while a block's keys are scored, the next
 * block's key and value rows are fetched into L2 a few lines per key (after a sequence's last block,
 * the next sequence's first, which with one thread is the next item; docs/benchmarks.md, "Decode
 * attention in one pass"). Returns 0, or -1 when memory runs out. */
int mm_decode_attention(int64_t S, int64_t h, int64_t kvh, int64_t D, const float *q, int64_t ldq, float *out,
                        int64_t ldo, const void *k_cache, const void *v_cache, int kv_type, int64_t block_size,
                        const int64_t *block_tables, int64_t max_blocks, const int64_t *kv_len, float scale,
                        int nthreads) {
    const int64_t G = h / kvh;
    if (S <= 0) return 0;
    int64_t max_len = 1, total = 0;
    for (int64_t s = 0; s < S; s++) {
        max_len = kv_len[s] > max_len ? kv_len[s] : max_len;
        total += kv_len[s];
    }
    const int es = kv_type == W_F32 ? 4 : 2;
    const int64_t row = kvh * D * es; /* bytes between two keys' (or values') rows: every kv head */
    /* kv heads per item: all of them, unless several threads would get fewer than 4 items each, or
     * one sequence holds more than a quarter of a thread's share of the keys */
    int64_t want = 1;
    if (nthreads > 1) {
        const int64_t by_count = (4 * nthreads + S - 1) / S;
        const int64_t by_keys = total > 0 ? (4 * nthreads * max_len + total - 1) / total : 1;
        want = by_count > by_keys ? by_count : by_keys;
    }
    const int64_t parts = want < kvh ? want : kvh, per = (kvh + parts - 1) / parts; /* kv heads an item */
    const int64_t nparts = (kvh + per - 1) / per, items = S * nparts; /* (parts rounded by per) */
    const int64_t bsv = (block_size + VW - 1) / VW * VW; /* a head's block of scores, padded to whole vectors */
    int rc = 0;
#pragma omp parallel num_threads(nthreads < items ? nthreads : (int)items) if (nthreads > 1 && items > 1)
    {
        /* a block's scores for every head, the heads' sums, running maxima and totals */
        float *sc = malloc(sizeof(float) * h * (bsv + D + 2));
        if (!sc) {
#pragma omp atomic write
            rc = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!sc) continue;
            const int64_t s = item / nparts, kh0 = item % nparts * per;
            const int64_t kh1 = kh0 + per < kvh ? kh0 + per : kvh;
            const int64_t L = kv_len[s], j0 = kh0 * G, j1 = kh1 * G;
            const int64_t *bt = block_tables + s * max_blocks;
            const float *qs = q + s * ldq;
            float *acc = sc + h * bsv, *run_max = acc + h * D, *run_sum = run_max + h;
            memset(acc + j0 * D, 0, sizeof(float) * (j1 - j0) * D);
            for (int64_t j = j0; j < j1; j++) {
                run_max[j] = -INFINITY_F;
                run_sum[j] = 0.0f;
            }
            /* the item's part of a row: its kv heads' bytes */
            const int64_t part0 = kh0 * D * es, part_len = (kh1 - kh0) * D * es;
            /* after the last block: the next sequence's first (the same kv heads: its item with one
             * thread, and a block's worth of work either way) */
            const int64_t nx_len = s + 1 < S ? kv_len[s + 1] : 0;
            for (int64_t b0 = 0; b0 < L; b0 += block_size) {
                const int64_t blk = bt[b0 / block_size];
                const char *kb = (const char *)k_cache + blk * block_size * row;
                const char *vb = (const char *)v_cache + blk * block_size * row;
                const int64_t n = L - b0 < block_size ? L - b0 : block_size;
                const int64_t left = L - b0 - n;
                const int64_t nblk = left > 0 ? bt[b0 / block_size + 1] : nx_len > 0 ? block_tables[(s + 1) * max_blocks]
                                                                                     : -1;
                const int64_t nn = left > 0 ? (left < block_size ? left : block_size)
                                            : (nx_len < block_size ? nx_len : block_size); /* its rows */
                fetcher f = {0};
                if (nblk >= 0) {
                    f.k = (const char *)k_cache + nblk * block_size * row + part0;
                    f.v = (const char *)v_cache + nblk * block_size * row + part0;
                    f.row = row, f.len = part_len, f.rows = nn;
                    /* (spread over the first half of the block's keys) */
                    const int64_t lines = 2 * nn * ((part_len + 63) / 64 + 1), keys = (kh1 - kh0) * n;
                    f.step = 2 * ((lines + keys - 1) / keys);
                }
                for (int64_t kh = kh0; kh < kh1; kh++) {
                    att_scores(kv_type, D, G, qs + kh * G * D, kb + kh * D * es, row, n, scale, sc + kh * G * bsv, bsv,
                               &f);
                    for (int64_t g = 0; g < G; g++) {
                        const int64_t j = kh * G + g;
                        float *p = sc + j * bsv;
                        /* the running softmax: a higher maximum scales what was summed before it */
                        float m = run_max[j];
                        for (int64_t i = 0; i < n; i++) m = p[i] > m ? p[i] : m;
                        if (m == -INFINITY_F) { /* every score so far -inf: each weighs 0 (a NaN stays NaN) */
                            float t = 0.0f;
                            for (int64_t i = 0; i < n; i++) t += p[i] = p[i] == p[i] ? 0.0f : p[i];
                            run_sum[j] += t;
                            continue;
                        }
                        if (m > run_max[j]) {
                            const float f = __builtin_expf(run_max[j] - m); /* (0 for the first block) */
                            run_sum[j] *= f;
                            for (int64_t d = 0; d < D; d++) acc[j * D + d] *= f;
                            run_max[j] = m;
                        }
                        vf block_sum = {0};
                        for (int64_t i = 0; i < n; i += VW) {
                            vf e = vexp(load_f(p + i) - splat(m));
                            if (i + VW > n) /* the tail past the block's last key: masked by index (a NaN stays NaN) */
                                for (int64_t t = n - i; t < VW; t++) e[t] = 0.0f;
                            store_f(p + i, e);
                            block_sum += e;
                        }
                        run_sum[j] += hsum(block_sum);
                    }
                    att_values(kv_type, D, G, sc + kh * G * bsv, bsv, vb + kh * D * es, row, n, acc + kh * G * D);
                }
            }
            for (int64_t j = j0; j < j1; j++) {
                const float inv = 1.0f / run_sum[j];
                for (int64_t d = 0; d < D; d++) out[s * ldo + j * D + d] = acc[j * D + d] * inv;
            }
        }
        free(sc);
    }
    return rc;
}

/* RMSNorm with the residual add fused (float32), as Hugging Face computes it:
 *   r = x + residual (when residual is given, written to res_out), out = w * r / sqrt(mean(r^2) + eps)
 * x, residual, res_out, out: [T, H] rows ld apart (res_out and out: H apart). */
void mm_rmsnorm(int64_t T, int64_t H, const float *x, int64_t ldx, const float *residual, int64_t ldr,
                float *res_out, const float *w, float eps, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && T > 16)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * ldx;
        float *o = out + t * H;
        const float *src = xr;
        if (residual) {
            float *ro = res_out + t * H;
            const float *rr = residual + t * ldr;
            for (int64_t j = 0; j < H; j++) ro[j] = xr[j] + rr[j];
            src = ro;
        }
        vf acc = {0};
        int64_t j = 0;
        for (; j + VW <= H; j += VW) {
            vf v = load_f(src + j);
            acc += v * v;
        }
        float ss = 0.0f;
        for (int k = 0; k < VW; k++) ss += acc[k];
        for (; j < H; j++) ss += src[j] * src[j];
        const float inv = 1.0f / __builtin_sqrtf(ss / (float)H + eps);
        for (j = 0; j < H; j++) o[j] = w[j] * (src[j] * inv);
    }
}

/* Rotary embedding (rotate-half form) in place on the heads of each row:
 *   x[:D/2], x[D/2:] <- x1 * cos[:D/2] - x2 * sin[:D/2],  x2 * cos[D/2:] + x1 * sin[D/2:]
 * x: [T, heads, D] float32, rows ldx apart, heads D apart; cos/sin [P, D] (halves duplicated, as
 * Hugging Face builds them); positions [T]. */
__attribute__((optimize("fp-contract=off"))) void mm_rotary(int64_t T, int64_t heads, int64_t D, float *x, int64_t ldx, const int64_t *positions,
               const float *cos, const float *sin) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;
        for (int64_t hh = 0; hh < heads; hh++) {
            float *x1 = x + t * ldx + hh * D, *x2 = x1 + half;
            for (int64_t j = 0; j < half; j++) {
                const float a = x1[j], b = x2[j];
                const float p = a * c[j], q = b * s[j]; /* each product rounded, as torch does */
                const float r = b * c[half + j], u = a * s[half + j];
                x1[j] = p - q;
                x2[j] = r + u;
            }
        }
    }
}

#ifdef MM_TORCH_ORDER
int mm_torch_topk_order(const float *v, int64_t n, int64_t k, int64_t *ids); /* topk_order.cpp */
#endif

/* 1 where exact ties among router logits are broken as torch.topk breaks them (a C++ compiler
 * built topk_order.cpp in), 0 where they go to the lower expert */
int mm_torch_tie_order(void) {
#ifdef MM_TORCH_ORDER
    return 1;
#else
    return 0;
#endif
}

/* MoE routing: per token, softmax over the E router logits (float32), the K largest, renormalised
 * to sum 1 when asked. Ties: the lower expert first, unless the K-th is tied with an expert left
 * out, where the choice is torch.topk's (with topk_order.cpp built in). logits [T, E] rows ld
 * apart; weights [T, K] float32, ids [T, K] int64. */
void mm_topk_softmax(int64_t T, int64_t E, const float *logits, int64_t ld, int64_t K, int renormalize,
                     float *weights, int64_t *ids) {
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * ld;
        float m = l[0];
        for (int64_t e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
        float sum = 0.0f;
        for (int64_t e = 0; e < E; e++) sum += __builtin_expf(l[e] - m);
        float *w = weights + t * K;
        int64_t *id = ids + t * K;
        for (int64_t k = 0; k < K; k++) { /* selection: K is small */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t j = 0; j < k; j++) taken |= id[j] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            id[k] = best;
        }
#ifdef MM_TORCH_ORDER
        /* the K-th logit tied with one left out: which of the tied experts torch.topk takes
         * (topk_order.cpp). A row whose softmax is all NaN (a NaN logit, a +inf, or all -inf) is
         * ranked as torch ranks it: over E NaNs. */
        const float kth = l[id[K - 1]];
        int64_t tied = 0, tied_in = 0;
        for (int64_t e = 0; e < E; e++) tied += l[e] == kth;
        for (int64_t k = 0; k < K; k++) tied_in += l[id[k]] == kth;
        if (sum != sum) {
            float nans[E];
            for (int64_t e = 0; e < E; e++) nans[e] = __builtin_nanf("");
            mm_torch_topk_order(nans, E, K, id);
        } else if (tied > tied_in) {
            mm_torch_topk_order(l, E, K, id);
        }
#endif
        for (int64_t k = 0; k < K; k++) w[k] = __builtin_expf(l[id[k]] - m) / sum;
        if (renormalize) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += w[k];
            for (int64_t k = 0; k < K; k++) w[k] /= s;
        }
    }
}

/* ---- One whole decoder layer for a decode step (one new token per sequence, tensor parallel size 1)
 *
 * What the model files compute op by op (stage_worker/models/llama.py, moe.py), in one call: the
 * per-op path costs ~40 torch ops and ~30 Python calls per layer, several milliseconds a step at
 * small batches, as much as the weights take to read. Same kernels, same order of arithmetic. */

typedef struct { /* a weight packed as [ceil(n / NR)][k][NR] (weight type wt), int8 scales, a bias */
    const void *w;
    const float *scale;
    const float *bias;
    int64_t n, k, wt;
} mm_weight;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim;
    double eps, qk_eps;
    const float *in_norm, *post_norm, *q_norm, *k_norm; /* q_norm, k_norm: NULL without q/k norms */
    mm_weight qkv, o;
    const float *cos, *sin; /* [positions, head_dim] */
    void *k_cache, *v_cache; /* [blocks, block_size, kv_heads, head_dim] */
    int64_t kv_type, block_size;
    int64_t moe; /* 0: dense MLP (gate_up, down); 1: routed experts (+ a shared expert if gate_up.w) */
    mm_weight gate_up, down, router, shared_gate;
    int64_t experts, top_k, expert_offset, moe_intermediate, renormalize, moe_wt;
    const void *w13, *w2;
    const float *s13, *s2;
    int64_t moe_wt2; /* w2's weight type: moe_wt's, but for int8 where only one of them is in quads */
} mm_layer;

static int linear_rows(const mm_weight *m, int64_t T, const float *x, int64_t ldx, float *y, int nthreads) {
    if (mm_gemm(T, m->n, m->k, x, ldx, m->w, (int)m->wt, m->scale, y, m->n, nthreads)) return -1;
    if (m->bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < m->n; j++) y[t * m->n + j] += m->bias[j];
    return 0;
}

static void kv_store(void *cache, int64_t kv_type, int64_t slot, const float *src, int64_t n) {
    if (kv_type == W_F32) {
        memcpy((float *)cache + slot * n, src, n * 4);
    } else {
        uint16_t *dst = (uint16_t *)cache + slot * n;
        for (int64_t j = 0; j < n; j++) dst[j] = to_bf16(src[j]);
    }
}

/* y = down(silu(gate) * up) for T rows: gu [T, 2I] and act [T, I] are scratch. */
static int mlp_rows(const mm_weight *gate_up, const mm_weight *down, int64_t T, const float *x, int64_t H, float *gu,
                    float *act, float *y, int nthreads) {
    const int64_t I = gate_up->n / 2;
    if (linear_rows(gate_up, T, x, H, gu, nthreads)) return -1;
    for (int64_t t = 0; t < T; t++) silu_mul(gu + t * 2 * I, gu + t * 2 * I + I, act + t * I, I);
    return linear_rows(down, T, act, I, y, nthreads);
}

/* hidden [T, H]: the layer's input, overwritten with its output; residual [T, H]: the residual
 * stream, updated (first: the layer is the stage's first and there is no residual yet).
 * positions, slots [T]: each token's position and KV slot (block * block_size + offset);
 * block_tables [T, max_blocks], kv_len [T] as for mm_decode_attention. */
static int decoder_layer(const mm_layer *L, int64_t T, float *hidden, float *residual, int first,
                         const int64_t *positions, const int64_t *slots, const int64_t *block_tables,
                         int64_t max_blocks, const int64_t *kv_len, int nthreads) {
    const int64_t H = L->hidden, h = L->heads, kvh = L->kv_heads, D = L->head_dim, nq = (h + 2 * kvh) * D;
    const int64_t I = L->moe ? (L->gate_up.w ? L->gate_up.n / 2 : 0) : L->gate_up.n / 2;
    const int64_t wide = nq > 2 * I ? nq : 2 * I;
    float *xn = malloc(sizeof(float) * T * H), *big = malloc(sizeof(float) * T * (wide > 0 ? wide : 1));
    float *attn = malloc(sizeof(float) * T * (h * D > I ? h * D : I)), *side = malloc(sizeof(float) * T * H);
    /* top-k weights [T, top_k], then router logits [T, E] (the shared expert's gate [T, 1] after them) */
    float *topw = malloc(sizeof(float) * T * ((L->top_k > 0 ? L->top_k : 1) + L->experts + 1));
    int64_t *topi = malloc(sizeof(int64_t) * T * (L->top_k > 0 ? L->top_k : 1));
    int rc = -1;
    if (!xn || !big || !attn || !side || !topw || !topi) goto done;

    /* x = norm(hidden + residual); residual = hidden + residual */
    if (first) {
        memcpy(residual, hidden, sizeof(float) * T * H);
        mm_rmsnorm(T, H, hidden, H, NULL, 0, NULL, L->in_norm, (float)L->eps, xn, nthreads);
    } else {
        mm_rmsnorm(T, H, hidden, H, residual, H, residual, L->in_norm, (float)L->eps, xn, nthreads);
    }
    /* attention: qkv, q/k norms, rotary, the new K/V into the cache, attention, o_proj */
    if (linear_rows(&L->qkv, T, xn, H, big, nthreads)) goto done;
    if (L->q_norm)
        for (int64_t t = 0; t < T; t++) {
            float *q = big + t * nq;
            mm_rmsnorm(h, D, q, D, NULL, 0, NULL, L->q_norm, (float)L->qk_eps, q, 1);
            mm_rmsnorm(kvh, D, q + h * D, D, NULL, 0, NULL, L->k_norm, (float)L->qk_eps, q + h * D, 1);
        }
    mm_rotary(T, h, D, big, nq, positions, L->cos, L->sin);
    mm_rotary(T, kvh, D, big + h * D, nq, positions, L->cos, L->sin);
    for (int64_t t = 0; t < T; t++) {
        kv_store(L->k_cache, L->kv_type, slots[t], big + t * nq + h * D, kvh * D);
        kv_store(L->v_cache, L->kv_type, slots[t], big + t * nq + (h + kvh) * D, kvh * D);
    }
    if (mm_decode_attention(T, h, kvh, D, big, nq, attn, h * D, L->k_cache, L->v_cache, (int)L->kv_type,
                            L->block_size, block_tables, max_blocks, kv_len, 1.0f / __builtin_sqrtf((float)D),
                            nthreads))
        goto done;
    if (linear_rows(&L->o, T, attn, h * D, hidden, nthreads)) goto done;
    /* x = norm(attn + residual); residual += attn */
    mm_rmsnorm(T, H, hidden, H, residual, H, residual, L->post_norm, (float)L->eps, xn, nthreads);

    if (!L->moe) {
        if (mlp_rows(&L->gate_up, &L->down, T, xn, H, big, attn, hidden, nthreads)) goto done;
    } else {
        float *logits = topw + T * L->top_k;
        if (linear_rows(&L->router, T, xn, H, logits, nthreads)) goto done;
        mm_topk_softmax(T, L->experts, logits, L->experts, L->top_k, (int)L->renormalize, topw, topi);
        if (mm_moe(T, H, L->moe_intermediate, L->top_k, xn, topi, topw, L->experts, L->expert_offset, L->w13, L->s13,
                   L->w2, L->s2, (int)L->moe_wt, (int)L->moe_wt2, hidden, nthreads))
            goto done;
        if (L->gate_up.w) { /* + sigmoid(shared_gate x) * the shared expert's MLP */
            float *g = logits + T * L->experts; /* [T, 1] */
            if (mlp_rows(&L->gate_up, &L->down, T, xn, H, big, attn, side, nthreads)) goto done;
            if (linear_rows(&L->shared_gate, T, xn, H, g, nthreads)) goto done;
            for (int64_t t = 0; t < T; t++) {
                const float sg = 1.0f / (1.0f + __builtin_expf(-g[t]));
                for (int64_t j = 0; j < H; j++) hidden[t * H + j] += sg * side[t * H + j];
            }
        }
    }
    rc = 0;
done:
    free(xn);
    free(big);
    free(attn);
    free(side);
    free(topw);
    free(topi);
    return rc;
}

/* The n layers L[0..n) of a stage in turn (first: the first of them starts the residual stream):
 * one call per decode step instead of one per layer. */
int mm_decoder_layers(const mm_layer *L, int64_t n, int64_t T, float *hidden, float *residual, int first,
                      const int64_t *positions, const int64_t *slots, const int64_t *block_tables,
                      int64_t max_blocks, const int64_t *kv_len, int nthreads) {
    for (int64_t i = 0; i < n; i++)
        if (decoder_layer(L + i, T, hidden, residual, first && i == 0, positions, slots, block_tables, max_blocks,
                          kv_len, nthreads))
            return -1;
    return 0;
}

/* Greedy sampling: the first index of each row's maximum (a NaN counts as the maximum, as in
 * torch.max), rows of x [R, n] float32 ld apart. */
void mm_argmax_rows(int64_t R, int64_t n, const float *x, int64_t ld, int64_t *out) {
    const vf ninf = splat(-INFINITY_F);
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * ld;
        /* pass 1: the maximum and whether any NaN; four independent running maxima keep the
         * compare-and-select chains apart (a NaN never wins a compare, so it never enters them) */
        vf m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
        vi nan = {0};
        int64_t i = 0;
        for (; i + 4 * VW <= n; i += 4 * VW) {
            const vf a = load_f(row + i), b = load_f(row + i + VW), c = load_f(row + i + 2 * VW),
                     d = load_f(row + i + 3 * VW);
            nan |= (a != a) | (b != b) | (c != c) | (d != d);
            m0 = vselect(a > m0, a, m0);
            m1 = vselect(b > m1, b, m1);
            m2 = vselect(c > m2, c, m2);
            m3 = vselect(d > m3, d, m3);
        }
        for (; i + VW <= n; i += VW) {
            const vf v = load_f(row + i);
            nan |= v != v;
            m0 = vselect(v > m0, v, m0);
        }
        m0 = vselect(m1 > m0, m1, m0);
        m2 = vselect(m3 > m2, m3, m2);
        m0 = vselect(m2 > m0, m2, m0);
        float m = -INFINITY_F;
        int any_nan = 0;
        for (int j = 0; j < VW; j++) {
            m = m0[j] > m ? m0[j] : m;
            any_nan |= nan[j] != 0;
        }
        for (; i < n; i++) {
            any_nan |= row[i] != row[i];
            m = row[i] > m ? row[i] : m;
        }
        /* pass 2: its first index (a NaN's, if any), four vectors at a time until one holds it */
        const vf mv = splat(m);
        int64_t best = -1;
        for (i = 0; best < 0 && i + 4 * VW <= n; i += 4 * VW) {
            vi hit = {0};
            for (int q = 0; q < 4; q++) {
                const vf v = load_f(row + i + q * VW);
                hit |= any_nan ? (v != v) : (v == mv);
            }
            int found = 0;
            for (int j = 0; j < VW; j++) found |= hit[j] != 0;
            if (!found) continue;
            for (int64_t k = i; k < i + 4 * VW; k++)
                if (any_nan ? row[k] != row[k] : row[k] == m) {
                    best = k;
                    break;
                }
        }
        for (; best < 0 && i < n; i++)
            if (any_nan ? row[i] != row[i] : row[i] == m) best = i;
        out[r] = best < 0 ? 0 : best;
    }
}

/* Greedy sampling through a screened head (a float32 lm_head with a bfloat16 copy, or a bfloat16 one
 * with an int8 copy; kernels/cpu_gemm.py `ScreenedHead` derives the bound). approx [R, n] of type at
 * (float32, or bfloat16 where torch's matmul multiplied the copy; rows lda elements apart): row r's
 * logits from the copy, each within xn_r * radius[j] of the head's logit (xn_r = |x_r|,
 * the row's Euclidean norm). A row's candidates are the j whose interval reaches the largest lower end
 * of any: no other j can hold the maximum. Their logits are recomputed in float32 from x [R, K] (rows
 * ldx apart) and the packed head w of type wt (float32, bfloat16 widened, or int8 widened, each sum
 * then multiplied by its column's w_scale as the head's product does; w_scale NULL for the others),
 * and out[r] is the first maximum among them. out[r] = -1 where that cannot be
 * decided here (more than SCREEN_CAP candidates, or SCREEN_BUF still in reach when the buffer
 * fills; a value that is not finite; |x_r| wn_max at or above 2^126, where a sum could overflow):
 * the caller computes that row's logits in full. */
#define SCREEN_CAP 64
#define SCREEN_BUF 256
/* Whether any lane of a comparison's mask is set */
INLINE int any_lane(vi h) {
#if VW == 16
    return _mm512_test_epi32_mask((__m512i)h, (__m512i)h) != 0;
#elif VW == 8 && defined(__AVX2__)
    return !_mm256_testz_si256((__m256i)h, (__m256i)h);
#else
    int found = 0;
    for (int j = 0; j < VW; j++) found |= h[j] != 0;
    return found;
#endif
}

/* The largest lane of v */
INLINE float vmax_lanes(vf v) {
    float m = v[0];
    for (int j = 1; j < VW; j++) m = v[j] > m ? v[j] : m;
    return m;
}

void mm_screened_argmax(int64_t R, int64_t n, int64_t K, const void *approx, int at, int64_t lda, const float *x,
                        int64_t ldx, const float *radius, float wn_max, const void *w, int wt, const float *w_scale,
                        int64_t *out, int nthreads) {
    const int es = elem_size(wt);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && R > 1)
    for (int64_t r = 0; r < R; r++) {
        const void *a = (const char *)approx + r * lda * elem_size(at);
        const float *xr = x + r * ldx;
        double ss = 0.0;
        for (int64_t k = 0; k < K; k++) ss += (double)xr[k] * xr[k];
        const float xn = (float)__builtin_sqrt(ss) * (1.0f + 0x1p-20f);
        out[r] = -1;
        /* The bound holds where nothing overflows: every partial sum of either product is at most
         * |x| |w| (Cauchy-Schwarz), so rows with |x| wn_max (wn_max: the largest column norm of
         * either copy) below 2^126 are decided here; inf, NaN or huge activations (or weights) take
         * the full product, which says what they give. */
        if (!(xn < 0x1p126f) || !(xn * wn_max < 0x1p126f)) continue;
        /* one pass: the running largest lower end per lane (m), and every column whose upper end
         * reaches the largest lower end seen so far (floor_, raised whenever a vector has such a
         * column), kept with that upper end; pruned to the current floor when the buffer fills.
         * 1e-30: the bfloat16 denormals the products flush to zero. A NaN end is flagged. */
        const vf xv = splat(xn);
        vf m = splat(-INFINITY_F);
        vi bad = {0};
        int64_t cand[SCREEN_BUF];
        float upper[SCREEN_BUF];
        int count = 0, full = 0;
        float floor_ = -INFINITY_F;
        for (int64_t i = 0; i < n && !full; i += VW) {
            const int64_t len = n - i < VW ? n - i : VW;
            vf v, e;
            if (len == VW) {
                v = load_w(a, i, at);
                e = xv * load_f(radius + i);
            } else { /* the tail: lanes past n repeat column n - 1 (never a second hit: not above) */
                for (int j = 0; j < VW; j++) {
                    v[j] = load_w1(a, i + (j < len ? j : len - 1), at);
                    e[j] = xn * radius[i + (j < len ? j : len - 1)];
                }
            }
            const vf lo = v - e, hi = v + e;
            bad |= (lo != lo) | (hi != hi);
            m = vselect(lo > m, lo, m);
            if (!any_lane(hi >= splat(floor_))) continue;
            floor_ = vmax_lanes(m) - 1e-30f;
            for (int j = 0; j < len; j++) {
                if (!(hi[j] >= floor_)) continue;
                if (count == SCREEN_BUF) { /* prune to the floor as it is now */
                    int kept = 0;
                    for (int c = 0; c < count; c++)
                        if (upper[c] >= floor_) {
                            cand[kept] = cand[c];
                            upper[kept++] = upper[c];
                        }
                    count = kept;
                    if (count == SCREEN_BUF) {
                        full = 1;
                        break;
                    }
                }
                cand[count] = i + j;
                upper[count++] = hi[j];
            }
        }
        int any_bad = 0;
        for (int j = 0; j < VW; j++) any_bad |= bad[j] != 0;
        floor_ = vmax_lanes(m) - 1e-30f;
        if (any_bad || full || !(floor_ > -INFINITY_F)) continue;
        int kept = 0;
        for (int c = 0; c < count; c++)
            if (upper[c] >= floor_) cand[kept++] = cand[c];
        if (kept > SCREEN_CAP) continue;
        /* the candidates' logits, from the packed head: column j is lane j % NR of panel j / NR
         * (`paired_at` in a paired bfloat16 panel) */
        float best = -INFINITY_F;
        int64_t arg = -1;
        for (int c = 0; c < kept; c++) {
            const int64_t j = cand[c], cj = j % NR;
            const char *panel = (const char *)w + (j / NR) * K * NR * es;
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++)
                s = __builtin_fmaf(xr[k], load_w1(panel, PAIRED(wt) ? paired_at(k, cj, K) : k * NR + cj, wt), s);
            if (w_scale) s *= w_scale[j];
            if (!(s - s == 0.0f)) { /* (not finite: unreachable under the guard above) */
                arg = -1;
                break;
            }
            if (arg < 0 || s > best) {
                best = s;
                arg = j;
            }
        }
        out[r] = arg;
    }
}

/* Several greedy decode steps of a whole model in one call (a stage that is both the first and the
 * last, one tensor rank), each feeding back the tokens the one before sampled: what the runner's
 * decode step (embedding, mm_decoder_layers, the final norm, the lm_head, mm_argmax_rows) computes,
 * `steps` times, with no return to Python in between.
 * S sequences: tokens[S], each one's next input token, at positions[S] (the tokens before it are in
 * its cache); block_tables [S, max_blocks] cover every position up to positions[i] + steps - 1. The
 * caller has checked those, and the tokens against the embedding's rows (vocab <= its rows).
 * embed: [rows, H] of type et (float32 or bfloat16); norm: the final RMSNorm's weight (float32);
 * head: the packed lm_head, head_n >= vocab columns of type ht with its scale (or NULL).
 * screen (type st, scales screen_scale or NULL), radius, screen_wn_max: the head's copy (packed as
 * head, head_n columns: bfloat16 for a float32 head, int8 for a bfloat16 one) and its bound, to sample
 * through mm_screened_argmax (the rows it cannot decide take the full product, together); screen
 * NULL: none.
 * out [steps, S]: the tokens sampled, each the first maximum of its row's first vocab logits.
 * Returns -1 when out of memory. */
int mm_greedy_decode(const mm_layer *L, int64_t n, int64_t S, int64_t H, const void *embed, int et,
                     const float *norm, float eps, const void *head, int ht, const float *head_scale,
                     int64_t head_n, int64_t vocab, const void *screen, int st, const float *screen_scale,
                     const float *radius, float screen_wn_max,
                     const int64_t *tokens,
                     const int64_t *positions, const int64_t *block_tables, int64_t max_blocks, int64_t block_size,
                     int64_t steps, int64_t *out, int nthreads) {
    int rc = 0;
    float *hidden = malloc(sizeof(float) * S * H), *residual = malloc(sizeof(float) * S * H);
    float *summed = malloc(sizeof(float) * S * H), *normed = malloc(sizeof(float) * S * H);
    float *logits = malloc(sizeof(float) * S * head_n);
    int64_t *meta = malloc(sizeof(int64_t) * 3 * S); /* positions, slots, kv lengths of one step */
    if (!hidden || !residual || !summed || !normed || !logits || !meta) {
        rc = -1;
        goto done;
    }
    int64_t *pos = meta, *slots = meta + S, *kv_len = meta + 2 * S;
    for (int64_t s = 0; s < steps; s++) {
        const int64_t *in = s ? out + (s - 1) * S : tokens;
        for (int64_t i = 0; i < S; i++) {
            const int64_t p = positions[i] + s;
            pos[i] = p;
            kv_len[i] = p + 1;
            slots[i] = block_tables[i * max_blocks + p / block_size] * block_size + p % block_size;
            const int64_t row = in[i] * H;
            for (int64_t j = 0; j < H; j++) hidden[i * H + j] = load_w1(embed, row + j, et);
        }
        if (mm_decoder_layers(L, n, S, hidden, residual, 1, pos, slots, block_tables, max_blocks, kv_len,
                              nthreads)) {
            rc = -1;
            goto done;
        }
        mm_rmsnorm(S, H, hidden, H, residual, H, summed, norm, eps, normed, nthreads);
        int64_t *sampled = out + s * S;
        if (screen) {
            if (mm_gemm(S, head_n, H, normed, H, screen, st, screen_scale, logits, head_n, nthreads)) {
                rc = -1;
                goto done;
            }
            mm_screened_argmax(S, vocab, H, logits, W_F32, head_n, normed, H, radius, screen_wn_max, head, ht,
                               head_scale, sampled, nthreads);
            int64_t left = 0; /* the undecided rows, gathered into `summed` (free until the next step) */
            for (int64_t i = 0; i < S; i++)
                if (sampled[i] < 0) memcpy(summed + left++ * H, normed + i * H, sizeof(float) * H);
            if (!left) continue;
            if (mm_gemm(left, head_n, H, summed, H, head, ht, head_scale, logits, head_n, nthreads)) {
                rc = -1;
                goto done;
            }
            mm_argmax_rows(left, vocab, logits, head_n, meta); /* (meta: free until the next step too) */
            for (int64_t i = 0, j = 0; i < S; i++)
                if (sampled[i] < 0) sampled[i] = meta[j++];
            continue;
        }
        if (mm_gemm(S, head_n, H, normed, H, head, ht, head_scale, logits, head_n, nthreads)) {
            rc = -1;
            goto done;
        }
        mm_argmax_rows(S, vocab, logits, head_n, sampled);
    }
done:
    free(hidden);
    free(residual);
    free(summed);
    free(normed);
    free(logits);
    free(meta);
    return rc;
}
