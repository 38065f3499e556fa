/* The codec's INT8 kernels in C (AVX2, F16C, FMA): one call quantizes or dequantizes one
 * half (K or V) of a whole layer's blocks, bit for bit what kvstore.core.kernels' eager
 * torch ops produce.
 *
 * Python side: kvstore/core/native.py, which checks shapes, dtypes and strides and passes
 * data pointers and element strides; nothing here allocates on the heap or keeps a
 * reference. The GIL is released while a kernel runs.
 *
 * Same bytes as eager: every value is computed in float32 with the same operations in the
 * same order, each rounded once as torch rounds it (no contraction: -ffp-contract=off;
 * torch.lerp's vectorized kernel is an FMA, so the centred mid-range is one here too).
 * float32 -> float16 is the F16C conversion (round to nearest even, inf on overflow), as
 * c10::Half's; float32 -> bfloat16 rounds to nearest even, NaN to 0xFFFF, as ATen's vectorized
 * conversion does (measured: torch.tensor([nan]).to(torch.bfloat16) is 0xFFFF here).
 * Max and min are exact in any order. A NaN anywhere in a tile makes one of its scales NaN
 * (the codec then refuses the chunk, as it does for eager's NaN scales).
 *
 * Any head dim d from 8 on: each head's row is walked in whole vectors from channel 0, and
 * where the vector width does not divide d, one more vector ends at channel d, overlapping
 * the one before it. The overlap recomputes values already there (the same operations on
 * the same inputs) and folds maxima and minima in again (idempotent), so the bytes are the
 * ones a width dividing d would give; every load and store stays inside the row. Scratch
 * rows are padded to ROW_FLOATS(d), so the whole vectors load aligned.
 *
 * The modes (codec.py's docstring): c per channel, cc per channel centred, t per token,
 * ct channel-smoothed per token. Dtype codes are the chunk header's: 1 float16,
 * 2 bfloat16, 3 float32.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT
/* Where the CPU has AVX-512 with BF16, encode's passes and decode's rows of float16/bfloat16
 * also have a 512-bit form (16 channels per vector; for decode, one instruction rounds 16
 * values to bfloat16 where AVX2 takes five per 8). */
#define TGT512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define INL512 static inline __attribute__((always_inline)) TGT512

enum { ISA_AVX2 = 0, ISA_AVX512 = 1 };
static int isa = -1; /* what encode and decode use: the best this CPU has unless set_isa chose */

static int best_isa(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                   __builtin_cpu_supports("avx512bf16")
               ? ISA_AVX512
               : ISA_AVX2;
}

enum { F16 = 1, BF16 = 2, F32 = 3 };
enum { MODE_C = 1, MODE_CC = 2, MODE_T = 3, MODE_CT = 4 };
#define MAX_D 4096
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 16 /* rows ahead; 8, 16 and 32 measured alike, none ~25% slower */
#endif
#ifndef STREAM_BYTES
#define STREAM_BYTES (256 << 10)
#endif
#ifndef TILE_BYTES
#define TILE_BYTES (1 << 20) /* input per tile: 128 KiB tiles (2 heads here) measured no faster */
#endif
#define MAX_HD (1 << 20) /* scratch channels per block (ROW_FLOATS per head): 16 bytes each */
#define ROW_FLOATS(d) (((d) + 15) & ~(int64_t)15) /* a head's scratch row: 64-byte multiples */

static const float QMAX_INV = (float)(1.0 / 127.0); /* torch casts the scalar to float */
static const float TINY = 6.103515625e-05f;         /* 2**-14 */

typedef struct {
    char *p;
    int64_t n, t, h; /* element strides; the last dimension is contiguous */
} view_t;

typedef struct {
    uint16_t *p;
    int64_t n, t, h, d; /* float16 scale view, element strides */
} scales_t;

INL __m256 load8(const char *p, int dt) {
    if (dt == F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (dt == BF16) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    return _mm256_loadu_ps((const float *)p);
}

INL int esize(int dt) { return dt == F32 ? 4 : 2; }

/* Codes round to nearest even through MXCSR (encode_half sets it for the call). A NaN
 * converts to INT32_MIN and packs to -128, a code no finite value gets (|codes| <= 127 by
 * construction of the scales): `bad` collects them, so NaN is detected where the codes
 * are stored and the statistics passes need no check of their own. */
INL __m256i codes_i32(__m256 y) { return _mm256_cvtps_epi32(y); }

/* 32 codes in one store: the packs work within 128-bit lanes, the permute restores order */
INL void store_codes32(int8_t *q, __m256 a, __m256 b, __m256 c, __m256 d, __m256i *bad) {
    __m256i ab = _mm256_packs_epi32(codes_i32(a), codes_i32(b));
    __m256i cd = _mm256_packs_epi32(codes_i32(c), codes_i32(d));
    __m256i v = _mm256_packs_epi16(ab, cd);
    v = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, v);
    *bad = _mm256_or_si256(*bad, _mm256_cmpeq_epi8(v, _mm256_set1_epi8(-128)));
}

INL void store_codes8(int8_t *q, __m256 y, __m256i *bad) {
    __m256i i = codes_i32(y);
    __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    __m128i p8 = _mm_packs_epi16(p16, p16);
    _mm_storel_epi64((__m128i *)q, p8);
    __m128i hit = _mm_cmpeq_epi8(p8, _mm_set1_epi8(-128));
    *bad = _mm256_or_si256(*bad, _mm256_castsi128_si256(hit));
}

INL int any(__m256i bad) { return !_mm256_testz_si256(bad, bad); }

/* float16 round trip: the stored value and its float32 */
INL __m256 round16(__m256 v, __m128i *bits) {
    *bits = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    return _mm256_cvtph_ps(*bits);
}

INL float h2f(uint16_t h) { return _cvtsh_ss(h); }

INL void put_scales8(const scales_t *s, int64_t at, __m128i bits) {
    if (s->d == 1) {
        _mm_storeu_si128((__m128i *)(s->p + at), bits);
        return;
    }
    uint16_t tmp[8];
    _mm_storeu_si128((__m128i *)tmp, bits);
    for (int i = 0; i < 8; i++) s->p[at + i * s->d] = tmp[i];
}

/* Per-channel max and min over the rows of one block: row r's head j holds channels
 * j*dp .. j*dp+d-1 of hi/lo (dp = ROW_FLOATS(d), in L1 for usual shapes). Rows are walked in
 * memory order: walking one head down the rows (a stride of H*D values) left the loads
 * waiting on memory (38% of an encode's samples on one load). */
INL void minmax4(const char *pc, int64_t row_bytes, int dt, float *h, float *l) {
    __m256 a = load8(pc, dt), b = load8(pc + row_bytes, dt);
    __m256 e = load8(pc + 2 * row_bytes, dt), f = load8(pc + 3 * row_bytes, dt);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(e, f));
    __m256 mn = _mm256_min_ps(_mm256_min_ps(a, b), _mm256_min_ps(e, f));
    _mm256_storeu_ps(h, _mm256_max_ps(_mm256_loadu_ps(h), mx));
    _mm256_storeu_ps(l, _mm256_min_ps(_mm256_loadu_ps(l), mn));
}

INL void minmax1(const char *pc, int dt, float *h, float *l) {
    __m256 a = load8(pc, dt);
    _mm256_storeu_ps(h, _mm256_max_ps(_mm256_loadu_ps(h), a));
    _mm256_storeu_ps(l, _mm256_min_ps(_mm256_loadu_ps(l), a));
}

