/* The frame MAC's bulk pass (gearflow/transport/integrity.py): NH over a frame's bytes, its outputs
 * fed to the frame's Poly1305 (libcrypto's EVP_MAC_update, whose address integrity.py takes from the
 * libcrypto Python's ssl module loaded), with the GIL released.
 *
 * NH(key, fn, ctx, simd=True).update_spans(spans) takes a frame's spans in one call: a span is an
 * (address, nbytes) tuple (memory the caller keeps alive: rows of a shared-memory segment) or an
 * object with the buffer protocol (bytes, a C-contiguous memoryview or numpy array). A sample reply
 * of 256 rows is ~520 spans: one Python call and one GIL hand-off instead of ~520 of each, so a MAC
 * thread runs beside the loop thread that writes the same bytes without waiting on it for the GIL.
 *
 * recv_into(fd, buffer, nh=None, piece, cipher=None) reads a frame's big block from a socket in pieces
 * without the GIL, each piece decrypted (gearflow's records under TLS) and fed to nh as it lands (a
 * client's wire thread: transport/wire_io.py). xor_spans / xor_inplace: the records' stream cipher.
 *
 * No OpenSSL header is needed: fn is int (*)(void *ctx, const unsigned char *data, size_t n),
 * EVP_MAC_update's signature (OpenSSL >= 3), returning 1 on success.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

typedef int (*update_fn)(void *ctx, const unsigned char *data, size_t n);

/* A span list's addresses and sizes (buffer views held until spans_release). */
typedef struct {
    Py_ssize_t n, nviews;
    const unsigned char **addr;
    size_t *len;
    Py_buffer *views;
    PyObject *seq;
} Spans;

static void spans_release(Spans *sp) {
    for (Py_ssize_t i = 0; i < sp->nviews; i++)
        PyBuffer_Release(&sp->views[i]);
    PyMem_Free(sp->addr);
    PyMem_Free(sp->len);
    PyMem_Free(sp->views);
    Py_XDECREF(sp->seq);
}

