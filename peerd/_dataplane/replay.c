/* The replay window's two block operations in C (peerd.wire.replay.ReplayWindow.would_accept_block and
 * accept_block are the reference; tests/test_replay_native.py compares them). A receive block of one session's
 * datagrams otherwise costs a dozen numpy calls here, each a few microseconds on a loaded core: the sequence
 * numbers are read straight from the datagram headers (the big-endian uint64 at SEQ_OFFSET), and the window's
 * ring is the numpy array the Python object holds (one byte per slot, sequence s in slot s % len). */

#include "common.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SEQ_AT 13 /* wire.envelope.SEQ_OFFSET: magic, version, type, flags, token */
#define SORT_ROWS 64 /* blocks out of order with more rows than this find repeats by sorting, not pairwise */

static uint64_t be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int k = 0; k < 8; k++) v = (v << 8) | p[k];
    return v;
}

/* ``highest``: a Python int, -1 for a window that has accepted nothing, else 0..2**64-1. */
static int parse_highest(PyObject *obj, int *none, uint64_t *highest) {
    if (!PyLong_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "highest must be an int");
        return 0;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred()) return 0;
    if (overflow == 0 && v < 0) {
        if (v != -1) {
            PyErr_Format(PyExc_ValueError, "highest %lld: -1 or a sequence number", v);
            return 0;
        }
        *none = 1;
        *highest = 0;
        return 1;
    }
    unsigned long long u = PyLong_AsUnsignedLongLong(obj);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    *none = 0;
    *highest = (uint64_t)u;
    return 1;
}

/* The arguments both take: (seen, highest, src, src_offset, src_stride, rows, mask). */
typedef struct {
    Py_buffer seen, mask;
    Py_buffer src;
    Py_ssize_t src_len, offset, stride, rows;
    int none;
    uint64_t highest;
} ReplayArgs;

static void release(ReplayArgs *a) {
    PyBuffer_Release(&a->seen);
    PyBuffer_Release(&a->src);
    PyBuffer_Release(&a->mask);
}

static int parse(PyObject *args, ReplayArgs *a, int mask_writable) {
    PyObject *highest, *src;
    memset(a, 0, sizeof(*a));
    int ok = mask_writable
        ? PyArg_ParseTuple(args, "w*OOnnnw*", &a->seen, &highest, &src, &a->offset, &a->stride, &a->rows, &a->mask)
        : PyArg_ParseTuple(args, "w*OOnnny*", &a->seen, &highest, &src, &a->offset, &a->stride, &a->rows, &a->mask);
    if (!ok) return 0;
    if (!get_rows(src, &a->src, &a->src_len)) {
        PyBuffer_Release(&a->seen);
        PyBuffer_Release(&a->mask);
        return 0;
    }
    if (!parse_highest(highest, &a->none, &a->highest)) goto fail;
    if (a->seen.len < 1) {
        PyErr_SetString(PyExc_ValueError, "seen: a window of at least one slot");
        goto fail;
    }
    if (a->rows < 0 || a->rows > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "rows %zd out of range", a->rows);
        goto fail;
    }
    if (a->mask.len < a->rows) {
        PyErr_Format(PyExc_ValueError, "mask of %zd bytes for %zd rows", a->mask.len, a->rows);
        goto fail;
    }
    /* each row's sequence number lies in src: its 8 bytes at offset + i * stride + SEQ_AT (rows may overlap,
     * as a stride shorter than a header lets them: they are only read) */
    if (a->rows > 0 && (a->offset < 0 || a->stride < 0 || a->offset > a->src_len - (SEQ_AT + 8)
                        || (a->stride > 0 && a->rows - 1 > (a->src_len - (SEQ_AT + 8) - a->offset) / a->stride))) {
        PyErr_Format(PyExc_ValueError, "%zd rows of stride %zd from %zd do not fit %zd bytes of src", a->rows,
                     a->stride, a->offset, a->src_len);
        goto fail;
    }
    return 1;
fail:
    release(a);
    return 0;
}

typedef struct {
    uint64_t seq;
    Py_ssize_t row;
} Keyed;

static int by_seq(const void *x, const void *y) {
    const Keyed *a = x, *b = y;
    if (a->seq != b->seq) return a->seq < b->seq ? -1 : 1;
    return a->row < b->row ? -1 : a->row > b->row;
}

const char replay_check_doc[] =
    "replay_check(seen, highest, src, src_offset, src_stride, rows, mask) -> replays\n"
    "--\n\n"
    "ReplayWindow.would_accept_block over the datagrams at src[src_offset + i * src_stride] (each row's sequence\n"
    "number read from its header): mask[i] = 1 where row i would be accepted, 0 where it is a replay (behind the\n"
    "window, seen, or a repeat of an earlier row of the block). ``seen``: the window's ring, one byte per slot;\n"
    "``highest``: its newest sequence, -1 for none. Returns how many rows are replays.";