INL void channel_minmax(const char *x, int64_t rows, int64_t row_bytes, int64_t h,
                        int64_t head_bytes, int64_t d, int dt, float *hi, float *lo) {
    const int es = esize(dt);
    const int64_t dp = ROW_FLOATS(d);
    for (int64_t c = 0; c < h * dp; c += 8) {
        _mm256_store_ps(hi + c, _mm256_set1_ps(-INFINITY));
        _mm256_store_ps(lo + c, _mm256_set1_ps(INFINITY));
    }
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) /* four rows per load and store of the statistics */
        for (int64_t j = 0; j < h; j++) {
            const char *p = x + r * row_bytes + j * head_bytes;
            float *hj = hi + j * dp, *lj = lo + j * dp;
            if (r + PREFETCH_ROWS + 4 <= rows) /* the same head PREFETCH_ROWS rows on */
                for (int k = 0; k < 4; k++)
                    for (int64_t at = 0; at < d * es; at += 64)
                        _mm_prefetch(p + (PREFETCH_ROWS + k) * row_bytes + at, _MM_HINT_T0);
            int64_t c = 0;
            for (; c + 8 <= d; c += 8) minmax4(p + c * es, row_bytes, dt, hj + c, lj + c);
            if (c < d) minmax4(p + (d - 8) * es, row_bytes, dt, hj + d - 8, lj + d - 8);
        }
    for (; r < rows; r++)
        for (int64_t j = 0; j < h; j++) {
            const char *p = x + r * row_bytes + j * head_bytes;
            float *hj = hi + j * dp, *lj = lo + j * dp;
            int64_t c = 0;
            for (; c + 8 <= d; c += 8) minmax1(p + c * es, dt, hj + c, lj + c);
            if (c < d) minmax1(p + (d - 8) * es, dt, hj + d - 8, lj + d - 8);
        }
}

/* max over channels of |y|, and y's values as float32 into buf */
INL __m256 absmax8(const char *p, int dt, float *buf, const float *mul, __m256 r) {
    __m256 y = load8(p, dt);
    if (mul) y = _mm256_mul_ps(y, _mm256_loadu_ps(mul));
    _mm256_storeu_ps(buf, y);
    return _mm256_max_ps(r, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), y));
}

INL float row_absmax(const char *p, int64_t d, int dt, float *buf, const float *mul) {
    __m256 r = _mm256_setzero_ps();
    const int es = esize(dt);
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) r = absmax8(p + c * es, dt, buf + c, mul ? mul + c : NULL, r);
    if (c < d) r = absmax8(p + (d - 8) * es, dt, buf + d - 8, mul ? mul + d - 8 : NULL, r);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

typedef struct {
    const char *x;      /* the block's first value */
    int64_t rows, row_bytes, h, head_bytes, d;
    int8_t *q;          /* its first code */
    int64_t qrow, qhead;
    const scales_t *s0, *s1;
    int64_t b0, b1;     /* the block's offsets in s0 and s1 */
    float *hi, *lo, *mid, *buf; /* scratch: h rows of ROW_FLOATS(d) floats each (buf: one) */
} block_t;

/* a head's row of codes: y (its float32 values) times vi (the reciprocal of its scale) */
INL void row_codes(int8_t *q, const float *y, int64_t d, __m256 vi, __m256i *bad) {
    int64_t c = 0;
    for (; c + 32 <= d; c += 32)
        store_codes32(q + c, _mm256_mul_ps(_mm256_load_ps(y + c), vi),
                      _mm256_mul_ps(_mm256_load_ps(y + c + 8), vi),
                      _mm256_mul_ps(_mm256_load_ps(y + c + 16), vi),
                      _mm256_mul_ps(_mm256_load_ps(y + c + 24), vi), bad);
    for (; c + 8 <= d; c += 8) store_codes8(q + c, _mm256_mul_ps(_mm256_load_ps(y + c), vi), bad);
    if (c < d) store_codes8(q + d - 8, _mm256_mul_ps(_mm256_loadu_ps(y + d - 8), vi), bad);
}

/* per token (t), or channel-smoothed per token (ct: mul holds 1 / the channel maxima).
 * A token's heads go 8 at a time: their maxima first (values kept in buf), then their 8
 * scales and reciprocals in one vector, then their codes. One head at a time, each row
 * waited on its own scalar chain (max, float16 round trip, divide) before its codes: a half
 * of 8 blocks of 256 tokens (H=8, D=128, bfloat16) took 0.41 ms in t and 0.57 in ct, now
 * 0.24 and 0.39. */
INL void encode_rows(const block_t *b, int dt, const scales_t *s, int64_t base, const float *mul) {
    __m256i bad = _mm256_setzero_si256();
    const int64_t d = b->d, dp = ROW_FLOATS(d);
    const __m256 tiny = _mm256_set1_ps(TINY), qinv = _mm256_set1_ps(QMAX_INV);
    for (int64_t r = 0; r < b->rows; r++)
        for (int64_t j0 = 0; j0 < b->h; j0 += 8) {
            const int64_t g = b->h - j0 < 8 ? b->h - j0 : 8;
            float mx[8] __attribute__((aligned(32))) = {0}, iv[8] __attribute__((aligned(32)));
            uint16_t st[8];
            for (int64_t k = 0; k < g; k++) {
                const char *p = b->x + r * b->row_bytes + (j0 + k) * b->head_bytes;
                mx[k] = row_absmax(p, d, dt, b->buf + k * dp, mul ? mul + (j0 + k) * dp : NULL);
            }
            /* the scales, clamp_(min=TINY): max(TINY, s) keeps a NaN s NaN, as torch's
             * clamp does, and their reciprocals */
            __m128i bits;
            __m256 sv = _mm256_max_ps(tiny, _mm256_mul_ps(_mm256_load_ps(mx), qinv));
            _mm256_store_ps(iv, _mm256_div_ps(_mm256_set1_ps(1.0f), round16(sv, &bits)));
            _mm_storeu_si128((__m128i *)st, bits);
            for (int64_t k = 0; k < g; k++) {
                s->p[base + r * s->t + (j0 + k) * s->h] = st[k];
                row_codes(b->q + r * b->qrow + (j0 + k) * b->qhead, b->buf + k * dp, d,
                          _mm256_set1_ps(iv[k]), &bad);
            }
        }
    if (any(bad)) s->p[base] = 0x7E00; /* NaN in the KV: the codec refuses the chunk */
}

/* One vector of a head's channel statistics (hv, lv: channels cj.. of head j) into its
 * scales, and the reciprocals (and mid-ranges) that the codes pass reads at hj, mj. */
