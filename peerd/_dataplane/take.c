/* A group's intake of one block of DATA bodies (group.GroupAverage.receive_block's native path): the checks that
 * the block is a run of this group's ranges, the seen bitmap, and the values added into the owner's sums
 * (reduce-scatter, fp32: take_rows) or decoded into the sender's stage row (reduce-scatter, int8 and int4:
 * take_coded), or copied or decoded into the result (all-gather), in one call instead of a dozen numpy operations
 * a block. receive_block's numpy path is the reference: tests/test_take_native.py holds the two to the same state.
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
"take_rows(bodies, stride, rows, *, mode, group, codec, per, total, start, full, known, max_weight, seen, dst,\n"
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

/* take_rows's arguments, parsed and checked once (every span before anything is read). */
typedef struct {
    Py_buffer src, seen, dst, filled, wsum, status;
    Py_ssize_t stride, rows, full, span;
    Py_ssize_t qgroup, body;  /* take_coded: values per scale, and a body's bytes (0: fp32, 4 * per) */
    int mode, bits;           /* bits: 8 or 4 for take_coded, 0 for take_rows */
    unsigned int group, codec, per, total;
    unsigned long long start, dst_base;
    double known, max_weight;
} TakeArgs;

static void take_release(TakeArgs *t) {
    PyBuffer_Release(&t->src);
    PyBuffer_Release(&t->seen);
    PyBuffer_Release(&t->dst);
    PyBuffer_Release(&t->filled);
    PyBuffer_Release(&t->wsum);
    PyBuffer_Release(&t->status);
}

/* Whether the buffers overlap where they must not (the all-gather writes no filled nor wsum). */
static int take_overlap(const TakeArgs *t) {
    const Py_buffer *dst = &t->dst, *src = &t->src, *seen = &t->seen, *status = &t->status;
    const Py_buffer *filled = &t->filled, *wsum = &t->wsum;
    if (spans_meet(dst, src) || spans_meet(dst, seen) || spans_meet(dst, status) || spans_meet(seen, src)
        || spans_meet(status, src) || spans_meet(seen, status))
        return 1;
    return t->mode == MODE_RS && !t->bits
           && (spans_meet(dst, filled) || spans_meet(dst, wsum) || spans_meet(filled, src) || spans_meet(wsum, src)
               || spans_meet(filled, seen) || spans_meet(wsum, seen) || spans_meet(filled, wsum)
               || spans_meet(filled, status) || spans_meet(wsum, status));
}

/* The spans' sizes, alignment and separation: 0, or -1 with an exception set. */
static int take_check(TakeArgs *t) {
    Py_ssize_t full = t->full;
    unsigned int per = t->per;
    if ((t->mode != MODE_RS && t->mode != MODE_AG) || per < 1 || per > 0xFFFF || t->rows < 1 || full < 0) {
        PyErr_Format(PyExc_ValueError, "mode %d, per %u, rows %zd or full %zd out of range", t->mode, per, t->rows,
                     full);
        return -1;
    }
    Py_ssize_t length = 4 * (Py_ssize_t)per;
    Py_ssize_t width = BODY_HEADER + (t->bits ? t->body : length);
    if (!rows_fit("bodies", t->span, 0, t->stride, width, t->rows)) return -1;
    if (t->seen.len < full || t->status.len < t->rows || (uintptr_t)t->dst.buf % 4 || (uintptr_t)t->wsum.buf % 8) {
        PyErr_Format(PyExc_ValueError, "seen (%zd bytes) must cover %zd ranges and status (%zd) %zd rows, dst and "
                     "wsum aligned", t->seen.len, full, t->status.len, t->rows);
        return -1;
    }
    if (t->mode == MODE_RS && t->bits) {
        if (t->dst_base != 0 || t->dst.len / length < full) {
            PyErr_Format(PyExc_ValueError, "%zd ranges of %u float32 do not fit dst (%zd bytes), or dst_base %llu is "
                         "not 0", full, per, t->dst.len, t->dst_base);
            return -1;
        }
    } else if (t->mode == MODE_RS) {
        if (t->dst_base != 0 || t->filled.len < full || t->wsum.len / 8 < full || t->dst.len / length < full) {
            PyErr_Format(PyExc_ValueError, "%zd ranges of %u float32 do not fit dst (%zd bytes), filled (%zd) or "
                         "wsum (%zd), or dst_base %llu is not 0", full, per, t->dst.len, t->filled.len, t->wsum.len,
                         t->dst_base);
            return -1;
        }
    } else if (t->dst_base > (unsigned long long)(t->dst.len / 4)
               || (t->dst.len / 4 - (Py_ssize_t)t->dst_base) / per < full) {
        PyErr_Format(PyExc_ValueError, "%zd ranges of %u float32 from element %llu do not fit dst (%zd bytes)", full,
                     per, t->dst_base, t->dst.len);
        return -1;
    }
    if (take_overlap(t)) {
        PyErr_SetString(PyExc_ValueError, "bodies, seen, dst, filled, wsum and status must not overlap");
        return -1;
    }
    return 0;
}

