/* A paced part of a sealed block onto the wire in one call: its rows go out as GSO messages (UDP_SEGMENT: one
 * message of up to 64 rows, the kernel cuts it into datagrams), many messages per sendmmsg, the GIL released.
 *
 * Why: a paced part at a loopback or LAN rate is ~10 GSO sends. Sent one sendmsg at a time from Python each cost
 * ~2.5 us of interpreter beside the syscall (tests/test_send_native.py has the measurement's command). The Python
 * loop (peerd.transport.udp.UdpSocket.send_block) stays the reference and the fallback: the same datagrams in the
 * same order, the same messages.
 *
 * The destination comes as a sockaddr that Python packed (its family checked against the socket's); the rows as a
 * buffer with explicit offset, stride, count and size, every bound checked before anything is sent. */
#include "common.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>

#ifdef __linux__
#include <netinet/in.h>
#include <netinet/udp.h>
#include <sys/socket.h>

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif

#define SEND_BATCH 32      /* messages per sendmmsg (a paced part at 1 GB/s is ~16) */
#define MAX_SEGMENTS 64    /* rows per GSO message (the kernel's UDP_MAX_SEGMENTS is 64 on older kernels) */
#define MAX_MESSAGE 65507  /* bytes per message: the largest UDP payload */

const char send_rows_doc[] =
"send_rows(fd, rows, offset, stride, count, size, segment_rows, sockaddr, gso)\n"
"--\n\n"
"Send ``count`` datagrams of ``size`` bytes (row i at rows[offset + i * stride]) to ``sockaddr`` (a packed\n"
"struct sockaddr_in or sockaddr_in6) on the non-blocking UDP socket ``fd``, in order. With ``gso``, runs of\n"
"``segment_rows`` rows go as one message each (UDP_SEGMENT = size; a run of one row as a plain datagram), else\n"
"one row per message; many messages per sendmmsg. Returns (rows_sent, syscalls, errno): errno 0 when all were\n"
"sent, else the error that stopped it (EAGAIN: the socket is full; the caller waits and sends the rest).";

PyObject *send_rows(PyObject *module, PyObject *args) {
    int fd, gso;
    PyObject *rows_obj;
    Py_buffer rows = {0}, addr = {0};
    Py_ssize_t offset, stride, count, size, segment_rows, span;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "iOnnnnny*p", &fd, &rows_obj, &offset, &stride, &count, &size, &segment_rows, &addr,
                          &gso))
        return NULL;
    if (!get_rows(rows_obj, &rows, &span)) goto done;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "fd must be an open socket's descriptor");
        goto done;
    }
    if (size < 1 || size > MAX_MESSAGE) {
        PyErr_Format(PyExc_ValueError, "size %zd out of range 1..%d", size, MAX_MESSAGE);
        goto done;
    }
    if (segment_rows < 1 || segment_rows > MAX_SEGMENTS || segment_rows * size > MAX_MESSAGE) {
        PyErr_Format(PyExc_ValueError, "segment_rows %zd of %zd bytes: 1..%d rows and at most %d bytes a message",
                     segment_rows, size, MAX_SEGMENTS, MAX_MESSAGE);
        goto done;
    }
    if (!rows_fit("rows", span, offset, stride, size, count)) goto done;
    sa_family_t family = 0;
    if (addr.len >= (Py_ssize_t)sizeof(sa_family_t)) memcpy(&family, addr.buf, sizeof(family));
    if (!((family == AF_INET && addr.len == (Py_ssize_t)sizeof(struct sockaddr_in))
          || (family == AF_INET6 && addr.len == (Py_ssize_t)sizeof(struct sockaddr_in6)))) {
        PyErr_SetString(PyExc_ValueError, "sockaddr must be a packed sockaddr_in or sockaddr_in6");
        goto done;
    }
    Py_ssize_t per = gso ? segment_rows : 1;
    Py_ssize_t sent = 0, calls = 0;
    int err = 0;
    const unsigned char *base = (const unsigned char *)rows.buf + offset;
    Py_BEGIN_ALLOW_THREADS
    struct mmsghdr msgs[SEND_BATCH];
    struct iovec iovs[SEND_BATCH][MAX_SEGMENTS];
    union {
        char buf[CMSG_SPACE(sizeof(uint16_t))];
        struct cmsghdr align;
    } controls[SEND_BATCH];
    Py_ssize_t msg_rows[SEND_BATCH];
    while (sent < count) {
        int n = 0;
        Py_ssize_t at = sent;
        while (n < SEND_BATCH && at < count) {
            Py_ssize_t k = count - at < per ? count - at : per;
            struct msghdr *h = &msgs[n].msg_hdr;
            memset(h, 0, sizeof(*h));
            h->msg_name = addr.buf;
            h->msg_namelen = (socklen_t)addr.len;
            if (stride == size) { /* contiguous rows: one span */
                iovs[n][0].iov_base = (void *)(base + at * stride);
                iovs[n][0].iov_len = (size_t)(k * size);
                h->msg_iovlen = 1;
            } else {
                for (Py_ssize_t j = 0; j < k; j++) {
                    iovs[n][j].iov_base = (void *)(base + (at + j) * stride);
                    iovs[n][j].iov_len = (size_t)size;
                }
                h->msg_iovlen = (size_t)k;
            }
            h->msg_iov = iovs[n];
            if (k > 1) { /* a GSO message: the kernel cuts it into datagrams of ``size`` */
                memset(controls[n].buf, 0, sizeof(controls[n].buf));
                h->msg_control = controls[n].buf;
                h->msg_controllen = sizeof(controls[n].buf);
                struct cmsghdr *c = CMSG_FIRSTHDR(h);
                c->cmsg_level = SOL_UDP;
                c->cmsg_type = UDP_SEGMENT;
                c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
                uint16_t seg = (uint16_t)size;
                memcpy(CMSG_DATA(c), &seg, sizeof(seg));
            }
            msg_rows[n] = k;
            at += k;
            n++;
        }
        int done_msgs;
        do {
            done_msgs = sendmmsg(fd, msgs, (unsigned int)n, 0);
        } while (done_msgs < 0 && errno == EINTR);
        calls++;
        if (done_msgs < 0) {
            err = errno;
            break;
        }
        for (int i = 0; i < done_msgs; i++) sent += msg_rows[i];
        if (done_msgs < n) { /* the next message failed: learn why (EAGAIN, mostly) by sending it alone */
            continue;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(nni)", sent, calls, err);
done:
    PyBuffer_Release(&rows);
    PyBuffer_Release(&addr);
    return result;
}
#endif /* __linux__ */
