/* Paged attention on CPU: fp32 or bf16 queries over a KV cache of the same dtype or, for fp32
 * models, of half precision (vb_act.h: act_t, kv_t): every row of a flattened batch in one call.
 *
 * Specification and test oracle: kernels/attention_ref.py `paged_attention` (same contract).
 * Python binding: kernels/cpu_native.py (built with the system C compiler, loaded with ctypes).
 *
 * Request r owns query rows [query_start[r], query_start[r+1]); row i of it sits at absolute
 * position seq_lens[r] - query_len + i and attends to cache positions 0..that position, read
 * through block_tables[r]. Decode (query length 1), prefill, prefill on a cached prefix and
 * chunked prefill are all the same loop.
 *
 * The paths: items of TILED_MIN_ROWS rows or more take the tiled path (vb_attention_tiled.h); the
 * others, one query row at a time, the per-block loop below with 16-lane vectors (AVX-512) or the
 * spans of vb_attention_spans.h on narrower registers. This file plans the items and runs them.
 *
 * NOTE: a work item is (request, a range of kv heads, up to ROWS_PER_ITEM query rows). Normally
 * the range is every kv head, so a block's keys and values are read as the contiguous rows the
 * cache stores ([block_size, kv_heads, head_dim]) instead of a 1/kv_heads slice of each row; the
 * range is split per head only when there are too few requests to keep the threads busy. The G
 * query heads that share a kv head are done together, so each key/value row is used G times.
 * NOTE: a call of very few decode rows splits each row along its positions instead (every kv head
 * per part, partial softmax states merged: vb_attention.h SPLIT_*), whatever the thread count.
 * NOTE: one sweep over the request's blocks with an online softmax (running max, rescaled sums and
 * accumulators, as in flash attention): each block's keys and values are read once, in place,
 * upcast to fp32 in registers (bf16), while the next block is prefetched (the blocks of a request sit
 * anywhere in the cache, so the hardware prefetcher cannot guess the jump).
 * NOTE: the one-row loop keeps each softmax sum per lane (a vector, summed across lanes once at
 * the row's end) instead of a horizontal sum per block. On Zen 4, in one process
 * (bench/decode_attention.py --against, alternating rounds, medians), 4 rows x 256 positions in
 * L2: 0.92x the time of the per-block sums, 0.95-0.97x 388b602's kernel (1.03-1.04x before).
 * Memory-bound (256 rows x 384 positions, 30 layers) it changes nothing: 1.003-1.005x the
 * per-block sums (3 runs).
 * NOTE: q.k uses vdpbf16ps for bf16 where the CPU has avx512_bf16 (bf16 pairs multiplied exactly,
 * summed in fp32: the products the reference gets by upcasting both sides), fp32 FMAs otherwise.
 * NOTE: exp is vb_simd.h's polynomial (relative error about 1e-7).
 * NOTE: only positions below a request's length are read: unwritten cache slots (any bit
 * pattern, NaN included) never reach the arithmetic.
 */
#include "vb_attention.h"

/* scores[g][o] = q_g . k_o (scaled) for the n rows of one block and one kv head; returns nothing,
 * the block maxima go to bmax[g]. kbuf: scratch for 16 widened key rows ([16, D] fp32). */