INL void scales_of8(int mode, const block_t *b, int64_t j, int64_t cj, __m256 hv, __m256 lv,
                    float *hj, float *mj) {
    const __m256 tiny = _mm256_set1_ps(TINY), one = _mm256_set1_ps(1.0f);
    const scales_t *sv = mode == MODE_CC ? b->s1 : b->s0; /* where the scales go */
    const int64_t bv = mode == MODE_CC ? b->b1 : b->b0;
    const int64_t at = j * b->s0->h + cj * b->s0->d;
    __m256 r, m = _mm256_setzero_ps();
    __m128i bits;
    if (mode == MODE_CC) {
        /* torch.lerp(lo, hi, 0.5), vectorized: fma(0.5 - 1, hi - lo, hi); + 0 makes a
         * zero +0 whichever zero max and min kept (kernels._enc_cc) */
        m = _mm256_fmadd_ps(_mm256_set1_ps(-0.5f), _mm256_sub_ps(hv, lv), hv);
        m = round16(_mm256_add_ps(m, _mm256_setzero_ps()), &bits);
        put_scales8(b->s0, b->b0 + at, bits);
        r = _mm256_max_ps(_mm256_sub_ps(hv, m), _mm256_sub_ps(m, lv));
    } else {
        /* maximum(amax, -amin); a NaN input shows in its code (store_codes32) */
        r = _mm256_max_ps(hv, _mm256_xor_ps(lv, _mm256_set1_ps(-0.0f)));
    }
    if (mode == MODE_CT) {
        __m256 cs = round16(_mm256_max_ps(r, tiny), &bits); /* the channel maxima */
        put_scales8(b->s0, b->b0 + at, bits);
        _mm256_storeu_ps(hj, _mm256_div_ps(one, cs));
        return;
    }
    __m256 s = round16(_mm256_max_ps(_mm256_mul_ps(r, _mm256_set1_ps(QMAX_INV)), tiny), &bits);
    put_scales8(sv, bv + j * sv->h + cj * sv->d, bits);
    _mm256_storeu_ps(hj, _mm256_div_ps(one, s)); /* the reciprocals */
    _mm256_storeu_ps(mj, m);
}

INL void encode_block(int mode, int dt, const block_t *b) {
    const int es = esize(dt);
    const int64_t d = b->d, dp = ROW_FLOATS(d);
    if (mode == MODE_T) {
        encode_rows(b, dt, b->s0, b->b0, NULL);
        return;
    }
    float *hi = b->hi, *lo = b->lo, *mid = b->mid;
    channel_minmax(b->x, b->rows, b->row_bytes, b->h, b->head_bytes, d, dt, hi, lo);
    for (int64_t j = 0; j < b->h; j++) {
        float *hj = hi + j * dp, *lj = lo + j * dp, *mj = mid + j * dp;
        /* the overlapping last vector's statistics, read before the vectors before it
         * overwrite hi with their reciprocals */
        const __m256 ht = _mm256_loadu_ps(hj + d - 8), lt = _mm256_loadu_ps(lj + d - 8);
        int64_t c = 0;
        for (; c + 8 <= d; c += 8)
            scales_of8(mode, b, j, c, _mm256_load_ps(hj + c), _mm256_load_ps(lj + c), hj + c,
                            mj + c);
        if (c < d) scales_of8(mode, b, j, d - 8, ht, lt, hj + d - 8, mj + d - 8);
    }
    if (mode == MODE_CT) {
        encode_rows(b, dt, b->s1, b->b1, hi);
        return;
    }
    const scales_t *sv = mode == MODE_CC ? b->s1 : b->s0;
    const int64_t bv = mode == MODE_CC ? b->b1 : b->b0;
    __m256i bad = _mm256_setzero_si256();
    for (int64_t r = 0; r < b->rows; r++)
        for (int64_t j = 0; j < b->h; j++) {
            const char *p = b->x + r * b->row_bytes + j * b->head_bytes;
            int8_t *q = b->q + r * b->qrow + j * b->qhead;
            const float *inv = hi + j * dp, *mj = mid + j * dp;
            int64_t c = 0;
#define CODE(k) (mode == MODE_CC ? _mm256_mul_ps(_mm256_sub_ps(load8(p + (c + k) * es, dt), \
                 _mm256_loadu_ps(mj + c + k)), _mm256_loadu_ps(inv + c + k)) \
                 : _mm256_mul_ps(load8(p + (c + k) * es, dt), _mm256_loadu_ps(inv + c + k)))
            for (; c + 32 <= d; c += 32) store_codes32(q + c, CODE(0), CODE(8), CODE(16), CODE(24), &bad);
            for (; c + 8 <= d; c += 8) store_codes8(q + c, CODE(0), &bad);
            if (c < d) {
                c = d - 8;
                store_codes8(q + c, CODE(0), &bad);
            }
#undef CODE
        }
    if (any(bad)) sv->p[bv] = 0x7E00;
}

/* ---------------------------------------------------------------- encode, 512-bit rows */

/* Encode's passes, 16 channels per vector, where the CPU has AVX-512 (isa) and d >= 16: the
 * same float32 operations on each channel in the same order as above (each lane of a
 * 512-bit operation rounds as the 256-bit one does), so the same bytes. Where 16 does not
 * divide d, each row ends with one more vector at channel d - 16, as above. Codes saturate
 * from int32 to int8 in one VPMOVSDB, which clamps as the two packs above do (INT32_MIN,
 * a NaN's, to -128). Measured on an AMD EPYC with AVX-512 BF16 (2 shared cores, noisy),
 * int8-kcc-vct, H=8, D=128, bfloat16, one thread, best of 10-20 batches: a 2048-token
 * layer's two encode kernels in 256-token blocks 0.70-0.79 ms on AVX2, 0.51-0.61 ms on
 * AVX-512 (t: 0.28 -> 0.20 ms a half; ct, the slowest: 0.37 -> 0.30). */

INL512 __m512 load16(const char *p, int dt) {
    if (dt == F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    if (dt == BF16) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
    return _mm512_loadu_ps((const float *)p);
}

/* 16 codes of y (rounded through MXCSR, as codes_i32); `low` keeps their bytewise minimum,
 * -128 only where a value was NaN */
INL512 void store_codes16(int8_t *q, __m512 y, __m128i *low) {
    __m128i v = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(y));
    _mm_storeu_si128((__m128i *)q, v);
    *low = _mm_min_epi8(*low, v);
}

/* 64 codes in one store: the packs work within 128-bit lanes (lane k: a, b, c, d's values
 * 4k..4k+3), the permute restores order. VPMOVSDB per 16 codes was the code loops' hottest
 * instruction in perf; this way the encode kernels above took 0.51 ms at best, against 0.55
 * with it. */
INL512 void store_codes64(int8_t *q, __m512 a, __m512 b, __m512 c, __m512 d, __m512i *low) {
    __m512i ab = _mm512_packs_epi32(_mm512_cvtps_epi32(a), _mm512_cvtps_epi32(b));
    __m512i cd = _mm512_packs_epi32(_mm512_cvtps_epi32(c), _mm512_cvtps_epi32(d));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512i v = _mm512_permutexvar_epi32(order, _mm512_packs_epi16(ab, cd));
    _mm512_storeu_si512((void *)q, v);
    *low = _mm512_min_epi8(*low, v);
}

INL512 int any_nan_code(__m128i low) {
    return _mm_movemask_epi8(_mm_cmpeq_epi8(low, _mm_set1_epi8(-128))) != 0;
}

INL512 int any_nan_code64(__m512i low) {
    return _mm512_cmpeq_epi8_mask(low, _mm512_set1_epi8(-128)) != 0;
}

INL512 __m512 round16x16(__m512 v, __m256i *bits) {
    *bits = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    return _mm512_cvtph_ps(*bits);
}

INL512 void put_scales16(const scales_t *s, int64_t at, __m256i bits) {
    if (s->d == 1) {
        _mm256_storeu_si256((__m256i *)(s->p + at), bits);
        return;
    }
    uint16_t tmp[16];
    _mm256_storeu_si256((__m256i *)tmp, bits);
    for (int i = 0; i < 16; i++) s->p[at + i * s->d] = tmp[i];
}

