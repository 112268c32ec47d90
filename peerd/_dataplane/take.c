/* A group's intake of one block of plain fp32 DATA bodies (group.GroupAverage.receive_block's native path): the
 * checks that the block is a run of this group's ranges, the seen bitmap, and the values added into the owner's
 * sums (reduce-scatter) or copied into the result (all-gather), in one call instead of a dozen numpy operations a
 * block. receive_block's numpy path is the reference: tests/test_take_native.py holds the two to the same state.
 *
 * Everything is read and checked before anything is written. A block this path does not take (a header unlike its
 * first row's, ranges out of order or outside the phase, a weight that is not the sender's, a NaN in the
 * all-gather) changes nothing and comes back None: the reference path then takes it body by body and counts
 * precisely what is wrong. */

#include "common.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#define BODY_HEADER 19   /* group u32, codec u8, total u32, offset u32, count u16, weight f32 (codec.HEADER) */
#define OFFSET_AT 9
#define OFFSET_END 13
#define WEIGHT_AT 15
#define MODE_RS 0
#define MODE_AG 1

static uint32_t u32_at(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static float f32_at(const unsigned char *p) {
    uint32_t bits = u32_at(p);
    float x;
    memcpy(&x, &bits, 4);
    return x;
}

static int values_finite(const unsigned char *p, Py_ssize_t n) {
    uint32_t special = 0;
    for (Py_ssize_t j = 0; j < n; j++) special |= (uint32_t)((u32_at(p + 4 * j) & 0x7F800000u) == 0x7F800000u);
    return !special;
}

static int spans_meet(const Py_buffer *a, const Py_buffer *b) {
    uintptr_t a0 = (uintptr_t)a->buf, a1 = a0 + (uintptr_t)a->len;
    uintptr_t b0 = (uintptr_t)b->buf, b1 = b0 + (uintptr_t)b->len;
    return a->len > 0 && b->len > 0 && a0 < b1 && b0 < a1;
}

const char take_rows_doc[] =
"take_rows(bodies, stride, rows, mode, group, codec, per, total, start, full, known, max_weight, seen, dst,\n"
"          dst_base, filled, wsum, status)\n"
"--\n\n"
"Take ``rows`` DATA bodies of 19 + 4 * per bytes (row i at bodies[i * stride]: a contiguous buffer or a 2-D byte\n"
"array of contiguous rows) from one sender into its group, as GroupAverage.receive_block does.\n\n"
"The block must be a run of this phase's ranges: every row's header is row 0's but for the offset (bytes 9..13;\n"
"for the all-gather, mode 1, the weight may differ too); row 0 holds ``group``, ``codec``, ``per`` and\n"
"``total``; each offset is ``start`` plus a multiple k of ``per``, with k below ``full`` and rising row by row.\n"
"Reduce-scatter (mode 0): row 0's weight is finite and positive, and ``known`` (NaN: none yet) where known. The\n"
"all-gather: every weight finite and not negative, every value finite. Where any of it fails nothing changes and\n"
"the result is None.\n\n"
"Otherwise each row whose range k is not yet in ``seen`` (one byte per range) is marked there and taken:\n"
"reduce-scatter, its values times float32(min(weight, max_weight)) added into the float32 sums ``dst`` at\n"
"k * per (``filled``, one byte per range: whether dst holds a sum; ``wsum``, float64 per range: the weight\n"
"summed there, not added for a refused row), as accumulate_rows does; the all-gather, its values copied to dst at\n"
"element dst_base + k * per. ``status[i]``: 0 taken, 1 refused (a NaN or inf), 2 left out (a float32 overflow:\n"
"the caller keeps it aside), 3 a duplicate. Returns (accepted, duplicates, k_last, weight, weights, odd): the\n"
"rows new to ``seen``, those that were not, the last new range, row 0's weight, (the all-gather) the sum of the\n"
"new rows' weights, and how many rows have status 1 or 2.\n"
"Every span is checked before anything is read; the GIL is released while rows are written.";

PyObject *take_rows(PyObject *module, PyObject *args) {
    Py_buffer src = {0}, seen = {0}, dst = {0}, filled = {0}, wsum = {0}, status = {0};
    PyObject *src_obj, *result = NULL;
    Py_ssize_t stride, rows, full, span;
    int mode;
    unsigned int group, codec, per, total;
    unsigned long long start, dst_base;
    double known, max_weight;
    if (!PyArg_ParseTuple(args, "OnniIIIIKnddw*w*Kw*w*w*", &src_obj, &stride, &rows, &mode, &group, &codec, &per,
                          &total, &start, &full, &known, &max_weight, &seen, &dst, &dst_base, &filled, &wsum,
                          &status))
        return NULL;
    if (!get_rows(src_obj, &src, &span)) goto done;
    if ((mode != MODE_RS && mode != MODE_AG) || per < 1 || per > 0xFFFF || rows < 1 || full < 0) {
        PyErr_Format(PyExc_ValueError, "mode %d, per %u, rows %zd or full %zd out of range", mode, per, rows, full);
        goto done;
    }
    Py_ssize_t width = BODY_HEADER + 4 * (Py_ssize_t)per, length = 4 * (Py_ssize_t)per;
    if (!rows_fit("bodies", span, 0, stride, width, rows)) goto done;
    if (seen.len < full || status.len < rows || (uintptr_t)dst.buf % 4 || (uintptr_t)wsum.buf % 8) {
        PyErr_Format(PyExc_ValueError, "seen (%zd bytes) must cover %zd ranges and status (%zd) %zd rows, dst and "
                     "wsum aligned", seen.len, full, status.len, rows);
        goto done;
    }
    if (mode == MODE_RS) {
        if (dst_base != 0 || filled.len < full || wsum.len / 8 < full || dst.len / length < full) {
            PyErr_Format(PyExc_ValueError, "%zd ranges of %u float32 do not fit dst (%zd bytes), filled (%zd) or "
                         "wsum (%zd), or dst_base %llu is not 0", full, per, dst.len, filled.len, wsum.len, dst_base);
            goto done;
        }
    } else if (dst_base > (unsigned long long)(dst.len / 4) || (dst.len / 4 - (Py_ssize_t)dst_base) / per < full) {
        PyErr_Format(PyExc_ValueError, "%zd ranges of %u float32 from element %llu do not fit dst (%zd bytes)", full,
                     per, dst_base, dst.len);
        goto done;
    }
    if (spans_meet(&dst, &src) || spans_meet(&dst, &seen) || spans_meet(&dst, &status) || spans_meet(&seen, &src)
        || spans_meet(&status, &src) || spans_meet(&seen, &status)
        || (mode == MODE_RS && (spans_meet(&dst, &filled) || spans_meet(&dst, &wsum) || spans_meet(&filled, &src)
                                || spans_meet(&wsum, &src) || spans_meet(&filled, &seen)
                                || spans_meet(&wsum, &seen) || spans_meet(&filled, &wsum)
                                || spans_meet(&filled, &status) || spans_meet(&wsum, &status)))) {
        PyErr_SetString(PyExc_ValueError, "bodies, seen, dst, filled, wsum and status must not overlap");
        goto done;
    }

    /* Read-only: is this a run this path takes? */
    const unsigned char *base = (const unsigned char *)src.buf, *r0 = base;
    float w0 = f32_at(r0 + WEIGHT_AT);
    Py_ssize_t same = mode == MODE_RS ? BODY_HEADER : WEIGHT_AT;
    int ok = u32_at(r0) == group && r0[4] == codec && u32_at(r0 + 5) == total
             && (unsigned int)(r0[13] | r0[14] << 8) == per;
    if (ok && mode == MODE_RS)
        ok = w0 > 0.0f && w0 < INFINITY && (isnan(known) || known == (double)w0);
    int64_t prev = -1;
    for (Py_ssize_t i = 0; ok && i < rows; i++) {
        const unsigned char *r = base + i * stride;
        if (i && (memcmp(r, r0, OFFSET_AT) || memcmp(r + OFFSET_END, r0 + OFFSET_END, (size_t)(same - OFFSET_END)))) {
            ok = 0;
            break;
        }
        int64_t rel = (int64_t)u32_at(r + OFFSET_AT) - (int64_t)start;
        if (rel < 0 || rel % per) {
            ok = 0;
            break;
        }
        int64_t k = rel / per;
        if (k >= full || k <= prev) {
            ok = 0;
            break;
        }
        prev = k;
        if (mode == MODE_AG) {
            float w = f32_at(r + WEIGHT_AT);
            ok = w >= 0.0f && w < INFINITY && values_finite(r + BODY_HEADER, per);
        }
    }
    if (!ok) {
        Py_INCREF(Py_None);
        result = Py_None;
        goto done;
    }

    /* Write: every span was checked above, every k is in [0, full). */
    Py_ssize_t accepted = 0, duplicates = 0, odd = 0;
    int64_t k_last = -1;
    double weights = 0.0, ws = mode == MODE_RS ? ((double)w0 < max_weight ? (double)w0 : max_weight) : 0.0;
    float factor = (float)ws;
    Py_BEGIN_ALLOW_THREADS
    unsigned char *sn = (unsigned char *)seen.buf, *st = (unsigned char *)status.buf;
    unsigned char *fl = (unsigned char *)filled.buf;
    double *wk = (double *)wsum.buf;
    float *d = (float *)dst.buf;
    for (Py_ssize_t i = 0; i < rows; i++) {
        const unsigned char *r = base + i * stride;
        int64_t k = ((int64_t)u32_at(r + OFFSET_AT) - (int64_t)start) / per;
        if (sn[k]) {
            st[i] = 3;
            duplicates++;
            continue;
        }
        sn[k] = 1;
        accepted++;
        k_last = k;
        if (mode == MODE_RS) {
            st[i] = dp_add_row(r + BODY_HEADER, d + k * per, per, fl[k] != 0, factor);
            if (st[i] == 0) fl[k] = 1;
            else odd++;
            if (st[i] != 1) wk[k] += ws;
        } else {
            memcpy(d + dst_base + (uint64_t)k * per, r + BODY_HEADER, (size_t)length);
            st[i] = 0;
            weights += (double)f32_at(r + WEIGHT_AT);
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("nnLddn", accepted, duplicates, (long long)k_last, (double)w0, weights, odd);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&seen);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&filled);
    PyBuffer_Release(&wsum);
    PyBuffer_Release(&status);
    return result;
}
