/* peerd._dataplane._native: the per-datagram hot loops of the data plane over whole blocks of rows.
 *
 * Python (numpy) parses and validates every header and decides which rows to open (the replay window);
 * these functions only do the work over rows whose layout they are told explicitly (offsets, strides,
 * counts), and check every bound again before touching memory: a wrong argument raises, it never reads
 * or writes out of bounds. The GIL is released over a whole block.
 *
 * Wire format (protocol/PROTOCOL.md 4): a datagram is a 21-byte header (magic, version, type, flags:
 * 5 bytes; token: 8; sequence: 8, big-endian) then the body sealed with AES-256-GCM: nonce = 4 zero bytes
 * || the header's 8 sequence bytes, associated data = header || the receiver's 32-byte node id (or nothing
 * for a datagram sealed for no receiver), 16-byte tag after the ciphertext.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include <openssl/core_dispatch.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/opensslv.h>
#include <openssl/params.h>
#include <openssl/provider.h>

#include "common.h"

#define HEADER_SIZE 21
#define PREFIX_SIZE 13 /* magic .. token: what every row of a block shares */
#define SEQ_OFFSET 13
#define TAG_SIZE 16
#define NONCE_SIZE 12
#define KEY_SIZE 32
#define RECEIVER_SIZE 32
#define AAD_MAX (HEADER_SIZE + RECEIVER_SIZE)
/* A body or datagram longer than the largest UDP payload is a caller's bug: refuse it before EVP's int
 * lengths could overflow. */
#define MAX_ROW 65535

static EVP_CIPHER *aes_gcm = NULL; /* fetched once: an EVP_*Init with a named cipher fetches every time */

/* ---- AES-256-GCM, a row at a time ----------------------------------------------------------------- */

/* A row's fixed cost through EVP is about 170 ns on OpenSSL 3.0 (0.47 us of a 1200-byte row): each
 * EVP_*Init_ex asks the provider for the IV length and each tag is got or set through EVP_CIPHER_CTX_ctrl,
 * both by OSSL_PARAM lookups (strcmp over parameter names). The same provider's own functions, taken once from
 * its dispatch table (OSSL_PROVIDER_query_operation: public API), skip that layer: about 100 ns a row, the same
 * bytes (module_exec checks them against EVP before it uses them). Where they cannot be found or disagree, EVP
 * does the work: ``direct`` stays unset. */
typedef struct {
    OSSL_FUNC_cipher_newctx_fn *newctx;
    OSSL_FUNC_cipher_freectx_fn *freectx;
    OSSL_FUNC_cipher_encrypt_init_fn *einit;
    OSSL_FUNC_cipher_decrypt_init_fn *dinit;
    OSSL_FUNC_cipher_update_fn *update;
    OSSL_FUNC_cipher_final_fn *final;
    OSSL_FUNC_cipher_get_ctx_params_fn *get_ctx_params;
    void *provctx;
} Direct;

static Direct direct_fns;
static int have_direct = 0;

/* One key's context in one direction: the provider's own (``alg``) or EVP's. */
typedef struct {
    EVP_CIPHER_CTX *evp;
    void *alg;
} Gcm;

static void gcm_free(Gcm *g) {
    if (g->alg) direct_fns.freectx(g->alg);
    if (g->evp) EVP_CIPHER_CTX_free(g->evp);
    g->alg = NULL;
    g->evp = NULL;
}

/* Set up ``g`` with a key for sealing (``enc``) or opening, by the provider's functions where ``use_direct``. */
static int gcm_setup(Gcm *g, const unsigned char *key, int enc, int use_direct) {
    if (use_direct && have_direct) {
        g->alg = direct_fns.newctx(direct_fns.provctx);
        if (g->alg == NULL) return 0;
        return (enc ? direct_fns.einit : direct_fns.dinit)(g->alg, key, KEY_SIZE, NULL, 0, NULL) == 1;
    }
    g->evp = EVP_CIPHER_CTX_new();
    if (g->evp == NULL) return 0;
    return (enc ? EVP_EncryptInit_ex(g->evp, aes_gcm, NULL, key, NULL)
                : EVP_DecryptInit_ex(g->evp, aes_gcm, NULL, key, NULL)) == 1;
}

/* A row's nonce; opening, also its expected tag (the provider's functions take it here, EVP at gcm_finish). */
static int gcm_start(Gcm *g, int enc, const unsigned char *nonce, const unsigned char *tag) {
    if (g->alg) {
        OSSL_PARAM params[2] = {OSSL_PARAM_END, OSSL_PARAM_END};
        if (tag) params[0] = OSSL_PARAM_construct_octet_string(OSSL_CIPHER_PARAM_AEAD_TAG, (void *)tag, TAG_SIZE);
        return (enc ? direct_fns.einit : direct_fns.dinit)(g->alg, NULL, 0, nonce, NONCE_SIZE,
                                                           tag ? params : NULL) == 1;
    }
    return (enc ? EVP_EncryptInit_ex(g->evp, NULL, NULL, NULL, nonce)
                : EVP_DecryptInit_ex(g->evp, NULL, NULL, NULL, nonce)) == 1;
}

/* ``len`` bytes of ``in`` through the cipher into ``out`` (NULL: associated data). */
static int gcm_update(Gcm *g, int enc, unsigned char *out, const unsigned char *in, int len) {
    int n;
    if (g->alg) {
        size_t outl;
        return direct_fns.update(g->alg, out, &outl, (size_t)len, in, (size_t)len) == 1;
    }
    return (enc ? EVP_EncryptUpdate(g->evp, out, &n, in, len) : EVP_DecryptUpdate(g->evp, out, &n, in, len)) == 1;
}

/* The row's end. Sealing, its tag is written to ``tag``. Opening, ``tag`` is the expected one (the same as given
 * to gcm_start), and 1 means it matched. */
static int gcm_finish(Gcm *g, int enc, unsigned char *tag) {
    unsigned char none[16];
    int n;
    if (g->alg) {
        size_t outl;
        if (direct_fns.final(g->alg, none, &outl, 0) != 1) return 0;
        if (!enc) return 1;
        OSSL_PARAM params[2] = {OSSL_PARAM_construct_octet_string(OSSL_CIPHER_PARAM_AEAD_TAG, tag, TAG_SIZE),
                                OSSL_PARAM_END};
        return direct_fns.get_ctx_params(g->alg, params) == 1;
    }
    if (!enc) {
        if (EVP_CIPHER_CTX_ctrl(g->evp, EVP_CTRL_GCM_SET_TAG, TAG_SIZE, tag) != 1) return -1;
        return EVP_DecryptFinal_ex(g->evp, none, &n) == 1;
    }
    if (EVP_EncryptFinal_ex(g->evp, none, &n) != 1) return 0;
    return EVP_CIPHER_CTX_ctrl(g->evp, EVP_CTRL_GCM_GET_TAG, TAG_SIZE, tag) == 1;
}

/* Whether ``names`` (an OSSL_ALGORITHM's, colon-separated) holds ``name``. */
static int names_hold(const char *names, const char *name) {
    size_t len = strlen(name);
    for (const char *p = names; p && *p;) {
        const char *end = strchr(p, ':');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == len && OPENSSL_strncasecmp(p, name, len) == 0) return 1;
        p = end ? end + 1 : NULL;
    }
    return 0;
}

/* Seal and open one row both ways (EVP, and the provider's functions): 1 where they agree byte for byte and a
 * flipped tag bit is refused. */
static int direct_agrees(void) {
    static const unsigned char key[KEY_SIZE] = {7, 1, 2, 3}, nonce[NONCE_SIZE] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5};
    unsigned char aad[AAD_MAX] = {0x50, 0x44}, body[67], a[sizeof body + TAG_SIZE], b[sizeof body + TAG_SIZE];
    unsigned char back[sizeof body];
    for (size_t i = 0; i < sizeof body; i++) body[i] = (unsigned char)(i * 37 + 11);
    Gcm e = {0}, d = {0}, x = {0};
    int ok = gcm_setup(&e, key, 1, 0) && gcm_setup(&d, key, 1, 1) && gcm_setup(&x, key, 0, 1)
        && gcm_start(&e, 1, nonce, NULL) && gcm_update(&e, 1, NULL, aad, AAD_MAX)
        && gcm_update(&e, 1, a, body, sizeof body) && gcm_finish(&e, 1, a + sizeof body) == 1
        && gcm_start(&d, 1, nonce, NULL) && gcm_update(&d, 1, NULL, aad, AAD_MAX)
        && gcm_update(&d, 1, b, body, sizeof body) && gcm_finish(&d, 1, b + sizeof body) == 1
        && memcmp(a, b, sizeof a) == 0
        && gcm_start(&x, 0, nonce, a + sizeof body) && gcm_update(&x, 0, NULL, aad, AAD_MAX)
        && gcm_update(&x, 0, back, a, sizeof body) && gcm_finish(&x, 0, a + sizeof body) == 1
        && memcmp(back, body, sizeof body) == 0;
    if (ok) {
        a[sizeof body] ^= 1;
        ok = gcm_start(&x, 0, nonce, a + sizeof body) && gcm_update(&x, 0, NULL, aad, AAD_MAX)
            && gcm_update(&x, 0, back, a, sizeof body) && gcm_finish(&x, 0, a + sizeof body) == 0;
    }
    gcm_free(&e);
    gcm_free(&d);
    gcm_free(&x);
    ERR_clear_error();
    return ok;
}

/* Take AES-256-GCM's functions from the provider ``aes_gcm`` came from; leave have_direct unset where any is
 * missing or the result differs from EVP's. */
static void resolve_direct(void) {
    OSSL_PROVIDER *prov = (OSSL_PROVIDER *)EVP_CIPHER_get0_provider(aes_gcm);
    if (prov == NULL) return;
    int no_cache = 0;
    const OSSL_ALGORITHM *algs = OSSL_PROVIDER_query_operation(prov, OSSL_OP_CIPHER, &no_cache);
    if (algs == NULL) return;
    Direct f = {0};
    for (const OSSL_ALGORITHM *alg = algs; alg->algorithm_names != NULL; alg++) {
        if (!names_hold(alg->algorithm_names, EVP_CIPHER_get0_name(aes_gcm))) continue;
        for (const OSSL_DISPATCH *d = alg->implementation; d && d->function_id != 0; d++) {
            switch (d->function_id) {
            case OSSL_FUNC_CIPHER_NEWCTX: f.newctx = OSSL_FUNC_cipher_newctx(d); break;
            case OSSL_FUNC_CIPHER_FREECTX: f.freectx = OSSL_FUNC_cipher_freectx(d); break;
            case OSSL_FUNC_CIPHER_ENCRYPT_INIT: f.einit = OSSL_FUNC_cipher_encrypt_init(d); break;
            case OSSL_FUNC_CIPHER_DECRYPT_INIT: f.dinit = OSSL_FUNC_cipher_decrypt_init(d); break;
            case OSSL_FUNC_CIPHER_UPDATE: f.update = OSSL_FUNC_cipher_update(d); break;
            case OSSL_FUNC_CIPHER_FINAL: f.final = OSSL_FUNC_cipher_final(d); break;
            case OSSL_FUNC_CIPHER_GET_CTX_PARAMS: f.get_ctx_params = OSSL_FUNC_cipher_get_ctx_params(d); break;
            default: break;
            }
        }
        break;
    }
    OSSL_PROVIDER_unquery_operation(prov, OSSL_OP_CIPHER, algs);
    f.provctx = OSSL_PROVIDER_get0_provider_ctx(prov);
    if (!f.newctx || !f.freectx || !f.einit || !f.dinit || !f.update || !f.final || !f.get_ctx_params) return;
    direct_fns = f;
    have_direct = 1;
    if (!direct_agrees()) {
        have_direct = 0;
        memset(&direct_fns, 0, sizeof direct_fns);
    }
}

/* ---- Aead: one AES-256-GCM key with its cached contexts ------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Gcm enc;
    Gcm dec;
    int keyed;
    int busy; /* set (under the GIL) while a call runs without it: a second thread must not share a ctx */
} AeadObject;

static void Aead_dealloc(AeadObject *self) {
    gcm_free(&self->enc);
    gcm_free(&self->dec);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Aead_init(AeadObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"key", "direct", NULL};
    Py_buffer key;
    int use_direct = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|p", kwlist, &key, &use_direct)) return -1;
    if (self->keyed || self->enc.evp || self->enc.alg || self->dec.evp || self->dec.alg) {
        PyBuffer_Release(&key);
        PyErr_SetString(PyExc_RuntimeError, "an Aead's key is set once");
        return -1;
    }
    if (key.len != KEY_SIZE) {
        PyBuffer_Release(&key);
        PyErr_Format(PyExc_ValueError, "an AES-256-GCM key is %d bytes, got %zd", KEY_SIZE, key.len);
        return -1;
    }
    int ok = gcm_setup(&self->enc, key.buf, 1, use_direct) && gcm_setup(&self->dec, key.buf, 0, use_direct);
    PyBuffer_Release(&key);
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL could not set up AES-256-GCM");
        return -1;
    }
    self->keyed = 1;
    return 0;
}

static PyObject *Aead_get_direct(AeadObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(self->enc.alg != NULL);
}