static inline __attribute__((always_inline)) void block_scores(
        const act_t *q /* [G, D] of this kv head */, float scale, const kv_t *krows, int64_t row_stride, int n,
        float *scores, int score_stride, float *bmax, float *kbuf, const int NV, const int G) {
#if HAVE_DPBF16
    if (NV % 2 == 0 && VB_KV_IS_ACT) {
        /* bf16 pairs multiplied exactly and summed in fp32, keys not converted. 16 positions at a
           time: their 16 partial-dot vectors are summed by one transposing tree (45 shuffles/adds
           instead of 8 per score), leaving the 16 scores in one vector. */
        for (int g = 0; g < G; ++g) {
            __m512bh qb[MAX_HEAD_DIM / 32];
            for (int c = 0; c < NV / 2; ++c) qb[c] = (__m512bh)_mm512_loadu_si512(q + g * NV * VL + 32 * c);
            for (int o0 = 0; o0 < n; o0 += 16) {
                const int m = n - o0 < 16 ? n - o0 : 16;
                __m512 dot[16];
                for (int j = 0; j < 16; ++j) {
                    dot[j] = _mm512_setzero_ps();
                    if (j < m)
                        for (int c = 0; c < NV / 2; ++c)
                            dot[j] = _mm512_dpbf16_ps(dot[j], qb[c],
                                (__m512bh)load_kv_bf16x32(krows + (o0 + j) * row_stride + 32 * c));
                }
                const __m512 all = _mm512_mul_ps(sum16x16(dot), _mm512_set1_ps(scale));
                _mm512_store_ps(scores + g * score_stride + o0, all);
                const float top = _mm512_mask_reduce_max_ps((__mmask16)((1u << m) - 1u), all);
                bmax[g] = top > bmax[g] ? top : bmax[g];
            }
        }
        return;
    }
#endif
    vf qf[MAX_GROUP][MAX_HEAD_DIM / VL];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < NV; ++c) qf[g][c] = load_act(q + g * NV * VL + VL * c) * scale;
#if VB_AVX512 && !VB_KV_IS_ACT
    /* A cache narrower than the activations (fp8, or half precision under fp32): fp32 FMAs, 16
       positions at a time, their keys widened once into kbuf, then per query head 16 partial-dot
       vectors summed by one transposing tree (as the vdpbf16ps path) instead of a horizontal sum
       per score. bench/decode_attention.py, 256 x 384 positions, 2 rounds: bf16 queries over E5M2
       27.9 -> 23.0-23.5 ns per position and kv head (over E4M3 with the vdpbf16ps path after
       widening: 52 ns), fp32 queries over bf16 36.4-38.4 -> 35.2-37.0; an fp32 cache keeps the
       loop below (57-58 against 56-56.5 ns this way: read in place, it is bound by memory). */
    for (int o0 = 0; o0 < n; o0 += 16) {
        const int m = n - o0 < 16 ? n - o0 : 16;
        for (int j = 0; j < m; ++j)
            for (int c = 0; c < NV; ++c) store_f32(kbuf + j * NV * VL + VL * c, load_kv(krows + (o0 + j) * row_stride + VL * c));
        for (int g = 0; g < G; ++g) {
            __m512 dot[16];
            for (int j = 0; j < 16; ++j) {
                vf d = splat(0.0f);
                if (j < m)
                    for (int c = 0; c < NV; ++c) d += qf[g][c] * load_f32(kbuf + j * NV * VL + VL * c);
                dot[j] = (__m512)d;
            }
            const __m512 all = sum16x16(dot);
            _mm512_store_ps(scores + g * score_stride + o0, all);
            const float top = _mm512_mask_reduce_max_ps((__mmask16)((1u << m) - 1u), all);
            bmax[g] = top > bmax[g] ? top : bmax[g];
        }
    }
    return;
#endif
    (void)kbuf;
    for (int o = 0; o < n; ++o) {
        vf k[MAX_HEAD_DIM / VL];
        for (int c = 0; c < NV; ++c) k[c] = load_kv(krows + o * row_stride + VL * c);
        for (int g = 0; g < G; ++g) {
            vf dot = qf[g][0] * k[0];
            for (int c = 1; c < NV; ++c) dot += qf[g][c] * k[c];
            const float s = hsum(dot);
            scores[g * score_stride + o] = s;
            bmax[g] = s > bmax[g] ? s : bmax[g];
        }
    }
}

#include "vb_attention_tiled.h"
#include "vb_attention_tiled8.h"
#include "vb_attention_spans.h"

/* One work item. NV (= head_dim / VL) and G are compile-time constants in the specialised copies
 * below, so the query and accumulator vectors of one kv head live in registers. */