INL512 void minmax4x16(const char *pc, int64_t row_bytes, int dt, float *h, float *l) {
    __m512 a = load16(pc, dt), b = load16(pc + row_bytes, dt);
    __m512 e = load16(pc + 2 * row_bytes, dt), f = load16(pc + 3 * row_bytes, dt);
    __m512 mx = _mm512_max_ps(_mm512_max_ps(a, b), _mm512_max_ps(e, f));
    __m512 mn = _mm512_min_ps(_mm512_min_ps(a, b), _mm512_min_ps(e, f));
    _mm512_storeu_ps(h, _mm512_max_ps(_mm512_loadu_ps(h), mx));
    _mm512_storeu_ps(l, _mm512_min_ps(_mm512_loadu_ps(l), mn));
}

INL512 void minmax1x16(const char *pc, int dt, float *h, float *l) {
    __m512 a = load16(pc, dt);
    _mm512_storeu_ps(h, _mm512_max_ps(_mm512_loadu_ps(h), a));
    _mm512_storeu_ps(l, _mm512_min_ps(_mm512_loadu_ps(l), a));
}

/* channel_minmax, 16 channels per vector */
INL512 void channel_minmax512(const char *x, int64_t rows, int64_t row_bytes, int64_t h,
                              int64_t head_bytes, int64_t d, int dt, float *hi, float *lo) {
    const int es = esize(dt);
    const int64_t dp = ROW_FLOATS(d);
    for (int64_t c = 0; c < h * dp; c += 16) {
        _mm512_store_ps(hi + c, _mm512_set1_ps(-INFINITY));
        _mm512_store_ps(lo + c, _mm512_set1_ps(INFINITY));
    }
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
        for (int64_t j = 0; j < h; j++) {
            const char *p = x + r * row_bytes + j * head_bytes;
            float *hj = hi + j * dp, *lj = lo + j * dp;
            if (r + PREFETCH_ROWS + 4 <= rows)
                for (int k = 0; k < 4; k++)
                    for (int64_t at = 0; at < d * es; at += 64)
                        _mm_prefetch(p + (PREFETCH_ROWS + k) * row_bytes + at, _MM_HINT_T0);
            int64_t c = 0;
            for (; c + 16 <= d; c += 16) minmax4x16(p + c * es, row_bytes, dt, hj + c, lj + c);
            if (c < d) minmax4x16(p + (d - 16) * es, row_bytes, dt, hj + d - 16, lj + d - 16);
        }
    for (; r < rows; r++)
        for (int64_t j = 0; j < h; j++) {
            const char *p = x + r * row_bytes + j * head_bytes;
            float *hj = hi + j * dp, *lj = lo + j * dp;
            int64_t c = 0;
            for (; c + 16 <= d; c += 16) minmax1x16(p + c * es, dt, hj + c, lj + c);
            if (c < d) minmax1x16(p + (d - 16) * es, dt, hj + d - 16, lj + d - 16);
        }
}

/* absmax16 and row_absmax, 16 channels per vector; the maximum is exact in any order */
INL512 __m512 absmax16(const char *p, int dt, float *buf, const float *mul, __m512 r) {
    __m512 y = load16(p, dt);
    if (mul) y = _mm512_mul_ps(y, _mm512_loadu_ps(mul));
    _mm512_storeu_ps(buf, y);
    return _mm512_max_ps(r, _mm512_abs_ps(y));
}

INL512 float row_absmax512(const char *p, int64_t d, int dt, float *buf, const float *mul) {
    __m512 r = _mm512_setzero_ps();
    const int es = esize(dt);
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) r = absmax16(p + c * es, dt, buf + c, mul ? mul + c : NULL, r);
    if (c < d) r = absmax16(p + (d - 16) * es, dt, buf + d - 16, mul ? mul + d - 16 : NULL, r);
    return _mm512_reduce_max_ps(r);
}

INL512 void row_codes512(int8_t *q, const float *y, int64_t d, __m512 vi, __m128i *low,
                         __m512i *low64) {
    int64_t c = 0;
    for (; c + 64 <= d; c += 64)
        store_codes64(q + c, _mm512_mul_ps(_mm512_load_ps(y + c), vi),
                      _mm512_mul_ps(_mm512_load_ps(y + c + 16), vi),
                      _mm512_mul_ps(_mm512_load_ps(y + c + 32), vi),
                      _mm512_mul_ps(_mm512_load_ps(y + c + 48), vi), low64);
    for (; c + 16 <= d; c += 16) store_codes16(q + c, _mm512_mul_ps(_mm512_load_ps(y + c), vi), low);
    if (c < d) store_codes16(q + d - 16, _mm512_mul_ps(_mm512_loadu_ps(y + d - 16), vi), low);
}

/* encode_rows, 16 channels per vector (the 8 heads' scales as there) */
INL512 void encode_rows512(const block_t *b, int dt, const scales_t *s, int64_t base,
                           const float *mul) {
    __m128i low = _mm_setzero_si128();
    __m512i low64 = _mm512_setzero_si512();
    const int64_t d = b->d, dp = ROW_FLOATS(d);
    const __m256 tiny = _mm256_set1_ps(TINY), qinv = _mm256_set1_ps(QMAX_INV);
    for (int64_t r = 0; r < b->rows; r++)
        for (int64_t j0 = 0; j0 < b->h; j0 += 8) {
            const int64_t g = b->h - j0 < 8 ? b->h - j0 : 8;
            float mx[8] __attribute__((aligned(32))) = {0}, iv[8] __attribute__((aligned(32)));
            uint16_t st[8];
            for (int64_t k = 0; k < g; k++) {
                const char *p = b->x + r * b->row_bytes + (j0 + k) * b->head_bytes;
                mx[k] = row_absmax512(p, d, dt, b->buf + k * dp, mul ? mul + (j0 + k) * dp : NULL);
            }
            __m128i bits;
            __m256 sv = _mm256_max_ps(tiny, _mm256_mul_ps(_mm256_load_ps(mx), qinv));
            _mm256_store_ps(iv, _mm256_div_ps(_mm256_set1_ps(1.0f), round16(sv, &bits)));
            _mm_storeu_si128((__m128i *)st, bits);
            for (int64_t k = 0; k < g; k++) {
                s->p[base + r * s->t + (j0 + k) * s->h] = st[k];
                row_codes512(b->q + r * b->qrow + (j0 + k) * b->qhead, b->buf + k * dp, d,
                             _mm512_set1_ps(iv[k]), &low, &low64);
            }
        }
    if (any_nan_code(low) || any_nan_code64(low64)) s->p[base] = 0x7E00;
}

