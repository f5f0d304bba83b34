/* Can one core hide a stream of weight reads behind arithmetic? (docs/benchmarks.md, "Why a
 * 64-row step costs 0.58 of a 128-row one here")
 *
 *   gcc -O2 -march=native -o /tmp/rwc docs/tools/read_while_computing.c
 *   taskset -c 0 /tmp/rwc ITERS DIST HINT SLICES STRIDE      e.g. /tmp/rwc 800 4 2 8 64
 *
 * 96 MB of "weights" are walked in 16 KB chunks (one int8 panel of a 512 x 32 weight), each chunk
 * in SLICES slices; per slice the core loads the slice's cache lines and/or runs ITERS / SLICES
 * rounds of 8 independent AVX-512 FMAs. Four timings, best of five: the reads alone, the
 * arithmetic alone, both interleaved, and both with the chunk DIST chunks ahead software-prefetched
 * a slice at a time, one prefetch every STRIDE bytes (HINT 1: prefetcht2, 2: prefetcht1, 3:
 * prefetcht0). A core that overlaps the two takes max(read, compute); one that cannot, their sum. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHUNK 16384

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static __m512 acc[8];

static void compute(int iters) {
    const __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
    __m512 x0 = acc[0], x1 = acc[1], x2 = acc[2], x3 = acc[3], x4 = acc[4], x5 = acc[5], x6 = acc[6], x7 = acc[7];
    for (int i = 0; i < iters; i++) { /* eight independent chains: the FMA units' throughput, not latency */
        x0 = _mm512_fmadd_ps(x0, a, b);
        x1 = _mm512_fmadd_ps(x1, a, b);
        x2 = _mm512_fmadd_ps(x2, a, b);
        x3 = _mm512_fmadd_ps(x3, a, b);
        x4 = _mm512_fmadd_ps(x4, a, b);
        x5 = _mm512_fmadd_ps(x5, a, b);
        x6 = _mm512_fmadd_ps(x6, a, b);
        x7 = _mm512_fmadd_ps(x7, a, b);
    }
    acc[0] = x0, acc[1] = x1, acc[2] = x2, acc[3] = x3, acc[4] = x4, acc[5] = x5, acc[6] = x6, acc[7] = x7;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s ITERS DIST HINT SLICES STRIDE\n", argv[0]);
        return 2;
    }
    const int iters = atoi(argv[1]), dist = atoi(argv[2]), hint = atoi(argv[3]), slices = atoi(argv[4]),
              stride = atoi(argv[5]);
    if (iters < 0 || dist < 1 || hint < 1 || hint > 3 || slices < 1 || CHUNK % slices || stride < 1) {
        fprintf(stderr, "ITERS >= 0, DIST >= 1, HINT 1-3, SLICES dividing %d, STRIDE >= 1\n", CHUNK);
        return 2;
    }
    const size_t n = (size_t)96 << 20, chunks = n / CHUNK, slice = CHUNK / slices;
    char *buf = aligned_alloc(2 << 20, n);
    if (!buf) {
        perror("aligned_alloc");
        return 1;
    }
    memset(buf, 1, n);
    const char *names[] = {"read", "compute", "read+compute", "read+compute+prefetch"};
    for (int mode = 0; mode < 4; mode++) {
        double best = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            __m512i s = _mm512_setzero_si512();
            const double t0 = now();
            for (size_t c = 0; c < chunks; c++) {
                const char *p = buf + c * CHUNK;
                for (int sl = 0; sl < slices; sl++) {
                    if (mode == 3 && c + dist < chunks) {
                        const char *q = buf + (c + dist) * CHUNK + sl * slice;
                        for (size_t l = 0; l < slice; l += stride) {
                            if (hint == 3) _mm_prefetch(q + l, _MM_HINT_T0);
                            else if (hint == 2) _mm_prefetch(q + l, _MM_HINT_T1);
                            else _mm_prefetch(q + l, _MM_HINT_T2);
                        }
                    }
                    if (mode != 1)
                        for (size_t l = sl * slice; l < (sl + 1) * slice; l += 64)
                            s = _mm512_add_epi32(s, _mm512_load_si512(p + l));
                    if (mode != 0) compute(iters / slices);
                }
            }
            const double t = now() - t0;
            if (t < best) best = t;
            volatile int sink = _mm512_reduce_add_epi32(s);
            (void)sink;
        }
        printf("%-22s %7.2f ms  %6.2f GB/s\n", names[mode], best * 1e3, n / best / 1e9);
    }
    free(buf);
    return 0;
}
