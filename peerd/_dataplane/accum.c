/* The owner's running sums for a plain fp32 average (peerd.allreduce.group, the streaming reconstruction): each
 * opened reduce-scatter row, times its sender's weight, is added into the owner's float32 sums as it arrives, so
 * no row is staged and read again (one pass over the bytes, where the values are still in cache). The reference
 * is group._accumulate_numpy; tests/test_accumulate.py holds the two to the same bits.
 *
 * A row is added only when all of it can be: a NaN or inf among its values refuses it (status 1), and a sum that
 * would overflow float32 leaves it out (status 2: the caller keeps the row and sums that range in float64 at the
 * end). Either way nothing of that row is written.
 *
 * finalize_rows is the all-gather's side of the same sums: own * weight plus the sum, over the weight that arrived,
 * in one pass (group._finalize_f32 is its reference, bit for bit). */

#include "common.h"

#include <stdint.h>
#include <string.h>

static float load_f32(const unsigned char *p) {
    uint32_t bits;
    float x;
    memcpy(&bits, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    bits = __builtin_bswap32(bits);
#endif
    memcpy(&x, &bits, 4);
    return x;
}

static uint32_t special(float x) { /* 1 for NaN or inf: an all-ones exponent */
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return (uint32_t)((bits & 0x7F800000u) == 0x7F800000u);
}

/* One row of ``m`` values at ``s`` into ``d`` (``set``: d holds a sum already, else it is overwritten). */
unsigned char dp_add_row(const unsigned char *s, float *d, Py_ssize_t m, int set, float factor) {
    uint32_t bad_x = 0, bad_sum = 0;
    if (set) {
        for (Py_ssize_t j = 0; j < m; j++) {
            float x = load_f32(s + 4 * j);
            bad_x |= special(x);
            bad_sum |= special(d[j] + x * factor);
        }
    } else {
        for (Py_ssize_t j = 0; j < m; j++) {
            float x = load_f32(s + 4 * j);
            bad_x |= special(x);
            bad_sum |= special(x * factor);
        }
    }
    if (bad_x) return 1;
    if (bad_sum) return 2;
    if (set) {
        for (Py_ssize_t j = 0; j < m; j++) d[j] = d[j] + load_f32(s + 4 * j) * factor;
    } else {
        for (Py_ssize_t j = 0; j < m; j++) d[j] = load_f32(s + 4 * j) * factor;
    }
    return 0;
}

const char accumulate_rows_doc[] =
"accumulate_rows(src, src_offset, src_stride, rows, length, dst, dst_stride, ks, filled, factor)\n"
"--\n\n"
"Add ``rows`` rows of ``length`` bytes of little-endian float32 values (row i at src[src_offset + i * src_stride],\n"
"any alignment), each times ``factor`` in float32, into the float32 buffer ``dst`` at byte ks[i] * dst_stride,\n"
"where ``ks`` is an int64 buffer of ``rows`` range indices. ``filled`` (one byte per range): 0 means dst holds\n"
"nothing for that range yet (it is overwritten, and the byte set to 1). Returns bytes, one status per row: 0\n"
"added, 1 refused (a NaN or inf among its values), 2 left out (the float32 sum would overflow). A refused or left\n"
"out row changes nothing. Every index and span is checked before anything is written; the GIL is released.";

PyObject *accumulate_rows(PyObject *module, PyObject *args) {
    Py_buffer src = {0}, dst = {0}, ks = {0}, filled = {0};
    PyObject *src_obj, *result = NULL;
    Py_ssize_t src_offset, src_stride, rows, length, dst_stride, src_len;
    float factor;
    if (!PyArg_ParseTuple(args, "Onnnnw*ny*w*f", &src_obj, &src_offset, &src_stride, &rows, &length, &dst,
                          &dst_stride, &ks, &filled, &factor))
        return NULL;
    if (!get_rows(src_obj, &src, &src_len)) goto done;
    if (length < 0 || length % 4 || dst_stride < 0 || dst_stride % 4 || (uintptr_t)dst.buf % 4) {
        PyErr_Format(PyExc_ValueError, "length %zd and dst_stride %zd must be multiples of 4 and dst aligned to "
                     "float32", length, dst_stride);
        goto done;
    }
    if (!rows_fit("src", src_len, src_offset, src_stride, length, rows)) goto done;
    if (ks.len != rows * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "ks holds %zd bytes, not %zd int64 range indices", ks.len, rows);
        goto done;
    }
    uintptr_t s0 = (uintptr_t)src.buf, s1 = s0 + (uintptr_t)src_len;
    uintptr_t d0 = (uintptr_t)dst.buf, d1 = d0 + (uintptr_t)dst.len;
    uintptr_t f0 = (uintptr_t)filled.buf, f1 = f0 + (uintptr_t)filled.len;
    if ((rows && length && s0 < d1 && d0 < s1) || (d0 < f1 && f0 < d1) || (s0 < f1 && f0 < s1)) {
        PyErr_SetString(PyExc_ValueError, "src, dst and filled must not overlap");
        goto done;
    }
    const unsigned char *kb = (const unsigned char *)ks.buf;
    for (Py_ssize_t i = 0; i < rows; i++) { /* every index in bounds before anything is written */
        int64_t k;
        memcpy(&k, kb + i * 8, 8);
        if (k < 0 || k >= filled.len
            || (length && (length > dst.len || (dst_stride && k > (dst.len - length) / dst_stride)))) {
            PyErr_Format(PyExc_ValueError, "range %lld of row %zd is outside dst (%zd bytes, stride %zd) or filled "
                         "(%zd ranges)", (long long)k, i, dst.len, dst_stride, filled.len);
            goto done;
        }
    }
    result = PyBytes_FromStringAndSize(NULL, rows);
    if (result == NULL) goto done;
    unsigned char *status = (unsigned char *)PyBytes_AS_STRING(result);
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *s = (const unsigned char *)src.buf + src_offset;
    unsigned char *fl = (unsigned char *)filled.buf;
    for (Py_ssize_t i = 0; i < rows; i++) {
        int64_t k;
        memcpy(&k, kb + i * 8, 8);
        float *d = (float *)((unsigned char *)dst.buf + k * dst_stride);
        status[i] = dp_add_row(s + i * src_stride, d, length / 4, fl[k] != 0, factor);
        if (status[i] == 0) fl[k] = 1;
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&ks);
    PyBuffer_Release(&filled);
    return result;
}