/* scales_of8, 16 channels */
INL512 void scales_of16(int mode, const block_t *b, int64_t j, int64_t cj, __m512 hv, __m512 lv,
                        float *hj, float *mj) {
    const __m512 tiny = _mm512_set1_ps(TINY), one = _mm512_set1_ps(1.0f);
    const scales_t *sv = mode == MODE_CC ? b->s1 : b->s0;
    const int64_t bv = mode == MODE_CC ? b->b1 : b->b0;
    const int64_t at = j * b->s0->h + cj * b->s0->d;
    __m512 r, m = _mm512_setzero_ps();
    __m256i bits;
    if (mode == MODE_CC) {
        m = _mm512_fmadd_ps(_mm512_set1_ps(-0.5f), _mm512_sub_ps(hv, lv), hv);
        m = round16x16(_mm512_add_ps(m, _mm512_setzero_ps()), &bits);
        put_scales16(b->s0, b->b0 + at, bits);
        r = _mm512_max_ps(_mm512_sub_ps(hv, m), _mm512_sub_ps(m, lv));
    } else {
        r = _mm512_max_ps(hv, _mm512_castsi512_ps(_mm512_xor_si512(
                                  _mm512_castps_si512(lv), _mm512_set1_epi32((int)0x80000000u))));
    }
    if (mode == MODE_CT) {
        __m512 cs = round16x16(_mm512_max_ps(r, tiny), &bits);
        put_scales16(b->s0, b->b0 + at, bits);
        _mm512_storeu_ps(hj, _mm512_div_ps(one, cs));
        return;
    }
    __m512 s = round16x16(_mm512_max_ps(_mm512_mul_ps(r, _mm512_set1_ps(QMAX_INV)), tiny), &bits);
    put_scales16(sv, bv + j * sv->h + cj * sv->d, bits);
    _mm512_storeu_ps(hj, _mm512_div_ps(one, s));
    _mm512_storeu_ps(mj, m);
}

/* encode_block, 16 channels per vector */
INL512 void encode_block512(int mode, int dt, const block_t *b) {
    const int es = esize(dt);
    const int64_t d = b->d, dp = ROW_FLOATS(d);
    if (mode == MODE_T) {
        encode_rows512(b, dt, b->s0, b->b0, NULL);
        return;
    }
    float *hi = b->hi, *lo = b->lo, *mid = b->mid;
    channel_minmax512(b->x, b->rows, b->row_bytes, b->h, b->head_bytes, d, dt, hi, lo);
    for (int64_t j = 0; j < b->h; j++) {
        float *hj = hi + j * dp, *lj = lo + j * dp, *mj = mid + j * dp;
        const __m512 ht = _mm512_loadu_ps(hj + d - 16), lt = _mm512_loadu_ps(lj + d - 16);
        int64_t c = 0;
        for (; c + 16 <= d; c += 16)
            scales_of16(mode, b, j, c, _mm512_load_ps(hj + c), _mm512_load_ps(lj + c), hj + c,
                        mj + c);
        if (c < d) scales_of16(mode, b, j, d - 16, ht, lt, hj + d - 16, mj + d - 16);
    }
    if (mode == MODE_CT) {
        encode_rows512(b, dt, b->s1, b->b1, hi);
        return;
    }
    const scales_t *sv = mode == MODE_CC ? b->s1 : b->s0;
    const int64_t bv = mode == MODE_CC ? b->b1 : b->b0;
    __m128i low = _mm_setzero_si128();
    __m512i low64 = _mm512_setzero_si512();
    for (int64_t r = 0; r < b->rows; r++)
        for (int64_t j = 0; j < b->h; j++) {
            const char *p = b->x + r * b->row_bytes + j * b->head_bytes;
            int8_t *q = b->q + r * b->qrow + j * b->qhead;
            const float *inv = hi + j * dp, *mj = mid + j * dp;
            int64_t c = 0;
#define CODE16(at) (mode == MODE_CC ? _mm512_mul_ps(_mm512_sub_ps(load16(p + (at) * es, dt), \
                    _mm512_loadu_ps(mj + (at))), _mm512_loadu_ps(inv + (at))) \
                    : _mm512_mul_ps(load16(p + (at) * es, dt), _mm512_loadu_ps(inv + (at))))
            for (; c + 64 <= d; c += 64)
                store_codes64(q + c, CODE16(c), CODE16(c + 16), CODE16(c + 32), CODE16(c + 48),
                              &low64);
            for (; c + 16 <= d; c += 16) store_codes16(q + c, CODE16(c), &low);
            if (c < d) store_codes16(q + d - 16, CODE16(d - 16), &low);
#undef CODE16
        }
    if (any_nan_code(low) || any_nan_code64(low64)) sv->p[bv] = 0x7E00;
}

/* encode_block512 with constant mode and dtype: each case inlines its own loads and drops
 * the other modes' branches from its inner loops */
TGT512 static void encode_block512_of(int mode, int dt, const block_t *b) {
#define MODES(T) switch (mode) { \
    case MODE_C: encode_block512(MODE_C, T, b); break; \
    case MODE_CC: encode_block512(MODE_CC, T, b); break; \
    case MODE_T: encode_block512(MODE_T, T, b); break; \
    default: encode_block512(MODE_CT, T, b); break; }
    switch (dt) {
    case F16: MODES(F16); break;
    case BF16: MODES(BF16); break;
    default: MODES(F32); break;
    }
#undef MODES
}

TGT static void encode_half(int mode, int dt, int64_t n, int64_t t, int64_t h, int64_t d,
                            view_t x, int8_t *q, int64_t qn, int64_t qt, int64_t qh,
                            scales_t s0, scales_t s1, float *scratch) {
    const int es = esize(dt);
    const int64_t dp = ROW_FLOATS(d);
    const unsigned int csr = _mm_getcsr(); /* round to nearest even, exceptions masked */
    _mm_setcsr((csr & ~0x6000u) | 0x1F80u);
    int64_t g = TILE_BYTES / (t * d * es); /* heads per tile */
    g = g < 1 ? 1 : g > h ? h : g;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < h; j += g) {
            int64_t heads = h - j < g ? h - j : g;
            block_t b = {x.p + (i * x.n + j * x.h) * es, t, x.t * es, heads, x.h * es, d,
                         q + i * qn + j * qh, qt, qh, &s0, &s1, i * s0.n + j * s0.h,
                         i * s1.n + j * s1.h, scratch, scratch + h * dp, scratch + 2 * h * dp,
                         scratch + 3 * h * dp};
            if (isa == ISA_AVX512 && d >= 16) {
                encode_block512_of(mode, dt, &b);
                continue;
            }
            switch (dt) { /* constant dtypes: each case inlines its own loads */
            case F16: encode_block(mode, F16, &b); break;
            case BF16: encode_block(mode, BF16, &b); break;
            default: encode_block(mode, F32, &b); break;
            }
        }
    _mm_setcsr(csr);
}

/* ------------------------------------------------------------------------------ decode */

/* bfloat16 bits of finite v, rounded to nearest even (in the low half of each lane) */
INL __m256i bf16_bits(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}

/* 16 values to p in dt; `finite`: no NaN among them (else NaN stores as ATen's vectorized
 * conversion stores it, 0xFFFF); `nt`: non-temporal stores (p 32-byte aligned) */
INL void store16(char *p, __m256 v0, __m256 v1, int dt, int finite, int nt) {
    if (dt == F16) {
        __m128i h0 = _mm256_cvtps_ph(v0, _MM_FROUND_TO_NEAREST_INT);
        __m128i h1 = _mm256_cvtps_ph(v1, _MM_FROUND_TO_NEAREST_INT);
        if (nt) {
            _mm256_stream_si256((__m256i *)p, _mm256_set_m128i(h1, h0));
        } else {
            _mm_storeu_si128((__m128i *)p, h0);
            _mm_storeu_si128((__m128i *)(p + 16), h1);
        }
        return;
    }
    if (dt == F32) {
        if (nt) {
            _mm256_stream_ps((float *)p, v0);
            _mm256_stream_ps((float *)(p + 32), v1);
        } else {
            _mm256_storeu_ps((float *)p, v0);
            _mm256_storeu_ps((float *)(p + 32), v1);
        }
        return;
    }
    __m256i r0 = bf16_bits(v0), r1 = bf16_bits(v1);
    if (!finite) {
        const __m256i qnan = _mm256_set1_epi32(0xFFFF);
        r0 = _mm256_blendv_epi8(r0, qnan, _mm256_castps_si256(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q)));
        r1 = _mm256_blendv_epi8(r1, qnan, _mm256_castps_si256(_mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)));
    }
    /* packus interleaves the 128-bit lanes (r0 lo, r1 lo, r0 hi, r1 hi); restore order */
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8);
    if (nt)
        _mm256_stream_si256((__m256i *)p, packed);
    else
        _mm256_storeu_si256((__m256i *)p, packed);
}