PyObject *replay_check(PyObject *module, PyObject *args) {
    ReplayArgs a;
    if (!parse(args, &a, 1)) return NULL;
    PyObject *result = NULL;
    Keyed *keyed = NULL;
    const unsigned char *src = (const unsigned char *)a.src.buf + a.offset;
    const unsigned char *seen = a.seen.buf;
    unsigned char *mask = a.mask.buf;
    uint64_t size = (uint64_t)a.seen.len;
    int ordered = 1;
    uint64_t last = 0;
    for (Py_ssize_t i = 0; i < a.rows; i++) {
        uint64_t seq = be64(src + i * a.stride + SEQ_AT);
        if (i > 0 && seq <= last) ordered = 0;
        last = seq;
        mask[i] = a.none || seq > a.highest || (a.highest - seq < size && !seen[seq % size]);
    }
    if (!ordered) { /* a repeat within the block counts once: its first row */
        if (a.rows <= SORT_ROWS) {
            for (Py_ssize_t i = 1; i < a.rows; i++) {
                uint64_t seq = be64(src + i * a.stride + SEQ_AT);
                for (Py_ssize_t j = 0; j < i; j++)
                    if (be64(src + j * a.stride + SEQ_AT) == seq) {
                        mask[i] = 0;
                        break;
                    }
            }
        } else {
            keyed = PyMem_RawMalloc(sizeof(Keyed) * (size_t)a.rows);
            if (keyed == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            for (Py_ssize_t i = 0; i < a.rows; i++) {
                keyed[i].seq = be64(src + i * a.stride + SEQ_AT);
                keyed[i].row = i;
            }
            qsort(keyed, (size_t)a.rows, sizeof(Keyed), by_seq);
            for (Py_ssize_t i = 1; i < a.rows; i++)
                if (keyed[i].seq == keyed[i - 1].seq) mask[keyed[i].row] = 0;
        }
    }
    Py_ssize_t replays = 0;
    for (Py_ssize_t i = 0; i < a.rows; i++) replays += !mask[i];
    result = PyLong_FromSsize_t(replays);
done:
    PyMem_RawFree(keyed);
    release(&a);
    return result;
}

const char replay_accept_doc[] =
    "replay_accept(seen, highest, src, src_offset, src_stride, rows, mask) -> highest\n"
    "--\n\n"
    "ReplayWindow.accept_block over the rows whose mask[i] is non-zero (authenticated, and passed by\n"
    "replay_check): the window advances to the newest of them (the slots it passes over cleared) and marks each\n"
    "one still inside it. Writes ``seen``; returns the new highest (-1 while none was ever accepted).";

PyObject *replay_accept(PyObject *module, PyObject *args) {
    ReplayArgs a;
    if (!parse(args, &a, 0)) return NULL;
    const unsigned char *src = (const unsigned char *)a.src.buf + a.offset;
    unsigned char *seen = a.seen.buf;
    const unsigned char *mask = a.mask.buf;
    uint64_t size = (uint64_t)a.seen.len;
    int any = 0;
    uint64_t newest = 0;
    for (Py_ssize_t i = 0; i < a.rows; i++) {
        if (!mask[i]) continue;
        uint64_t seq = be64(src + i * a.stride + SEQ_AT);
        if (!any || seq > newest) newest = seq;
        any = 1;
    }
    if (any) {
        if (a.none || newest > a.highest) { /* advance: clear the slots of the sequences it skips */
            uint64_t first = a.none ? 0 : a.highest + 1;
            if (a.none || newest - first + 1 >= size) {
                memset(seen, 0, (size_t)size);
            } else {
                /* (newest + 1) % size without newest + 1: it wraps to 0 at newest = 2**64 - 1 */
                uint64_t from = first % size, to = (newest % size + 1) % size;
                if (from < to) {
                    memset(seen + from, 0, (size_t)(to - from));
                } else {
                    memset(seen + from, 0, (size_t)(size - from));
                    memset(seen, 0, (size_t)to);
                }
            }
            a.none = 0;
            a.highest = newest;
        }
        for (Py_ssize_t i = 0; i < a.rows; i++) {
            if (!mask[i]) continue;
            uint64_t seq = be64(src + i * a.stride + SEQ_AT);
            if (newest - seq < size) seen[seq % size] = 1; /* one pushed out of the window marks nothing */
        }
    }
    int none = a.none;
    uint64_t highest = a.highest;
    release(&a);
    return none ? PyLong_FromLong(-1) : PyLong_FromUnsignedLongLong(highest);
}