const char finalize_rows_doc[] =
"finalize_rows(own, acc, summed, got, weight, out, rows, width)\n"
"--\n\n"
"The all-gather's finalize of ``rows`` ranges of ``width`` float32 values (group._finalize_stream's float32\n"
"path, the reference, bit for bit): range i is own[i] where got[i] (float64) is not > 0, else\n"
"(own[i] * float32(weight) + (acc[i] if summed[i] else 0)) / float32(got[i] + weight). ``out`` may be ``own``\n"
"itself (in place) but no other overlap. Returns True once every range is written; False, with nothing\n"
"written, where own * weight (+ acc) is not finite somewhere (NaN, inf, an overflow): the caller then sums\n"
"the ranges in float64. Every length is checked first; the GIL is released.";

/* Range i's own * weight (+ its sum): what numpy computes before its one finiteness check over the piece. */
static inline float scaled(const float *o, const float *a, int summed, Py_ssize_t j, float wf) {
    float r = o[j] * wf;
    return summed ? r + a[j] : r;
}

PyObject *finalize_rows(PyObject *module, PyObject *args) {
    Py_buffer own = {0}, acc = {0}, summed = {0}, got = {0}, out = {0};
    Py_ssize_t rows, width;
    double weight;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*y*dw*nn", &own, &acc, &summed, &got, &weight, &out, &rows, &width))
        return NULL;
    if (rows < 0 || width < 0 || (width && rows > PY_SSIZE_T_MAX / 4 / width)) {
        PyErr_Format(PyExc_ValueError, "rows %zd and width %zd out of range", rows, width);
        goto done;
    }
    Py_ssize_t nbytes = rows * width * 4;
    if (own.len < nbytes || acc.len < nbytes || out.len < nbytes || summed.len < rows || got.len / 8 < rows) {
        PyErr_Format(PyExc_ValueError, "%zd ranges of %zd float32 do not fit own (%zd bytes), acc (%zd), out (%zd), "
                     "summed (%zd) or got (%zd)", rows, width, own.len, acc.len, out.len, summed.len, got.len);
        goto done;
    }
    if ((uintptr_t)own.buf % 4 || (uintptr_t)acc.buf % 4 || (uintptr_t)out.buf % 4) {
        PyErr_SetString(PyExc_ValueError, "own, acc and out must be aligned to float32");
        goto done;
    }
    uintptr_t o0 = (uintptr_t)own.buf, o1 = o0 + (uintptr_t)nbytes;
    uintptr_t a0 = (uintptr_t)acc.buf, a1 = a0 + (uintptr_t)nbytes;
    uintptr_t d0 = (uintptr_t)out.buf, d1 = d0 + (uintptr_t)nbytes;
    uintptr_t s0 = (uintptr_t)summed.buf, s1 = s0 + (uintptr_t)rows;
    uintptr_t g0 = (uintptr_t)got.buf, g1 = g0 + (uintptr_t)rows * 8;
    if (nbytes && ((d0 != o0 && d0 < o1 && o0 < d1) || (d0 < a1 && a0 < d1) || (rows && d0 < s1 && s0 < d1)
                   || (rows && d0 < g1 && g0 < d1))) {
        PyErr_SetString(PyExc_ValueError, "out may be own itself but must not overlap own, acc, summed or got");
        goto done;
    }
    int finite = 1;
    Py_BEGIN_ALLOW_THREADS
    const float *ov = (const float *)own.buf, *av = (const float *)acc.buf;
    const unsigned char *sv = (const unsigned char *)summed.buf, *gv = (const unsigned char *)got.buf;
    float *dv = (float *)out.buf;
    float wf = (float)weight;
    uint32_t bad = 0;
    for (Py_ssize_t i = 0; i < rows && !bad; i++) { /* numpy checks the whole piece before it divides */
        const float *o = ov + i * width, *a = av + i * width;
        int s = sv[i] != 0;
        for (Py_ssize_t j = 0; j < width; j++) bad |= special(scaled(o, a, s, j, wf));
    }
    finite = !bad;
    for (Py_ssize_t i = 0; i < rows && finite; i++) {
        const float *o = ov + i * width, *a = av + i * width;
        float *d = dv + i * width;
        double g;
        memcpy(&g, gv + 8 * i, 8);
        if (!(g > 0)) { /* nothing arrived for the range: the own values, exactly */
            if (d != o) memcpy(d, o, (size_t)width * 4);
            continue;
        }
        float ws = (float)(g + weight);
        int s = sv[i] != 0;
        for (Py_ssize_t j = 0; j < width; j++) d[j] = scaled(o, a, s, j, wf) / ws;
    }
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(finite);
done:
    PyBuffer_Release(&own);
    PyBuffer_Release(&acc);
    PyBuffer_Release(&summed);
    PyBuffer_Release(&got);
    PyBuffer_Release(&out);
    return result;
}