static int spans_parse(PyObject *spans, Spans *sp) {
    memset(sp, 0, sizeof(*sp));
    sp->seq = PySequence_Fast(spans, "update_spans: spans must be a list");
    if (sp->seq == NULL)
        return -1;
    Py_ssize_t n = sp->n = PySequence_Fast_GET_SIZE(sp->seq);
    PyObject **items = PySequence_Fast_ITEMS(sp->seq);
    sp->addr = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(*sp->addr));
    sp->len = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(*sp->len));
    sp->views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (sp->addr == NULL || sp->len == NULL || sp->views == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = items[i];
        if (PyTuple_CheckExact(s) && PyTuple_GET_SIZE(s) == 2) {
            unsigned long long a = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(s, 0));
            Py_ssize_t m = PyLong_AsSsize_t(PyTuple_GET_ITEM(s, 1));
            if (PyErr_Occurred())
                return -1;
            if (m < 0 || (m > 0 && a == 0)) {
                PyErr_Format(PyExc_ValueError, "update_spans: span %zd is (%llu, %zd)", i, a, m);
                return -1;
            }
            sp->addr[i] = (const unsigned char *)(uintptr_t)a;
            sp->len[i] = (size_t)m;
        } else {
            if (PyObject_GetBuffer(s, &sp->views[sp->nviews], PyBUF_SIMPLE) < 0)
                return -1;
            sp->addr[i] = sp->views[sp->nviews].buf;
            sp->len[i] = (size_t)sp->views[sp->nviews].len;
            sp->nviews++;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ NH (the frame MAC's bulk pass)
 *
 * NH as Adiantum's NHPoly1305 has it (Crowley & Biggers 2018; Linux crypto/nh_generic.c): a
 * message chunk of up to NH_CHUNK bytes in 16-byte units (m0..m3, little-endian u32), four
 * passes with the key shifted four words each (Toeplitz), each pass
 *     sum_p += (u32)(m0 + k[4i+4p+0]) * (u32)(m2 + k[4i+4p+2])
 *            + (u32)(m1 + k[4i+4p+1]) * (u32)(m3 + k[4i+4p+3])       (products and sums mod 2^64)
 * -> 32 bytes (sum_0..sum_3, little-endian u64) per chunk. A last chunk shorter than NH_CHUNK is
 * zero-padded to a whole unit. The outputs go to fn(ctx, ...) (EVP_MAC_update of the frame's
 * Poly1305) in batches; finish() adds the message's length (LE u64). integrity.py says why the
 * composition is a MAC; its numpy reference computes the same bytes.
 */
#define NH_CHUNK 1024
#define NH_UNITS (NH_CHUNK / 16)
#define NH_KEY_WORDS (NH_CHUNK / 4 + 12)
#define NH_OUT 32
#define NH_BATCH 128 /* outputs per Poly1305 update: 4 KiB */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define NH_X86 1
#include <immintrin.h>
#endif

typedef struct NHObject {
    PyObject_HEAD
    uint32_t key[NH_KEY_WORDS];
#ifdef NH_X86
    uint32_t ka[4][NH_CHUNK / 32][8]; /* each pass's key, permuted as the AVX2 pass pairs words */
#endif
    update_fn fn;
    void *ctx;
    uint8_t part[NH_CHUNK];
    size_t npart;
    uint8_t out[NH_BATCH * NH_OUT];
    size_t nout;
    uint64_t total;
    int failed;
    int simd; /* the AVX2 pass (where the CPU has it and the caller did not ask for the scalar one) */
    /* a frame with row digests (set_rows): the block's row regions go to `rows` (NH under the row
     * key, cut at each row's start), each row's outputs into this NH as its bytes */
    struct NHObject *rows;
    int64_t *plan; /* (start, end, row_bytes) triples, offsets in the block, ascending */
    size_t nplan, seg;
    uint64_t pos; /* block bytes fed since set_rows */
} NHObject;

static int nh_avx2_ok = 0;
static PyTypeObject NHType;
struct NHObject;

static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void nh_units(const uint32_t *key, const uint8_t *m, size_t units, uint8_t out[NH_OUT]) {
    uint64_t s[4] = {0, 0, 0, 0};
    for (size_t i = 0; i < units; i++) {
        uint32_t m0 = le32(m + 16 * i), m1 = le32(m + 16 * i + 4), m2 = le32(m + 16 * i + 8), m3 = le32(m + 16 * i + 12);
        const uint32_t *k = key + 4 * i;
        for (int p = 0; p < 4; p++)
            s[p] += (uint64_t)(uint32_t)(m0 + k[4 * p]) * (uint32_t)(m2 + k[4 * p + 2]) +
                    (uint64_t)(uint32_t)(m1 + k[4 * p + 1]) * (uint32_t)(m3 + k[4 * p + 3]);
    }
    for (int p = 0; p < 4; p++)
        put64(out + 8 * p, s[p]);
}

#ifdef NH_X86
#define NH_SHUF _MM_SHUFFLE(3, 1, 2, 0) /* a unit's words m0 m1 m2 m3 -> m0 m2 m1 m3: the pairs in 64-bit lanes */

__attribute__((target("avx2"))) static void nh_prepare_avx2(NHObject *o) {
    for (int p = 0; p < 4; p++)
        for (int j = 0; j < NH_CHUNK / 32; j++) {
            __m256i k = _mm256_loadu_si256((const __m256i *)(o->key + 8 * j + 4 * p));
            _mm256_storeu_si256((__m256i *)o->ka[p][j], _mm256_shuffle_epi32(k, NH_SHUF));
        }
}

/* NH of `units` 16-byte units of m (a whole chunk, or a message's or a row's short last one,
 * zero-padded to a whole unit), 32 bytes (two units) a step: (m + k) permuted is perm(m) + perm(k), so
 * the message is permuted once a step and the key once per session; each pass is an add, a shift,
 * one 32x32->64 multiply of four lanes (t0*t2, t1*t3 of each unit) and an accumulate; an odd last
 * unit goes through the scalar pass (the same bytes) */
__attribute__((target("avx2"), always_inline)) static inline void nh_pass_avx2(const NHObject *o, const uint8_t *m,
                                                                              size_t units, uint8_t *out) {
    const uint32_t(*ka)[NH_CHUNK / 32][8] = o->ka;
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0, t;
#define NH_PASS(acc, p)                                                                   \
    t = _mm256_add_epi32(x, _mm256_loadu_si256((const __m256i *)ka[p][j]));              \
    acc = _mm256_add_epi64(acc, _mm256_mul_epu32(t, _mm256_srli_epi64(t, 32)));
    for (size_t j = 0; j < units / 2; j++) {
        __m256i x = _mm256_shuffle_epi32(_mm256_loadu_si256((const __m256i *)(m + 32 * j)), NH_SHUF);
        NH_PASS(s0, 0)
        NH_PASS(s1, 1)
        NH_PASS(s2, 2)
        NH_PASS(s3, 3)
    }
#undef NH_PASS
    __m256i s[4] = {s0, s1, s2, s3};
    uint8_t last[NH_OUT];
    if (units & 1)
        nh_units(o->key + 4 * (units - 1), m + 16 * (units - 1), 1, last);
    for (int p = 0; p < 4; p++) {
        __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s[p]), _mm256_extracti128_si256(s[p], 1));
        uint64_t v = (uint64_t)_mm_cvtsi128_si64(h) + (uint64_t)_mm_extract_epi64(h, 1), w = 0;
        if (units & 1)
            memcpy(&w, last + 8 * p, 8);
        v += w;
        memcpy(out + 8 * p, &v, 8);
    }
}

/* `chunks` whole chunks, their outputs to out */
__attribute__((target("avx2"))) static void nh_chunks_avx2(const NHObject *o, const uint8_t *m, size_t chunks,
                                                             uint8_t *out) {
    for (size_t c = 0; c < chunks; c++, m += NH_CHUNK, out += NH_OUT)
        nh_pass_avx2(o, m, NH_UNITS, out);
}

