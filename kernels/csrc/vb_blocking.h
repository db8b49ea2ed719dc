/* Cache blocking shared by the GEMMs (cpu_gemm.c, cpu_gemm_q8.c): how much of K one block takes.
 *
 * Both GEMMs loop k blocks outermost, then blocks of MC rows, then the thread's panels of 16
 * outputs; a panel's k block is reused by every micro tile of the row block, and the row block's
 * k block by every panel. vb_k_block keeps the two of them (bytes_per_k bytes per k together) in
 * half the L2 cache, in a multiple of `multiple`.
 * NOTE: why the L2 and not the L1 (session 24, Zen 4: 32 KiB L1, 1 MiB L2; docs/performance/q8_0.md
 * "Q8_0's k block on a 32 KiB L1"). Sized to the L1, the blocks cut SmolLM2's K = 576 in two or
 * three, and each extra block re-reads and re-writes every output: raced in one process, the
 * L2-sized blocks took 0.86-0.97x the time at 8,192 rows (integer Q8_0 and fp32 alike) and the
 * 256-prompt q8_0 run went 1.17x faster. The micro tiles are bound by their multiply-adds, and a
 * panel streams from the L2 as fast as from the L1.
 */
#ifndef VB_BLOCKING_H
#define VB_BLOCKING_H

#include <unistd.h>

static inline int vb_k_block(long bytes_per_k, int multiple) {
    long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (l2 < 128 * 1024 || l2 > 64 * 1024 * 1024) l2 = 512 * 1024;  /* unknown (0 / -1) or implausible */
    const int kc = (int)(l2 / 2 / bytes_per_k) / multiple * multiple;
    return kc < multiple ? multiple : kc;
}

/* Rows of a block whose x rows (bytes_per_row each) and `fixed` bytes more fit half the L2: a multiple
 * of `multiple`, at least one, at most `most` (cpu_gemm.c's gated GEMM, which takes all of K at once). */
static inline int vb_row_block(long bytes_per_row, long fixed, int most, int multiple) {
    long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (l2 < 128 * 1024 || l2 > 64 * 1024 * 1024) l2 = 512 * 1024;  /* unknown (0 / -1) or implausible */
    const long room = l2 / 2 - fixed;
    const int rows = room > 0 ? (int)(room / bytes_per_row) / multiple * multiple : 0;
    return rows < multiple ? multiple : rows > most ? most : rows;
}

#endif