/* 8 values to p in dt (decode_row's heads of 8 to 15 channels) */
INL void store8(char *p, __m256 v, int dt, int finite) {
    if (dt == F16) {
        _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        return;
    }
    if (dt == F32) {
        _mm256_storeu_ps((float *)p, v);
        return;
    }
    __m256i r = bf16_bits(v);
    if (!finite)
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF),
                               _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    /* per lane: 4 values twice; the permute brings lane 1's next to lane 0's */
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

INL __m256 codes8(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

INL __m256 scales8(const scales_t *s, int64_t at) {
    if (s->d == 1) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s->p + at)));
    float tmp[8];
    for (int i = 0; i < 8; i++) tmp[i] = h2f(s->p[at + i * s->d]);
    return _mm256_loadu_ps(tmp);
}

/* per-channel scales of one block as float32, head j's d of them at to + j*ROW_FLOATS(d);
 * whether all are finite */
INL __m256 unpack_scales8(const scales_t *s, int64_t at, float *to, __m256 bad) {
    const __m256 inf = _mm256_set1_ps(INFINITY), sign = _mm256_set1_ps(-0.0f);
    __m256 v = scales8(s, at);
    _mm256_storeu_ps(to, v);
    return _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_andnot_ps(sign, v), inf, _CMP_NLT_UQ));
}

INL int channel_scales(const scales_t *s, int64_t base, int64_t h, int64_t d, float *to) {
    __m256 bad = _mm256_setzero_ps();
    const int64_t dp = ROW_FLOATS(d);
    for (int64_t j = 0; j < h; j++) {
        const int64_t at = base + j * s->h;
        float *tj = to + j * dp;
        int64_t c = 0;
        for (; c + 8 <= d; c += 8) bad = unpack_scales8(s, at + c * s->d, tj + c, bad);
        if (c < d) bad = unpack_scales8(s, at + (d - 8) * s->d, tj + d - 8, bad);
    }
    return _mm256_movemask_ps(bad) == 0;
}

/* One head's row: d values from codes qp into op. Finite scales give finite values
 * (|q·s·c| <= 127·65504², |m + q·s| likewise), so only rows with a non-finite scale take
 * the NaN-safe stores. */
INL void decode_row(int mode, int dt, const int8_t *qp, char *op, int64_t d, const float *aj,
                    const float *bj, float st, int finite, int nt) {
    const int es = esize(dt);
    const __m256 vs = _mm256_set1_ps(st);
#define VALUE(k) (mode == MODE_T ? _mm256_mul_ps(codes8(qp + c + k), vs) \
    : mode == MODE_CT ? _mm256_mul_ps(_mm256_mul_ps(codes8(qp + c + k), vs), _mm256_loadu_ps(aj + c + k)) \
    : mode == MODE_CC ? _mm256_add_ps(_mm256_loadu_ps(aj + c + k), _mm256_mul_ps(codes8(qp + c + k), _mm256_loadu_ps(bj + c + k))) \
    : _mm256_mul_ps(codes8(qp + c + k), _mm256_loadu_ps(aj + c + k)))
    /* q·s is exact in float32, so each value rounds once, as eager's do */
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) store16(op + c * es, VALUE(0), VALUE(8), dt, finite, nt);
    if (c < d && d >= 16) { /* the last 16, overlapping (nt: d % 16 == 0, never here) */
        c = d - 16;
        store16(op + c * es, VALUE(0), VALUE(8), dt, finite, 0);
    } else if (c < d) { /* 8 to 15 channels: the first 8 and the last 8 */
        store8(op, VALUE(0), dt, finite);
        c = d - 8;
        if (c) store8(op + c * es, VALUE(0), dt, finite);
    }
#undef VALUE
}

/* decode_row's finite case for float16/bfloat16 and d >= 16, 16 values per vector (the last
 * 16 overlapping where 16 does not divide d), the same float32 operations in the same
 * order. VCVTNEPS2BF16 rounds to nearest even, as ATen does, but treats denormal inputs as
 * zero: none can occur here, since every scale and mid-range is a float16 (a multiple of
 * 2**-24) and codes are integers, so a value is 0 or at least 2**-48 in magnitude, far
 * above float32's denormals (below 2**-126). */
INL512 __m512 codes16(const int8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
}

INL512 __m256i values16(int mode, int dt, const int8_t *qp, const float *aj, const float *bj,
                         __m512 vs) {
    __m512 q = codes16(qp), v;
    if (mode == MODE_T) v = _mm512_mul_ps(q, vs);
    else if (mode == MODE_CT) v = _mm512_mul_ps(_mm512_mul_ps(q, vs), _mm512_loadu_ps(aj));
    else if (mode == MODE_CC)
        v = _mm512_add_ps(_mm512_loadu_ps(aj), _mm512_mul_ps(q, _mm512_loadu_ps(bj)));
    else v = _mm512_mul_ps(q, _mm512_loadu_ps(aj));
    return dt == F16 ? _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)
                     : (__m256i)_mm512_cvtneps_pbh(v);
}

INL512 void decode_row512(int mode, int dt, const int8_t *qp, char *op, int64_t d,
                          const float *aj, const float *bj, float st, int nt) {
    const __m512 vs = _mm512_set1_ps(st);
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) {
        __m256i bits = values16(mode, dt, qp + c, aj + c, bj + c, vs);
        if (nt)
            _mm256_stream_si256((__m256i *)(op + 2 * c), bits);
        else
            _mm256_storeu_si256((__m256i *)(op + 2 * c), bits);
    }
    if (c < d) { /* the last 16, overlapping (nt: d % 16 == 0, never here) */
        c = d - 16;
        __m256i bits = values16(mode, dt, qp + c, aj + c, bj + c, vs);
        _mm256_storeu_si256((__m256i *)(op + 2 * c), bits);
    }
}

TGT512 static void decode_rows512(int mode, int dt, const int8_t *q, int64_t rows, int64_t qrow,
                                  int64_t qhead, int64_t h, int64_t d, char *out, int64_t orow,
                                  int64_t ohead, const scales_t *sv, int64_t bv, const float *a,
                                  const float *b, int nt) {
    const int64_t dp = ROW_FLOATS(d);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < h; j++) {
            const int8_t *qp = q + r * qrow + j * qhead;
            char *op = out + (r * orow + j * ohead) * 2;
            float st = 0.0f;
            if (mode == MODE_T || mode == MODE_CT) st = h2f(sv->p[bv + r * sv->t + j * sv->h]);
            if (!isfinite(st)) { /* the NaN-safe AVX2 row */
                decode_row(mode, dt, qp, op, d, a + j * dp, b + j * dp, st, 0, 0);
                continue;
            }
#define ROW(M, T) decode_row512(M, T, qp, op, d, a + j * dp, b + j * dp, st, nt)
            if (dt == F16) {
                switch (mode) {
                case MODE_C: ROW(MODE_C, F16); break;
                case MODE_CC: ROW(MODE_CC, F16); break;
                case MODE_T: ROW(MODE_T, F16); break;
                default: ROW(MODE_CT, F16); break;
                }
            } else {
                switch (mode) {
                case MODE_C: ROW(MODE_C, BF16); break;
                case MODE_CC: ROW(MODE_CC, BF16); break;
                case MODE_T: ROW(MODE_T, BF16); break;
                default: ROW(MODE_CT, BF16); break;
                }
            }
#undef ROW
        }
}

