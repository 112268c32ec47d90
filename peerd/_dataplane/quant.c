/* int8, int4, fp16 and bf16 bodies in one pass (protocol/codecs.md, "Integer codecs", "Float codecs"): the native
 * twin of peerd/compress/quant.py's IntCodec and floats.py's Float16Codec and BFloat16Codec (_encode_rows,
 * _decode_rows), byte for byte.
 *
 * Python checks shapes and sizes first (Codec.encode_block, decode_block); these functions take explicit rows,
 * counts and strides, check every bound again, and release the GIL over the block. The arithmetic follows the
 * numpy path's operation order exactly: fp16 roundings from the exact value (float32 -> fp16 and float64 -> fp16
 * round once, to nearest even), float32 products and sums never fused (-ffp-contract=off in pyproject.toml),
 * draws from rounding.py's stream (splitmix64 key, murmur3 fmix32 per element).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define GOLDEN32 0x9E3779B9u
#define DRAW_SHIFT 8         /* 32 - DRAW_BITS: draws are 24 bits */
#define TINY16 0x0001u       /* the smallest positive fp16: the scale of a constant group */
#define MAX_GROUP 0xFFFF
#define MAX_COUNT (1 << 20)  /* elements per body: Codec.MAX_COUNT */

/* ---- fp16 ------------------------------------------------------------------------------------------------- */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
    if (exp == 0) {
        float v = ldexpf((float)man, -24); /* subnormal (or zero): exact */
        return sign ? -v : v;
    }
    if (exp == 31) bits = sign | 0x7F800000u | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ``d`` rounded to the nearest fp16 (ties to even), overflow to infinity, NaN to a quiet NaN: numpy's astype. */
static uint16_t double_to_half(double d) {
    uint16_t sign = signbit(d) ? 0x8000u : 0;
    double a = fabs(d);
    if (isnan(d)) return (uint16_t)(sign | 0x7E00u);
    if (a >= 65520.0) return (uint16_t)(sign | 0x7C00u); /* 65520 ties to 65536: infinity */
    if (a < ldexp(1.0, -14)) return (uint16_t)(sign | (uint16_t)nearbyint(ldexp(a, 24))); /* 1024: the least normal */
    int e;
    frexp(a, &e); /* a = f * 2^e, f in [0.5, 1): the fp16 exponent is e - 1 */
    double m = nearbyint(ldexp(a, 11 - e)); /* 1024 .. 2048 */
    uint32_t bits = ((uint32_t)(e - 1 + 15) << 10) + (uint32_t)m - 1024u; /* m = 2048 carries into the exponent */
    return (uint16_t)(sign | bits);
}

static void put16(unsigned char *p, uint16_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
}

static uint16_t get16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* Whether two buffers share no byte. */
static int buffers_disjoint(const Py_buffer *a, const Py_buffer *b) {
    const char *x = a->buf, *y = b->buf;
    return a->len == 0 || b->len == 0 || x + a->len <= y || y + b->len <= x;
}

/* What every decoder checks before it touches memory: ``rows`` bodies of ``body`` bytes at offset + i * stride lie
 * inside the ``span`` bytes of ``src``; ``values`` (rows x count float32) and ``ok`` (rows bytes) are long enough; no
 * two of the buffers overlap. 0 with a ValueError otherwise. */
static int decode_fits(const Py_buffer *src, Py_ssize_t span, Py_ssize_t offset, Py_ssize_t stride, Py_ssize_t rows,
                       Py_ssize_t count, Py_ssize_t body, const Py_buffer *values, const Py_buffer *ok) {
    if (!rows_fit("bodies", span, offset, stride, body, rows)) return 0;
    if (values->len / 4 / count < rows || ok->len < rows) {
        PyErr_SetString(PyExc_ValueError, "values or ok is shorter than rows");
        return 0;
    }
    if (!buffers_disjoint(src, values) || !buffers_disjoint(src, ok) || !buffers_disjoint(values, ok)) {
        PyErr_SetString(PyExc_ValueError, "bodies, values and ok must not overlap");
        return 0;
    }
    return 1;
}

static int half_finite(uint16_t h) { return (h & 0x7C00u) != 0x7C00u; }

/* The next fp16 after ``h`` (finite, or infinity towards the finite side) towards +infinity (up) or -infinity:
 * numpy's nextafter. */