static inline __attribute__((always_inline)) void attend_item(
        const Problem *p, const Item *it, Scratch *sc, const int NV, const int G) {
    const int D = NV * VL, Hq = p->num_q_heads, BS = p->block_size;
    const ItemView iv = item_view(p, it, D);
    const int64_t row_stride = iv.row_stride, block_stride = iv.block_stride;
    const int32_t *table = iv.table;
    const int q_begin = iv.q_begin, first_pos = iv.first_pos;
    const int h0 = it->head_begin, nh = it->head_end - it->head_begin;
#if HAVE_DPBF16
    if (NV % 2 == 0 && BS % 16 == 0 && it->row_end - it->row_begin >= TILED_MIN_ROWS) {
        attend_rows_tiled(p, it, sc, NV, G);
        return;
    }
#endif
#if VL < 16
    for (int i = it->row_begin; i < it->row_end; ++i) {
        const int64_t t = q_begin + i;
        const int len = first_pos + i + 1;
        attend_row_spans(p, &iv, it, p->query + t * p->query_stride, p->out + t * Hq * D, it->pos_begin,
                         len < it->pos_end ? len : it->pos_end, len, sc, NV, G);
    }
    return;
#endif
    const int SS = (BS + 15) / 16 * 16;                    /* score row stride: whole aligned vectors */
    const int ahead_blocks = PREFETCH_BLOCKS * ((PREFETCH_HEAD_BLOCKS + nh - 1) / nh);   /* vb_attention.h */

    for (int i = it->row_begin; i < it->row_end; ++i) {
        const int64_t t = q_begin + i;
        const int row_len = first_pos + i + 1;  /* keys 0 .. first_pos + i; this item's: pos_begin .. len - 1 */
        const int len = row_len < it->pos_end ? row_len : it->pos_end;
        const act_t *qrow = p->query + t * p->query_stride;
        for (int j = 0; j < nh * G; ++j) { sc->mx[j] = -FLT_MAX; ((vf *)sc->sum)[j] = splat(0.0f); }
        memset(sc->acc, 0, sizeof(float) * (size_t)nh * G * D);

        for (int s0 = it->pos_begin; s0 < len; s0 += BS) {
            const int n = len - s0 < BS ? len - s0 : BS;
            const int64_t block = table[s0 / BS];
            /* the next block (keys and values) is prefetched row by row while this one is used */
            const int ahead = s0 + ahead_blocks * BS;   /* past a part's end too: this thread may take the next */
            const int64_t next = ahead < row_len ? (int64_t)table[ahead / BS] * block_stride : -1;
            const int n_next = next < 0 ? 0 : (row_len - ahead < BS ? row_len - ahead : BS);
            for (int h = h0; h < h0 + nh; ++h) {
                const int64_t base = block * block_stride + (int64_t)h * D;
                float *mx = sc->mx + (h - h0) * G;
                vf *sum = (vf *)sc->sum + (h - h0) * G;  /* per-lane running sums */
                float *acc = sc->acc + (int64_t)(h - h0) * G * D;
                float bmax[MAX_GROUP];
                for (int g = 0; g < G; ++g) bmax[g] = mx[g];
                block_scores(qrow + (int64_t)h * G * D, p->scale, p->key_cache + base, row_stride, n,
                             sc->scores, SS, bmax, (float *)sc->kt, NV, G);
                /* online softmax: rescale what was accumulated under the old max */
                vf a[MAX_GROUP][MAX_HEAD_DIM / VL];
                for (int g = 0; g < G; ++g) {
                    const float alpha = exp1(mx[g] - bmax[g]);
                    mx[g] = bmax[g];
                    float *sg = sc->scores + g * SS;
                    vf lanes = sum[g] * alpha;
                    for (int o = 0; o < n; o += VL) {
                        vf e = vexp(*(vf *)(sg + o) - bmax[g]);
                        const int left = n - o;
                        if (left < VL) e = select_lanes(mask_lanes_below(left), e, splat(0.0f));
                        *(vf *)(sg + o) = e;
                        lanes += e;
                    }
                    sum[g] = lanes;
                    for (int c = 0; c < NV; ++c) a[g][c] = *(vf *)(acc + g * D + VL * c) * alpha;
                }
                const kv_t *vrows = p->value_cache + base;
                for (int o = 0; o < n; ++o) {
                    if (o < n_next) {
                        const int64_t at = next + o * row_stride + (int64_t)h * D;
                        for (int b = 0; b < D * (int)sizeof(kv_t); b += 64) {
                            __builtin_prefetch((const char *)(p->key_cache + at) + b, 0, PREFETCH_HINT);
                            __builtin_prefetch((const char *)(p->value_cache + at) + b, 0, PREFETCH_HINT);
                        }
                    }
                    vf v[MAX_HEAD_DIM / VL];
                    for (int c = 0; c < NV; ++c) v[c] = load_kv(vrows + o * row_stride + VL * c);
                    for (int g = 0; g < G; ++g) {
                        const float w = sc->scores[g * SS + o];
                        for (int c = 0; c < NV; ++c) a[g][c] += w * v[c];
                    }
                }
                for (int g = 0; g < G; ++g)
                    for (int c = 0; c < NV; ++c) *(vf *)(acc + g * D + VL * c) = a[g][c];
            }
        }
        if (it->split >= 0) {   /* every kv head (vb_attention_plan) */
            store_part(p, it, sc->acc, sc->mx, sc->sum, VL);
            continue;
        }
        for (int h = h0; h < h0 + nh; ++h)
            for (int g = 0; g < G; ++g) {
                const float inv = 1.0f / hsum(((const vf *)sc->sum)[(h - h0) * G + g]);
                const float *acc = sc->acc + ((int64_t)(h - h0) * G + g) * D;
                act_t *os = p->out + (t * Hq + (int64_t)h * G + g) * D;
                for (int c = 0; c < NV; ++c) store_act(os + VL * c, *(const vf *)(acc + VL * c) * inv);
            }
    }
}

