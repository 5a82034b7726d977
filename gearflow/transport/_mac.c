/* The frame MAC's one call per frame (gearflow/transport/integrity.py).
 *
 * update_spans(fn, ctx, spans): calls fn(ctx, data, nbytes) -- libcrypto's EVP_MAC_update, whose
 * address integrity.py takes from the libcrypto Python's ssl module loaded -- once per span of
 * `spans`, in order, with the GIL released around the whole loop. A span is an (address, nbytes)
 * tuple (memory the caller keeps alive: rows of a shared-memory segment) or an object with the
 * buffer protocol (bytes, a C-contiguous memoryview or numpy array). A sample reply of 256 rows
 * is ~520 spans: one Python call and one GIL hand-off instead of ~520 of each, so a MAC thread
 * runs beside the loop thread that writes the same bytes without waiting on it for the GIL.
 *
 * No OpenSSL header is needed: fn is int (*)(void *ctx, const unsigned char *data, size_t n),
 * EVP_MAC_update's signature (OpenSSL >= 3), returning 1 on success.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef int (*update_fn)(void *ctx, const unsigned char *data, size_t n);

static PyObject *update_spans(PyObject *self, PyObject *args) {
    unsigned long long fn_addr, ctx_addr;
    PyObject *spans;
    if (!PyArg_ParseTuple(args, "KKO", &fn_addr, &ctx_addr, &spans))
        return NULL;
    if (fn_addr == 0 || ctx_addr == 0) {
        PyErr_SetString(PyExc_ValueError, "update_spans: a null function or context");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(spans, "update_spans: spans must be a list");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    const unsigned char **addr = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(*addr));
    size_t *len = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(*len));
    Py_buffer *views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    Py_ssize_t nviews = 0, i;
    int failed_at = -1;
    if (addr == NULL || len == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++) {
        PyObject *s = items[i];
        if (PyTuple_CheckExact(s) && PyTuple_GET_SIZE(s) == 2) {
            unsigned long long a = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(s, 0));
            Py_ssize_t m = PyLong_AsSsize_t(PyTuple_GET_ITEM(s, 1));
            if (PyErr_Occurred())
                goto done;
            if (m < 0 || (m > 0 && a == 0)) {
                PyErr_Format(PyExc_ValueError, "update_spans: span %zd is (%llu, %zd)", i, a, m);
                goto done;
            }
            addr[i] = (const unsigned char *)(uintptr_t)a;
            len[i] = (size_t)m;
        } else {
            if (PyObject_GetBuffer(s, &views[nviews], PyBUF_SIMPLE) < 0)
                goto done;
            addr[i] = views[nviews].buf;
            len[i] = (size_t)views[nviews].len;
            nviews++;
        }
    }
    {
        update_fn fn = (update_fn)(uintptr_t)fn_addr;
        void *ctx = (void *)(uintptr_t)ctx_addr;
        Py_BEGIN_ALLOW_THREADS
        for (i = 0; i < n; i++) {
            if (len[i] && fn(ctx, addr[i], len[i]) != 1) {
                failed_at = (int)i;
                break;
            }
        }
        Py_END_ALLOW_THREADS
    }
    if (failed_at >= 0)
        PyErr_Format(PyExc_ValueError, "update_spans: the MAC update of span %d failed", failed_at);
done:
    for (i = 0; i < nviews; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(addr);
    PyMem_Free(len);
    PyMem_Free(views);
    Py_DECREF(seq);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"update_spans", update_spans, METH_VARARGS,
     "update_spans(fn, ctx, spans): fn(ctx, data, n) for each span, in order, without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mac", NULL, -1, methods};

PyMODINIT_FUNC PyInit__mac(void) { return PyModule_Create(&module); }