static uint16_t half_next(uint16_t h, int up) {
    if ((h & 0x7FFFu) == 0) return up ? 0x0001u : 0x8001u;
    int negative = (h & 0x8000u) != 0;
    return (uint16_t)(negative == up ? h - 1 : h + 1);
}

/* ---- draws ------------------------------------------------------------------------------------------------ */

static uint32_t draw(uint32_t index, uint32_t key_lo, uint32_t key_hi) {
    uint32_t z = index * GOLDEN32 + key_lo;
    z ^= key_hi;
    z ^= z >> 16;
    z *= 0x85EBCA6Bu;
    z ^= z >> 13;
    z *= 0xC2B2AE35u;
    z ^= z >> 16;
    return z >> DRAW_SHIFT;
}

/* ---- encode ----------------------------------------------------------------------------------------------- */

/* Code ``q`` (0..levels) of element ``i``: a byte (int8), or a nibble, low first (int4; the codes start zeroed). */
static inline void codes_put(unsigned char *codes, int bits, Py_ssize_t i, int q) {
    if (bits == 8) codes[i] = (unsigned char)q;
    else codes[i >> 1] |= (unsigned char)(q << (4 * (i & 1)));
}

/* fp16 (scale, min) of a group whose values lie in [lo, hi] (quant.py's group_params). Returns 0, 1 (the min is not
 * finite in fp16: NaN or |x| > 65504) or 2 (the scale is not). */
static int group_params(float lo, float hi, int levels, uint16_t *scale, uint16_t *min) {
    uint16_t m = double_to_half((double)lo);
    if (half_to_float(m) > lo) m = half_next(m, 0); /* +infinity (lo > 65504) steps down to 65504, as numpy does */
    *min = m;
    if (!half_finite(m)) return 1;
    double need = ((double)hi - (double)half_to_float(m)) / levels;
    uint16_t s = double_to_half(need);
    if (half_finite(s) && (double)half_to_float(s) < need) s = half_next(s, 1);
    if (half_finite(s) && half_to_float(s) < half_to_float(TINY16)) s = TINY16; /* zero, or below the least */
    float m32 = half_to_float(m);
    for (int i = 0; i < 4 && half_finite(s); i++) {
        float top = (float)levels * half_to_float(s);
        top = m32 + top;
        if (!(top < hi)) break;
        s = half_next(s, 1);
    }
    *scale = s;
    return half_finite(s) ? 0 : 2;
}

/* The two hot loops of an int8 encode are compiled vectorized (the build's -O2 leaves loops of a runtime length
 * scalar), with an AVX2 clone picked at load time where the CPU has it (glibc's ifunc). Vectorizing reorders
 * nothing within an element's arithmetic (no fused products: -ffp-contract=off, and no FMA target), so the bytes
 * are the scalar path's. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__) && \
    !defined(__SANITIZE_ADDRESS__)
#define VECTORIZED __attribute__((optimize("tree-vectorize"), target_clones("avx2", "default"), noinline))
#elif defined(__GNUC__) && !defined(__clang__)
#define VECTORIZED __attribute__((optimize("tree-vectorize"), noinline))
#else
#define VECTORIZED
#endif

/* The range [a, b)'s least and greatest value, and whether it holds a NaN: eight independent lanes the compiler can
 * keep in one vector register each, then combined. Which of two equal zeros a lane keeps may differ from a scalar
 * pass; the caller adds +0 to the min and only compares or subtracts the max, so the body comes out the same. */
VECTORIZED static int range_limits(const float *x, Py_ssize_t a, Py_ssize_t b, float *lo_out, float *hi_out) {
    float lo[8], hi[8];
    int nan = 0;
    for (int k = 0; k < 8; k++) lo[k] = hi[k] = x[a];
    Py_ssize_t i = a;
    for (; i + 8 <= b; i += 8)
        for (int k = 0; k < 8; k++) {
            float v = x[i + k];
            nan |= v != v;
            lo[k] = v < lo[k] ? v : lo[k];
            hi[k] = v > hi[k] ? v : hi[k];
        }
    for (; i < b; i++) {
        float v = x[i];
        nan |= v != v;
        lo[0] = v < lo[0] ? v : lo[0];
        hi[0] = v > hi[0] ? v : hi[0];
    }
    for (int k = 1; k < 8; k++) {
        lo[0] = lo[k] < lo[0] ? lo[k] : lo[0];
        hi[0] = hi[k] > hi[0] ? hi[k] : hi[0];
    }
    *lo_out = lo[0];
    *hi_out = hi[0];
    return nan;
}