/* a short chunk */
__attribute__((target("avx2"))) static void nh_part_avx2(const NHObject *o, const uint8_t *m, size_t units,
                                                           uint8_t *out) {
    nh_pass_avx2(o, m, units, out);
}
#endif

/* a short chunk: `units` whole units of m (zero-padded by the caller) */
static void nh_part(const NHObject *o, const uint8_t *m, size_t units, uint8_t *out) {
#ifdef NH_X86
    if (o->simd) {
        nh_part_avx2(o, m, units, out);
        return;
    }
#endif
    nh_units(o->key, m, units, out);
}

/* `chunks` whole chunks of m, their outputs to out (room for them all) */
static void nh_chunks(const NHObject *o, const uint8_t *m, size_t chunks, uint8_t *out) {
#ifdef NH_X86
    if (o->simd) {
        nh_chunks_avx2(o, m, chunks, out);
        return;
    }
#endif
    for (size_t c = 0; c < chunks; c++)
        nh_units(o->key, m + c * NH_CHUNK, NH_UNITS, out + c * NH_OUT);
}

static void nh_flush(NHObject *o) {
    if (o->nout && !o->failed && o->fn(o->ctx, o->out, o->nout * NH_OUT) != 1)
        o->failed = 1;
    o->nout = 0;
}

static inline uint8_t *nh_slot(NHObject *o) {
    if (o->nout == NH_BATCH)
        nh_flush(o);
    return o->out + NH_OUT * o->nout++;
}

/* called without the GIL */
static void nh_feed_plain(NHObject *o, const uint8_t *data, size_t n) {
    o->total += n;
    if (o->npart) {
        size_t take = NH_CHUNK - o->npart < n ? NH_CHUNK - o->npart : n;
        memcpy(o->part + o->npart, data, take);
        o->npart += take;
        data += take;
        n -= take;
        if (o->npart < NH_CHUNK)
            return;
        nh_chunks(o, o->part, 1, nh_slot(o));
        o->npart = 0;
    }
    while (n >= NH_CHUNK) {  /* as many whole chunks a call as the output batch has room for */
        if (o->nout == NH_BATCH)
            nh_flush(o);
        size_t k = n / NH_CHUNK < NH_BATCH - o->nout ? n / NH_CHUNK : NH_BATCH - o->nout;
        nh_chunks(o, data, k, o->out + NH_OUT * o->nout);
        o->nout += k;
        data += k * NH_CHUNK;
        n -= k * NH_CHUNK;
    }
    if (n) {
        memcpy(o->part, data, n);
        o->npart = n;
    }
}

/* a row's last chunk (zero-padded to a whole unit) and every output so far to fn: the row is done */
static void nh_end_row(NHObject *o) {
    if (o->npart) {
        size_t padded = (o->npart + 15) & ~(size_t)15;
        memset(o->part + o->npart, 0, padded - o->npart);
        nh_part(o, o->part, padded / 16, nh_slot(o));
        o->npart = 0;
    }
    nh_flush(o);
}

/* a row NH's outputs, as bytes of the frame's NH (its fn: set_rows points ctx at that NH; none, a failure) */
static int nh_sink(void *ctx, const unsigned char *data, size_t n) {
    if (ctx == NULL)
        return 0;
    nh_feed_plain((NHObject *)ctx, data, n);
    return 1;
}

/* called without the GIL: the frame's bytes, routed by the plan when the frame has row digests */
static void nh_feed(NHObject *o, const uint8_t *data, size_t n) {
    if (o->nplan == 0) {
        nh_feed_plain(o, data, n);
        return;
    }
    while (n) {
        while (o->seg < o->nplan && o->pos >= (uint64_t)o->plan[3 * o->seg + 1])
            o->seg++;
        size_t take = n;
        if (o->seg == o->nplan || o->pos < (uint64_t)o->plan[3 * o->seg]) {  /* bytes outside the rows: as they are */
            if (o->seg < o->nplan && (uint64_t)o->plan[3 * o->seg] - o->pos < take)
                take = (size_t)((uint64_t)o->plan[3 * o->seg] - o->pos);
            nh_feed_plain(o, data, take);
        } else {  /* a row's bytes to the row NH; its outputs follow into this NH at the row's end */
            uint64_t rb = (uint64_t)o->plan[3 * o->seg + 2], off = (o->pos - (uint64_t)o->plan[3 * o->seg]) % rb;
            if (rb - off < take)
                take = (size_t)(rb - off);
            nh_feed_plain(o->rows, data, take);
            if (off + take == rb)
                nh_end_row(o->rows);
        }
        o->pos += take;
        data += take;
        n -= take;
    }
}

static void nh_clear_rows(NHObject *o);