INL void decode_block(int mode, int dt, const int8_t *q, int64_t rows, int64_t qrow, int64_t qhead,
                      int64_t h, int64_t d, char *out, int64_t orow, int64_t ohead,
                      const scales_t *s0, int64_t b0, const scales_t *s1, int64_t b1, float *a,
                      float *b) {
    const int es = esize(dt);
    const int64_t dp = ROW_FLOATS(d);
    int finite = 1;
    if (mode != MODE_T) finite = channel_scales(s0, b0, h, d, a);
    if (mode == MODE_CC) finite &= channel_scales(s1, b1, h, d, b);
    const scales_t *sv = mode == MODE_T ? s0 : s1; /* per-token scales (t, ct) */
    const int64_t bv = mode == MODE_T ? b0 : b1;
    /* Big outputs bypass the cache (no read for ownership of lines written whole): the
     * layer an engine decodes into is larger than the cache anyway. */
    const int nt = rows * h * d * es >= STREAM_BYTES && d % 16 == 0 && (uintptr_t)out % 32 == 0 &&
                   (orow * es) % 32 == 0 && (ohead * es) % 32 == 0;
    if (isa == ISA_AVX512 && finite && dt != F32 && d >= 16) {
        decode_rows512(mode, dt, q, rows, qrow, qhead, h, d, out, orow, ohead, sv, bv, a, b, nt);
        if (nt) _mm_sfence();
        return;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < h; j++) {
            const int8_t *qp = q + r * qrow + j * qhead;
            char *op = out + (r * orow + j * ohead) * es;
            float st = 0.0f;
            if (mode == MODE_T || mode == MODE_CT) st = h2f(sv->p[bv + r * sv->t + j * sv->h]);
            const float *aj = a + j * dp, *bj = b + j * dp;
            if (finite && isfinite(st) && nt)
                decode_row(mode, dt, qp, op, d, aj, bj, st, 1, 1);
            else if (finite && isfinite(st))
                decode_row(mode, dt, qp, op, d, aj, bj, st, 1, 0);
            else
                decode_row(mode, dt, qp, op, d, aj, bj, st, 0, 0);
        }
    if (nt) _mm_sfence(); /* streamed stores visible before the call returns */
}

TGT static void decode_half(int mode, int dt, int64_t n, int64_t t, int64_t h, int64_t d,
                            const int8_t *q, int64_t qn, int64_t qt, int64_t qh, view_t out,
                            scales_t s0, scales_t s1, float *scratch) {
    float *a = scratch, *b = scratch + h * ROW_FLOATS(d);
    for (int64_t i = 0; i < n; i++) {
        const int8_t *qp = q + i * qn;
        char *op = out.p + i * out.n * esize(dt);
        int64_t b0 = i * s0.n, b1 = i * s1.n;
        switch (dt) {
        case F16: decode_block(mode, F16, qp, t, qt, qh, h, d, op, out.t, out.h, &s0, b0, &s1, b1, a, b); break;
        case BF16: decode_block(mode, BF16, qp, t, qt, qh, h, d, op, out.t, out.h, &s0, b0, &s1, b1, a, b); break;
        default: decode_block(mode, F32, qp, t, qt, qh, h, d, op, out.t, out.h, &s0, b0, &s1, b1, a, b); break;
        }
    }
}

/* ------------------------------------------------------------------------------ Python */

#define SCALES_FMT "KLLLL"

static int check_args(int mode, int dt, long long t, long long h, long long d) {
    if (mode < MODE_C || mode > MODE_CT || dt < F16 || dt > F32) {
        PyErr_SetString(PyExc_ValueError, "unknown mode or dtype code");
        return 0;
    }
    if (t < 1 || h < 1 || d < 8 || d > MAX_D || h * ROW_FLOATS(d) > MAX_HD) {
        PyErr_SetString(PyExc_ValueError, "shape outside the kernels' range (D: 8..4096)");
        return 0;
    }
    return 1;
}

static PyObject *py_encode(PyObject *self, PyObject *args) {
    int mode, dt;
    long long n, t, h, d;
    unsigned long long xp, qp, s0p, s1p;
    long long xn, xt, xh, qn, qt, qh, a[4], b[4];
    if (!PyArg_ParseTuple(args, "iiLLLLKLLLKLLL" SCALES_FMT SCALES_FMT, &mode, &dt, &n, &t, &h, &d,
                          &xp, &xn, &xt, &xh, &qp, &qn, &qt, &qh, &s0p, &a[0], &a[1], &a[2],
                          &a[3], &s1p, &b[0], &b[1], &b[2], &b[3]))
        return NULL;
    if (!check_args(mode, dt, t, h, d)) return NULL;
    view_t x = {(char *)(uintptr_t)xp, xn, xt, xh};
    scales_t s0 = {(uint16_t *)(uintptr_t)s0p, a[0], a[1], a[2], a[3]};
    scales_t s1 = {(uint16_t *)(uintptr_t)s1p, b[0], b[1], b[2], b[3]};
    float *scratch = aligned_alloc(64, (size_t)(4 * h * ROW_FLOATS(d)) * sizeof(float));
    if (!scratch) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    encode_half(mode, dt, n, t, h, d, x, (int8_t *)(uintptr_t)qp, qn, qt, qh, s0, s1, scratch);
    Py_END_ALLOW_THREADS
    free(scratch);
    Py_RETURN_NONE;
}

static PyObject *py_decode(PyObject *self, PyObject *args) {
    int mode, dt;
    long long n, t, h, d;
    unsigned long long qp, op, s0p, s1p;
    long long qn, qt, qh, on, ot, oh, a[4], b[4];
    if (!PyArg_ParseTuple(args, "iiLLLLKLLLKLLL" SCALES_FMT SCALES_FMT, &mode, &dt, &n, &t, &h, &d,
                          &qp, &qn, &qt, &qh, &op, &on, &ot, &oh, &s0p, &a[0], &a[1], &a[2],
                          &a[3], &s1p, &b[0], &b[1], &b[2], &b[3]))
        return NULL;
    if (!check_args(mode, dt, t, h, d)) return NULL;
    view_t out = {(char *)(uintptr_t)op, on, ot, oh};
    scales_t s0 = {(uint16_t *)(uintptr_t)s0p, a[0], a[1], a[2], a[3]};
    scales_t s1 = {(uint16_t *)(uintptr_t)s1p, b[0], b[1], b[2], b[3]};
    float *scratch = aligned_alloc(64, (size_t)(2 * h * ROW_FLOATS(d)) * sizeof(float));
    if (!scratch) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    decode_half(mode, dt, n, t, h, d, (const int8_t *)(uintptr_t)qp, qn, qt, qh, out, s0, s1, scratch);
    Py_END_ALLOW_THREADS
    free(scratch);
    Py_RETURN_NONE;
}