/* int8 codes of [a, b) with stochastic rounding: one loop without branches, which the compiler vectorizes (the
 * draw is 32-bit integer arithmetic per element). Each element's arithmetic is the scalar path's, in its order. */
VECTORIZED static void codes8_stochastic(const float *x, Py_ssize_t a, Py_ssize_t b, float m32, float inv, int levels,
                              uint32_t first, uint32_t key_lo, uint32_t key_hi, unsigned char *codes) {
    for (Py_ssize_t i = a; i < b; i++) {
        float t = x[i] - m32;
        t = t * inv;
        t = t + (float)draw(first + (uint32_t)i, key_lo, key_hi) * 0x1p-24f;
        int q = (int)t;
        codes[i] = (unsigned char)(q > levels ? levels : q);
    }
}

/* One body: ``count`` values of one range into ``out`` (4 bytes of scale and min per group, then the codes). The
 * range's element i draws at stream index ``first + i``. */
static int encode_row(const float *x, Py_ssize_t count, int bits, Py_ssize_t group, int stochastic,
                      uint32_t key_lo, uint32_t key_hi, uint32_t first, unsigned char *out) {
    int levels = (1 << bits) - 1;
    Py_ssize_t groups = (count + group - 1) / group;
    unsigned char *head = out, *codes = out + 4 * groups;
    int bad = 0;
    if (bits == 4) memset(codes, 0, (size_t)((count + 1) / 2));
    for (Py_ssize_t g = 0; g < groups; g++) {
        Py_ssize_t a = g * group, b = a + group < count ? a + group : count;
        float lo, hi;
        if (range_limits(x, a, b, &lo, &hi)) lo = hi = NAN;
        lo = lo + 0.0f; /* a min of zero is +0, whichever zero came first (quant.py does the same) */
        uint16_t s, m;
        int why = group_params(lo, hi, levels, &s, &m);
        if (why) {
            if (!bad || why < bad) bad = why;
            continue;
        }
        put16(head + 4 * g, s);
        put16(head + 4 * g + 2, m);
        float m32 = half_to_float(m), inv = 1.0f / half_to_float(s);
        /* t = (x - min) / scale is >= 0 (x >= lo >= min, scale > 0) and below 2^23: floor is truncation, and
         * (t + 2^23) - 2^23 rounds to nearest even in float32, as numpy's floor and rint do */
        if (stochastic && bits == 8) {
            codes8_stochastic(x, a, b, m32, inv, levels, first, key_lo, key_hi, codes);
        } else if (stochastic) {
            for (Py_ssize_t i = a; i < b; i++) {
                float t = x[i] - m32;
                t = t * inv;
                t = t + (float)draw(first + (uint32_t)i, key_lo, key_hi) * 0x1p-24f;
                int q = (int)t;
                codes_put(codes, bits, i, q > levels ? levels : q);
            }
        } else {
            for (Py_ssize_t i = a; i < b; i++) {
                float t = x[i] - m32;
                t = t * inv;
                t = (t + 0x1p23f) - 0x1p23f;
                int q = (int)t;
                codes_put(codes, bits, i, q > levels ? levels : q);
            }
        }
    }
    return bad;
}

const char quant_encode_doc[] =
    "quant_encode(values, rows, count, out, bits, group, stochastic, key, offset) -> 0, 1 or 2\n"
    "Encode rows x count float32 ``values`` (C-contiguous) into ``out`` (rows x body_size bytes): int8 or int4 "
    "bodies with groups of ``group`` values, stochastic rounding drawn from the u64 stream ``key`` (row i's element "
    "j at index offset + i * count + j) or nearest. Returns 0, or 1 / 2 where a group's min / scale does not fit "
    "fp16 (the caller raises; the first such reason in quant.py's order: any min before any scale).";