#define SPECIALISE(DIM, GROUP) \
    static void attend_##DIM##_##GROUP(const Problem *p, const Item *it, Scratch *sc) { \
        attend_item(p, it, sc, DIM / VL, GROUP); }
#define SPECIALISE_GROUPS(DIM) SPECIALISE(DIM, 1) SPECIALISE(DIM, 2) SPECIALISE(DIM, 3) SPECIALISE(DIM, 4) \
    SPECIALISE(DIM, 5) SPECIALISE(DIM, 6) SPECIALISE(DIM, 7) SPECIALISE(DIM, 8)
SPECIALISE_GROUPS(64)
SPECIALISE_GROUPS(128)

static void attend_generic(const Problem *p, const Item *it, Scratch *sc) {
    attend_item(p, it, sc, p->head_dim / VL, p->num_q_heads / p->num_kv_heads);
}

typedef void (*AttendFn)(const Problem *, const Item *, Scratch *);

#if HAVE_DPBF16
static AttendFn pick_tiled(int head_dim, int block_size) {  /* inside attend_item (vdpbf16ps) */
    (void)head_dim; (void)block_size;
    return NULL;
}
#else
/* The FMA tiled path is specialised on head_dim only (the group is a loop bound there): 18 copies
 * of it cost the AVX2 build 20 s of compile time for nothing measurable. On 8 lanes with FMA it is
 * vb_attention_tiled8.h's micro tiles. */
#if HAVE_TILED8
#define attend_rows_tiled_any attend_rows_tiled8
#else
#define attend_rows_tiled_any attend_rows_tiled_fma
#endif
#define SPECIALISE_TILED(DIM) \
    static void attend_tiled_##DIM(const Problem *p, const Item *it, Scratch *sc) { \
        attend_rows_tiled_any(p, it, sc, DIM / VL, p->num_q_heads / p->num_kv_heads); }
SPECIALISE_TILED(64)
SPECIALISE_TILED(128)

static void attend_tiled_generic(const Problem *p, const Item *it, Scratch *sc) {
    attend_rows_tiled_any(p, it, sc, p->head_dim / VL, p->num_q_heads / p->num_kv_heads);
}

