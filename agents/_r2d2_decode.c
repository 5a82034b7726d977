/* One-token decode step of a small pre-LayerNorm causal transformer with ALiBi, on the CPU.
 *
 * The cached actors (agents/kv_cache.py) run, per env step, the network on one new token
 * per env against that env's cached keys and values. With a model of d_model 64 and two
 * blocks the arithmetic is a few hundred thousand multiply-adds per recv; TorchScript spends
 * most of its ~150-190 us on the ~60 operator calls around it. This module runs the whole
 * step in one call, with no allocation besides one scratch block:
 *
 *   x = W_in · obs + b_in                                  (optional input projection)
 *   per block l:  h = LN1(x);  q, k, v = W_qkv · h + b
 *                 kv[e, l, :, :, s] = k, v                   (s = length: the token's slot)
 *                 y_h = softmax_j(q_h · k_hj / sqrt(hs) − slope_h · (s − j)) · v_hj,  j ≤ s
 *                 x += W_proj · y + b;  x += W2 · GELU(W1 · LN2(x) + b1) + b2
 *   out = W_head · LN(x) + b_head
 *
 * Layouts are those of the torch modules (nn.Linear weight: out × in, row-major) and of
 * agents.kv_cache.KVCache.kv: (E, L, 2, nh, S, hs) float32, C-contiguous. The weights are
 * read in place (the plan holds buffer views of the torch parameters), so a weight sync that
 * copies into the parameters reaches the next step. agents/r2d2_accel.py checks the
 * step against its TorchScript and eager references before acting with it
 * (tests/test_native_decode.py holds the three equal).
 *
 * Numerics: float32 throughout, sums in another order than torch's, GELU's erf and the
 * softmax's exp by the polynomials below (errors ~1e-7 absolute): Q-values agree with torch to
 * float rounding (~1e-6 relative), as two BLAS libraries would.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
/* AVX2 + FMA where the CPU has them (picked at load time), SSE2 elsewhere */
#define WIDE __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define WIDE
#endif

#define N_LAYER_W 12 /* ln1 w, b; qkv w, b; proj w, b; ln2 w, b; fc1 w, b; fc2 w, b */

typedef struct {
    const float *ln1w, *ln1b, *qkvw, *qkvb, *projw, *projb, *ln2w, *ln2b, *fc1w, *fc1b, *fc2w, *fc2b;
} layer_t;

typedef struct {
    int L, D, nh, hs, F, A, in_dim, has_in;
    float eps;
    const float *inw, *inb, *lnw, *lnb, *headw, *headb, *slopes;
    layer_t *layers;
    Py_buffer *bufs;
    int nbufs;
} plan_t;

/* ------------------------------------------------------------------ math */

/* e^x for x <= 0 (softmax after max subtraction) and the GELU range: Cephes' range reduction
 * x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n by the exponent bits.
 * Written without branches so that the loops around it vectorise. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } u;
    u.i = ((int32_t)n + 127) << 23;
    return p * u.f;
}

/* erf by Abramowitz & Stegun 7.1.26 (absolute error <= 1.5e-7). */
static inline float erf_approx(float x) {
    float a = fabsf(x);
    float t = 1.0f / (1.0f + 0.3275911f * a);
    float y = ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t + 0.254829592f) * t;
    y = 1.0f - y * exp_approx(-a * a);
    return x < 0 ? -y : y;
}