PyObject *quant_encode(PyObject *module, PyObject *args) {
    Py_buffer values = {0}, out = {0};
    Py_ssize_t rows, count, group, offset;
    int bits, stochastic;
    unsigned long long key;
    if (!PyArg_ParseTuple(args, "y*nnw*inpKn", &values, &rows, &count, &out, &bits, &group, &stochastic, &key,
                          &offset))
        return NULL;
    PyObject *result = NULL;
    if (bits != 8 && bits != 4) {
        PyErr_Format(PyExc_ValueError, "bits must be 8 or 4, got %d", bits);
        goto done;
    }
    if (group < 1 || group > MAX_GROUP || count < 1 || count > MAX_COUNT || rows < 0 || rows > (1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "group, count or rows out of range");
        goto done;
    }
    Py_ssize_t groups = (count + group - 1) / group;
    Py_ssize_t body = 4 * groups + (bits == 8 ? count : (count + 1) / 2);
    if (values.len / 4 / count < rows || out.len / body < rows) {
        PyErr_SetString(PyExc_ValueError, "values or out is shorter than rows x count");
        goto done;
    }
    if (offset < 0 || offset > (Py_ssize_t)UINT32_MAX || rows * count > (Py_ssize_t)UINT32_MAX + 1 - offset) {
        PyErr_SetString(PyExc_ValueError, "elements do not fit u32 stream indices");
        goto done;
    }
    if (!buffers_disjoint(&values, &out)) {
        PyErr_SetString(PyExc_ValueError, "out overlaps values");
        goto done;
    }
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    const float *x = (const float *)values.buf;
    unsigned char *o = (unsigned char *)out.buf;
    for (Py_ssize_t r = 0; r < rows; r++) {
        int why = encode_row(x + r * count, count, bits, group, stochastic, (uint32_t)key, (uint32_t)(key >> 32),
                             (uint32_t)(offset + r * count), o + r * body);
        if (why && (!bad || why < bad)) bad = why;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(bad);
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&out);
    return result;
}

/* ---- decode ----------------------------------------------------------------------------------------------- */

/* One body into ``count`` float32 values; 0 (and zeros) where a scale or min is not finite, a scale is not
 * positive, or int4's padding nibble is set. */
static int decode_row(const unsigned char *body, Py_ssize_t count, int bits, Py_ssize_t group, float *v);

int dp_decode_row(const unsigned char *body, Py_ssize_t count, int bits, Py_ssize_t group, float *v) {
    return decode_row(body, count, bits, group, v);
}

int dp_row_valid(const unsigned char *body, Py_ssize_t count, int bits, Py_ssize_t group) {
    Py_ssize_t groups = (count + group - 1) / group;
    const unsigned char *codes = body + 4 * groups;
    if (bits == 4 && (count & 1) && (codes[count >> 1] >> 4)) return 0;
    for (Py_ssize_t g = 0; g < groups; g++) {
        uint16_t s = get16(body + 4 * g), m = get16(body + 4 * g + 2);
        if (!half_finite(s) || !half_finite(m) || !(half_to_float(s) > 0.0f)) return 0;
    }
    return 1;
}

Py_ssize_t dp_coded_body(Py_ssize_t count, int bits, Py_ssize_t group) {
    if ((bits != 8 && bits != 4) || group < 1 || group > MAX_GROUP || count < 1 || count > MAX_COUNT) return -1;
    Py_ssize_t groups = (count + group - 1) / group;
    return 4 * groups + (bits == 8 ? count : (count + 1) / 2);
}

static int decode_row(const unsigned char *body, Py_ssize_t count, int bits, Py_ssize_t group, float *v) {
    Py_ssize_t groups = (count + group - 1) / group;
    const unsigned char *codes = body + 4 * groups;
    int ok = !(bits == 4 && (count & 1) && (codes[count >> 1] >> 4));
    for (Py_ssize_t g = 0; g < groups && ok; g++) {
        uint16_t s = get16(body + 4 * g), m = get16(body + 4 * g + 2);
        float s32 = half_to_float(s), m32 = half_to_float(m);
        if (!half_finite(s) || !half_finite(m) || !(s32 > 0.0f)) {
            ok = 0;
            break;
        }
        Py_ssize_t a = g * group, b = a + group < count ? a + group : count;
        for (Py_ssize_t i = a; i < b; i++) {
            unsigned q = bits == 8 ? codes[i] : (unsigned)(codes[i >> 1] >> (4 * (i & 1))) & 0x0Fu;
            float t = (float)q * s32;
            v[i] = t + m32;
        }
    }
    if (!ok) memset(v, 0, (size_t)count * sizeof(float));
    return ok;
}