static int claim(AeadObject *self) {
    if (!self->keyed) {
        PyErr_SetString(PyExc_RuntimeError, "Aead has no key (its __init__ did not run)");
        return 0;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Aead is in use by another thread");
        return 0;
    }
    self->busy = 1;
    return 1;
}

/* ---- bounds ---------------------------------------------------------------------------------------- */

/* Rows [0, rows) of ``len`` bytes at ``offset + i * stride`` lie inside a buffer of ``size`` bytes, and
 * do not overlap one another (stride >= len). Overflow-safe. */
#define MAX_ROWS (1 << 24) /* rows one call takes at most (a block holds hundreds) */

int rows_fit(const char *what, Py_ssize_t size, Py_ssize_t offset, Py_ssize_t stride, Py_ssize_t len,
                    Py_ssize_t rows) {
    if (offset < 0 || stride < 0 || len < 0 || rows < 0) {
        PyErr_Format(PyExc_ValueError, "%s: negative offset, stride, length or rows", what);
        return 0;
    }
    if (rows == 0) return 1;
    if (rows > MAX_ROWS) { /* rows of 0 bytes fit anywhere: without this a wild count loops for ever */
        PyErr_Format(PyExc_ValueError, "%s: %zd rows, over the limit of %d", what, rows, MAX_ROWS);
        return 0;
    }
    if (stride < len) {
        PyErr_Format(PyExc_ValueError, "%s: stride %zd is shorter than a row of %zd bytes", what, stride, len);
        return 0;
    }
    if (offset > size) goto out_of_bounds;
    Py_ssize_t room = size - offset;
    if (len > room) goto out_of_bounds;
    if (rows > 1 && stride > 0 && (rows - 1) > (room - len) / stride) goto out_of_bounds; /* stride 0: len 0 */
    return 1;
out_of_bounds:
    PyErr_Format(PyExc_ValueError, "%s: %zd rows of %zd bytes, %zd apart, from offset %zd do not fit in %zd bytes",
                 what, rows, len, stride, offset, size);
    return 0;
}

/* The byte spans two row sets cover overlap (the output must not alias the input: partial overlap makes
 * AES-GCM's output undefined). */
static int spans_overlap(const Py_buffer *a, Py_ssize_t a_off, Py_ssize_t a_stride, Py_ssize_t a_len,
                         const Py_buffer *b, Py_ssize_t b_off, Py_ssize_t b_stride, Py_ssize_t b_len,
                         Py_ssize_t rows) {
    if (rows == 0) return 0;
    uintptr_t a0 = (uintptr_t)a->buf + (uintptr_t)a_off;
    uintptr_t a1 = a0 + (uintptr_t)((rows - 1) * a_stride + a_len);
    uintptr_t b0 = (uintptr_t)b->buf + (uintptr_t)b_off;
    uintptr_t b1 = b0 + (uintptr_t)((rows - 1) * b_stride + b_len);
    return a0 < b1 && b0 < a1;
}

static int check_receiver(const Py_buffer *receiver) {
    if (receiver->len != 0 && receiver->len != RECEIVER_SIZE) {
        PyErr_Format(PyExc_ValueError, "a receiver is a %d-byte node id (or empty), got %zd bytes", RECEIVER_SIZE,
                     receiver->len);
        return 0;
    }
    return 1;
}

/* A source of rows: any C-contiguous buffer (its bytes), or a 2-D byte array whose rows are each contiguous and
 * ``strides[0]`` apart (rows cut out of a wider block, e.g. bodies past their envelope), seen as the bytes from its
 * first row's start to its last row's end, all inside the exporter's one allocation. ``*span`` gets that length. */
int get_rows(PyObject *obj, Py_buffer *view, Py_ssize_t *span) {
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDED_RO) < 0) return 0;
    if (PyBuffer_IsContiguous(view, 'C')) {
        *span = view->len;
        return 1;
    }
    if (view->ndim == 2 && view->itemsize == 1 && view->strides[1] == 1 && view->shape[0] > 0
        && view->strides[0] >= view->shape[1]) {
        *span = (view->shape[0] - 1) * view->strides[0] + view->shape[1];
        return 1;
    }
    PyBuffer_Release(view);
    PyErr_SetString(PyExc_ValueError, "rows must be a contiguous buffer or a 2-D byte array of contiguous rows");
    return 0;
}

/* ---- seal ------------------------------------------------------------------------------------------ */

/* Seal one row: ``out`` receives header || ciphertext || tag. Returns 1 on success. */
/* A row's start: its header (prefix, then seq big-endian) written to ``out``, the cipher set to its nonce, and the
 * associated data (header || receiver) fed in. 1: done; 0: OpenSSL failed. */
static int seal_begin(Gcm *g, const unsigned char *prefix, uint64_t seq, const unsigned char *receiver,
                      int receiver_len, unsigned char *out) {
    unsigned char aad[AAD_MAX];
    unsigned char nonce[NONCE_SIZE];
    memcpy(aad, prefix, PREFIX_SIZE);
    for (int b = 0; b < 8; b++) aad[SEQ_OFFSET + b] = (unsigned char)(seq >> (56 - 8 * b));
    memcpy(aad + HEADER_SIZE, receiver, (size_t)receiver_len);
    memset(nonce, 0, 4);
    memcpy(nonce + 4, aad + SEQ_OFFSET, 8);
    memcpy(out, aad, HEADER_SIZE);
    if (!gcm_start(g, 1, nonce, NULL)) return 0;
    return gcm_update(g, 1, NULL, aad, HEADER_SIZE + receiver_len);
}

/* A row's end: the cipher finished and its tag written after the ``body_len`` bytes of ciphertext at ``o``. */
static int seal_end(Gcm *g, unsigned char *o, int body_len) {
    return gcm_finish(g, 1, o + body_len) == 1;
}

static int seal_row(Gcm *g, const unsigned char *prefix, uint64_t seq, const unsigned char *body,
                    int body_len, const unsigned char *receiver, int receiver_len, unsigned char *out) {
    if (!seal_begin(g, prefix, seq, receiver, receiver_len, out)) return 0;
    if (body_len > 0 && !gcm_update(g, 1, out + HEADER_SIZE, body, body_len)) return 0;
    return seal_end(g, out + HEADER_SIZE, body_len);
}

PyDoc_STRVAR(Aead_seal_block_doc,
"seal_block(prefix, first_seq, rows, src, src_offset, src_stride, body_len, receiver, out, out_offset, out_stride)\n"
"--\n\n"
"Seal ``rows`` bodies of ``body_len`` bytes (row i at src[src_offset + i * src_stride]) into datagrams\n"
"header || ciphertext || tag at out[out_offset + i * out_stride]; row i's header is ``prefix`` (13 bytes:\n"
"magic, version, type, flags, token) then first_seq + i, big-endian. ``receiver``: the 32-byte node id\n"
"bound into the associated data, or b'' for none.");

static PyObject *Aead_seal_block(AeadObject *self, PyObject *args) {
    Py_buffer prefix = {0}, src = {0}, receiver = {0}, out = {0};
    unsigned long long first_seq;
    Py_ssize_t rows, src_offset, src_stride, body_len, out_offset, out_stride;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*Kny*nnny*w*nn", &prefix, &first_seq, &rows, &src, &src_offset, &src_stride,
                          &body_len, &receiver, &out, &out_offset, &out_stride))
        return NULL;
    Py_ssize_t width = HEADER_SIZE + body_len + TAG_SIZE;
    if (prefix.len != PREFIX_SIZE) {
        PyErr_Format(PyExc_ValueError, "the header prefix is %d bytes, got %zd", PREFIX_SIZE, prefix.len);
        goto done;
    }
    if (!check_receiver(&receiver)) goto done;
    if (body_len < 0 || body_len > MAX_ROW) {
        PyErr_Format(PyExc_ValueError, "body_len %zd out of range 0..%d", body_len, MAX_ROW);
        goto done;
    }
    if (rows < 0 || rows > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "rows %zd out of range", rows);
        goto done;
    }
    if (first_seq == 0 || (rows > 0 && first_seq > UINT64_MAX - (unsigned long long)(rows - 1))) {
        PyErr_SetString(PyExc_OverflowError, "sequence numbers run from 1 to 2**64 - 1");
        goto done;
    }
    if (!rows_fit("src", src.len, src_offset, src_stride, body_len, rows)) goto done;
    if (!rows_fit("out", out.len, out_offset, out_stride, width, rows)) goto done;
    if (spans_overlap(&src, src_offset, src_stride, body_len, &out, out_offset, out_stride, width, rows)) {
        PyErr_SetString(PyExc_ValueError, "out overlaps src");
        goto done;
    }
    if (!claim(self)) goto done;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *s = (const unsigned char *)src.buf + src_offset;
    unsigned char *o = (unsigned char *)out.buf + out_offset;
    for (Py_ssize_t i = 0; i < rows && ok; i++) {
        ok = seal_row(&self->enc, prefix.buf, (uint64_t)first_seq + (uint64_t)i, s + i * src_stride, (int)body_len,
                      receiver.buf, (int)receiver.len, o + i * out_stride);
    }
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL failed to seal a row");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&src);
    PyBuffer_Release(&receiver);
    PyBuffer_Release(&out);
    return result;
}

#define SPLIT_ROW_MAX 9216 /* a body up to this long (an 8 KB MTU's) is joined on the stack before sealing */

/* Seal one row whose body is two pieces, ``head`` then ``body`` (a tensor header, then values read straight from
 * the source vector): the same datagram as seal_row over their concatenation, without building it. */
static int seal_row2(Gcm *g, const unsigned char *prefix, uint64_t seq, const unsigned char *head,
                     int head_len, const unsigned char *body, int body_len, const unsigned char *receiver,
                     int receiver_len, unsigned char *out) {
    unsigned char *o = out + HEADER_SIZE;
    if (!seal_begin(g, prefix, seq, receiver, receiver_len, out)) return 0;
    /* GCM is a stream: each update's output is exactly its input's length, whatever the split. A row up to
     * SPLIT_ROW_MAX bytes is joined in a buffer on the stack (in L1: nearly free) and encrypted in one update: a
     * second EVP_EncryptUpdate costs more (OpenSSL 3's provider dispatch, ~45 ns a row, 10 % at 1200 bytes). */
    if (head_len + body_len <= SPLIT_ROW_MAX) {
        unsigned char row[SPLIT_ROW_MAX];
        memcpy(row, head, (size_t)head_len);
        memcpy(row + head_len, body, (size_t)body_len);
        if (head_len + body_len > 0 && !gcm_update(g, 1, o, row, head_len + body_len)) return 0;
    } else {
        if (head_len > 0 && !gcm_update(g, 1, o, head, head_len)) return 0;
        if (body_len > 0 && !gcm_update(g, 1, o + head_len, body, body_len)) return 0;
    }
    return seal_end(g, o, head_len + body_len);
}

PyDoc_STRVAR(Aead_seal_split_doc,
"seal_split(prefix, first_seq, rows, head, head_offset, head_stride, head_len, src, src_offset, src_stride,\n"
"           body_len, receiver, out, out_offset, out_stride)\n"
"--\n\n"
"seal_block over bodies given in two pieces: row i's body is the ``head_len`` bytes at\n"
"head[head_offset + i * head_stride] then the ``body_len`` bytes at src[src_offset + i * src_stride] (a tensor\n"
"header, then values straight from the vector: no packed copy). Datagram i (21 + head_len + body_len + 16\n"
"bytes) goes to out[out_offset + i * out_stride], byte for byte what seal_block makes of the joined body.");

static PyObject *Aead_seal_split(AeadObject *self, PyObject *args) {
    Py_buffer prefix = {0}, head = {0}, src = {0}, receiver = {0}, out = {0};
    unsigned long long first_seq;
    Py_ssize_t rows, head_offset, head_stride, head_len, src_offset, src_stride, body_len, out_offset, out_stride;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*Kny*nnny*nnny*w*nn", &prefix, &first_seq, &rows, &head, &head_offset,
                          &head_stride, &head_len, &src, &src_offset, &src_stride, &body_len, &receiver, &out,
                          &out_offset, &out_stride))
        return NULL;
    if (prefix.len != PREFIX_SIZE) {
        PyErr_Format(PyExc_ValueError, "the header prefix is %d bytes, got %zd", PREFIX_SIZE, prefix.len);
        goto done;
    }
    if (!check_receiver(&receiver)) goto done;
    if (head_len < 0 || body_len < 0 || head_len > MAX_ROW || body_len > MAX_ROW - head_len) {
        PyErr_Format(PyExc_ValueError, "head_len %zd + body_len %zd out of range 0..%d", head_len, body_len,
                     MAX_ROW);
        goto done;
    }
    Py_ssize_t width = HEADER_SIZE + head_len + body_len + TAG_SIZE;
    if (rows < 0 || rows > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "rows %zd out of range", rows);
        goto done;
    }
    if (first_seq == 0 || (rows > 0 && first_seq > UINT64_MAX - (unsigned long long)(rows - 1))) {
        PyErr_SetString(PyExc_OverflowError, "sequence numbers run from 1 to 2**64 - 1");
        goto done;
    }
    if (!rows_fit("head", head.len, head_offset, head_stride, head_len, rows)) goto done;
    if (!rows_fit("src", src.len, src_offset, src_stride, body_len, rows)) goto done;
    if (!rows_fit("out", out.len, out_offset, out_stride, width, rows)) goto done;
    if (spans_overlap(&src, src_offset, src_stride, body_len, &out, out_offset, out_stride, width, rows)
        || spans_overlap(&head, head_offset, head_stride, head_len, &out, out_offset, out_stride, width, rows)) {
        PyErr_SetString(PyExc_ValueError, "out overlaps head or src");
        goto done;
    }
    if (!claim(self)) goto done;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *h = (const unsigned char *)head.buf + head_offset;
    const unsigned char *s = (const unsigned char *)src.buf + src_offset;
    unsigned char *o = (unsigned char *)out.buf + out_offset;
    for (Py_ssize_t i = 0; i < rows && ok; i++) {
        ok = seal_row2(&self->enc, prefix.buf, (uint64_t)first_seq + (uint64_t)i, h + i * head_stride, (int)head_len,
                       s + i * src_stride, (int)body_len, receiver.buf, (int)receiver.len, o + i * out_stride);
    }
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL failed to seal a row");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&head);
    PyBuffer_Release(&src);
    PyBuffer_Release(&receiver);
    PyBuffer_Release(&out);
    return result;
}