/* y[r, o] (+)= b[o] + sum_i W[o, i] x[r, i] for rows r < R; weight rows read once per 4 rows. */
WIDE static void linear(const float *W, const float *b, const float *x, int R, int in, int out, float *y, int add) {
    for (int o = 0; o < out; o++) {
        const float *w = W + (size_t)o * in;
        int r = 0;
        for (; r + 4 <= R; r += 4) {
            const float *x0 = x + (size_t)r * in, *x1 = x0 + in, *x2 = x1 + in, *x3 = x2 + in;
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int i = 0; i < in; i++) {
                float wi = w[i];
                s0 += wi * x0[i];
                s1 += wi * x1[i];
                s2 += wi * x2[i];
                s3 += wi * x3[i];
            }
            float bo = b[o];
            float *yo = y + (size_t)r * out + o;
            if (add) {
                yo[0] += s0 + bo; yo[out] += s1 + bo; yo[2 * out] += s2 + bo; yo[3 * out] += s3 + bo;
            } else {
                yo[0] = s0 + bo; yo[out] = s1 + bo; yo[2 * out] = s2 + bo; yo[3 * out] = s3 + bo;
            }
        }
        for (; r < R; r++) {
            const float *xr = x + (size_t)r * in;
            float s = 0;
#pragma omp simd reduction(+ : s)
            for (int i = 0; i < in; i++) s += w[i] * xr[i];
            float *yo = y + (size_t)r * out + o;
            *yo = (add ? *yo : 0.0f) + s + b[o];
        }
    }
}

WIDE static void layer_norm(const float *x, const float *g, const float *b, int R, int D, float eps, float *y) {
    for (int r = 0; r < R; r++) {
        const float *xr = x + (size_t)r * D;
        float *yr = y + (size_t)r * D;
        float mean = 0, var = 0;
#pragma omp simd reduction(+ : mean)
        for (int i = 0; i < D; i++) mean += xr[i];
        mean /= D;
#pragma omp simd reduction(+ : var)
        for (int i = 0; i < D; i++) var += (xr[i] - mean) * (xr[i] - mean);
        float inv = 1.0f / sqrtf(var / D + eps);
#pragma omp simd
        for (int i = 0; i < D; i++) yr[i] = (xr[i] - mean) * inv * g[i] + b[i];
    }
}

/* ------------------------------------------------------------------ the step */

/* kv of env e, layer l, part c (0 keys, 1 values), head h: S × hs floats */
#define KV_AT(kv, e, l, c, h) ((kv) + ((((size_t)(e) * P->L + (l)) * 2 + (c)) * P->nh + (h)) * (size_t)S * P->hs)

WIDE static void run_step(const plan_t *P, const float *inp, float *kv, int64_t S, const int64_t *ids,
                     const int64_t *length, int R, float *out, float *scratch) {
    const int D = P->D, nh = P->nh, hs = P->hs, F = P->F;
    float *x = scratch, *h = x + (size_t)R * D, *qkv = h + (size_t)R * D, *y = qkv + (size_t)R * 3 * D;
    float *m = y + (size_t)R * D, *sc = m + (size_t)R * F; /* sc: S scores */
    const float scale = 1.0f / sqrtf((float)hs);
    if (P->has_in)
        linear(P->inw, P->inb, inp, R, P->in_dim, D, x, 0);
    else
        memcpy(x, inp, sizeof(float) * (size_t)R * D);
    for (int l = 0; l < P->L; l++) {
        const layer_t *Ly = &P->layers[l];
        layer_norm(x, Ly->ln1w, Ly->ln1b, R, D, P->eps, h);
        linear(Ly->qkvw, Ly->qkvb, h, R, D, 3 * D, qkv, 0);
        for (int r = 0; r < R; r++) {
            const int64_t e = ids[r], s = length[r];
            const float *q = qkv + (size_t)r * 3 * D;
            float *yr = y + (size_t)r * D;
            for (int hd = 0; hd < nh; hd++) {
                float *K = KV_AT(kv, e, l, 0, hd), *V = KV_AT(kv, e, l, 1, hd);
                memcpy(K + s * hs, q + D + hd * hs, sizeof(float) * hs);     /* the token's key */
                memcpy(V + s * hs, q + 2 * D + hd * hs, sizeof(float) * hs); /* and value, slot s */
                const float *qh = q + hd * hs;
                const float slope = P->slopes[hd];
                float mx = -INFINITY;
                for (int64_t j = 0; j <= s; j++) {
                    const float *kj = K + j * hs;
                    float d = 0;
#pragma omp simd reduction(+ : d)
                    for (int i = 0; i < hs; i++) d += qh[i] * kj[i];
                    d = d * scale - slope * (float)(s - j);
                    sc[j] = d;
                    mx = d > mx ? d : mx;
                }
                float total = 0;
#pragma omp simd reduction(+ : total)
                for (int64_t j = 0; j <= s; j++) {
                    sc[j] = exp_approx(sc[j] - mx);
                    total += sc[j];
                }
                float *yh = yr + hd * hs;
                for (int i = 0; i < hs; i++) yh[i] = 0;
                for (int64_t j = 0; j <= s; j++) {
                    const float p = sc[j] / total, *vj = V + j * hs;
#pragma omp simd
                    for (int i = 0; i < hs; i++) yh[i] += p * vj[i];
                }
            }
        }
        linear(Ly->projw, Ly->projb, y, R, D, D, x, 1);
        layer_norm(x, Ly->ln2w, Ly->ln2b, R, D, P->eps, h);
        linear(Ly->fc1w, Ly->fc1b, h, R, D, F, m, 0);
        const size_t RF = (size_t)R * F;
#pragma omp simd
        for (size_t i = 0; i < RF; i++) m[i] = 0.5f * m[i] * (1.0f + erf_approx(m[i] * 0.70710678118654752f));
        linear(Ly->fc2w, Ly->fc2b, m, R, F, D, x, 1);
    }
    layer_norm(x, P->lnw, P->lnb, R, D, P->eps, h);
    linear(P->headw, P->headb, h, R, D, P->A, out, 0);
}