const char quant_decode_doc[] =
    "quant_decode(bodies, offset, stride, rows, count, bits, group, values, ok)\n"
    "Decode ``rows`` int8/int4 bodies of ``count`` elements (each body_size bytes at offset + i * stride of "
    "``bodies``) into ``values`` (rows x count float32, C-contiguous) and ``ok`` (rows bytes: 1 valid, 0 not; an "
    "invalid row's values are zero).";

PyObject *quant_decode(PyObject *module, PyObject *args) {
    Py_buffer src = {0}, values = {0}, ok = {0};
    PyObject *src_obj;
    Py_ssize_t offset, stride, rows, count, group, span;
    int bits;
    if (!PyArg_ParseTuple(args, "Onnnninw*w*", &src_obj, &offset, &stride, &rows, &count, &bits, &group, &values,
                          &ok))
        return NULL;
    PyObject *result = NULL;
    if (!get_rows(src_obj, &src, &span)) {
        PyBuffer_Release(&values);
        PyBuffer_Release(&ok);
        return NULL;
    }
    if (bits != 8 && bits != 4) {
        PyErr_Format(PyExc_ValueError, "bits must be 8 or 4, got %d", bits);
        goto done;
    }
    if (group < 1 || group > MAX_GROUP || count < 1 || count > MAX_COUNT) {
        PyErr_SetString(PyExc_ValueError, "group or count out of range");
        goto done;
    }
    Py_ssize_t groups = (count + group - 1) / group;
    Py_ssize_t body = 4 * groups + (bits == 8 ? count : (count + 1) / 2);
    if (!decode_fits(&src, span, offset, stride, rows, count, body, &values, &ok)) goto done;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *s = (const unsigned char *)src.buf + offset;
    float *v = (float *)values.buf;
    unsigned char *k = (unsigned char *)ok.buf;
    for (Py_ssize_t r = 0; r < rows; r++)
        k[r] = (unsigned char)decode_row(s + r * stride, count, bits, group, v + r * count);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&values);
    PyBuffer_Release(&ok);
    return result;
}

/* ---- fp16 bodies ------------------------------------------------------------------------------------------ */

/* floats.py's Float16Codec: raw binary16, rounded to nearest even from float32. With F16C (checked at run time)
 * eight values a conversion; without it, double_to_half (the same roundings, slower). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_F16C_PATH 1

__attribute__((target("avx,f16c"))) static int half_encode_f16c(const float *x, Py_ssize_t n, unsigned char *out) {
    Py_ssize_t i = 0;
    int bad = 0;
    const __m128i exp = _mm_set1_epi16(0x7C00);
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(out + 2 * i), h);
        bad |= _mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(h, exp), exp));
    }
    for (; i < n; i++) {
        uint16_t h = double_to_half((double)x[i]);
        put16(out + 2 * i, h);
        bad |= !half_finite(h);
    }
    return bad != 0;
}

__attribute__((target("avx,f16c"))) static int half_decode_f16c(const unsigned char *body, Py_ssize_t n, float *v) {
    Py_ssize_t i = 0;
    int bad = 0;
    const __m128i exp = _mm_set1_epi16(0x7C00);
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(body + 2 * i));
        bad |= _mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(h, exp), exp));
        _mm256_storeu_ps(v + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; i++) {
        uint16_t h = get16(body + 2 * i);
        bad |= !half_finite(h);
        v[i] = half_to_float(h);
    }
    return !bad;
}
#endif

static int have_f16c(void) {
#ifdef HAVE_F16C_PATH
    static int known = -1;
    if (known < 0) known = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    return known;
#else
    return 0;
#endif
}

/* ---- bf16 bodies: float32's top half, rounded to nearest even (floats.py's to_bf16_bits) ---- */

static int bf16_encode_span(const float *x, Py_ssize_t n, unsigned char *out) {
    uint32_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        uint16_t h = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        put16(out + 2 * i, h);
        bad |= (h & 0x7F80u) == 0x7F80u;
    }
    return bad != 0;
}

static int bf16_decode_row(const unsigned char *body, Py_ssize_t n, float *v) {
    uint32_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t h = get16(body + 2 * i), u = h << 16;
        bad |= (h & 0x7F80u) == 0x7F80u;
        memcpy(v + i, &u, 4);
    }
    if (bad) memset(v, 0, (size_t)n * sizeof(float));
    return !bad;
}