static AttendFn pick_tiled(int head_dim, int block_size) {  /* items of >= TILED_MIN_ROWS rows */
    if (block_size % 16 != 0) return NULL;
    return head_dim == 64 ? attend_tiled_64 : head_dim == 128 ? attend_tiled_128 : attend_tiled_generic;
}
#endif

static AttendFn pick(int head_dim, int group) {
    static const AttendFn by64[8] = {attend_64_1, attend_64_2, attend_64_3, attend_64_4,
                                     attend_64_5, attend_64_6, attend_64_7, attend_64_8};
    static const AttendFn by128[8] = {attend_128_1, attend_128_2, attend_128_3, attend_128_4,
                                      attend_128_5, attend_128_6, attend_128_7, attend_128_8};
    if (group >= 1 && group <= 8 && head_dim == 64) return by64[group - 1];
    if (group >= 1 && group <= 8 && head_dim == 128) return by128[group - 1];
    return attend_generic;
}

/* A planned call: the work items and the kernel copy, shared by the threads that run it. */
struct VbAttention {
    Problem problem;
    AttendFn fn;
    AttendFn tiled_fn;  /* items of TILED_MIN_ROWS rows or more, where the build has a separate copy */
    Item *items;
    int64_t num_items;
    int heads_per_item, group;
    Split *splits;      /* the split decode rows (SPLIT_BELOW_ROWS, vb_attention.h) */
    int32_t *arrivals;  /* per split: parts finished, counted up across runs (the merge takes a multiple) */
};

/* Lays out the items (and the split rows' parts) in `items`, `splits`; with NULL arrays, only
 * counts them. */
static void lay_out(const int32_t *query_start, const int32_t *seq_lens, int num_reqs, int num_kv_heads,
                    int heads_per_item, int block_size, int split, Item *items, Split *splits, int64_t *num_items,
                    int64_t *num_splits, int64_t *num_parts) {
    int64_t k = 0, s = 0, slot = 0;
    for (int r = 0; r < num_reqs; ++r) {
        const int q_len = query_start[r + 1] - query_start[r], len = seq_lens[r];
        /* a split decode row: the most parts, a power of two, of at least SPLIT_MIN_POSITIONS each */
        int parts = 1;
        while (split && q_len == 1 && len / (2 * parts) >= SPLIT_MIN_POSITIONS && 2 * parts <= MAX_PARTS) parts *= 2;
        const int part_len = (len + parts - 1) / parts;
        const int aligned = (part_len + block_size - 1) / block_size * block_size;   /* whole blocks */
        parts = (len + aligned - 1) / aligned;
        if (parts > 1) {
            if (splits) splits[s] = (Split){query_start[r], (int32_t)slot, parts};
            for (int j = 0; j < parts; ++j, ++k)
                if (items) items[k] = (Item){r, 0, num_kv_heads, 0, 1, j * aligned, (j + 1) * aligned, (int32_t)s,
                                             (int32_t)(slot + j)};
            ++s;
            slot += parts;
            continue;
        }
        for (int b = 0; b < q_len; b += ROWS_PER_ITEM)
            for (int h = 0; h < num_kv_heads; h += heads_per_item, ++k)
                if (items) items[k] = (Item){r, h, h + heads_per_item, b, b + ROWS_PER_ITEM < q_len ? b + ROWS_PER_ITEM : q_len,
                                             0, INT32_MAX, -1, -1};
    }
    *num_items = k;
    *num_splits = s;
    *num_parts = slot;
}

/* Returns 0, or: 1 unsupported shape (head_dim not a multiple of 16 or above 256, more than 16
 * query heads per kv head, block size above 1024), 2 out of memory. */