/* ---- open ------------------------------------------------------------------------------------------ */

/* Open one datagram of ``row_len`` bytes into ``out`` (row_len - 37 bytes). 1: authentic; 0: not (``out``
 * is zeroed: no unauthenticated plaintext is left behind); -1: OpenSSL failed. */
static int open_row(Gcm *g, const unsigned char *row, int row_len, const unsigned char *receiver,
                    int receiver_len, unsigned char *out) {
    unsigned char aad[AAD_MAX];
    unsigned char nonce[NONCE_SIZE];
    unsigned char tag[TAG_SIZE];
    int body_len = row_len - HEADER_SIZE - TAG_SIZE;
    memcpy(aad, row, HEADER_SIZE);
    memcpy(aad + HEADER_SIZE, receiver, (size_t)receiver_len);
    memset(nonce, 0, 4);
    memcpy(nonce + 4, row + SEQ_OFFSET, 8);
    memcpy(tag, row + HEADER_SIZE + body_len, TAG_SIZE);
    if (!gcm_start(g, 0, nonce, tag)) return -1;
    if (!gcm_update(g, 0, NULL, aad, HEADER_SIZE + receiver_len)) return -1;
    if (body_len > 0 && !gcm_update(g, 0, out, row + HEADER_SIZE, body_len)) return -1;
    int r = gcm_finish(g, 0, tag);
    if (r < 0) return -1;
    if (r == 1) return 1;
    memset(out, 0, (size_t)body_len);
    return 0;
}

PyDoc_STRVAR(Aead_open_block_doc,
"open_block(src, src_offset, src_stride, row_len, rows, receiver, out, out_offset, out_stride, mask)\n"
"--\n\n"
"Open the datagrams of ``row_len`` bytes at src[src_offset + i * src_stride] whose mask[i] is non-zero,\n"
"writing each body (row_len - 37 bytes) to out[out_offset + i * out_stride]. A row that fails\n"
"authentication gets mask[i] = 0 and a zeroed body. Returns how many failed. Rows whose mask is 0 are\n"
"neither read nor written. ``out`` may be ``src`` itself at src_offset + 21 with the same stride (each body\n"
"opened over its ciphertext); any other overlap is refused.");

static PyObject *Aead_open_block(AeadObject *self, PyObject *args) {
    Py_buffer src = {0}, receiver = {0}, out = {0}, mask = {0};
    Py_ssize_t src_offset, src_stride, row_len, rows, out_offset, out_stride;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*nnnny*w*nnw*", &src, &src_offset, &src_stride, &row_len, &rows, &receiver, &out,
                          &out_offset, &out_stride, &mask))
        return NULL;
    Py_ssize_t body_len = row_len - HEADER_SIZE - TAG_SIZE;
    if (!check_receiver(&receiver)) goto done;
    if (row_len < HEADER_SIZE + TAG_SIZE || row_len > MAX_ROW) {
        PyErr_Format(PyExc_ValueError, "row_len %zd out of range %d..%d", row_len, HEADER_SIZE + TAG_SIZE, MAX_ROW);
        goto done;
    }
    if (rows < 0 || rows > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "rows %zd out of range", rows);
        goto done;
    }
    if (mask.len < rows) {
        PyErr_Format(PyExc_ValueError, "mask of %zd bytes for %zd rows", mask.len, rows);
        goto done;
    }
    if (!rows_fit("src", src.len, src_offset, src_stride, row_len, rows)) goto done;
    if (!rows_fit("out", out.len, out_offset, out_stride, body_len, rows)) goto done;
    /* In place is allowed exactly: each body written over its own ciphertext (AES-GCM's output may be its
     * input, not partly overlap it); the header and tag it reads are copied out before the row is opened. */
    int in_place = src.buf == out.buf && out_offset == src_offset + HEADER_SIZE && out_stride == src_stride;
    if ((!in_place && spans_overlap(&src, src_offset, src_stride, row_len, &out, out_offset, out_stride, body_len,
                                    rows))
        || spans_overlap(&mask, 0, 1, 1, &out, out_offset, out_stride, body_len, rows)
        || spans_overlap(&mask, 0, 1, 1, &src, src_offset, src_stride, row_len, rows)) {
        PyErr_SetString(PyExc_ValueError, "out, src and mask must not overlap");
        goto done;
    }
    if (!claim(self)) goto done;
    Py_ssize_t failures = 0;
    int broken = 0;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *s = (const unsigned char *)src.buf + src_offset;
    unsigned char *o = (unsigned char *)out.buf + out_offset;
    unsigned char *m = (unsigned char *)mask.buf;
    for (Py_ssize_t i = 0; i < rows; i++) {
        if (!m[i]) continue;
        int r = open_row(&self->dec, s + i * src_stride, (int)row_len, receiver.buf, (int)receiver.len,
                         o + i * out_stride);
        if (r < 0) {
            broken = 1;
            break;
        }
        if (r == 0) {
            m[i] = 0;
            failures++;
        }
    }
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (broken) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL failed to open a row");
        goto done;
    }
    result = PyLong_FromSsize_t(failures);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&receiver);
    PyBuffer_Release(&out);
    PyBuffer_Release(&mask);
    return result;
}