static int nh_init(NHObject *o, PyObject *args, PyObject *kw) {
    Py_buffer key;
    unsigned long long fn_addr, ctx_addr;
    int simd = 1, rows = 0;
    static char *names[] = {"key", "fn", "ctx", "simd", "rows", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*KK|pp", names, &key, &fn_addr, &ctx_addr, &simd, &rows))
        return -1;
    if (rows && fn_addr == 0 && ctx_addr == 0)  /* a row NH: its outputs go nowhere until set_rows gives it a frame's NH */
        fn_addr = (unsigned long long)(uintptr_t)nh_sink;
    else
        rows = 0;
    if (key.len != NH_KEY_WORDS * 4 || fn_addr == 0 || (ctx_addr == 0 && !rows)) {
        PyErr_Format(PyExc_ValueError, "NH(key, fn, ctx): a %d-byte key and non-null fn, ctx (got %zd bytes)",
                     NH_KEY_WORDS * 4, key.len);
        PyBuffer_Release(&key);
        return -1;
    }
    for (int i = 0; i < NH_KEY_WORDS; i++)
        o->key[i] = le32((const uint8_t *)key.buf + 4 * i);
    PyBuffer_Release(&key);
    o->simd = simd && nh_avx2_ok;
#ifdef NH_X86
    if (o->simd)
        nh_prepare_avx2(o);
#endif
    o->fn = (update_fn)(uintptr_t)fn_addr;
    o->ctx = (void *)(uintptr_t)ctx_addr;
    o->npart = o->nout = 0;
    o->total = 0;
    o->failed = 0;
    nh_clear_rows(o);
    return 0;
}

static int nh_unready(NHObject *o) {  /* made by NH.__new__ alone: no key, no Poly1305 to feed */
    if (o->fn != NULL)
        return 0;
    PyErr_SetString(PyExc_ValueError, "NH: not initialised (NH(key, fn, ctx) makes one)");
    return 1;
}

static PyObject *nh_failed(NHObject *o) {
    o->failed = 0;
    PyErr_SetString(PyExc_ValueError, "NH: the Poly1305 update of its outputs failed");
    return NULL;
}

static void nh_clear_rows(NHObject *o) {  /* the frame's plan ends: its bytes are plain again */
    PyMem_RawFree(o->plan);
    o->plan = NULL;
    o->nplan = o->seg = 0;
    o->pos = 0;
    if (o->rows != NULL)
        o->rows->npart = o->rows->nout = 0;
}

static PyObject *nh_reset(NHObject *o, PyObject *unused) {
    o->npart = o->nout = 0;
    o->total = 0;
    o->failed = 0;
    nh_clear_rows(o);
    Py_RETURN_NONE;
}

/* set_rows(rows, plan): the frame's block (fed from now on) has row regions: plan is int64 (k, 3),
 * (start, end, row_bytes) in the block, ascending, each a whole number of rows; their bytes go to
 * `rows` (an NH under the row key) row by row, each row's outputs into this NH in their place */
static PyObject *nh_set_rows(NHObject *o, PyObject *args) {
    PyObject *rows;
    Py_buffer b;
    if (nh_unready(o) || !PyArg_ParseTuple(args, "O!y*", &NHType, &rows, &b))
        return NULL;
    NHObject *r = (NHObject *)rows;
    const int64_t *t = b.buf;
    size_t k = (size_t)b.len / (3 * sizeof(int64_t));
    const char *bad = NULL;
    if (r == o || nh_unready(r))
        bad = "rows must be another, initialised NH";
    else if (b.len % (3 * sizeof(int64_t)) != 0 || k == 0)
        bad = "plan must be a non-empty int64 array of (start, end, row_bytes) triples";
    for (size_t i = 0; bad == NULL && i < k; i++)
        if (t[3 * i] < (i ? t[3 * i - 2] : 0) || t[3 * i + 1] <= t[3 * i] || t[3 * i + 2] <= 0 ||
            (t[3 * i + 1] - t[3 * i]) % t[3 * i + 2] != 0)
            bad = "plan's regions must ascend, not overlap, and each hold a whole number of rows";
    int64_t *plan = bad ? NULL : PyMem_RawMalloc((size_t)b.len);
    if (plan != NULL)
        memcpy(plan, t, (size_t)b.len);
    PyBuffer_Release(&b);
    if (bad != NULL) {
        PyErr_Format(PyExc_ValueError, "NH.set_rows: %s", bad);
        return NULL;
    }
    if (plan == NULL)
        return PyErr_NoMemory();
    nh_clear_rows(o);
    Py_INCREF(rows);
    Py_XSETREF(o->rows, r);
    r->fn = nh_sink;
    r->ctx = o;
    r->npart = r->nout = 0;
    o->plan = plan;
    o->nplan = k;
    Py_RETURN_NONE;
}

/* digest_rows(addresses, row_bytes, outs): the row digest of each row (row_bytes at each of
 * addresses, int64) written at outs (int64: room for ceil(row_bytes / 1024) * 32 bytes each) —
 * the bytes a frame's NH takes in a row's place (set_rows); memory the caller keeps alive */
static PyObject *nh_digest_rows(NHObject *o, PyObject *args) {
    Py_buffer a, w;
    Py_ssize_t rb;
    if (nh_unready(o) || !PyArg_ParseTuple(args, "y*ny*", &a, &rb, &w))
        return NULL;
    size_t n = (size_t)a.len / sizeof(int64_t);
    if (rb <= 0 || a.len % sizeof(int64_t) || w.len != a.len) {
        PyBuffer_Release(&a);
        PyBuffer_Release(&w);
        PyErr_Format(PyExc_ValueError, "NH.digest_rows: int64 addresses and outs of one length and row_bytes > 0 (got %zd)", rb);
        return NULL;
    }
    const int64_t *src = a.buf, *dst = w.buf;
    for (size_t i = 0; i < n; i++)
        if (src[i] == 0 || dst[i] == 0) {
            PyBuffer_Release(&a);
            PyBuffer_Release(&w);
            PyErr_Format(PyExc_ValueError, "NH.digest_rows: a null address (row %zu)", i);
            return NULL;
        }
    size_t whole = (size_t)rb / NH_CHUNK, rest = (size_t)rb % NH_CHUNK;
    Py_BEGIN_ALLOW_THREADS
    uint8_t last[NH_CHUNK];
    for (size_t i = 0; i < n; i++) {
        const uint8_t *m = (const uint8_t *)(uintptr_t)src[i];
        uint8_t *out = (uint8_t *)(uintptr_t)dst[i];
        nh_chunks(o, m, whole, out);
        if (rest) {
            size_t padded = (rest + 15) & ~(size_t)15;
            memcpy(last, m + whole * NH_CHUNK, rest);
            memset(last + rest, 0, padded - rest);
            nh_part(o, last, padded / 16, out + whole * NH_OUT);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&a);
    PyBuffer_Release(&w);
    Py_RETURN_NONE;
}

static void nh_dealloc(NHObject *o) {
    PyMem_RawFree(o->plan);
    if (o->rows != NULL && o->rows->ctx == o)  /* the row NH outlives this one: it feeds nothing now */
        o->rows->ctx = NULL;
    Py_XDECREF(o->rows);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyObject *nh_update(NHObject *o, PyObject *arg) {
    Py_buffer b;
    if (nh_unready(o))
        return NULL;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    nh_feed(o, b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    if (o->failed)
        return nh_failed(o);
    Py_RETURN_NONE;
}

static PyObject *nh_update_at(NHObject *o, PyObject *args) {
    unsigned long long a;
    if (nh_unready(o))
        return NULL;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "Kn", &a, &n))
        return NULL;
    if (n < 0 || (n > 0 && a == 0)) {
        PyErr_Format(PyExc_ValueError, "NH.update_at(%llu, %zd): a null address or a negative size", a, n);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    nh_feed(o, (const uint8_t *)(uintptr_t)a, (size_t)n);
    Py_END_ALLOW_THREADS
    if (o->failed)
        return nh_failed(o);
    Py_RETURN_NONE;
}

static PyObject *nh_finish(NHObject *o, PyObject *unused) {
    uint8_t len[8];
    if (nh_unready(o))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (o->npart) {
        size_t padded = (o->npart + 15) & ~(size_t)15;
        memset(o->part + o->npart, 0, padded - o->npart);
        nh_part(o, o->part, padded / 16, nh_slot(o));
    }
    nh_flush(o);
    put64(len, o->total);
    if (!o->failed && o->fn(o->ctx, len, 8) != 1)
        o->failed = 1;
    o->npart = 0;
    o->total = 0;
    Py_END_ALLOW_THREADS
    if (o->failed)
        return nh_failed(o);
    Py_RETURN_NONE;
}

static PyObject *nh_spans(NHObject *o, PyObject *spans) {
    Spans sp;
    if (nh_unready(o))
        return NULL;
    if (spans_parse(spans, &sp) == 0) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < sp.n; i++)
            if (sp.len[i])
                nh_feed(o, sp.addr[i], sp.len[i]);
        Py_END_ALLOW_THREADS
    }
    spans_release(&sp);
    if (PyErr_Occurred())
        return NULL;
    if (o->failed)
        return nh_failed(o);
    Py_RETURN_NONE;
}

static PyMethodDef nh_methods[] = {
    {"reset", (PyCFunction)nh_reset, METH_NOARGS, "reset(): start a message (drops what was fed, unfinished)."},
    {"update", (PyCFunction)nh_update, METH_O, "update(buffer): feed a bytes-like object, without the GIL."},
    {"update_at", (PyCFunction)nh_update_at, METH_VARARGS, "update_at(address, nbytes): feed memory the caller keeps alive."},
    {"update_spans", (PyCFunction)nh_spans, METH_O,
     "update_spans(spans): feed each (address, nbytes) tuple or bytes-like object, in order, without the GIL."},
    {"set_rows", (PyCFunction)nh_set_rows, METH_VARARGS,
     "set_rows(rows, plan): the frame's block fed from now on has row regions (int64 (start, end, row_bytes) triples): "
     "their rows go to the NH rows, each row's outputs into this one; until reset()."},
    {"digest_rows", (PyCFunction)nh_digest_rows, METH_VARARGS,
     "digest_rows(addresses, row_bytes, outs): each row's NH outputs (ceil(row_bytes / 1024) * 32 bytes) at outs, "
     "without the GIL."},
    {"finish", (PyCFunction)nh_finish, METH_NOARGS,
     "finish(): the last chunk and the length to the Poly1305 context; ready for the next message."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject NHType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gearflow.transport._mac.NH",
    .tp_basicsize = sizeof(NHObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "NH(key, fn, ctx, simd=True, rows=False): NH of a message's chunks into fn(ctx, data, n) (the frame's "
              "Poly1305); simd=False: the scalar pass (the same bytes); rows=True with fn = ctx = 0: a row NH (digest_rows, "
              "and another NH's set_rows).",
    .tp_methods = nh_methods,
    .tp_init = (initproc)nh_init,
    .tp_dealloc = (destructor)nh_dealloc,
    .tp_new = PyType_GenericNew,
};


/* ------------------------------------------------------------------ a big frame's block from the socket, MACed as it lands
 *
 * recv_into(fd, buffer, nh=None, piece=262144, cipher=None): fill buffer from a non-blocking socket without the
 * GIL, piece by piece, each piece fed to nh (the frame's NH) just after the kernel copied it in: the
 * MAC reads it from this core's cache, never from memory again, and no Python call or MAC thread
 * wakes per piece; with a cipher (gearflow's records under TLS) each piece is decrypted in place
 * first. The connection's wire thread runs it (transport/wire_io.py) on a duplicate of the
 * socket (shutdown() on it from another thread ends the call with an OSError).
 */
static int wire_wait(int fd, short events) {
    struct pollfd p = {fd, events, 0};
    for (;;) {
        int r = poll(&p, 1, -1);
        if (r > 0)
            return (p.revents & (POLLERR | POLLNVAL)) && !(p.revents & events) ? -1 : 0;
        if (r < 0 && errno != EINTR)
            return -1;
    }
}

static NHObject *wire_nh(PyObject *nh);

/* ------------------------------------------------------------------ the records' stream cipher
 *
 * gearflow's records under TLS (transport/records.py) encrypt every byte after the key exchange with
 * AES-128-CTR through libcrypto's EVP_EncryptUpdate, whose address records.py passes in (as
 * integrity.py passes EVP_MAC_update's): int (*)(void *ctx, unsigned char *out, int *outl,
 * const unsigned char *in, int inl), returning 1 on success. A CTR context is a keystream that goes
 * on where the last call stopped (partial blocks included), so pieces of any size chain.
 */
typedef int (*cipher_fn)(void *ctx, unsigned char *out, int *outl, const unsigned char *in, int inl);

typedef struct {
    cipher_fn fn;
    void *ctx;
} Cipher;

static int cipher_run(const Cipher *c, uint8_t *out, const uint8_t *in, size_t n) {
    while (n) {
        int take = n > (1u << 30) ? (1 << 30) : (int)n, outl = 0;
        if (c->fn(c->ctx, out, &outl, in, take) != 1 || outl != take)
            return -1;
        out += take, in += take, n -= (size_t)take;
    }
    return 0;
}

static int cipher_parse(PyObject *arg, Cipher *c) {  /* (fn, ctx) addresses, or None: 0 / 1 (none) / -1 */
    if (arg == NULL || arg == Py_None)
        return 1;
    unsigned long long fn = 0, ctx = 0;
    if (!PyTuple_Check(arg) || !PyArg_ParseTuple(arg, "KK", &fn, &ctx) || !fn || !ctx) {
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "cipher must be (EVP_EncryptUpdate address, EVP_CIPHER_CTX address), non-zero");
        }
        return -1;
    }
    c->fn = (cipher_fn)(uintptr_t)fn;
    c->ctx = (void *)(uintptr_t)ctx;
    return 0;
}

static PyObject *cipher_failed(void) {
    PyErr_SetString(PyExc_RuntimeError, "EVP_EncryptUpdate failed (the records' stream cipher)");
    return NULL;
}

/* xor_spans(cipher, spans, out): the spans' bytes (as update_spans takes them), in order, through the
 * cipher into out (a writable buffer of exactly their total size); without the GIL. */
static PyObject *xor_spans(PyObject *self, PyObject *args) {
    PyObject *carg, *spans;
    Py_buffer out;
    Cipher c;
    Spans sp;
    if (!PyArg_ParseTuple(args, "OOw*", &carg, &spans, &out))
        return NULL;
    if (cipher_parse(carg, &c) != 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "xor_spans: a cipher is needed");
        PyBuffer_Release(&out);
        return NULL;
    }
    if (spans_parse(spans, &sp) < 0) {
        spans_release(&sp);
        PyBuffer_Release(&out);
        return NULL;
    }
    size_t total = 0;
    for (Py_ssize_t i = 0; i < sp.n; i++)
        total += sp.len[i];
    int bad = 0;
    if (total != (size_t)out.len) {
        PyErr_Format(PyExc_ValueError, "xor_spans: spans of %zu bytes into a buffer of %zd", total, out.len);
        bad = 1;
    } else {
        Py_BEGIN_ALLOW_THREADS
        uint8_t *o = out.buf;
        for (Py_ssize_t i = 0; i < sp.n && !bad; i++) {
            bad = cipher_run(&c, o, sp.addr[i], sp.len[i]) != 0;
            o += sp.len[i];
        }
        Py_END_ALLOW_THREADS
        if (bad)
            cipher_failed();
    }
    spans_release(&sp);
    PyBuffer_Release(&out);
    if (bad)
        return NULL;
    Py_RETURN_NONE;
}