/* set_isa(n): encode and decode with AVX2 (0) or AVX-512 (1, where the CPU has it; -1: the
 * best it has); returns the ISA now in use. Tests run both. */
static PyObject *py_set_isa(PyObject *self, PyObject *args) {
    int want;
    if (!PyArg_ParseTuple(args, "i", &want)) return NULL;
    int best = best_isa();
    isa = want < 0 || want > best ? best : want;
    return PyLong_FromLong(isa);
}

static PyObject *py_supported(PyObject *self, PyObject *noargs) {
    __builtin_cpu_init();
    int ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    return PyBool_FromLong(ok);
}

/* known_headers(addrs, keys, forms, xxh3, covered=0): of the chunks whose 64-byte headers
 * start at addrs[i] (host memory, each at least 64 bytes), the indices i whose header is not
 * of one of the known forms, or names another key than keys[i] = (block_hash: 16 bytes,
 * layer, shard), or fails its header check (the low 32 bits of xxh3(bytes 0..59), computed
 * by the Python callable xxh3): those take the full check (kvstore/core/headers.py). A form
 * is 36 bytes, bytes 0..7 and 32..59 of a header that passed it; forms is their
 * concatenation. Each header is copied once before it is read, so the verdict is on one
 * version of its bytes even while a peer may still WRITE into the chunk. covered > 0: the
 * forms are of chunks checksummed with xxh3_64 over their first covered bytes, stored as a
 * little-endian u64 right after them, and a chunk whose checksum does not match is listed
 * too. That reads the whole chunk, after its header was copied: a peer that still writes
 * into it can make the two disagree, as it can for Python's check, which also reads the
 * header first. The caller vouches for every address (kvstore/core/headers.py). */
#define FORM_NBYTES 36

/* *out = xxh3(arg) for the Python callable xxh3; takes arg's reference (NULL: the error that
 * made it). 0, or -1 with a Python error set. */
static int digest_of(PyObject *xxh3, PyObject *arg, unsigned long long *out) {
    if (!arg) return -1;
    PyObject *digest = PyObject_CallOneArg(xxh3, arg);
    Py_DECREF(arg);
    if (!digest) return -1;
    *out = PyLong_AsUnsignedLongLongMask(digest);
    Py_DECREF(digest);
    return PyErr_Occurred() ? -1 : 0;
}
static PyObject *py_known_headers(PyObject *self, PyObject *args) {
    PyObject *addrs, *keys, *xxh3;
    Py_buffer forms;
    Py_ssize_t covered = 0;
    if (!PyArg_ParseTuple(args, "O!O!y*O|n", &PyList_Type, &addrs, &PyList_Type, &keys, &forms,
                          &xxh3, &covered))
        return NULL;
    PyObject *out = NULL, *key = NULL;
    Py_ssize_t n = PyList_GET_SIZE(addrs), nforms = forms.len / FORM_NBYTES;
    if (PyList_GET_SIZE(keys) != n || forms.len % FORM_NBYTES) {
        PyErr_SetString(PyExc_ValueError, "one key per address, and whole 36-byte forms");
        goto done;
    }
    out = PyList_New(0);
    if (!out) goto done;
    const uint8_t *known = (const uint8_t *)forms.buf;
    /* (the lists are read again at each step: the xxh3 callable is Python, which may run
     * anything; the key is held while it is read) */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PyList_GET_SIZE(addrs) || i >= PyList_GET_SIZE(keys)) {
            PyErr_SetString(PyExc_RuntimeError, "the lists changed during the check");
            goto fail;
        }
        unsigned long long addr = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(addrs, i));
        if (PyErr_Occurred()) goto fail;
        key = Py_NewRef(PyList_GET_ITEM(keys, i));
        if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 3 ||
            !PyBytes_Check(PyTuple_GET_ITEM(key, 0)) ||
            PyBytes_GET_SIZE(PyTuple_GET_ITEM(key, 0)) != 16) {
            PyErr_SetString(PyExc_TypeError, "a key is (16-byte block hash, layer, shard)");
            goto fail;
        }
        uint8_t head[64];
        memcpy(head, (const void *)(uintptr_t)addr, sizeof head);
        int ok = 0;
        for (Py_ssize_t f = 0; f < nforms && !ok; f++) {
            const uint8_t *form = known + f * FORM_NBYTES;
            ok = !memcmp(head, form, 8) && !memcmp(head + 32, form + 8, 28);
        }
        if (ok) {
            uint32_t layer, shard;
            memcpy(&layer, head + 24, 4);
            memcpy(&shard, head + 28, 4);
            unsigned long long want_layer = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(key, 1));
            unsigned long long want_shard = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(key, 2));
            if (PyErr_Occurred()) goto fail;
            ok = !memcmp(head + 8, PyBytes_AS_STRING(PyTuple_GET_ITEM(key, 0)), 16) &&
                 layer == want_layer && shard == want_shard;
        }
        if (ok) {
            unsigned long long sum;
            if (digest_of(xxh3, PyBytes_FromStringAndSize((const char *)head, 60), &sum) < 0)
                goto fail;
            uint32_t check;
            memcpy(&check, head + 60, 4);
            ok = check == (uint32_t)sum;
        }
        if (ok && covered > 0) {
            char *base = (char *)(uintptr_t)addr;
            unsigned long long sum;
            if (digest_of(xxh3, PyMemoryView_FromMemory(base, covered, PyBUF_READ), &sum) < 0)
                goto fail;
            uint64_t stored;
            memcpy(&stored, base + covered, 8);
            ok = stored == sum;
        }
        if (!ok) {
            PyObject *index = PyLong_FromSsize_t(i);
            if (!index || PyList_Append(out, index) < 0) {
                Py_XDECREF(index);
                goto fail;
            }
            Py_DECREF(index);
        }
        Py_CLEAR(key);
    }
    goto done;
fail:
    Py_CLEAR(out);
    Py_CLEAR(key);
done:
    PyBuffer_Release(&forms);
    return out;
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS,
     "encode(mode, dtype, N, T, H, D, x, xsN, xsT, xsH, q, qsN, qsT, qsH, s0, s0N, s0T, s0H, s0D, "
     "s1, s1N, s1T, s1H, s1D): quantize one half of N blocks (pointers and element strides)"},
    {"decode", py_decode, METH_VARARGS,
     "decode(mode, dtype, N, T, H, D, q, qsN, qsT, qsH, out, osN, osT, osH, s0, ..., s1, ...): "
     "dequantize one half of N blocks into out"},
    {"supported", py_supported, METH_NOARGS, "whether this CPU has AVX2, FMA and F16C"},
    {"known_headers", py_known_headers, METH_VARARGS,
     "known_headers(addrs, keys, forms, xxh3, covered=0): indices of the chunk headers at addrs "
     "that are not of a known form, name another key or fail their header check (covered > 0: "
     "or their xxh3_64 checksum of that many bytes)"},
    {"set_isa", py_set_isa, METH_VARARGS,
     "set_isa(n): encode and decode with AVX2 (0) or AVX-512 (1, where the CPU has it; -1: the "
     "best); "
     "returns the ISA in use"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "The codec's INT8 kernels in C (kvstore/core/native.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__native(void) {
    isa = best_isa();
    return PyModule_Create(&module);
}