static PyMethodDef Aead_methods[] = {
    {"seal_block", (PyCFunction)Aead_seal_block, METH_VARARGS, Aead_seal_block_doc},
    {"seal_split", (PyCFunction)Aead_seal_split, METH_VARARGS, Aead_seal_split_doc},
    {"open_block", (PyCFunction)Aead_open_block, METH_VARARGS, Aead_open_block_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Aead_getset[] = {
    {"direct", (getter)Aead_get_direct, NULL, "whether this key seals and opens by the provider's own functions", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Aead_doc,
"Aead(key, direct=True)\n--\n\nAES-256-GCM under one 32-byte key, its OpenSSL contexts set up once (cache one per token).\n"
"``direct``: by the provider's own functions where the module found them (AEAD_DIRECT), else through EVP; the\n"
"bytes are the same either way.");

static PyTypeObject AeadType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "peerd._dataplane._native.Aead",
    .tp_basicsize = sizeof(AeadObject),
    .tp_dealloc = (destructor)Aead_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Aead_doc,
    .tp_methods = Aead_methods,
    .tp_getset = Aead_getset,
    .tp_init = (initproc)Aead_init,
    .tp_new = PyType_GenericNew,
};

/* ---- row copies without crypto ---------------------------------------------------------------------- */

PyDoc_STRVAR(frame_block_doc,
"frame_block(prefix, first_seq, rows, src, src_offset, src_stride, body_len, out, out_offset, out_stride)\n"
"--\n\n"
"Unsealed datagrams (--insecure): header (``prefix`` then first_seq + i, big-endian) || body, row i at\n"
"out[out_offset + i * out_stride].");

static PyObject *frame_block(PyObject *module, PyObject *args) {
    Py_buffer prefix = {0}, src = {0}, out = {0};
    unsigned long long first_seq;
    Py_ssize_t rows, src_offset, src_stride, body_len, out_offset, out_stride;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*Kny*nnnw*nn", &prefix, &first_seq, &rows, &src, &src_offset, &src_stride,
                          &body_len, &out, &out_offset, &out_stride))
        return NULL;
    Py_ssize_t width = HEADER_SIZE + body_len;
    if (prefix.len != PREFIX_SIZE) {
        PyErr_Format(PyExc_ValueError, "the header prefix is %d bytes, got %zd", PREFIX_SIZE, prefix.len);
        goto done;
    }
    if (body_len < 0 || body_len > MAX_ROW || rows < 0 || rows > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "body_len %zd or rows %zd out of range", body_len, rows);
        goto done;
    }
    if (first_seq == 0 || (rows > 0 && first_seq > UINT64_MAX - (unsigned long long)(rows - 1))) {
        PyErr_SetString(PyExc_OverflowError, "sequence numbers run from 1 to 2**64 - 1");
        goto done;
    }
    if (!rows_fit("src", src.len, src_offset, src_stride, body_len, rows)) goto done;
    if (!rows_fit("out", out.len, out_offset, out_stride, width, rows)) goto done;
    if (spans_overlap(&src, src_offset, src_stride, body_len, &out, out_offset, out_stride, width, rows)) {
        PyErr_SetString(PyExc_ValueError, "out overlaps src");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *s = (const unsigned char *)src.buf + src_offset;
    unsigned char *o = (unsigned char *)out.buf + out_offset;
    for (Py_ssize_t i = 0; i < rows; i++) {
        unsigned char *row = o + i * out_stride;
        uint64_t seq = (uint64_t)first_seq + (uint64_t)i;
        memcpy(row, prefix.buf, PREFIX_SIZE);
        for (int b = 0; b < 8; b++) row[SEQ_OFFSET + b] = (unsigned char)(seq >> (56 - 8 * b));
        memcpy(row + HEADER_SIZE, s + i * src_stride, (size_t)body_len);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(frame_split_doc,
"frame_split(prefix, first_seq, rows, head, head_offset, head_stride, head_len, src, src_offset, src_stride,\n"
"            body_len, out, out_offset, out_stride)\n"
"--\n\n"
"frame_block over bodies in two pieces (as Aead.seal_split): row i is the header, then the ``head_len`` bytes at\n"
"head[head_offset + i * head_stride], then the ``body_len`` bytes at src[src_offset + i * src_stride].");

static PyObject *frame_split(PyObject *module, PyObject *args) {
    Py_buffer prefix = {0}, head = {0}, src = {0}, out = {0};
    unsigned long long first_seq;
    Py_ssize_t rows, head_offset, head_stride, head_len, src_offset, src_stride, body_len, out_offset, out_stride;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*Kny*nnny*nnnw*nn", &prefix, &first_seq, &rows, &head, &head_offset, &head_stride,
                          &head_len, &src, &src_offset, &src_stride, &body_len, &out, &out_offset, &out_stride))
        return NULL;
    if (prefix.len != PREFIX_SIZE) {
        PyErr_Format(PyExc_ValueError, "the header prefix is %d bytes, got %zd", PREFIX_SIZE, prefix.len);
        goto done;
    }
    if (head_len < 0 || body_len < 0 || head_len > MAX_ROW || body_len > MAX_ROW - head_len || rows < 0
        || rows > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "head_len %zd, body_len %zd or rows %zd out of range", head_len, body_len,
                     rows);
        goto done;
    }
    if (first_seq == 0 || (rows > 0 && first_seq > UINT64_MAX - (unsigned long long)(rows - 1))) {
        PyErr_SetString(PyExc_OverflowError, "sequence numbers run from 1 to 2**64 - 1");
        goto done;
    }
    Py_ssize_t width = HEADER_SIZE + head_len + body_len;
    if (!rows_fit("head", head.len, head_offset, head_stride, head_len, rows)) goto done;
    if (!rows_fit("src", src.len, src_offset, src_stride, body_len, rows)) goto done;
    if (!rows_fit("out", out.len, out_offset, out_stride, width, rows)) goto done;
    if (spans_overlap(&src, src_offset, src_stride, body_len, &out, out_offset, out_stride, width, rows)
        || spans_overlap(&head, head_offset, head_stride, head_len, &out, out_offset, out_stride, width, rows)) {
        PyErr_SetString(PyExc_ValueError, "out overlaps head or src");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *h = (const unsigned char *)head.buf + head_offset;
    const unsigned char *s = (const unsigned char *)src.buf + src_offset;
    unsigned char *o = (unsigned char *)out.buf + out_offset;
    for (Py_ssize_t i = 0; i < rows; i++) {
        unsigned char *row = o + i * out_stride;
        uint64_t seq = (uint64_t)first_seq + (uint64_t)i;
        memcpy(row, prefix.buf, PREFIX_SIZE);
        for (int b = 0; b < 8; b++) row[SEQ_OFFSET + b] = (unsigned char)(seq >> (56 - 8 * b));
        memcpy(row + HEADER_SIZE, h + i * head_stride, (size_t)head_len);
        memcpy(row + HEADER_SIZE + head_len, s + i * src_stride, (size_t)body_len);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&head);
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

/* ---- placing opened rows --------------------------------------------------------------------------- */

/* No little-endian float32 in ``row`` (``n`` bytes, a multiple of 4) is NaN or inf: no exponent is all ones.
 * Branch-free over the row, whole 32-bit loads, so that the compiler vectorizes it (several GB/s). */
static int row_finite(const unsigned char *row, Py_ssize_t n) {
    uint32_t special = 0;
    for (Py_ssize_t j = 0; j < n; j += 4) {
        uint32_t x;
        memcpy(&x, row + j, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        x = __builtin_bswap32(x);
#endif
        special |= (uint32_t)((x & 0x7F800000u) == 0x7F800000u);
    }
    return !special;
}

PyDoc_STRVAR(first_nonfinite_doc,
"first_nonfinite(src, src_offset, src_stride, rows, length)\n"
"--\n\n"
"The first of ``rows`` rows of ``length`` bytes of little-endian float32 values (row i at\n"
"src[src_offset + i * src_stride]) that holds a NaN or an inf, or -1 when every value is finite.");

/* The arguments (src, src_offset, src_stride, rows, length) of a scan over rows, parsed and bounds-checked: 1, or 0
 * with an exception set and nothing held. */
static int scan_args(PyObject *args, Py_buffer *src, Py_ssize_t *offset, Py_ssize_t *stride, Py_ssize_t *rows,
                     Py_ssize_t *length) {
    PyObject *obj;
    Py_ssize_t span;
    if (!PyArg_ParseTuple(args, "Onnnn", &obj, offset, stride, rows, length)) return 0;
    if (!get_rows(obj, src, &span)) return 0;
    if (!rows_fit("src", span, *offset, *stride, *length, *rows)) {
        PyBuffer_Release(src);
        return 0;
    }
    return 1;
}

static PyObject *first_nonfinite(PyObject *module, PyObject *args) {
    Py_buffer src = {0};
    Py_ssize_t src_offset, src_stride, rows, length;
    if (!scan_args(args, &src, &src_offset, &src_stride, &rows, &length)) return NULL;
    if (length % 4) {
        PyErr_Format(PyExc_ValueError, "length %zd is not a multiple of 4 (float32 rows)", length);
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *s = (const unsigned char *)src.buf + src_offset;
    for (Py_ssize_t i = 0; i < rows; i++) {
        if (!row_finite(s + i * src_stride, length)) {
            bad = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    return PyLong_FromSsize_t(bad);
}

PyDoc_STRVAR(same_lead_doc,
"same_lead(src, src_offset, src_stride, rows, length)\n"
"--\n\n"
"Whether each of ``rows`` rows (row i at src[src_offset + i * src_stride]) begins with the same ``length`` bytes\n"
"as the first: a block's datagrams share magic, version, type, flags and token (Opener.open_block), checked\n"
"without numpy's strided copy of every header.");

static PyObject *same_lead(PyObject *module, PyObject *args) {
    Py_buffer src = {0};
    Py_ssize_t src_offset, src_stride, rows, length;
    if (!scan_args(args, &src, &src_offset, &src_stride, &rows, &length)) return NULL;
    int same = 1;
    const unsigned char *s = (const unsigned char *)src.buf + src_offset;
    for (Py_ssize_t i = 1; i < rows && same; i++) same = memcmp(s, s + i * src_stride, (size_t)length) == 0;
    PyBuffer_Release(&src);
    return PyBool_FromLong(same);
}

PyDoc_STRVAR(place_rows_doc,
"place_rows(src, src_offset, src_stride, rows, length, dst, dst_offset, dst_stride)\n"
"--\n\n"
"Copy ``rows`` rows of ``length`` bytes from src[src_offset + i * src_stride] to dst[dst_offset + i * dst_stride]:\n"
"opened tensor values into a group's stage or result, one pass, the GIL released. ``src``: a contiguous buffer,\n"
"or a 2-D byte array of contiguous rows (offsets from its first byte, rows its own stride apart).");

static PyObject *place_rows(PyObject *module, PyObject *args) {
    Py_buffer src = {0}, dst = {0};
    PyObject *src_obj;
    Py_ssize_t src_offset, src_stride, rows, length, dst_offset, dst_stride, src_len;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "Onnnnw*nn", &src_obj, &src_offset, &src_stride, &rows, &length, &dst, &dst_offset,
                          &dst_stride))
        return NULL;
    if (!get_rows(src_obj, &src, &src_len)) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (!rows_fit("src", src_len, src_offset, src_stride, length, rows)) goto done;
    if (!rows_fit("dst", dst.len, dst_offset, dst_stride, length, rows)) goto done;
    if (spans_overlap(&src, src_offset, src_stride, length, &dst, dst_offset, dst_stride, length, rows)) {
        PyErr_SetString(PyExc_ValueError, "dst overlaps src");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *s = (const unsigned char *)src.buf + src_offset;
    unsigned char *d = (unsigned char *)dst.buf + dst_offset;
    if (src_stride == length && dst_stride == length) {
        memcpy(d, s, (size_t)(rows * length));
    } else {
        for (Py_ssize_t i = 0; i < rows; i++) memcpy(d + i * dst_stride, s + i * src_stride, (size_t)length);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* ---- receiving: one pass over a UDP socket ---------------------------------------------------------- */

#ifdef __linux__
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <sys/socket.h>

#define RECV_VLEN 64           /* messages per recvmmsg */
#define RECV_CONTROL 128       /* control bytes per message: UDP_GRO and SO_RXQ_OVFL (an int and a u32) and
                                * SO_TIMESTAMPNS (a struct timespec) */
#define RECV_MAX_ENTRIES 65536 /* max_datagrams is at most this */
#define MERGE_PREFIX PREFIX_SIZE
#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef SCM_TIMESTAMPNS
#define SCM_TIMESTAMPNS 35
#endif
#ifndef SO_RXQ_OVFL
#define SO_RXQ_OVFL 40
#endif

/* A source address as Python's socket module gives it: family, port and address bytes (flow info and scope
 * id are not part of Python's (host, port), so they are not compared either). */
typedef struct {
    int family; /* AF_INET, AF_INET6, or 0: none Python would make a (host, port) of */
    uint16_t port;
    unsigned char addr[16];
} Source;

typedef struct {
    Py_ssize_t start, size, row;
    Source source;
    double stamp; /* the kernel's receive time of its latest message (SO_TIMESTAMPNS, unix seconds), 0: none */
    Py_ssize_t head, tail; /* its messages (recv_batch's pieces), a chain through Piece.next, in order */
    int in_out;            /* after materialize: its bytes are at ``start`` in recv_batch's ``out``, not the arena */
    const unsigned char *data; /* after materialize: its first byte */
} Block;

/* One received message where it lies in the arena; a block is a chain of them until materialize makes it one run. */
typedef struct {
    Py_ssize_t start, size, next;
} Piece;

/* The header checks of peerd.wire.envelope.peek, with its constants given by the caller (``screen``). */
typedef struct {
    unsigned char lead[3]; /* magic, version */
    int known_flags, no_receiver_flag, ping_type, sealed_flag;
    Py_ssize_t min_sealed;
    PyObject *tokens; /* borrowed: the known tokens (a dict keyed by int) */
} Screen;

/* 0: a valid header; 1: malformed; 2: an unknown version (what peek refuses, and why). */
static int bad_header(const Screen *sc, const unsigned char *d, Py_ssize_t size) {
    if (size < HEADER_SIZE) return 1;
    if (memcmp(d, sc->lead, 3) != 0) return memcmp(d, sc->lead, 2) != 0 ? 1 : 2;
    int mtype = d[3], flags = d[4];
    if ((flags & ~sc->known_flags) || ((flags & sc->no_receiver_flag) && mtype != sc->ping_type)) return 1;
    return 0;
}

static void source_of(const struct sockaddr_storage *ss, socklen_t len, Source *out) {
    memset(out, 0, sizeof(*out));
    if (ss->ss_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        out->family = AF_INET;
        out->port = ntohs(a->sin_port);
        memcpy(out->addr, &a->sin_addr, 4);
    } else if (ss->ss_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        out->family = AF_INET6;
        out->port = ntohs(a->sin6_port);
        memcpy(out->addr, &a->sin6_addr, 16);
    }
}

static int same_source(const Source *a, const Source *b) {
    return a->family == b->family && a->port == b->port && memcmp(a->addr, b->addr, 16) == 0;
}

/* (host, port) as socket.recvmsg gives it (inet_ntop), or None for an address of another family. */
static PyObject *source_tuple(const Source *s) {
    char host[INET6_ADDRSTRLEN];
    if (s->family == 0) return Py_NewRef(Py_None);
    if (inet_ntop(s->family, s->addr, host, sizeof(host)) == NULL) return PyErr_SetFromErrno(PyExc_OSError);
    return Py_BuildValue("(sI)", host, (unsigned int)s->port);
}

/* ---- Ration: guard.AuthLimiter's table in C, so that recv_batch can refuse junk before Python sees it ---- */

/* The same decisions as peerd.transport.guard.AuthLimiter (the reference; tests/test_recv_batch.py compares them
 * call by call): a token bucket per source address that failed to authenticate (failure_rate a second,
 * failure_burst at once), at most max_sources of them (least recently failed evicted first), and one bucket for
 * the node's key derivations (derive_rate, derive_burst), made at the first may_derive. Fixed size: every entry
 * is allocated at construction; a lookup hashes the address with a per-table random seed (a chain an attacker
 * cannot grow on purpose). Only ever used with the GIL held. */
typedef struct {
    Source source;
    double tokens, at;
    uint64_t limited_pass; /* the recv_batch pass that refused this source a derivation (see recv_batch) */
    int32_t prev, next;    /* least recently failed first; -1 ends */
    int32_t chain;         /* next entry in the same hash slot, or the next free entry */
} RationEntry;

typedef struct {
    PyObject_HEAD
    double failure_rate, failure_burst, derive_rate, derive_burst;
    double derive_tokens, derive_at;
    int derive_started;
    Py_ssize_t max_sources, count;
    uint64_t seed, passes;
    RationEntry *entries;
    int32_t *slots; /* nslots heads of hash chains, -1: empty */
    Py_ssize_t nslots;
    int32_t oldest, newest, free;
} RationObject;

#define RATION_MAX_SOURCES (1 << 20)
#define RATION_TOKENS 64 /* tokens of a pass's handed-back datagrams remembered (past them: Python decides) */

/* TokenBucket._refill / has / take, with the same arithmetic. */
static inline void bucket_refill(double *tokens, double *at, double rate, double burst, double now) {
    if (now > *at) {
        double t = *tokens + (now - *at) * rate;
        *tokens = burst < t ? burst : t;
        *at = now;
    }
}

static inline int bucket_take(double *tokens, double *at, double rate, double burst, double now, double n) {
    bucket_refill(tokens, at, rate, burst, now);
    if (*tokens < 1) return 0;
    *tokens -= n;
    return 1;
}

static uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

static Py_ssize_t ration_slot(const RationObject *r, const Source *s) {
    uint64_t a, b;
    memcpy(&a, s->addr, 8);
    memcpy(&b, s->addr + 8, 8);
    uint64_t h = mix64(r->seed ^ ((uint64_t)s->family << 16 | s->port));
    h = mix64(h ^ a);
    h = mix64(h ^ b);
    return (Py_ssize_t)(h & (uint64_t)(r->nslots - 1));
}

static int32_t ration_find(const RationObject *r, const Source *s) {
    for (int32_t i = r->slots[ration_slot(r, s)]; i >= 0; i = r->entries[i].chain)
        if (same_source(&r->entries[i].source, s)) return i;
    return -1;
}

static void lru_unlink(RationObject *r, int32_t i) {
    RationEntry *e = &r->entries[i];
    if (e->prev >= 0) r->entries[e->prev].next = e->next;
    else r->oldest = e->next;
    if (e->next >= 0) r->entries[e->next].prev = e->prev;
    else r->newest = e->prev;
    e->prev = e->next = -1;
}

static void lru_append(RationObject *r, int32_t i) {
    RationEntry *e = &r->entries[i];
    e->prev = r->newest;
    e->next = -1;
    if (r->newest >= 0) r->entries[r->newest].next = i;
    else r->oldest = i;
    r->newest = i;
}

static void ration_remove(RationObject *r, int32_t i) {
    int32_t *link = &r->slots[ration_slot(r, &r->entries[i].source)];
    while (*link != i) link = &r->entries[*link].chain; /* i is in its chain */
    *link = r->entries[i].chain;
    lru_unlink(r, i);
    r->entries[i].chain = r->free;
    r->free = i;
    r->count--;
}

/* AuthLimiter.may_derive: refills the source's bucket (when it has one) and takes from the node's. */
static int ration_may_derive(RationObject *r, const Source *s, double now) {
    int32_t i = ration_find(r, s);
    if (i >= 0) {
        RationEntry *e = &r->entries[i];
        bucket_refill(&e->tokens, &e->at, r->failure_rate, r->failure_burst, now);
        if (e->tokens < 1) return 0;
    }
    if (!r->derive_started) {
        r->derive_tokens = r->derive_burst;
        r->derive_at = now;
        r->derive_started = 1;
    }
    return bucket_take(&r->derive_tokens, &r->derive_at, r->derive_rate, r->derive_burst, now, 1);
}

/* AuthLimiter.failed: the source's bucket (a new one full), made the most recent, then ``count`` taken. */
static void ration_failed(RationObject *r, const Source *s, double now, double count) {
    int32_t i = ration_find(r, s);
    if (i >= 0) {
        lru_unlink(r, i);
    } else {
        if (r->count >= r->max_sources) ration_remove(r, r->oldest);
        i = r->free;
        RationEntry *e = &r->entries[i];
        r->free = e->chain;
        e->source = *s;
        e->tokens = r->failure_burst;
        e->at = now;
        e->limited_pass = 0;
        Py_ssize_t slot = ration_slot(r, s);
        e->chain = r->slots[slot];
        r->slots[slot] = i;
        r->count++;
    }
    lru_append(r, i);
    RationEntry *e = &r->entries[i];
    bucket_take(&e->tokens, &e->at, r->failure_rate, r->failure_burst, now, count);
}

/* (host, port) as recv_batch gives it (source_tuple) into a Source; 0: not such a pair (a scoped IPv6 host too:
 * the Python loop keys it with its scope, which a Source has not; the caller decides), -1: an error set. */
static int parse_source(PyObject *obj, Source *out) {
    memset(out, 0, sizeof(*out));
    if (!PyTuple_CheckExact(obj) || PyTuple_GET_SIZE(obj) != 2) return 0;
    PyObject *host = PyTuple_GET_ITEM(obj, 0), *port = PyTuple_GET_ITEM(obj, 1);
    if (!PyUnicode_Check(host) || !PyLong_Check(port)) return 0;
    long p = PyLong_AsLong(port);
    if (p == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (p < 0 || p > 65535) return 0;
    Py_ssize_t len;
    const char *text = PyUnicode_AsUTF8AndSize(host, &len);
    if (text == NULL) {
        PyErr_Clear();
        return 0;
    }
    char buf[INET6_ADDRSTRLEN + 1];
    Py_ssize_t n = len;
    if (n <= 0 || n >= (Py_ssize_t)sizeof(buf) || memchr(text, '\0', (size_t)n) || memchr(text, '%', (size_t)n))
        return 0;
    memcpy(buf, text, (size_t)n);
    buf[n] = '\0';
    if (inet_pton(AF_INET, buf, out->addr) == 1) out->family = AF_INET;
    else if (inet_pton(AF_INET6, buf, out->addr) == 1) out->family = AF_INET6;
    else return 0;
    out->port = (uint16_t)p;
    return 1;
}

static void Ration_dealloc(RationObject *self) {
    PyMem_Free(self->entries);
    PyMem_Free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Ration_init(RationObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"failure_rate", "failure_burst", "derive_rate", "derive_burst", "max_sources", "seed",
                             NULL};
    double fr = 10.0, fb = 32.0, dr = 1000.0, db = 1000.0;
    Py_ssize_t max_sources = 4096;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$ddddnK", kwlist, &fr, &fb, &dr, &db, &max_sources, &seed))
        return -1;
    if (self->entries) {
        PyErr_SetString(PyExc_RuntimeError, "a Ration is set up once");
        return -1;
    }
    if (!(fr >= 0 && fb >= 0 && dr >= 0 && db >= 0 && fr < 1e300 && fb < 1e300 && dr < 1e300 && db < 1e300)) {
        PyErr_SetString(PyExc_ValueError, "rates and bursts are finite and >= 0");
        return -1;
    }
    if (max_sources < 1 || max_sources > RATION_MAX_SOURCES) {
        PyErr_Format(PyExc_ValueError, "max_sources %zd out of range 1..%d", max_sources, RATION_MAX_SOURCES);
        return -1;
    }
    Py_ssize_t nslots = 1;
    while (nslots < 2 * max_sources) nslots <<= 1;
    self->entries = PyMem_Calloc((size_t)max_sources, sizeof(RationEntry));
    self->slots = PyMem_Malloc(sizeof(int32_t) * (size_t)nslots);
    if (self->entries == NULL || self->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < nslots; i++) self->slots[i] = -1;
    for (Py_ssize_t i = 0; i < max_sources; i++) {
        self->entries[i].chain = i + 1 < max_sources ? (int32_t)(i + 1) : -1;
        self->entries[i].prev = self->entries[i].next = -1;
    }
    self->failure_rate = fr;
    self->failure_burst = fb;
    self->derive_rate = dr;
    self->derive_burst = db;
    self->max_sources = max_sources;
    self->nslots = nslots;
    self->seed = mix64((uint64_t)seed + 0x9e3779b97f4a7c15ULL);
    self->oldest = self->newest = -1;
    self->free = 0;
    return 0;
}

static int ration_ready(RationObject *self) {
    if (self->entries == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Ration.__init__ was not called");
        return 0;
    }
    return 1;
}

/* A non-finite time or count would stick in a bucket (NaN compares false: never empty again): refused. */
static int finite_args(double now, double count) {
    if (isfinite(now) && isfinite(count)) return 1;
    PyErr_SetString(PyExc_ValueError, "now and count must be finite");
    return 0;
}

PyDoc_STRVAR(Ration_may_derive_doc,
"may_derive(source, now) -> bool or None\n--\n\n"
"AuthLimiter.may_derive; None (nothing changed) when ``source`` is not an IP (host, port).");

static PyObject *Ration_may_derive(RationObject *self, PyObject *args) {
    PyObject *src;
    double now;
    if (!PyArg_ParseTuple(args, "Od", &src, &now) || !ration_ready(self) || !finite_args(now, 1)) return NULL;
    Source s;
    int ok = parse_source(src, &s);
    if (ok < 0) return NULL;
    if (!ok) Py_RETURN_NONE;
    return PyBool_FromLong(ration_may_derive(self, &s, now));
}

PyDoc_STRVAR(Ration_failed_doc,
"failed(source, now, count=1) -> bool\n--\n\n"
"AuthLimiter.failed; False (nothing recorded) when ``source`` is not an IP (host, port).");

static PyObject *Ration_failed(RationObject *self, PyObject *args) {
    PyObject *src;
    double now, count = 1;
    if (!PyArg_ParseTuple(args, "Od|d", &src, &now, &count) || !ration_ready(self) || !finite_args(now, count))
        return NULL;
    Source s;
    int ok = parse_source(src, &s);
    if (ok < 0) return NULL;
    if (!ok) Py_RETURN_FALSE;
    ration_failed(self, &s, now, count);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(Ration_derive_doc,
"derive(now) -> bool\n--\n\nTake one key derivation from the node's bucket (a source that is no IP address).");

static PyObject *Ration_derive(RationObject *self, PyObject *args) {
    double now;
    if (!PyArg_ParseTuple(args, "d", &now) || !ration_ready(self) || !finite_args(now, 1)) return NULL;
    if (!self->derive_started) {
        self->derive_tokens = self->derive_burst;
        self->derive_at = now;
        self->derive_started = 1;
    }
    return PyBool_FromLong(bucket_take(&self->derive_tokens, &self->derive_at, self->derive_rate, self->derive_burst,
                                       now, 1));
}

PyDoc_STRVAR(Ration_bucket_doc,
"bucket(source) -> (tokens, at) or None\n--\n\n"
"The source's bucket as it stands (not refilled), or None; ``bucket(None)``: the derivations' bucket.");

static PyObject *Ration_bucket(RationObject *self, PyObject *src) {
    if (!ration_ready(self)) return NULL;
    if (src == Py_None) {
        if (!self->derive_started) Py_RETURN_NONE;
        return Py_BuildValue("(dd)", self->derive_tokens, self->derive_at);
    }
    Source s;
    int ok = parse_source(src, &s);
    if (ok < 0) return NULL;
    int32_t i = ok ? ration_find(self, &s) : -1;
    if (i < 0) Py_RETURN_NONE;
    return Py_BuildValue("(dd)", self->entries[i].tokens, self->entries[i].at);
}

static PyObject *Ration_sources(RationObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!ration_ready(self)) return NULL;
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    for (int32_t i = self->oldest; i >= 0; i = self->entries[i].next) {
        PyObject *t = source_tuple(&self->entries[i].source);
        if (t == NULL || PyList_Append(list, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(t);
    }
    return list;
}

static Py_ssize_t Ration_len(RationObject *self) { return self->count; }

static PyMethodDef Ration_methods[] = {
    {"may_derive", (PyCFunction)Ration_may_derive, METH_VARARGS, Ration_may_derive_doc},
    {"failed", (PyCFunction)Ration_failed, METH_VARARGS, Ration_failed_doc},
    {"derive", (PyCFunction)Ration_derive, METH_VARARGS, Ration_derive_doc},
    {"bucket", (PyCFunction)Ration_bucket, METH_O, Ration_bucket_doc},
    {"sources", (PyCFunction)Ration_sources, METH_NOARGS, "sources() -> [(host, port)], least recently failed first"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Ration_as_sequence = {.sq_length = (lenfunc)Ration_len};

PyDoc_STRVAR(Ration_doc,
"Ration(*, failure_rate=10.0, failure_burst=32.0, derive_rate=1000.0, derive_burst=1000.0, max_sources=4096, "
"seed=0)\n--\n\n"
"peerd.transport.guard.AuthLimiter's buckets in a fixed-size C table keyed by IP source address, which\n"
"recv_batch consults (its ``ration``) to refuse a rationed source's junk before it becomes a Python object.");

static PyTypeObject RationType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "peerd._dataplane._native.Ration",
    .tp_basicsize = sizeof(RationObject),
    .tp_dealloc = (destructor)Ration_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Ration_doc,
    .tp_methods = Ration_methods,
    .tp_as_sequence = &Ration_as_sequence,
    .tp_init = (initproc)Ration_init,
    .tp_new = PyType_GenericNew,
};

/* ---- shedding an overloaded pass: max-min fair shares per source --------------------------------------------- */

/* recv_batch's ``shed``: when the kernel queue holds more than the receive loop can take in time (the caller
 * decides: UdpSocket reads the queue's depth), a pass reads far more than Python will handle, and keeps at most
 * about ``keep`` datagrams of it, shared max-min fairly among their sources (water-filling): a source sending less
 * than its share keeps everything, the heaviest are cut to the level. Small PINGs and PONGs (the liveness checks,
 * ``urgent_bytes`` at most) are never shed nor counted. What the kernel would tail-drop from whoever comes last
 * when its queue overflows is instead dropped from the sources that fill it, and a PING waits one pass, not a
 * queue of tens of thousands. */
typedef struct {
    Py_ssize_t keep, urgent_bytes;
    int ping, pong;
    int sealed_flag;     /* the screen's: only sealed datagrams carry a session token */
    PyObject *protected; /* borrowed: tokens never shed (a dict keyed by int), or NULL */
} Shed;

typedef struct {
    Source *keys;
    Py_ssize_t *kept;    /* per source: datagrams counted (then kept) in this pass */
    unsigned char *used; /* per slot: 1 when it holds a source */
    Py_ssize_t nslots;
} PassSources;

static int pass_sources_init(PassSources *ps, Py_ssize_t nblocks) {
    Py_ssize_t n = 4;
    while (n < 2 * nblocks) n <<= 1;
    ps->nslots = n;
    ps->keys = PyMem_RawMalloc(sizeof(Source) * (size_t)n);
    ps->kept = PyMem_RawCalloc((size_t)n, sizeof(Py_ssize_t));
    ps->used = PyMem_RawCalloc((size_t)n, 1);
    if (ps->keys == NULL || ps->kept == NULL || ps->used == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* The count of ``s`` in this pass (its slot made on first sight; at most nblocks sources in 2 * nblocks slots). */
static Py_ssize_t *pass_source(PassSources *ps, const Source *s) {
    uint64_t a, b;
    memcpy(&a, s->addr, 8);
    memcpy(&b, s->addr + 8, 8);
    uint64_t h = mix64(mix64(mix64((uint64_t)s->family << 16 | s->port) ^ a) ^ b);
    Py_ssize_t i = (Py_ssize_t)(h & (uint64_t)(ps->nslots - 1));
    while (ps->used[i] && !same_source(&ps->keys[i], s)) i = (i + 1) & (ps->nslots - 1);
    if (!ps->used[i]) {
        ps->used[i] = 1;
        ps->keys[i] = *s;
    }
    return &ps->kept[i];
}

/* Never shed nor counted: a small PING or PONG, or (``protected``) a sealed datagram or block under a protected
 * token (the sessions of the members of running groups: their tensor data must not pay for a flood; a merged
 * block shares its first 13 bytes, so its token). A failed lookup (no memory) counts as unprotected. */
static int is_urgent(const Shed *sh, const Block *b) {
    if (sh->protected != NULL && b->size >= HEADER_SIZE && (b->data[4] & sh->sealed_flag)) {
        const unsigned char *d = b->data;
        uint64_t token = 0;
        for (int j = 0; j < 8; j++) token = (token << 8) | d[5 + j];
        PyObject *key = PyLong_FromUnsignedLongLong(token);
        int in = key == NULL ? -1 : PyDict_Contains(sh->protected, key);
        Py_XDECREF(key);
        if (in > 0) return 1;
        if (in < 0) PyErr_Clear();
    }
    if (b->size != b->row || b->size > sh->urgent_bytes || b->size < 4) return 0;
    int t = b->data[3];
    return t == sh->ping || t == sh->pong;
}

static int cmp_ssize(const void *x, const void *y) {
    Py_ssize_t a = *(const Py_ssize_t *)x, b = *(const Py_ssize_t *)y;
    return a < b ? -1 : a > b;
}

/* The water level: counts every source's datagrams of the pass (urgent ones left out), then the largest L with
 * sum(min(count, L)) <= keep; infinity when everything fits. The counts are reset to 0 (they count what is kept). */
static double shed_level(PassSources *ps, const Block *blocks, Py_ssize_t nblocks, const Shed *sh) {
    Py_ssize_t total = 0, n = 0;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        const Block *b = &blocks[i];
        if (is_urgent(sh, b)) continue;
        Py_ssize_t rows = b->row ? (b->size + b->row - 1) / b->row : 1;
        *pass_source(ps, &b->source) += rows;
        total += rows;
    }
    double level = INFINITY;
    if (total > sh->keep) {
        Py_ssize_t *counts = PyMem_RawMalloc(sizeof(Py_ssize_t) * (size_t)ps->nslots);
        if (counts != NULL) {
            for (Py_ssize_t i = 0; i < ps->nslots; i++)
                if (ps->kept[i] > 0) counts[n++] = ps->kept[i];
            qsort(counts, (size_t)n, sizeof(Py_ssize_t), cmp_ssize);
            double left = (double)sh->keep;
            for (Py_ssize_t i = 0; i < n; i++) {
                double share = left / (double)(n - i);
                if ((double)counts[i] > share) {
                    level = share < 1 ? 1 : share;
                    break;
                }
                left -= (double)counts[i];
            }
            PyMem_RawFree(counts);
        } else {
            level = (double)sh->keep / (double)(nblocks > 0 ? nblocks : 1); /* no memory: an even cut */
        }
    }
    for (Py_ssize_t i = 0; i < ps->nslots; i++) ps->kept[i] = 0;
    return level;
}

PyDoc_STRVAR(recv_batch_doc,
"recv_batch(fd, arena, max_datagrams, slot, *, screen=None, ration=None, now=0.0, shed=None, arrivals=None,\n"
"           out=None)\n"
"    -> (blocks, used, datagrams, receives, drained, kernel_drops, screened)\n"
"--\n\n"
"One receive pass over the non-blocking UDP socket ``fd`` with the GIL released: recvmmsg(MSG_DONTWAIT) into\n"
"``arena`` (a writable memoryview), each message given ``slot`` bytes, then moved down to follow the previous one.\n"
"It stops when the socket is empty (``drained``), at ``max_datagrams`` datagrams (GRO segments counted), or when\n"
"less than ``slot`` bytes are left after the data. Consecutive receives from one source whose datagrams have one\n"
"size and the same first 13 bytes (one stream) merge into one block, as UdpSocket.recv_blocks' Python loop does:\n"
"``blocks`` is [(arena[start:start + size], (host, port), segment)], segment 0 for a single datagram. With a\n"
"``screen`` (and no ``shed``), a source's blocks sealed under a known token also join its earlier block of the same\n"
"stream while no other block of that source came between (regroup_sessions: sources interleaved on a paced link);\n"
"each source's datagrams keep their order, only different sources' pass each other.\n"
"``used``: bytes of the arena used; ``receives``: messages received; ``kernel_drops``: the last SO_RXQ_OVFL count\n"
"seen, or -1. ECONNREFUSED, EHOSTUNREACH and ENETUNREACH (ICMP errors) end the pass, not drained; any other error\n"
"raises OSError (what was received before it is lost, as in the Python loop).\n\n"
"``screen``: (lead, known_flags, no_receiver_flag, ping_type, sealed_flag, min_sealed, tokens), the constants of\n"
"peerd.wire.envelope.peek and the receiver's known tokens (a dict keyed by int). A single datagram (not a GRO\n"
"block) whose header peek refuses is then counted and left out (never merged), and one with a valid header,\n"
"the sealed flag and a token not in ``tokens`` is counted as malformed when shorter than ``min_sealed``, else\n"
"handed back apart. ``screened`` is always (unknown: [(arena[start:start + size], (host, port))], malformed,\n"
"version, screened_bytes: the bytes of those counted, limited, shed): ([], 0, 0, 0, 0, 0) without a screen.\n\n"
"``ration`` (a Ration, with a screen) and ``now``: those under unknown tokens are rationed as the endpoint's\n"
"_receive_screened does, with the same decisions (see the comment in the code): ``unknown`` then holds only\n"
"those Python must still decide, the first of them with its key derivation already granted (charged), and\n"
"``limited`` counts those refused (``auth_limited``, their bytes in screened_bytes), which never became Python\n"
"objects (0 without a ration).\n\n"
"``shed`` (with a screen): (keep, urgent_bytes, ping_type, pong_type), for a pass over a queue that overflows:\n"
"of the datagrams left after the screen, about ``keep`` are kept, shared max-min fairly among their sources (the\n"
"heaviest cut to the water level), PINGs and PONGs of at most urgent_bytes always kept, and so is every sealed\n"
"datagram under a token of the optional fifth item ``protected`` (a dict keyed by int, or None), none of them\n"
"counted in the shares; ``shed`` counts the datagrams dropped so (their bytes in screened_bytes; 0 without\n"
"``shed``).\n\n"
"``arrivals``: (a dict, data_min[, data_mask]). For every block handed back whose first datagram's type byte t is at\n"
"least ``data_min`` (tensor data), and with ``data_mask`` under data_min + 64 with bit t - data_min set (the data\n"
"types, not their END markers), and that the kernel timestamped (SO_TIMESTAMPNS on the socket), dict[(host, port)]\n"
"is set to the kernel's receive time of its latest datagram (unix seconds): what a REPORT's ``arrived`` says.\n\n"
"``out``: a writable buffer at least as large as the arena and apart from it, where blocks that do not lie in\n"
"one run of the arena are laid out (their data then slices ``out``).");

/* Interleaved sessions merge (recv_batch, with a screen): where several members send at once, paced, a pass holds
 * A B C A B C ..., and the consecutive merge above leaves every datagram a block of its own, each a Python call
 * (on a paced 100 Mbit/s link, tens of thousands an average, several times the CPU of loopback's GRO blocks). Here
 * the blocks of one source that are sealed under a known token (a session's traffic, whose tokens are in the
 * screen) and share the row size and first PREFIX_SIZE bytes join the first such block of that source while no
 * other block of the source came between them: each source's blocks keep their order; only blocks of different
 * sources pass each other. Unknown tokens, unsealed datagrams and everything a screen counts stay as they were.
 * Joins the blocks' chains of pieces (materialize lays each out as one run) and removes the joined blocks from
 * ``blocks``; 0, or -1 with an exception set. */
#define REGROUP_SOURCES 64 /* sources with a group open at once; past that a source's blocks stay apart */
static int regroup_sessions(const unsigned char *base, Py_ssize_t used, Block *blocks, Py_ssize_t *nblocks_p,
                            Piece *pieces, const Screen *screen) {
    Py_ssize_t n = *nblocks_p;
    if (n < 3) return 0;
    Py_ssize_t open_lead[REGROUP_SOURCES], open_size[REGROUP_SOURCES];
    unsigned char *joined = PyMem_RawCalloc((size_t)n, 1);
    if (joined == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int nopen = 0;
    Py_ssize_t merges = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Block *b = &blocks[i];
        if (b->start < 0 || b->size < 0 || b->start > used - b->row) continue; /* never: the pass laid them out */
        const unsigned char *d = base + b->start; /* its first piece: the header of its first datagram */
        int slot = -1; /* this source's open group */
        for (int j = 0; j < nopen && slot < 0; j++)
            if (same_source(&blocks[open_lead[j]].source, &b->source)) slot = j;
        int eligible = b->row >= HEADER_SIZE && b->size >= b->row && b->size % b->row == 0
                       && (d[4] & screen->sealed_flag);
        if (eligible) {
            uint64_t token = 0;
            for (int k = 0; k < 8; k++) token = (token << 8) | d[5 + k];
            PyObject *key = PyLong_FromUnsignedLongLong(token);
            int known = key == NULL ? -1 : PyDict_Contains(screen->tokens, key);
            Py_XDECREF(key);
            if (known < 0) {
                PyMem_RawFree(joined);
                return -1;
            }
            eligible = known;
        }
        if (slot >= 0) {
            Block *l = &blocks[open_lead[slot]];
            if (eligible && l->row == b->row && open_size[slot] % b->row == 0
                && memcmp(base + l->start, d, PREFIX_SIZE) == 0) {
                pieces[l->tail].next = b->head; /* b's pieces follow the lead's */
                l->tail = b->tail;
                l->size += b->size;
                if (b->stamp > l->stamp) l->stamp = b->stamp;
                open_size[slot] += b->size;
                joined[i] = 1;
                merges++;
                continue;
            }
            open_lead[slot] = open_lead[--nopen]; /* another block of the source: its group closes */
            open_size[slot] = open_size[nopen];
        }
        if (eligible && nopen < REGROUP_SOURCES) {
            open_lead[nopen] = i;
            open_size[nopen] = b->size;
            nopen++;
        }
    }
    if (merges) {
        Py_ssize_t w = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (!joined[i]) blocks[w++] = blocks[i];
        *nblocks_p = w;
    }
    PyMem_RawFree(joined);
    return 0;
}

/* Each block as one run of bytes that Python slices (its ``start``, ``in_out`` and ``data``). A block of one piece,
 * or of pieces that lie one after another, stays where it is. The others are copied: with ``out`` (as large as the
 * arena), each into ``out``, once; without, every block is laid out again from the arena's start, through a buffer
 * (two copies, as before ``out``). 0, or -1 with an exception set. */
static int materialize(unsigned char *base, Py_ssize_t used, unsigned char *out, Py_ssize_t out_len, Block *blocks,
                       Py_ssize_t nblocks, const Piece *pieces) {
    int scattered = 0;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        Block *b = &blocks[i];
        b->in_out = 0;
        b->data = base + b->start;
        Py_ssize_t end = b->start;
        for (Py_ssize_t p = b->head; p >= 0; p = pieces[p].next) {
            if (pieces[p].start != end) {
                scattered = 1;
                break;
            }
            end += pieces[p].size;
        }
    }
    if (!scattered) return 0;
    unsigned char *tmp = NULL, *dst = out;
    Py_ssize_t room = out_len;
    if (out == NULL) {
        tmp = PyMem_RawMalloc((size_t)(used > 0 ? used : 1));
        if (tmp == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        dst = tmp;
        room = used;
    }
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        Block *b = &blocks[i];
        if (out != NULL) { /* with ``out``, a block that lies in one run stays in the arena */
            Py_ssize_t end = b->start, p = b->head;
            while (p >= 0 && pieces[p].start == end) {
                end += pieces[p].size;
                p = pieces[p].next;
            }
            if (p < 0) continue;
        }
        Py_ssize_t at = pos;
        for (Py_ssize_t p = b->head; p >= 0; p = pieces[p].next) {
            const Piece *q = &pieces[p];
            if (q->start < 0 || q->size < 0 || q->start > used - q->size || pos > room - q->size) {
                PyMem_RawFree(tmp); /* never: the pieces lie in the arena, and they fill at most ``used`` */
                PyErr_SetString(PyExc_RuntimeError, "recv_batch: a block's piece is out of the arena");
                return -1;
            }
            memcpy(dst + pos, base + q->start, (size_t)q->size);
            pos += q->size;
        }
        b->start = at;
        if (out != NULL) {
            b->in_out = 1;
            b->data = out + at;
        } else {
            b->data = base + at;
        }
    }
    if (tmp != NULL) {
        memcpy(base, tmp, (size_t)pos);
        PyMem_RawFree(tmp);
    }
    return 0;
}

/* recv_batch's arguments, parsed and checked once. */
typedef struct {
    int fd;
    Py_ssize_t max_datagrams, slot;
    PyObject *arena_obj, *out_obj; /* borrowed; out_obj Py_None without ``out`` */
    int screening;
    Screen screen;
    RationObject *ration; /* borrowed, or NULL */
    double now;
    Shed shed;
    PyObject *arrivals; /* borrowed: source -> the latest kernel receive time of its data, or NULL */
    int data_min, masked;
    unsigned long long data_mask;
} RecvOptions;

/* What one pass read into the arena (filled with the GIL released). */
typedef struct {
    unsigned char *base;
    Py_ssize_t arena_len;
    int have_out;
    Block *blocks;
    Piece *pieces;
    Py_ssize_t used, datagrams, receives, nblocks, npieces, malformed, version, screened_bytes;
    long long kernel_drops;
    int drained, err;
} RecvPass;

/* The hand-out of a pass's blocks as Python objects, and the rationing of those under unknown tokens. */
typedef struct {
    PyObject *list, *unknown; /* (blocks), (unknown): new references */
    PyObject *prev_tuple;     /* the last source tuple made (consecutive blocks of one source share it) */
    const Source *prev;
    Py_ssize_t limited, handed, shed_count;
    int derived, tokens_overflow, ntokens;
    Source granted; /* the source of the derivation granted in this pass (once ``derived``) */
    uint64_t handed_tokens[RATION_TOKENS];
    uint64_t pass;
    PassSources ps; /* shed's per-source counts */
    double level;   /* shed's water level */
} HandOut;

static int parse_arrivals(PyObject *obj, RecvOptions *o) {
    if (obj == Py_None) return 0;
    if (!PyTuple_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "arrivals: (dict, data_min[, data_mask]), or None");
        return -1;
    }
    o->masked = PyTuple_GET_SIZE(obj) > 2;
    if (!PyArg_ParseTuple(obj, "O!i|K;arrivals: (dict, data_min[, data_mask])", &PyDict_Type, &o->arrivals,
                          &o->data_min, &o->data_mask))
        return -1;
    if (o->data_min < 0 || o->data_min > 255) {
        PyErr_Format(PyExc_ValueError, "arrivals: data_min %d out of range 0..255", o->data_min);
        return -1;
    }
    return 0;
}

static int parse_shed(PyObject *obj, PyObject *screen_obj, Shed *shed) {
    if (obj == Py_None) return 0;
    if (screen_obj == Py_None) {
        PyErr_SetString(PyExc_TypeError, "shed: only with a screen");
        return -1;
    }
    PyObject *protected = Py_None;
    if (!PyArg_ParseTuple(obj, "nnii|O;shed: (keep, urgent_bytes, ping_type, pong_type[, protected])", &shed->keep,
                          &shed->urgent_bytes, &shed->ping, &shed->pong, &protected))
        return -1;
    if (protected != Py_None) {
        if (!PyDict_Check(protected)) {
            PyErr_SetString(PyExc_TypeError, "shed: protected must be a dict keyed by int, or None");
            return -1;
        }
        shed->protected = protected;
    }
    if (shed->keep < 1 || shed->urgent_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "shed: keep %zd must be >= 1, urgent_bytes %zd >= 0", shed->keep,
                     shed->urgent_bytes);
        return -1;
    }
    return 0;
}

static int parse_ration(PyObject *obj, PyObject *screen_obj, RecvOptions *o) {
    if (obj == Py_None) return 0;
    if (screen_obj == Py_None || !PyObject_TypeCheck(obj, &RationType)) {
        PyErr_SetString(PyExc_TypeError, "ration: a Ration, and only with a screen");
        return -1;
    }
    o->ration = (RationObject *)obj;
    if (!ration_ready(o->ration)) return -1;
    if (!isfinite(o->now)) {
        PyErr_SetString(PyExc_ValueError, "now must be finite");
        return -1;
    }
    return 0;
}

static int parse_screen(PyObject *obj, RecvOptions *o) {
    o->screening = obj != Py_None;
    if (!o->screening) return 0;
    const char *lead;
    Py_ssize_t lead_len;
    Screen *s = &o->screen;
    if (!PyArg_ParseTuple(obj, "y#iiiinO!;screen: (lead, known_flags, no_receiver_flag, ping_type, sealed_flag, "
                          "min_sealed, tokens)", &lead, &lead_len, &s->known_flags, &s->no_receiver_flag,
                          &s->ping_type, &s->sealed_flag, &s->min_sealed, &PyDict_Type, &s->tokens))
        return -1;
    if (lead_len != 3) {
        PyErr_Format(PyExc_ValueError, "screen: the lead is 3 bytes (magic, version), got %zd", lead_len);
        return -1;
    }
    memcpy(s->lead, lead, 3);
    o->shed.sealed_flag = s->sealed_flag;
    return 0;
}

/* recv_batch's arguments into ``o``; 0, or -1 with an exception set. */
static int recv_options(PyObject *args, PyObject *kwds, RecvOptions *o) {
    static char *kwlist[] = {"fd", "arena", "max_datagrams", "slot", "screen", "ration", "now", "shed", "arrivals",
                             "out", NULL};
    PyObject *screen_obj = Py_None, *ration_obj = Py_None, *shed_obj = Py_None, *arrivals_obj = Py_None;
    memset(o, 0, sizeof(*o));
    o->out_obj = Py_None;
    o->data_min = 256;
    o->shed = (Shed){0, 0, -1, -1, 0, NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOnn|$OOdOOO:recv_batch", kwlist, &o->fd, &o->arena_obj,
                                     &o->max_datagrams, &o->slot, &screen_obj, &ration_obj, &o->now, &shed_obj,
                                     &arrivals_obj, &o->out_obj))
        return -1;
    if (parse_arrivals(arrivals_obj, o) < 0 || parse_shed(shed_obj, screen_obj, &o->shed) < 0
        || parse_ration(ration_obj, screen_obj, o) < 0 || parse_screen(screen_obj, o) < 0)
        return -1;
    if (o->fd < 0) {
        PyErr_Format(PyExc_ValueError, "fd %d is not a file descriptor", o->fd);
        return -1;
    }
    if (o->max_datagrams < 1 || o->max_datagrams > RECV_MAX_ENTRIES) {
        PyErr_Format(PyExc_ValueError, "max_datagrams %zd out of range 1..%d", o->max_datagrams, RECV_MAX_ENTRIES);
        return -1;
    }
    if (o->slot < 1 || o->slot > (Py_ssize_t)1 << 20) {
        PyErr_Format(PyExc_ValueError, "slot %zd out of range 1..%d", o->slot, 1 << 20);
        return -1;
    }
    return 0;
}

/* A message's control data: its GRO segment size, its kernel receive time, and the socket's drop count. */
static void read_control(struct msghdr *h, const unsigned char *buf, size_t buf_len, Py_ssize_t *segment,
                         double *stamp, long long *kernel_drops) {
    if ((h->msg_flags & MSG_CTRUNC) || h->msg_controllen > buf_len) return;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c != NULL; c = CMSG_NXTHDR(h, c)) {
        size_t have = c->cmsg_len >= CMSG_LEN(0) ? c->cmsg_len - CMSG_LEN(0) : 0;
        if ((unsigned char *)CMSG_DATA(c) + have > buf + h->msg_controllen) break;
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
            if (have >= 4) {
                int32_t v;
                memcpy(&v, CMSG_DATA(c), 4);
                *segment = v;
            } else if (have >= 2) {
                uint16_t v;
                memcpy(&v, CMSG_DATA(c), 2);
                *segment = v;
            }
        } else if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_RXQ_OVFL && have >= 4) {
            uint32_t v;
            memcpy(&v, CMSG_DATA(c), 4);
            *kernel_drops = v;
        } else if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS && have >= sizeof(struct timespec)) {
            struct timespec ts;
            memcpy(&ts, CMSG_DATA(c), sizeof(ts));
            *stamp = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
        }
    }
}

/* Keep one message that landed at ``at``: counted and left out if the screen refuses it, else moved down after the
 * data before it and merged into the last block where it continues that block's stream. 0, or -1 (EOVERFLOW). */
static int keep_message(RecvPass *rp, const RecvOptions *o, unsigned char *at, Py_ssize_t size, Py_ssize_t segment,
                        const Source *source, double stamp) {
    Py_ssize_t row = (segment > 0 && segment < size) ? segment : size;
    rp->datagrams += row ? (size + row - 1) / row : 1;
    rp->receives++;
    if (o->screening && row == size) { /* a single datagram: one peek refuses is counted, not kept */
        int bad = bad_header(&o->screen, at, size);
        if (bad) {
            if (bad == 1) rp->malformed++;
            else rp->version++;
            rp->screened_bytes += size;
            return 0;
        }
    }
    /* ``used`` has grown by at most ``slot`` per message before this one, so the destination is never past ``at``:
     * the move goes down, over slots already moved, never over a later message's slot. With ``out`` a message of
     * more than half a slot stays where it landed (the gap before it is left unused): its block is copied once into
     * ``out`` by materialize if it is not one run, where moving it here and regrouping too moved each byte up to
     * three times (GRO blocks of 54 x 1200 bytes in 64 KB slots). */
    unsigned char *base = rp->base;
    Py_ssize_t dest = (rp->have_out && 2 * size > o->slot) ? (Py_ssize_t)(at - base) : rp->used;
    unsigned char *to = base + dest;
    if (to != at && size > 0) memmove(to, at, (size_t)size);
    if (rp->npieces >= o->max_datagrams || rp->nblocks >= o->max_datagrams) return -1; /* never: >= a datagram */
    Piece *pieces = rp->pieces;
    Py_ssize_t piece = rp->npieces++;
    pieces[piece].start = dest;
    pieces[piece].size = size;
    pieces[piece].next = -1;
    rp->used = dest + size;
    if (rp->nblocks > 0 && row) {
        Block *last = &rp->blocks[rp->nblocks - 1];
        Py_ssize_t prefix = row < MERGE_PREFIX ? row : MERGE_PREFIX;
        if (last->row == row && last->size % row == 0
            && (rp->have_out || pieces[last->tail].start + pieces[last->tail].size == dest)
            && same_source(&last->source, source) && memcmp(base + last->start, to, (size_t)prefix) == 0) {
            pieces[last->tail].next = piece;
            last->tail = piece;
            last->size += size;
            if (stamp > last->stamp) last->stamp = stamp;
            return 0;
        }
    }
    rp->blocks[rp->nblocks++] = (Block){.start = dest, .size = size, .row = row, .source = *source, .stamp = stamp,
                                        .head = piece, .tail = piece, .in_out = 0, .data = to};
    return 0;
}

/* The pass's recvmmsg calls, with the GIL released (no Python object is touched). */
static void receive_pass(RecvPass *rp, const RecvOptions *o) {
    struct mmsghdr msgs[RECV_VLEN];
    struct iovec iov[RECV_VLEN];
    struct sockaddr_storage names[RECV_VLEN];
    union {
        struct cmsghdr align;
        unsigned char buf[RECV_CONTROL];
    } control[RECV_VLEN];
    Py_ssize_t slot = o->slot;
    while (rp->datagrams < o->max_datagrams && rp->arena_len - rp->used >= slot) {
        Py_ssize_t k = (rp->arena_len - rp->used) / slot;
        if (k > RECV_VLEN) k = RECV_VLEN;
        if (k > o->max_datagrams - rp->datagrams) k = o->max_datagrams - rp->datagrams;
        for (Py_ssize_t i = 0; i < k; i++) {
            iov[i] = (struct iovec){.iov_base = rp->base + rp->used + i * slot, .iov_len = (size_t)slot};
            memset(&msgs[i].msg_hdr, 0, sizeof(msgs[i].msg_hdr));
            msgs[i].msg_hdr.msg_name = &names[i];
            msgs[i].msg_hdr.msg_namelen = sizeof(names[i]);
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
            msgs[i].msg_hdr.msg_control = control[i].buf;
            msgs[i].msg_hdr.msg_controllen = sizeof(control[i].buf);
            msgs[i].msg_len = 0;
        }
        int n = recvmmsg(o->fd, msgs, (unsigned int)k, MSG_DONTWAIT, NULL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) rp->drained = 1;
            else if (errno != ECONNREFUSED && errno != EHOSTUNREACH && errno != ENETUNREACH) rp->err = errno;
            return; /* EINTR too: the caller checks signals and passes again */
        }
        if (n > k) n = (int)k; /* never: the kernel fills at most k */
        for (int i = 0; i < n; i++) {
            struct msghdr *h = &msgs[i].msg_hdr;
            Py_ssize_t size = (Py_ssize_t)msgs[i].msg_len;
            if (size > slot) size = slot; /* never: a message is at most its iov */
            Py_ssize_t segment = 0;
            double stamp = 0.0;
            read_control(h, control[i].buf, sizeof(control[i].buf), &segment, &stamp, &rp->kernel_drops);
            Source source;
            source_of(&names[i], h->msg_namelen, &source);
            if (keep_message(rp, o, iov[i].iov_base, size, segment, &source, stamp) < 0) {
                rp->err = EOVERFLOW;
                return;
            }
        }
        if (n < k) { /* MSG_DONTWAIT: recvmmsg returns short only when the queue ran empty (or on an error, which
                      * the next call reports) */
            rp->drained = 1;
            return;
        }
    }
}

/* The rationing of the endpoint's _receive_screened (transport/receive.py PassRation) over the datagrams under
 * unknown tokens, in arrival order, with the ration's state as it stands (nothing else changes it until Python
 * has handled this pass): until a derivation is granted, each is asked may_derive; a source refused one is refused
 * for the rest of the pass (limited_pass). The first granted is handed back first in ``unknown``, its derivation
 * charged; after it, Python decides each again (its token may be known by then), so only those certain to be
 * refused there are refused here, their token being none that a datagram handed back could have made known: those
 * from the granted source (a source gets one derivation a pass), and those whose source's bucket is empty now where
 * the table cannot evict the bucket before Python sees it. Returns whether ``b`` is refused. */
static int ration_refuses(HandOut *h, const RecvOptions *o, const Block *b, uint64_t token) {
    RationObject *ration = o->ration;
    int refuse = 0;
    int32_t e = ration_find(ration, &b->source);
    if (e >= 0 && ration->entries[e].limited_pass == h->pass) {
        refuse = 1;
    } else if (!h->derived) {
        if (ration_may_derive(ration, &b->source, o->now)) {
            h->derived = 1;
            h->granted = b->source;
        } else {
            refuse = 1;
            if (e >= 0) ration->entries[e].limited_pass = h->pass;
        }
    } else if (!h->tokens_overflow) {
        if (same_source(&h->granted, &b->source)) {
            refuse = 1;
        } else if (e >= 0 && ration->count + h->handed < ration->max_sources) {
            RationEntry *en = &ration->entries[e];
            bucket_refill(&en->tokens, &en->at, ration->failure_rate, ration->failure_burst, o->now);
            refuse = en->tokens < 1;
        }
        for (int j = 0; refuse && j < h->ntokens; j++) /* Python opens it if its token is known */
            if (h->handed_tokens[j] == token) refuse = 0;
    }
    if (refuse) return 1;
    h->handed++;
    int seen = 0;
    for (int j = 0; !seen && j < h->ntokens; j++) seen = h->handed_tokens[j] == token;
    if (!seen) {
        if (h->ntokens < RATION_TOKENS) h->handed_tokens[h->ntokens++] = token;
        else h->tokens_overflow = 1;
    }
    return 0;
}

/* The screen's second look, at a block as materialized: a single sealed datagram under a token the receiver does
 * not know is counted (too short), refused by the ration, or handed back apart (``*apart``). Returns 1 when the
 * block is left out, 0 when it is handed back, -1 on an error. */
static int screen_block(HandOut *h, const RecvOptions *o, RecvPass *rp, const Block *b, int *apart) {
    *apart = 0;
    if (!o->screening || b->size != b->row || b->size < HEADER_SIZE) return 0;
    const unsigned char *d = b->data;
    if (!(d[4] & o->screen.sealed_flag)) return 0;
    uint64_t token = 0;
    for (int j = 0; j < 8; j++) token = (token << 8) | d[5 + j];
    PyObject *key = PyLong_FromUnsignedLongLong(token);
    int known = key == NULL ? -1 : PyDict_Contains(o->screen.tokens, key);
    Py_XDECREF(key);
    if (known < 0) return -1;
    if (!known && b->size < o->screen.min_sealed) {
        rp->malformed++;
        rp->screened_bytes += b->size;
        return 1;
    }
    *apart = !known;
    if (*apart && o->ration && ration_refuses(h, o, b, token)) {
        h->limited++;
        rp->screened_bytes += b->size;
        return 1;
    }
    return 0;
}

/* Shedding in an overloaded pass: past its source's fair share a block is dropped before any Python object is made
 * (a merged block keeps its first rows). Returns 1 when all of it is shed. */
static int shed_block(HandOut *h, const RecvOptions *o, RecvPass *rp, Block *b) {
    if (o->shed.keep == 0 || is_urgent(&o->shed, b)) return 0;
    Py_ssize_t *kept = pass_source(&h->ps, &b->source);
    Py_ssize_t rows = b->row ? (b->size + b->row - 1) / b->row : 1;
    double room = h->level - (double)*kept;
    Py_ssize_t allowed = room >= (double)rows ? rows : room > 0 ? (Py_ssize_t)ceil(room) : 0;
    if (allowed <= 0) {
        h->shed_count += rows;
        rp->screened_bytes += b->size;
        return 1;
    }
    if (allowed < rows) {
        Py_ssize_t size = allowed * b->row;
        h->shed_count += rows - allowed;
        rp->screened_bytes += b->size - size;
        b->size = size;
    }
    *kept += allowed;
    return 0;
}

/* The block's source tuple (a new reference; consecutive blocks of one source share one). */
static PyObject *block_source(HandOut *h, const Block *b) {
    if (h->prev != NULL && same_source(h->prev, &b->source)) return Py_NewRef(h->prev_tuple);
    PyObject *source = source_tuple(&b->source);
    if (source == NULL) return NULL;
    Py_XSETREF(h->prev_tuple, Py_NewRef(source));
    h->prev = &b->source;
    return source;
}

/* Records the block's kernel receive time in ``arrivals`` where it is tensor data (see the docstring). */
static int note_arrival(const RecvOptions *o, const Block *b, PyObject *source) {
    if (o->arrivals == NULL || b->stamp <= 0 || b->size <= 3 || b->data[3] < o->data_min) return 0;
    int t = b->data[3] - o->data_min;
    if (o->masked && (t >= 64 || !((o->data_mask >> t) & 1ULL))) return 0;
    PyObject *when = PyFloat_FromDouble(b->stamp);
    int r = when == NULL ? -1 : PyDict_SetItem(o->arrivals, source, when);
    Py_XDECREF(when);
    return r;
}

/* Appends (data, source, segment) to ``blocks``, or (data, source) to ``unknown``; steals both references. */
static int append_block(HandOut *h, const RecvOptions *o, const Block *b, PyObject *data, PyObject *source,
                        int apart) {
    PyObject *item = apart ? PyTuple_New(2) : PyTuple_New(3);
    PyObject *seg = apart ? NULL : PyLong_FromSsize_t(b->size > b->row ? b->row : 0);
    if (item == NULL || (!apart && seg == NULL) || (!apart && note_arrival(o, b, source) < 0)) {
        Py_XDECREF(item);
        Py_XDECREF(seg);
        Py_DECREF(data);
        Py_DECREF(source);
        return -1;
    }
    PyTuple_SET_ITEM(item, 0, data);
    PyTuple_SET_ITEM(item, 1, source);
    if (!apart) PyTuple_SET_ITEM(item, 2, seg);
    int r = PyList_Append(apart ? h->unknown : h->list, item);
    Py_DECREF(item);
    return r;
}

/* The pass's blocks as Python objects, screened, rationed and shed: 0, or -1 with an exception set. */
static int hand_out(HandOut *h, const RecvOptions *o, RecvPass *rp) {
    if ((h->list = PyList_New(0)) == NULL || (h->unknown = PyList_New(0)) == NULL) return -1;
    h->pass = o->ration ? ++o->ration->passes : 0;
    if (o->shed.keep > 0) {
        if (pass_sources_init(&h->ps, rp->nblocks) < 0) return -1;
        h->level = shed_level(&h->ps, rp->blocks, rp->nblocks, &o->shed);
    }
    for (Py_ssize_t i = 0; i < rp->nblocks; i++) {
        Block *b = &rp->blocks[i];
        int apart;
        int left = screen_block(h, o, rp, b, &apart);
        if (left < 0) return -1;
        if (left || shed_block(h, o, rp, b)) continue;
        PyObject *source = block_source(h, b);
        if (source == NULL) return -1;
        PyObject *data = PySequence_GetSlice(b->in_out ? o->out_obj : o->arena_obj, b->start, b->start + b->size);
        if (data == NULL) {
            Py_DECREF(source);
            return -1;
        }
        if (append_block(h, o, b, data, source, apart) < 0) return -1;
    }
    return 0;
}

/* Borrows the arena and ``out`` and allocates the pass's blocks and pieces: 0, or -1 with an exception set (what
 * was taken is released by release_pass). */
static int start_pass(RecvPass *rp, const RecvOptions *o, Py_buffer *arena, Py_buffer *outb) {
    if (PyObject_GetBuffer(o->arena_obj, arena, PyBUF_WRITABLE) < 0) return -1;
    rp->base = arena->buf;
    rp->arena_len = arena->len;
    rp->kernel_drops = -1;
    if (arena->len < o->slot) {
        PyErr_Format(PyExc_ValueError, "an arena of %zd bytes holds no slot of %zd", arena->len, o->slot);
        return -1;
    }
    if (o->out_obj != Py_None) {
        if (PyObject_GetBuffer(o->out_obj, outb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
        rp->have_out = 1;
        uintptr_t a0 = (uintptr_t)arena->buf, a1 = a0 + (uintptr_t)arena->len;
        uintptr_t o0 = (uintptr_t)outb->buf, o1 = o0 + (uintptr_t)outb->len;
        if (outb->len < arena->len || (a0 < o1 && o0 < a1)) {
            PyErr_Format(PyExc_ValueError, "out (%zd bytes) must be at least as large as the arena (%zd) and apart "
                         "from it", outb->len, arena->len);
            return -1;
        }
    }
    /* Every message is at least one datagram: at most max_datagrams messages, so as many blocks and pieces. */
    rp->blocks = PyMem_RawMalloc(sizeof(Block) * (size_t)o->max_datagrams);
    rp->pieces = PyMem_RawMalloc(sizeof(Piece) * (size_t)o->max_datagrams);
    if (rp->blocks == NULL || rp->pieces == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static PyObject *recv_batch(PyObject *module, PyObject *args, PyObject *kwds) {
    RecvOptions o;
    if (recv_options(args, kwds, &o) < 0) return NULL;
    Py_buffer arena = {0}, outb = {0};
    RecvPass rp = {0};
    HandOut h = {0};
    PyObject *result = NULL;
    if (start_pass(&rp, &o, &arena, &outb) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    receive_pass(&rp, &o);
    Py_END_ALLOW_THREADS
    if (rp.err) {
        errno = rp.err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (rp.nblocks == 0 && !rp.drained && PyErr_CheckSignals() < 0) goto done;
    /* (not in an overloaded pass: shedding keeps each source's first rows in arrival order) */
    if (o.screening && o.shed.keep == 0
        && regroup_sessions(rp.base, rp.used, rp.blocks, &rp.nblocks, rp.pieces, &o.screen) < 0)
        goto done;
    if (materialize(rp.base, rp.used, rp.have_out ? outb.buf : NULL, rp.have_out ? outb.len : 0, rp.blocks,
                    rp.nblocks, rp.pieces) < 0)
        goto done;
    if (hand_out(&h, &o, &rp) < 0) goto done;
    result = Py_BuildValue("(OnnnOL(Onnnnn))", h.list, rp.used, rp.datagrams, rp.receives,
                           rp.drained ? Py_True : Py_False, rp.kernel_drops, h.unknown, rp.malformed, rp.version,
                           rp.screened_bytes, h.limited, h.shed_count);
done:
    Py_XDECREF(h.prev_tuple);
    Py_XDECREF(h.list);
    Py_XDECREF(h.unknown);
    PyMem_RawFree(h.ps.keys);
    PyMem_RawFree(h.ps.kept);
    PyMem_RawFree(h.ps.used);
    PyMem_RawFree(rp.blocks);
    PyMem_RawFree(rp.pieces);
    if (arena.obj != NULL) PyBuffer_Release(&arena);
    if (rp.have_out) PyBuffer_Release(&outb);
    return result;
}
#endif /* __linux__ */

static PyMethodDef module_methods[] = {
    {"frame_block", frame_block, METH_VARARGS, frame_block_doc},
    {"frame_split", frame_split, METH_VARARGS, frame_split_doc},
    {"place_rows", place_rows, METH_VARARGS, place_rows_doc},
    {"first_nonfinite", first_nonfinite, METH_VARARGS, first_nonfinite_doc},
    {"same_lead", same_lead, METH_VARARGS, same_lead_doc},
    {"accumulate_rows", accumulate_rows, METH_VARARGS, accumulate_rows_doc},
    {"finalize_rows", finalize_rows, METH_VARARGS, finalize_rows_doc},
    {"take_rows", (PyCFunction)(void (*)(void))take_rows, METH_VARARGS | METH_KEYWORDS, take_rows_doc},
    {"take_coded", (PyCFunction)(void (*)(void))take_coded, METH_VARARGS | METH_KEYWORDS, take_coded_doc},
    {"replay_check", replay_check, METH_VARARGS, replay_check_doc},
    {"replay_accept", replay_accept, METH_VARARGS, replay_accept_doc},
    {"quant_encode", quant_encode, METH_VARARGS, quant_encode_doc},
    {"quant_decode", quant_decode, METH_VARARGS, quant_decode_doc},
    {"half_encode", half_encode, METH_VARARGS, half_encode_doc},
    {"half_decode", half_decode, METH_VARARGS, half_decode_doc},
#ifdef __linux__
    {"recv_batch", (PyCFunction)(void (*)(void))recv_batch, METH_VARARGS | METH_KEYWORDS, recv_batch_doc},
    {"send_rows", send_rows, METH_VARARGS, send_rows_doc},
#endif
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *m) {
    if (aes_gcm == NULL) {
        aes_gcm = EVP_CIPHER_fetch(NULL, "AES-256-GCM", NULL);
        if (aes_gcm == NULL) {
            PyErr_SetString(PyExc_ImportError, "OpenSSL has no AES-256-GCM");
            return -1;
        }
        resolve_direct();
    }
    if (PyType_Ready(&AeadType) < 0) return -1;
    if (PyModule_AddObjectRef(m, "Aead", (PyObject *)&AeadType) < 0) return -1;
#ifdef __linux__
    if (PyType_Ready(&RationType) < 0) return -1;
    if (PyModule_AddObjectRef(m, "Ration", (PyObject *)&RationType) < 0) return -1;
#endif
    if (PyModule_AddStringConstant(m, "OPENSSL_VERSION", OpenSSL_version(OPENSSL_VERSION)) < 0) return -1;
    if (PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0) return -1;
    if (PyModule_AddIntConstant(m, "TAG_SIZE", TAG_SIZE) < 0) return -1;
    if (PyModule_AddIntConstant(m, "MAX_ROW", MAX_ROW) < 0) return -1;
    /* whether Aead(key) seals and opens by the provider's own functions (see Direct) or through EVP */
    if (PyModule_AddIntConstant(m, "AEAD_DIRECT", have_direct) < 0) return -1;
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "peerd._dataplane._native",
    .m_doc = "peerd's native data plane: AES-256-GCM over whole blocks of datagrams (OpenSSL libcrypto).",
    .m_size = 0,
    .m_methods = module_methods,
    .m_slots = module_slots,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModuleDef_Init(&moduledef); }