/* 1 where some value rounds to infinity (beyond 65504): the caller refuses the whole encode. */
static int half_encode_span(const float *x, Py_ssize_t n, unsigned char *out, int fast) {
#ifdef HAVE_F16C_PATH
    if (fast) return half_encode_f16c(x, n, out);
#endif
    int bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint16_t h = double_to_half((double)x[i]);
        put16(out + 2 * i, h);
        bad |= !half_finite(h);
    }
    return bad;
}

/* 1 where every value of the body is finite; 0 (and zeros) otherwise. */
static int half_decode_row(const unsigned char *body, Py_ssize_t n, float *v, int fast) {
    int ok = 1;
#ifdef HAVE_F16C_PATH
    if (fast) ok = half_decode_f16c(body, n, v);
    else
#endif
        for (Py_ssize_t i = 0; i < n; i++) {
            uint16_t h = get16(body + 2 * i);
            ok &= half_finite(h);
            v[i] = half_to_float(h);
        }
    if (!ok) memset(v, 0, (size_t)n * sizeof(float));
    return ok;
}

const char half_encode_doc[] =
    "half_encode(values, n, out, bf16=False, scalar=False) -> 0 or 1\n"
    "Round ``n`` float32 ``values`` (C-contiguous) to binary16, or with ``bf16`` to bfloat16 (nearest even) into "
    "``out`` (2 n bytes, little-endian). Returns 1 where some value became infinite: the caller refuses the encode. "
    "``scalar``: fp16 without F16C even where the CPU has it (tests).";

PyObject *half_encode(PyObject *module, PyObject *args) {
    Py_buffer values = {0}, out = {0};
    Py_ssize_t n;
    int bf16 = 0, scalar = 0;
    if (!PyArg_ParseTuple(args, "y*nw*|pp", &values, &n, &out, &bf16, &scalar)) return NULL;
    PyObject *result = NULL;
    if (n < 0 || values.len / 4 < n || out.len / 2 < n) {
        PyErr_SetString(PyExc_ValueError, "n is negative, or values or out is shorter than n values");
        goto done;
    }
    if (!buffers_disjoint(&values, &out)) {
        PyErr_SetString(PyExc_ValueError, "out overlaps values");
        goto done;
    }
    int fast = !scalar && have_f16c(), bad;
    Py_BEGIN_ALLOW_THREADS
    if (bf16) bad = bf16_encode_span((const float *)values.buf, n, (unsigned char *)out.buf);
    else bad = half_encode_span((const float *)values.buf, n, (unsigned char *)out.buf, fast);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(bad);
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&out);
    return result;
}

const char half_decode_doc[] =
    "half_decode(bodies, offset, stride, rows, count, values, ok, bf16=False, scalar=False)\n"
    "Decode ``rows`` binary16 (or bfloat16) bodies of ``count`` values (2 count bytes at offset + i * stride of "
    "``bodies``) into ``values`` (rows x count float32) and ``ok`` (rows bytes: 1 every value finite, else 0 and the "
    "row zeros).";

PyObject *half_decode(PyObject *module, PyObject *args) {
    Py_buffer src = {0}, values = {0}, ok = {0};
    PyObject *src_obj;
    Py_ssize_t offset, stride, rows, count, span;
    int bf16 = 0, scalar = 0;
    if (!PyArg_ParseTuple(args, "Onnnnw*w*|pp", &src_obj, &offset, &stride, &rows, &count, &values, &ok, &bf16,
                          &scalar))
        return NULL;
    PyObject *result = NULL;
    if (!get_rows(src_obj, &src, &span)) {
        PyBuffer_Release(&values);
        PyBuffer_Release(&ok);
        return NULL;
    }
    if (count < 1 || count > MAX_COUNT) {
        PyErr_SetString(PyExc_ValueError, "count out of range");
        goto done;
    }
    if (!decode_fits(&src, span, offset, stride, rows, count, 2 * count, &values, &ok)) goto done;
    int fast = !scalar && have_f16c();
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *s = (const unsigned char *)src.buf + offset;
    float *v = (float *)values.buf;
    unsigned char *k = (unsigned char *)ok.buf;
    for (Py_ssize_t r = 0; r < rows; r++)
        k[r] = (unsigned char)(bf16 ? bf16_decode_row(s + r * stride, count, v + r * count)
                                    : half_decode_row(s + r * stride, count, v + r * count, fast));
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&values);
    PyBuffer_Release(&ok);
    return result;
}
