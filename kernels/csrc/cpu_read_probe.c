/* The machine's read bandwidth as the kernels can get it: a buffer read once, front to back.
 *
 * Specification: the sum of the buffer's 64-bit words (wrapping), returned so that the reads are
 * not optimised away; the only thing measured is the time. Python binding: kernels/cpu_native.py
 * read_probe; used by cli/bench_ceilings.py for the bandwidth ceiling.
 *
 * NOTE: why. A ceiling is what the memory system can do; torch's sum() reads one sequential stream
 * per thread, and one stream per core keeps fewer misses in flight than several far-apart ones
 * (measured on Zen 3, 2 threads, 270 MB: 16.6 GB/s with one stream, 24.6 with four). The small-rows
 * linear reads its weights as several streams, so its ceiling is measured the same way
 * (cli/bench_ceilings.py: the fastest of torch's sum and this probe at 2, 4 and 8 streams).
 */
#include <omp.h>
#include <stdint.h>

#include "vb_kernels.h"

typedef uint64_t v64 __attribute__((vector_size(VL * 4), aligned(8)));  /* a share may start at any word */

/* S streams of `part` bytes from base, side by side, summed (S a compile-time constant below). */
static inline __attribute__((always_inline)) uint64_t read_streams(const char *base, int64_t part, const int S) {
    v64 acc[8];
    for (int s = 0; s < S; ++s) acc[s] = (v64){0};
    for (int64_t i = 0; i < part; i += 64)
        for (int s = 0; s < S; ++s)
            for (int b = 0; b < 64; b += (int)sizeof(v64)) acc[s] += *(const v64 *)(base + s * part + i + b);
    uint64_t total = 0;
    for (int s = 0; s < S; ++s)
        for (int j = 0; j < (int)(sizeof(v64) / 8); ++j) total += acc[s][j];
    return total;
}

/* Each thread reads its share of the buffer as `streams` (1, 2, 4 or 8) equal parts side by side,
 * then the few words past the last whole line of each part one by one. bytes: a multiple of 8. */
uint64_t VB_ACT(vb_read_probe)(const void *buffer, int64_t bytes, int streams, int num_threads) {
    uint64_t total = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = bytes / 8 * me / threads * 8, end = bytes / 8 * (me + 1) / threads * 8;
        const int64_t part = (end - begin) / streams / 64 * 64;
        const char *base = (const char *)buffer + begin;
        switch (streams) {
            case 1: total += read_streams(base, part, 1); break;
            case 2: total += read_streams(base, part, 2); break;
            case 4: total += read_streams(base, part, 4); break;
            default: total += read_streams(base, part, 8); break;
        }
        for (int64_t i = begin + part * streams; i < end; i += 8) total += *(const uint64_t *)((const char *)buffer + i);
    }
    return total;
}