/* xor_spans_ahead(cipher, spans, out, progress, piece): xor_spans, storing after each piece of out
 * the bytes done so far into progress (an int64, release order; -1 on a failure): a thread encrypts a
 * frame ahead while another writes what is done (wait_progress). */
static PyObject *xor_spans_ahead(PyObject *self, PyObject *args) {
    PyObject *carg, *spans;
    Py_buffer out, prog;
    Py_ssize_t piece;
    Cipher c;
    Spans sp;
    if (!PyArg_ParseTuple(args, "OOw*w*n", &carg, &spans, &out, &prog, &piece))
        return NULL;
    int bad = 0;
    if (cipher_parse(carg, &c) != 0 || prog.len < (Py_ssize_t)sizeof(int64_t) || piece < 4096) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "xor_spans_ahead: a cipher, an int64 progress and a piece >= 4096 are needed");
        PyBuffer_Release(&out);
        PyBuffer_Release(&prog);
        return NULL;
    }
    if (spans_parse(spans, &sp) < 0) {
        spans_release(&sp);
        PyBuffer_Release(&out);
        PyBuffer_Release(&prog);
        return NULL;
    }
    size_t total = 0;
    for (Py_ssize_t i = 0; i < sp.n; i++)
        total += sp.len[i];
    int64_t *done = (int64_t *)prog.buf;
    if (total != (size_t)out.len) {
        PyErr_Format(PyExc_ValueError, "xor_spans_ahead: spans of %zu bytes into a buffer of %zd", total, out.len);
        __atomic_store_n(done, -1, __ATOMIC_RELEASE);
        bad = 2;
    } else {
        Py_BEGIN_ALLOW_THREADS
        uint8_t *o = out.buf;
        size_t at = 0, mark = (size_t)piece;
        for (Py_ssize_t i = 0; i < sp.n && !bad; i++) {
            const uint8_t *src = sp.addr[i];
            size_t left = sp.len[i];
            while (left && !bad) {  /* up to the next piece boundary, then say so */
                size_t take = mark - at < left ? mark - at : left;
                bad = cipher_run(&c, o + at, src, take) != 0;
                at += take, src += take, left -= take;
                if (at == mark) {
                    __atomic_store_n(done, (int64_t)at, __ATOMIC_RELEASE);
                    mark += (size_t)piece;
                }
            }
        }
        __atomic_store_n(done, bad ? (int64_t)-1 : (int64_t)at, __ATOMIC_RELEASE);
        Py_END_ALLOW_THREADS
        if (bad)
            cipher_failed();
    }
    spans_release(&sp);
    PyBuffer_Release(&out);
    PyBuffer_Release(&prog);
    if (bad)
        return NULL;
    Py_RETURN_NONE;
}