/* Read-only: is the block a run of this phase's ranges that this path takes? */
static int take_run_ok(const TakeArgs *t) {
    const unsigned char *base = (const unsigned char *)t->src.buf, *r0 = base;
    float w0 = f32_at(r0 + WEIGHT_AT);
    Py_ssize_t same = t->mode == MODE_RS ? BODY_HEADER : WEIGHT_AT;
    unsigned int per = t->per;
    int ok = u32_at(r0) == t->group && r0[4] == t->codec && u32_at(r0 + 5) == t->total
             && (unsigned int)(r0[13] | r0[14] << 8) == per;
    if (ok && t->mode == MODE_RS)
        ok = w0 > 0.0f && w0 < INFINITY && (isnan(t->known) || t->known == (double)w0);
    int64_t prev = -1;
    for (Py_ssize_t i = 0; ok && i < t->rows; i++) {
        const unsigned char *r = base + i * t->stride;
        if (i && (memcmp(r, r0, OFFSET_AT) || memcmp(r + OFFSET_END, r0 + OFFSET_END, (size_t)(same - OFFSET_END))))
            return 0;
        int64_t rel = (int64_t)u32_at(r + OFFSET_AT) - (int64_t)t->start;
        if (rel < 0 || rel % per) return 0;
        int64_t k = rel / per;
        if (k >= t->full || k <= prev) return 0;
        prev = k;
        if (t->mode == MODE_AG) {
            float w = f32_at(r + WEIGHT_AT);
            ok = w >= 0.0f && w < INFINITY && (t->bits || values_finite(r + BODY_HEADER, per));
        }
    }
    return ok;
}

typedef struct {
    Py_ssize_t accepted, duplicates, odd;
    int64_t k_last;
    double weights;
} Taken;

/* Row i (at r) of a checked run: its range k, marked in seen and counted as accepted (the last so far), or -1 for a
 * duplicate (status 3). */
static int64_t take_mark(const TakeArgs *t, const unsigned char *r, Py_ssize_t i, Taken *out) {
    unsigned char *sn = (unsigned char *)t->seen.buf;
    int64_t k = ((int64_t)u32_at(r + OFFSET_AT) - (int64_t)t->start) / t->per;
    if (sn[k]) {
        ((unsigned char *)t->status.buf)[i] = 3;
        out->duplicates++;
        return -1;
    }
    sn[k] = 1;
    out->accepted++;
    out->k_last = k;
    return k;
}

/* Write: every span was checked, every k is in [0, full). Called with the GIL released. */
static void take_write(const TakeArgs *t, double ws, Taken *out) {
    const unsigned char *base = (const unsigned char *)t->src.buf;
    unsigned char *st = (unsigned char *)t->status.buf, *fl = (unsigned char *)t->filled.buf;
    double *wk = (double *)t->wsum.buf;
    float *d = (float *)t->dst.buf;
    float factor = (float)ws;
    unsigned int per = t->per;
    for (Py_ssize_t i = 0; i < t->rows; i++) {
        const unsigned char *r = base + i * t->stride;
        int64_t k = take_mark(t, r, i, out);
        if (k < 0) continue;
        if (t->mode == MODE_RS) {
            st[i] = dp_add_row(r + BODY_HEADER, d + k * per, per, fl[k] != 0, factor);
            if (st[i] == 0) fl[k] = 1;
            else out->odd++;
            if (st[i] != 1) wk[k] += ws;
        } else {
            memcpy(d + t->dst_base + (uint64_t)k * per, r + BODY_HEADER, (size_t)(4 * (Py_ssize_t)per));
            st[i] = 0;
            out->weights += (double)f32_at(r + WEIGHT_AT);
        }
    }
}

/* (accepted, duplicates, k_last, row 0's weight, the new rows' weights, odd): what take_rows and take_coded return */
static PyObject *taken_result(const Taken *taken, float w0) {
    return Py_BuildValue("nnLddn", taken->accepted, taken->duplicates, (long long)taken->k_last, (double)w0,
                         taken->weights, taken->odd);
}