int VB_ACT(vb_attention_plan)(
        VbAttention **plan, const act_t *query, int64_t query_stride, act_t *out, const kv_t *key_cache,
        const kv_t *value_cache, const int32_t *block_tables, int64_t table_stride, const int32_t *query_start,
        const int32_t *seq_lens, int num_reqs, int num_q_heads, int num_kv_heads, int head_dim,
        int block_size, float scale, int num_threads) {
    const int group = num_q_heads / num_kv_heads;
    if (head_dim % 16 != 0 || head_dim > MAX_HEAD_DIM || group > MAX_GROUP || group * num_kv_heads != num_q_heads
        || block_size > MAX_BLOCK_SIZE)
        return 1;
    int64_t row_chunks = 0;
    for (int r = 0; r < num_reqs; ++r)
        row_chunks += (query_start[r + 1] - query_start[r] + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    /* decode rows split along their positions when the call has few rows (whatever the thread
       count: the results must not depend on it) */
    const int split = query_start[num_reqs] < SPLIT_BELOW_ROWS;
    /* all kv heads per item unless that leaves threads idle */
    const int heads_per_item = row_chunks >= 2 * (int64_t)num_threads ? num_kv_heads : 1;
    int64_t num_items, num_splits, num_parts;
    lay_out(query_start, seq_lens, num_reqs, num_kv_heads, heads_per_item, block_size, split, NULL, NULL, &num_items,
            &num_splits, &num_parts);
    VbAttention *pl = calloc(1, sizeof(VbAttention));
    Item *items = malloc(sizeof(Item) * (size_t)(num_items > 0 ? num_items : 1));
    /* the split rows' bookkeeping, only where some row splits (NULL otherwise) */
    Split *splits = num_splits > 0 ? malloc(sizeof(Split) * (size_t)num_splits) : NULL;
    int32_t *arrivals = num_splits > 0 ? calloc((size_t)num_splits, sizeof(int32_t)) : NULL;
    float *partials = num_splits > 0 ? malloc(sizeof(float) * (size_t)num_parts * num_q_heads * (head_dim + 2)) : NULL;
    if (!pl || !items || (num_splits > 0 && (!splits || !arrivals || !partials))) {
        free(pl);
        free(items);
        free(splits);
        free(arrivals);
        free(partials);
        return 2;
    }
    lay_out(query_start, seq_lens, num_reqs, num_kv_heads, heads_per_item, block_size, split, items, splits, &num_items,
            &num_splits, &num_parts);
    const Problem problem = {query, query_stride, out, key_cache, value_cache, block_tables, table_stride, query_start,
                             seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, scale, partials};
    pl->problem = problem;
    pl->fn = pick(head_dim, group);
    pl->tiled_fn = pick_tiled(head_dim, block_size);
    pl->items = items;
    pl->num_items = num_items;
    pl->heads_per_item = num_splits > 0 ? num_kv_heads : heads_per_item;   /* the scratch's size */
    pl->group = group;
    pl->splits = splits;
    pl->arrivals = arrivals;
    *plan = pl;
    return 0;
}

/* A split row's parts, merged into its output: per query head, out = sum_k e^(m_k - M) acc_k /
 * sum_k e^(m_k - M) l_k with M the parts' largest max, taken in part order (the same bits whoever
 * merges). */
static void merge_split(const Problem *p, const Split *s) {
    const int Hq = p->num_q_heads, D = p->head_dim, NV = D / VL;
    const int64_t slot_len = (int64_t)Hq * (D + 2);
    const float *first = p->partials + s->first * slot_len;
    for (int j = 0; j < Hq; ++j) {
        float top = -FLT_MAX;
        for (int k = 0; k < s->parts; ++k) {
            const float m = first[k * slot_len + (int64_t)Hq * D + j];
            top = m > top ? m : top;
        }
        vf acc[MAX_HEAD_DIM / VL];
        for (int c = 0; c < NV; ++c) acc[c] = splat(0.0f);
        float sum = 0.0f;
        for (int k = 0; k < s->parts; ++k) {
            const float *slot = first + k * slot_len;
            const float w = exp1(slot[(int64_t)Hq * D + j] - top);
            sum += w * slot[(int64_t)Hq * D + Hq + j];
            for (int c = 0; c < NV; ++c) acc[c] += w * load_f32(slot + (int64_t)j * D + VL * c);
        }
        act_t *o = p->out + ((int64_t)s->row * Hq + j) * D;
        const float inv = 1.0f / sum;
        for (int c = 0; c < NV; ++c) store_act(o + VL * c, acc[c] * inv);
    }
}

void VB_ACT(vb_attention_free)(VbAttention *plan) {
    if (plan) {
        free(plan->items);
        free(plan->splits);
        free(plan->arrivals);
        free(plan->problem.partials);
    }
    free(plan);
}

/* Called by every thread of the enclosing team (or alone): runs the items shared out by an
 * orphaned `omp for`, which ends with the team's barrier. Returns 0, or 2 when this thread's
 * scratch could not be allocated (its items are then not computed). */
int VB_ACT(vb_attention_run_shared)(const VbAttention *plan) {
    const int group = plan->group, head_dim = plan->problem.head_dim, heads_per_item = plan->heads_per_item;
    /* one aligned allocation: per-row state, then the tiled path's buffers (16-float aligned) */
    const size_t rg = (size_t)ROWS_PER_ITEM * group, up = 16;
    /* the last: the transposed keys (bf16 pairs: head_dim / 2 x 16 words; fp32: head_dim x 16), then
       the chunk's fp32 values (16 x head_dim) */
    const size_t key_words = (size_t)head_dim * 16 / (HAVE_DPBF16 ? 2 : 1);
    const size_t sizes[8] = {(size_t)heads_per_item * group * head_dim, (size_t)heads_per_item * group,
                             (size_t)heads_per_item * group * VL, rg * head_dim, rg, rg * 16, rg * 16,
                             key_words + (size_t)16 * head_dim};
    size_t total = 0;
    for (int j = 0; j < 8; ++j) total += (sizes[j] + up - 1) / up * up;
    Scratch *sc = aligned_alloc(64, (sizeof(Scratch) + 63) / 64 * 64);
    float *state = sc ? aligned_alloc(64, total * sizeof(float)) : NULL;
    if (state) {
        float *at[8];
        float *cursor = state;
        for (int j = 0; j < 8; ++j) { at[j] = cursor; cursor += (sizes[j] + up - 1) / up * up; }
        sc->acc = at[0]; sc->mx = at[1]; sc->sum = at[2];
        sc->tacc = at[3]; sc->tm = at[4]; sc->tl = at[5]; sc->tp = at[6];
        sc->kt = (uint32_t *)at[7];
        sc->vf = at[7] + key_words;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < plan->num_items; ++i) {
        const Item *it = &plan->items[i];
        if (!state) continue;
        if (plan->tiled_fn && it->row_end - it->row_begin >= TILED_MIN_ROWS) plan->tiled_fn(&plan->problem, it, sc);
        else plan->fn(&plan->problem, it, sc);
        /* the last part of a split row to finish merges it (acquire: the other parts' states are seen) */
        if (it->split >= 0) {
            const Split *s = &plan->splits[it->split];
            if (__atomic_add_fetch(&plan->arrivals[it->split], 1, __ATOMIC_ACQ_REL) % s->parts == 0)
                merge_split(&plan->problem, s);
        }
    }
    free(state);
    free(sc);
    return state ? 0 : 2;
}

/* The whole call: plan, run on num_threads threads, free. Returns vb_attention_plan's codes. */
int VB_ACT(vb_paged_attention)(
        const act_t *query, int64_t query_stride, act_t *out, const kv_t *key_cache, const kv_t *value_cache,
        const int32_t *block_tables, int64_t table_stride, const int32_t *query_start,
        const int32_t *seq_lens, int num_reqs, int num_q_heads, int num_kv_heads, int head_dim,
        int block_size, float scale, int num_threads) {
    VbAttention *plan = NULL;
    const int rc = VB_ACT(vb_attention_plan)(&plan, query, query_stride, out, key_cache, value_cache, block_tables,
                                     table_stride, query_start, seq_lens, num_reqs, num_q_heads, num_kv_heads,
                                     head_dim, block_size, scale, num_threads);
    if (rc != 0) return rc;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && plan->num_items > 1)
    {
        if (VB_ACT(vb_attention_run_shared)(plan) != 0) {
#pragma omp atomic write
            failed = 2;
        }
    }
    VB_ACT(vb_attention_free)(plan);
    return failed;
}