/* wait_progress(progress, at_least): progress's value once it is >= at_least or < 0 (a failure),
 * waiting without the GIL (the writer of a frame encrypted ahead by xor_spans_ahead). */
static PyObject *wait_progress(PyObject *self, PyObject *args) {
    Py_buffer prog;
    long long want;
    if (!PyArg_ParseTuple(args, "w*L", &prog, &want))
        return NULL;
    if (prog.len < (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(&prog);
        PyErr_SetString(PyExc_ValueError, "wait_progress: progress must be an int64");
        return NULL;
    }
    int64_t *done = (int64_t *)prog.buf, v = __atomic_load_n(done, __ATOMIC_ACQUIRE);
    if (v >= 0 && v < want) {
        Py_BEGIN_ALLOW_THREADS
        struct timespec ts = {0, 5000};  /* a piece is ~30 us of AES: poll at 5 us */
        while ((v = __atomic_load_n(done, __ATOMIC_ACQUIRE)) >= 0 && v < want)
            nanosleep(&ts, NULL);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&prog);
    return PyLong_FromLongLong((long long)v);
}

/* xor_inplace(cipher, buffer): the buffer through the cipher, in place; without the GIL. */
static PyObject *xor_inplace(PyObject *self, PyObject *args) {
    PyObject *carg;
    Py_buffer b;
    Cipher c;
    if (!PyArg_ParseTuple(args, "Ow*", &carg, &b))
        return NULL;
    if (cipher_parse(carg, &c) != 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "xor_inplace: a cipher is needed");
        PyBuffer_Release(&b);
        return NULL;
    }
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = cipher_run(&c, b.buf, b.buf, (size_t)b.len) != 0;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    if (bad)
        return cipher_failed();
    Py_RETURN_NONE;
}