PyObject *take_rows(PyObject *module, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"bodies", "stride", "rows", "mode", "group", "codec", "per", "total", "start", "full",
                             "known", "max_weight", "seen", "dst", "dst_base", "filled", "wsum", "status", NULL};
    TakeArgs t;
    memset(&t, 0, sizeof(t));
    PyObject *src_obj, *result = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onn$iIIIIKnddw*w*Kw*w*w*:take_rows", kwlist, &src_obj, &t.stride,
                                     &t.rows, &t.mode, &t.group, &t.codec, &t.per, &t.total, &t.start, &t.full,
                                     &t.known, &t.max_weight, &t.seen, &t.dst, &t.dst_base, &t.filled, &t.wsum,
                                     &t.status))
        return NULL;
    if (!get_rows(src_obj, &t.src, &t.span) || take_check(&t) < 0) goto done;
    if (!take_run_ok(&t)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    float w0 = f32_at((const unsigned char *)t.src.buf + WEIGHT_AT);
    double ws = t.mode == MODE_RS ? ((double)w0 < t.max_weight ? (double)w0 : t.max_weight) : 0.0;
    Taken taken = {0, 0, 0, -1, 0.0};
    Py_BEGIN_ALLOW_THREADS
    take_write(&t, ws, &taken);
    Py_END_ALLOW_THREADS
    result = taken_result(&taken, w0);
done:
    take_release(&t);
    return result;
}

const char take_coded_doc[] =
"take_coded(bodies, stride, rows, *, mode, group, codec, per, total, start, full, known, bits, qgroup, seen, dst,\n"
"           dst_base, status)\n"
"--\n\n"
"take_rows for int8 (``bits`` 8) or int4 (4) bodies of 19 + body bytes (protocol/codecs.md: an fp16 scale and min\n"
"per ``qgroup`` values, then the codes): the same checks of the run, then every body not yet in ``seen`` must\n"
"decode (finite scales and mins, positive scales, int4's padding clear), else nothing changes and the result is\n"
"None. Each new row is marked in ``seen`` and decoded to float32 at element dst_base + k * per of ``dst``: the\n"
"sender's stage row for the reduce-scatter (mode 0, dst_base 0), the result for the all-gather (mode 1).\n"
"``status[i]``: 0 taken, 3 a duplicate. Returns (accepted, duplicates, k_last, weight, weights, 0) as take_rows.\n"
"Every span is checked before anything is read; the GIL is released while rows are decoded.";

/* Read-only: does every body that is new to seen decode? */
static int coded_rows_valid(const TakeArgs *t) {
    const unsigned char *base = (const unsigned char *)t->src.buf, *sn = (const unsigned char *)t->seen.buf;
    for (Py_ssize_t i = 0; i < t->rows; i++) {
        const unsigned char *r = base + i * t->stride;
        int64_t k = ((int64_t)u32_at(r + OFFSET_AT) - (int64_t)t->start) / t->per;
        if (!sn[k] && !dp_row_valid(r + BODY_HEADER, t->per, t->bits, t->qgroup)) return 0;
    }
    return 1;
}

/* Write: every span was checked, every k is in [0, full), every new body decodes. Called with the GIL released. */
static void coded_write(const TakeArgs *t, Taken *out) {
    const unsigned char *base = (const unsigned char *)t->src.buf;
    unsigned char *st = (unsigned char *)t->status.buf;
    float *d = (float *)t->dst.buf;
    unsigned int per = t->per;
    for (Py_ssize_t i = 0; i < t->rows; i++) {
        const unsigned char *r = base + i * t->stride;
        int64_t k = take_mark(t, r, i, out);
        if (k < 0) continue;
        dp_decode_row(r + BODY_HEADER, per, t->bits, t->qgroup, d + t->dst_base + (uint64_t)k * per);
        st[i] = 0;
        if (t->mode == MODE_AG) out->weights += (double)f32_at(r + WEIGHT_AT);
    }
}

PyObject *take_coded(PyObject *module, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"bodies", "stride", "rows", "mode", "group", "codec", "per", "total", "start", "full",
                             "known", "bits", "qgroup", "seen", "dst", "dst_base", "status", NULL};
    TakeArgs t;
    memset(&t, 0, sizeof(t));
    PyObject *src_obj, *result = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onn$iIIIIKndinw*w*Kw*:take_coded", kwlist, &src_obj, &t.stride,
                                     &t.rows, &t.mode, &t.group, &t.codec, &t.per, &t.total, &t.start, &t.full,
                                     &t.known, &t.bits, &t.qgroup, &t.seen, &t.dst, &t.dst_base, &t.status))
        return NULL;
    t.body = dp_coded_body((Py_ssize_t)t.per, t.bits, t.qgroup);
    if (t.body < 0) {
        PyErr_Format(PyExc_ValueError, "bits %d, qgroup %zd or per %u out of range", t.bits, t.qgroup, t.per);
        goto done;
    }
    if (!get_rows(src_obj, &t.src, &t.span) || take_check(&t) < 0) goto done;
    if (!take_run_ok(&t) || !coded_rows_valid(&t)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    float w0 = f32_at((const unsigned char *)t.src.buf + WEIGHT_AT);
    Taken taken = {0, 0, 0, -1, 0.0};
    Py_BEGIN_ALLOW_THREADS
    coded_write(&t, &taken);
    Py_END_ALLOW_THREADS
    result = taken_result(&taken, w0);
done:
    take_release(&t);
    return result;
}