/* ------------------------------------------------------------------ Python */

static void plan_free(PyObject *capsule) {
    plan_t *P = (plan_t *)PyCapsule_GetPointer(capsule, "agents._r2d2_decode.plan");
    if (P == NULL) return;
    for (int i = 0; i < P->nbufs; i++)
        if (P->bufs[i].obj != NULL) PyBuffer_Release(&P->bufs[i]);
    free(P->bufs);
    free(P->layers);
    free(P);
}

/* A float32 C-contiguous buffer of exactly n floats, held by the plan. */
static const float *hold(plan_t *P, PyObject *obj, Py_ssize_t n, const char *what, int index) {
    Py_buffer *b = &P->bufs[P->nbufs];
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    P->nbufs++;
    if (b->itemsize != 4 || b->format == NULL || strcmp(b->format, "f") != 0) {
        PyErr_Format(PyExc_TypeError, "plan: weight %d (%s) must be float32, got format %s", index, what,
                     b->format ? b->format : "?");
        return NULL;
    }
    if (b->len != n * 4) {
        PyErr_Format(PyExc_ValueError, "plan: weight %d (%s) has %zd floats, expected %zd", index, what,
                     b->len / 4, n);
        return NULL;
    }
    return (const float *)b->buf;
}

static PyObject *make_plan(PyObject *self, PyObject *args) {
    PyObject *weights;
    int L, D, nh, F, A, in_dim;
    float eps;
    if (!PyArg_ParseTuple(args, "O!iiiiiif", &PyTuple_Type, &weights, &L, &D, &nh, &F, &A, &in_dim, &eps))
        return NULL;
    if (L < 1 || D < 1 || nh < 1 || D % nh || F < 1 || A < 1 || in_dim < 0) {
        PyErr_Format(PyExc_ValueError, "plan: bad sizes L=%d D=%d nh=%d F=%d A=%d in_dim=%d", L, D, nh, F, A, in_dim);
        return NULL;
    }
    const Py_ssize_t want = 2 + (Py_ssize_t)L * N_LAYER_W + 5;
    if (PyTuple_GET_SIZE(weights) != want) {
        PyErr_Format(PyExc_ValueError, "plan: %zd weights for %d layers, expected %zd", PyTuple_GET_SIZE(weights),
                     L, want);
        return NULL;
    }
    plan_t *P = calloc(1, sizeof(plan_t));
    if (P == NULL) return PyErr_NoMemory();
    P->layers = calloc(L, sizeof(layer_t));
    P->bufs = calloc(want, sizeof(Py_buffer));
    PyObject *capsule = NULL;
    if (P->layers == NULL || P->bufs == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    P->L = L, P->D = D, P->nh = nh, P->hs = D / nh, P->F = F, P->A = A, P->eps = eps;
    P->has_in = in_dim > 0, P->in_dim = in_dim > 0 ? in_dim : D;
    int k = 0;
#define TAKE(dst, n, what)                                                                    \
    do {                                                                                      \
        if (((dst) = hold(P, PyTuple_GET_ITEM(weights, k), (n), (what), k)) == NULL) goto fail; \
        k++;                                                                                  \
    } while (0)
    if (P->has_in) {
        TAKE(P->inw, (Py_ssize_t)D * in_dim, "input weight");
        TAKE(P->inb, D, "input bias");
    } else {
        if (PyTuple_GET_ITEM(weights, 0) != Py_None || PyTuple_GET_ITEM(weights, 1) != Py_None) {
            PyErr_SetString(PyExc_ValueError, "plan: in_dim=0 takes None for the input weight and bias");
            goto fail;
        }
        k = 2;
    }
    for (int l = 0; l < L; l++) {
        layer_t *Ly = &P->layers[l];
        TAKE(Ly->ln1w, D, "ln1 weight");
        TAKE(Ly->ln1b, D, "ln1 bias");
        TAKE(Ly->qkvw, (Py_ssize_t)3 * D * D, "qkv weight");
        TAKE(Ly->qkvb, 3 * D, "qkv bias");
        TAKE(Ly->projw, (Py_ssize_t)D * D, "proj weight");
        TAKE(Ly->projb, D, "proj bias");
        TAKE(Ly->ln2w, D, "ln2 weight");
        TAKE(Ly->ln2b, D, "ln2 bias");
        TAKE(Ly->fc1w, (Py_ssize_t)F * D, "fc1 weight");
        TAKE(Ly->fc1b, F, "fc1 bias");
        TAKE(Ly->fc2w, (Py_ssize_t)D * F, "fc2 weight");
        TAKE(Ly->fc2b, D, "fc2 bias");
    }
    TAKE(P->lnw, D, "final ln weight");
    TAKE(P->lnb, D, "final ln bias");
    TAKE(P->headw, (Py_ssize_t)A * D, "head weight");
    TAKE(P->headb, A, "head bias");
    TAKE(P->slopes, nh, "alibi slopes");
#undef TAKE
    capsule = PyCapsule_New(P, "agents._r2d2_decode.plan", plan_free);
    if (capsule == NULL) goto fail;
    return capsule;
fail:
    for (int i = 0; i < P->nbufs; i++) PyBuffer_Release(&P->bufs[i]);
    free(P->bufs);
    free(P->layers);
    free(P);
    return NULL;
}

static PyObject *step(PyObject *self, PyObject *args) {
    PyObject *capsule, *o_inp, *o_kv, *o_ids, *o_len, *o_out;
    if (!PyArg_ParseTuple(args, "OOOOOO", &capsule, &o_inp, &o_kv, &o_ids, &o_len, &o_out)) return NULL;
    plan_t *P = (plan_t *)PyCapsule_GetPointer(capsule, "agents._r2d2_decode.plan");
    if (P == NULL) return NULL;
    Py_buffer inp = {0}, kv = {0}, ids = {0}, len = {0}, out = {0};
    PyObject *ret = NULL;
    float *scratch = NULL;
    if (PyObject_GetBuffer(o_inp, &inp, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0 ||
        PyObject_GetBuffer(o_kv, &kv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0 ||
        PyObject_GetBuffer(o_ids, &ids, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0 ||
        PyObject_GetBuffer(o_len, &len, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0 ||
        PyObject_GetBuffer(o_out, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        goto done;
    if (strcmp(inp.format, "f") || strcmp(kv.format, "f") || strcmp(out.format, "f")) {
        PyErr_SetString(PyExc_TypeError, "step: inp, kv and out must be float32");
        goto done;
    }
    if (ids.itemsize != 8 || len.itemsize != 8 || (ids.format[0] != 'l' && ids.format[0] != 'q') ||
        (len.format[0] != 'l' && len.format[0] != 'q')) {
        PyErr_SetString(PyExc_TypeError, "step: ids and length must be int64");
        goto done;
    }
    const Py_ssize_t R = ids.len / 8;
    if (len.len / 8 != R || inp.len != R * P->in_dim * 4 || out.len != R * P->A * 4) {
        PyErr_Format(PyExc_ValueError, "step: %zd ids, %zd lengths, inp of %zd floats (want %zd), out of %zd (want %zd)",
                     R, len.len / 8, inp.len / 4, R * P->in_dim, out.len / 4, R * P->A);
        goto done;
    }
    if (kv.ndim != 6 || kv.shape[1] != P->L || kv.shape[2] != 2 || kv.shape[3] != P->nh || kv.shape[5] != P->hs) {
        PyErr_Format(PyExc_ValueError, "step: kv must be (E, %d, 2, %d, S, %d) float32", P->L, P->nh, P->hs);
        goto done;
    }
    const int64_t E = kv.shape[0], S = kv.shape[4];
    const int64_t *pi = ids.buf, *pl = len.buf;
    if (R == 0) goto ok;
    /* one block: the step's scratch floats, then a byte per env (which envs this call has) */
    const size_t n = (size_t)R * (3 * P->D + 3 * P->D + P->F) + (size_t)S + 16;
    scratch = malloc(sizeof(float) * n + (size_t)E);
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned char *seen = (unsigned char *)(scratch + n);
    memset(seen, 0, (size_t)E);
    for (Py_ssize_t r = 0; r < R; r++) {
        if (pi[r] < 0 || pi[r] >= E || pl[r] < 0 || pl[r] >= S) {
            PyErr_Format(PyExc_ValueError, "step: row %zd: env %lld of %lld, slot %lld of %lld", r, (long long)pi[r],
                         (long long)E, (long long)pl[r], (long long)S);
            goto done;
        }
        if (seen[pi[r]]++) {
            PyErr_Format(PyExc_ValueError, "step: env %lld appears twice", (long long)pi[r]);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    run_step(P, inp.buf, kv.buf, S, pi, pl, (int)R, out.buf, scratch);
    Py_END_ALLOW_THREADS
ok:
    ret = Py_None;
    Py_INCREF(ret);
done:
    free(scratch);
    if (inp.obj) PyBuffer_Release(&inp);
    if (kv.obj) PyBuffer_Release(&kv);
    if (ids.obj) PyBuffer_Release(&ids);
    if (len.obj) PyBuffer_Release(&len);
    if (out.obj) PyBuffer_Release(&out);
    return ret;
}

static PyMethodDef methods[] = {
    {"plan", make_plan, METH_VARARGS,
     "plan(weights, L, D, nh, F, A, in_dim, eps) -> plan: views of the weights (float32, torch layouts; "
     "in_dim 0: no input projection, its two weights None)"},
    {"step", step, METH_VARARGS,
     "step(plan, inp, kv, ids, length, out): one new token per row: its keys/values into kv[ids, :, :, :, "
     "length], Q-values into out (R, A)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_r2d2_decode", "One-token transformer decode step (CPU).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__r2d2_decode(void) { return PyModule_Create(&module); }