static PyObject *recv_into(PyObject *self, PyObject *args, PyObject *kw) {
    int fd;
    PyObject *nh_arg = Py_None, *cipher_arg = Py_None;
    Py_buffer b;
    Py_ssize_t piece = 256 << 10;
    Cipher cipher;
    static char *names[] = {"fd", "buffer", "nh", "piece", "cipher", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iw*|OnO", names, &fd, &b, &nh_arg, &piece, &cipher_arg))
        return NULL;
    if (piece < 4096) {
        PyBuffer_Release(&b);
        PyErr_Format(PyExc_ValueError, "recv_into: piece must be >= 4096 bytes, got %zd", piece);
        return NULL;
    }
    int has_cipher = cipher_parse(cipher_arg, &cipher);
    if (has_cipher < 0) {
        PyBuffer_Release(&b);
        return NULL;
    }
    has_cipher = has_cipher == 0;
    NHObject *nh = wire_nh(nh_arg);
    if (nh == NULL && nh_arg != Py_None) {
        PyBuffer_Release(&b);
        return NULL;
    }
    int err = 0, eof = 0, bad = 0;
    size_t got = 0, n = (size_t)b.len;
    uint8_t *p = b.buf;
    Py_BEGIN_ALLOW_THREADS
    while (got < n) {
        size_t want = n - got < (size_t)piece ? n - got : (size_t)piece;
        ssize_t r = recv(fd, p + got, want, MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if ((errno == EAGAIN || errno == EWOULDBLOCK) && wire_wait(fd, POLLIN) == 0)
                continue;
            err = errno ? errno : ECONNRESET;
            break;
        }
        if (r == 0) {
            eof = 1;
            break;
        }
        if (has_cipher && cipher_run(&cipher, p + got, p + got, (size_t)r) != 0) {  /* decrypted in cache */
            bad = 1;
            break;
        }
        if (nh != NULL)  /* the MAC reads the piece the kernel just wrote, in this core's cache */
            nh_feed(nh, p + got, (size_t)r);
        got += (size_t)r;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    if (bad)
        return cipher_failed();
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (eof)
        return PyErr_Format(PyExc_ConnectionResetError, "recv_into: the peer closed the connection %zu bytes into %zu", got, n);
    if (nh != NULL && nh->failed)
        return nh_failed(nh);
    Py_RETURN_NONE;
}

static NHObject *wire_nh(PyObject *nh) {
    if (nh == Py_None)
        return NULL;
    if (!PyObject_TypeCheck(nh, &NHType)) {
        PyErr_Format(PyExc_TypeError, "nh must be a _mac.NH or None, got %.80s", Py_TYPE(nh)->tp_name);
        return NULL;
    }
    if (nh_unready((NHObject *)nh))
        return NULL;
    return (NHObject *)nh;
}

static PyObject *avx2(PyObject *self, PyObject *unused) { return PyBool_FromLong(nh_avx2_ok); }

static PyMethodDef methods[] = {
    {"avx2", avx2, METH_NOARGS, "avx2(): whether NH runs its AVX2 pass on this CPU."},
    {"recv_into", (PyCFunction)(void (*)(void))recv_into, METH_VARARGS | METH_KEYWORDS,
     "recv_into(fd, buffer, nh=None, piece=262144, cipher=None): fill buffer from the non-blocking socket fd without "
     "the GIL; cipher: each piece decrypted as it lands, nh: then MACed. ConnectionResetError at the peer's end of stream, OSError on a socket error."},
    {"xor_spans", xor_spans, METH_VARARGS,
     "xor_spans(cipher, spans, out): the spans' bytes through the stream cipher (fn, ctx) into out, without the GIL."},
    {"xor_spans_ahead", xor_spans_ahead, METH_VARARGS,
     "xor_spans_ahead(cipher, spans, out, progress, piece): xor_spans, storing the bytes done into progress "
     "(int64) after each piece, -1 on a failure; without the GIL."},
    {"wait_progress", wait_progress, METH_VARARGS,
     "wait_progress(progress, at_least): progress once it is >= at_least or < 0, waiting without the GIL."},
    {"xor_inplace", xor_inplace, METH_VARARGS,
     "xor_inplace(cipher, buffer): buffer through the stream cipher (fn, ctx), in place, without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mac", NULL, -1, methods};

PyMODINIT_FUNC PyInit__mac(void) {
#ifdef NH_X86
    __builtin_cpu_init();
    nh_avx2_ok = __builtin_cpu_supports("avx2");
#endif
    if (PyType_Ready(&NHType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&NHType);
    if (PyModule_AddObject(m, "NH", (PyObject *)&NHType) < 0) {
        Py_DECREF(&NHType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "NH_CHUNK", NH_CHUNK) < 0 || PyModule_AddIntConstant(m, "NH_KEY_BYTES", NH_KEY_WORDS * 4) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
