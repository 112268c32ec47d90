/* What the files of peerd._dataplane._native share: bounds checks over caller-described rows (dataplane.c). */
#ifndef PEERD_DATAPLANE_COMMON_H
#define PEERD_DATAPLANE_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* ``obj``'s buffer as rows: C-contiguous, or a 2-D byte array of contiguous rows; ``span``: bytes from the first
 * row's start to the last row's end. 0 with an exception set otherwise. */
int get_rows(PyObject *obj, Py_buffer *view, Py_ssize_t *span);

/* Rows [0, rows) of ``len`` bytes at ``offset + i * stride`` lie inside ``size`` bytes and do not overlap. 0 with
 * a ValueError naming ``what`` otherwise. */
int rows_fit(const char *what, Py_ssize_t size, Py_ssize_t offset, Py_ssize_t stride, Py_ssize_t len,
             Py_ssize_t rows);

/* quant.c: int8, int4 and fp16 bodies */
extern const char quant_encode_doc[];
extern const char quant_decode_doc[];
extern const char half_encode_doc[];
extern const char half_decode_doc[];
PyObject *quant_encode(PyObject *module, PyObject *args);
PyObject *quant_decode(PyObject *module, PyObject *args);
PyObject *half_encode(PyObject *module, PyObject *args);
PyObject *half_decode(PyObject *module, PyObject *args);

/* replay.c: the replay window's block operations */
extern const char replay_check_doc[];
extern const char replay_accept_doc[];
PyObject *replay_check(PyObject *module, PyObject *args);
PyObject *replay_accept(PyObject *module, PyObject *args);

/* accum.c: the owner's running float32 sums */
extern const char accumulate_rows_doc[];
PyObject *accumulate_rows(PyObject *module, PyObject *args);
extern const char finalize_rows_doc[];
/* One row of m float32 values at s (any alignment) times factor into d: 0 added, 1 refused, 2 an overflow (accum.c) */
unsigned char dp_add_row(const unsigned char *s, float *d, Py_ssize_t m, int set, float factor);
PyObject *finalize_rows(PyObject *module, PyObject *args);

/* quant.c's int8/int4 rows for take.c: the body size of ``count`` values (-1: bits, group or count out of range),
 * whether a body decodes (its scales and mins finite, scales positive, int4's padding clear), and the decode */
Py_ssize_t dp_coded_body(Py_ssize_t count, int bits, Py_ssize_t group);
int dp_row_valid(const unsigned char *body, Py_ssize_t count, int bits, Py_ssize_t group);
int dp_decode_row(const unsigned char *body, Py_ssize_t count, int bits, Py_ssize_t group, float *v);

/* take.c: a group's intake of a block of fp32 (take_rows) or int8/int4 (take_coded) DATA bodies */
extern const char take_rows_doc[];
PyObject *take_rows(PyObject *module, PyObject *args, PyObject *kwds);
extern const char take_coded_doc[];
PyObject *take_coded(PyObject *module, PyObject *args, PyObject *kwds);

/* send.c: a paced part's rows onto the wire (sendmmsg, GSO) */
#ifdef __linux__
extern const char send_rows_doc[];
PyObject *send_rows(PyObject *module, PyObject *args);
#endif

#endif
