/* The replay hot path in C: sum-tree descent/update, proportional sampling,
 * and the row indices of sequence windows.
 *
 * The tree is the same object the numpy path uses: a tuple of C-contiguous
 * float64 arrays, levels[0] the root (1 node), levels[-1] the leaves; node j of
 * level d has children j*F .. j*F+F-1 on level d+1. These loops replace a
 * handful of numpy calls per level (about 20 us per level for a batch of 256)
 * with a pointer walk (well under 1 us per item), which is what the Python
 * per-call overhead cannot reach. The numpy path stays as the reference and
 * the fallback when this module was not built.
 *
 *   find(levels, fanout, targets: float64[B], out: int64[B])
 *       leaf holding each cumulative-mass target: at each node the last child
 *       with nonzero mass whose exclusive prefix sum is <= the remaining target
 *       (so a target at/after the total lands on the last nonzero leaf).
 *   set(levels, fanout, indices: int64[n] sorted unique, values: float64[n])
 *       set leaves, then recompute every ancestor as the sum of its children.
 *
 *   sample_proportional(levels, fanout, uniforms: float64[B], count, beta,
 *                       slots: int64[B], probs: float64[B], weights: float32[B])
 *                       [, group])
 *       stratified proportional draw (target b = (b + u_b) * total / B), its
 *       probabilities m/total and IS weights (count * P)^-beta / max; with group,
 *       B / group independent batches of group rows, each stratified and
 *       normalised on its own. The GIL is released for B >= 256 (the tree is
 *       only read; its writers hold the table's lock, as the caller does).
 *   window_rows(parts, starts: int64[B], lengths: int64[B], S, T, rows: int64[B, T]) -> padded
 *       rows p*S + (start + min(j, length-1)) % S of each window; returns whether
 *       any window is shorter than T.
 *
 * Everything is one pass over the batch with no allocation beyond a (B,)
 * scratch and no GIL release (calls take microseconds; a draw of >= 256 rows
 * excepted, see above); the numpy versions in
 * selectors.py and items.py stay as the reference and the fallback.
 *
 * The actor side (issue #16), each with its numpy reference in Python:
 *   nstep_context / nstep_add / nstep_publish   the Ape-X n-step adder (actors/adders.py)
 *   episode_stats                                an actor's per-recv episode counters (actors/base.py)
 *   put_rows                                     Writer.append's copy of large rows (replay/writer.py)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LEVELS 64
#define GE "\xe2\x89\xa5"  /* "≥", UTF-8: PyErr_Format wants an ASCII format */

/* log2(fanout) when it is a power of two (parents by shifting), else -1 (by dividing) */
static int pow2_shift(Py_ssize_t fanout) {
    if (fanout < 1 || (fanout & (fanout - 1))) return -1;
    int k = 0;
    while (((Py_ssize_t)1 << k) < fanout) k++;
    return k;
}

static inline double sum_block(const double *c, Py_ssize_t fanout) {
    double s = 0.0;
    for (Py_ssize_t j = 0; j < fanout; j++) s += c[j];
    return s;
}

typedef struct {
    Py_buffer bufs[MAX_LEVELS];
    double *data[MAX_LEVELS];
    Py_ssize_t len[MAX_LEVELS];
    int n;
} Levels;

static void release_levels(Levels *lv) {
    for (int i = 0; i < lv->n; i++) PyBuffer_Release(&lv->bufs[i]);
    lv->n = 0;
}

static int get_levels(PyObject *tuple, Levels *lv) {
    lv->n = 0;
    if (!PyTuple_Check(tuple) && !PyList_Check(tuple)) {
        PyErr_SetString(PyExc_TypeError, "levels must be a tuple or list of float64 arrays");
        return -1;
    }
    Py_ssize_t n = PySequence_Size(tuple);
    if (n < 2 || n > MAX_LEVELS) {
        PyErr_SetString(PyExc_ValueError, "levels: need 2..64 levels");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(tuple, i);
        if (item == NULL) { release_levels(lv); return -1; }
        int rc = PyObject_GetBuffer(item, &lv->bufs[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
        Py_DECREF(item);
        if (rc < 0) { release_levels(lv); return -1; }
        lv->n = (int)i + 1;
        if (lv->bufs[i].itemsize != 8 || lv->bufs[i].format == NULL || lv->bufs[i].format[0] != 'd') {
            PyErr_SetString(PyExc_TypeError, "levels must be float64 arrays");
            release_levels(lv);
            return -1;
        }
        lv->data[i] = (double *)lv->bufs[i].buf;
        lv->len[i] = lv->bufs[i].len / 8;
    }
    return 0;
}

/* Breadth-first descent of the whole batch: node[b] ends as the leaf of targets[b].
 * Every child block of a level is prefetched before any is read, so the cache
 * misses of the large lower levels overlap instead of queueing. */
static int descend(const Levels *lv, Py_ssize_t fanout, const double *targets, int64_t *node, Py_ssize_t B) {
    /* malloc, not PyMem_Malloc: sample_proportional calls this without the GIL; -1 (no
     * Python error set) when out of memory, the caller raises MemoryError with the GIL */
    double *rest = (double *)malloc(B * sizeof(double) + 1);  /* (B,) mass still to skip */
    if (rest == NULL) return -1;
    for (Py_ssize_t b = 0; b < B; b++) { rest[b] = targets[b]; node[b] = 0; }
    for (int d = 1; d < lv->n; d++) {
        const double *level = lv->data[d];
        for (Py_ssize_t b = 0; b < B; b++) {
            const double *blk = level + node[b] * fanout;
            for (Py_ssize_t off = 0; off < fanout; off += 8) __builtin_prefetch(blk + off);
        }
        for (Py_ssize_t b = 0; b < B; b++) {
            const double *children = level + node[b] * fanout;  /* (F,) */
            double before = 0.0, choice_before = 0.0;
            Py_ssize_t choice = -1;
            for (Py_ssize_t c = 0; c < fanout; c++) {
                double m = children[c];
                if (m > 0.0) {
                    if (before <= rest[b]) { choice = c; choice_before = before; }
                    else break;
                }
                before += m;
            }
            if (choice < 0) choice = 0;  /* only for an all-zero node: callers guard total > 0 */
            rest[b] -= choice_before;
            node[b] = node[b] * fanout + choice;
        }
    }
    free(rest);
    return 0;
}

static PyObject *sumtree_find(PyObject *self, PyObject *args) {
    PyObject *levels_obj;
    Py_ssize_t fanout;
    Py_buffer tb, ob;
    if (!PyArg_ParseTuple(args, "Ony*w*", &levels_obj, &fanout, &tb, &ob)) return NULL;
    Levels lv;
    PyObject *result = NULL;
    if (get_levels(levels_obj, &lv) < 0) goto done_bufs;
    Py_ssize_t B = tb.len / 8;
    if (ob.len / 8 != B || tb.itemsize != 8 || ob.itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "targets (float64) and out (int64) must have the same length");
        goto done;
    }
    if (descend(&lv, fanout, (const double *)tb.buf, (int64_t *)ob.buf, B) < 0) { PyErr_NoMemory(); goto done; }
    result = Py_None;
    Py_INCREF(result);
done:
    release_levels(&lv);
done_bufs:
    PyBuffer_Release(&tb);
    PyBuffer_Release(&ob);
    return result;
}

/* The draw itself, without the GIL for a large batch: the tree is only read (its writers hold
 * the table's lock, as the caller does), and a sampling thread's descent then runs beside the
 * learner's Python instead of holding it up. Rows [g*group, (g+1)*group) are one stratified
 * batch each (targets ((b mod group) + u_b) * total / group) with its own IS-weight maximum:
 * `groups` independent batches drawn in one call. Returns -1 when out of memory. */
static int draw_proportional(const Levels *lv, Py_ssize_t fanout, const double *u, Py_ssize_t B,
                             Py_ssize_t group, Py_ssize_t count, double beta, int64_t *slots,
                             double *probs, float *weights) {
    double *targets = (double *)malloc(B * sizeof(double) + 1);
    if (targets == NULL) return -1;
    const double total = lv->data[0][0];
    const double width = total / (double)group;
    for (Py_ssize_t b = 0; b < B; b++) targets[b] = ((double)(b % group) + u[b]) * width;  /* stratified */
    if (descend(lv, fanout, targets, slots, B) < 0) { free(targets); return -1; }
    const double *leaves = lv->data[lv->n - 1];
    for (Py_ssize_t g = 0; g < B; g += group) {
        double wmax = 0.0;
        for (Py_ssize_t b = g; b < g + group; b++) {
            probs[b] = leaves[slots[b]] / total;
            targets[b] = pow((double)count * probs[b], -beta);  /* reuse as unnormalised weights */
            if (targets[b] > wmax) wmax = targets[b];
        }
        for (Py_ssize_t b = g; b < g + group; b++) weights[b] = (float)(targets[b] / wmax);
    }
    free(targets);
    return 0;
}

#define NOGIL_DRAW 256  /* rows from which a draw releases the GIL (below, the hand-off costs more) */

static PyObject *sample_proportional(PyObject *self, PyObject *args) {
    PyObject *levels_obj;
    Py_ssize_t fanout, count, group = 0;
    double beta;
    Py_buffer ub, sb, pb, wb;
    if (!PyArg_ParseTuple(args, "Ony*ndw*w*w*|n", &levels_obj, &fanout, &ub, &count, &beta, &sb, &pb, &wb, &group))
        return NULL;
    Levels lv;
    PyObject *result = NULL;
    if (get_levels(levels_obj, &lv) < 0) goto done_bufs;
    Py_ssize_t B = ub.len / 8;
    if (B < 1 || sb.len / 8 != B || pb.len / 8 != B || wb.len / 4 != B) {
        PyErr_SetString(PyExc_ValueError, "uniforms, slots, probs (8-byte) and weights (float32) need one length");
        goto done;
    }
    if (group == 0) group = B;
    if (group < 1 || B % group != 0) {
        PyErr_Format(PyExc_ValueError, "group must divide the %zd rows (one stratified batch each), got %zd", B, group);
        goto done;
    }
    PyThreadState *released = B >= NOGIL_DRAW ? PyEval_SaveThread() : NULL;
    int rc = draw_proportional(&lv, fanout, (const double *)ub.buf, B, group, count, beta, (int64_t *)sb.buf,
                               (double *)pb.buf, (float *)wb.buf);
    if (released != NULL) PyEval_RestoreThread(released);
    if (rc < 0) { PyErr_NoMemory(); goto done; }
    result = Py_None;
    Py_INCREF(result);
done:
    release_levels(&lv);
done_bufs:
    PyBuffer_Release(&ub);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&pb);
    PyBuffer_Release(&wb);
    return result;
}

static PyObject *window_rows(PyObject *self, PyObject *args) {
    Py_buffer pb, stb, lb, rb;
    Py_ssize_t S, T;
    if (!PyArg_ParseTuple(args, "y*y*y*nnw*", &pb, &stb, &lb, &S, &T, &rb)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t B = pb.len / 8;
    if (stb.len / 8 != B || lb.len / 8 != B || rb.len / 8 != B * T || S < 1 || T < 1) {
        PyErr_SetString(PyExc_ValueError, "parts, starts, lengths (int64 [B]) and rows (int64 [B, T]) disagree");
        goto done;
    }
    const int64_t *parts = (const int64_t *)pb.buf, *starts = (const int64_t *)stb.buf;
    const int64_t *lengths = (const int64_t *)lb.buf;
    int64_t *rows = (int64_t *)rb.buf;  /* (B, T) */
    int padded = 0;
    for (Py_ssize_t b = 0; b < B; b++) {
        int64_t base = parts[b] * S, len = lengths[b];
        if (len < T) padded = 1;
        for (Py_ssize_t j = 0; j < T; j++) {
            int64_t k = j < len ? j : len - 1;  /* padding repeats the last step (masked later) */
            rows[b * T + j] = base + (starts[b] + k) % S;
        }
    }
    result = PyBool_FromLong(padded);
done:
    PyBuffer_Release(&pb);
    PyBuffer_Release(&stb);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&rb);
    return result;
}

static PyObject *sumtree_set(PyObject *self, PyObject *args) {
    PyObject *levels_obj;
    Py_ssize_t fanout;
    Py_buffer ib, vb;
    if (!PyArg_ParseTuple(args, "Ony*y*", &levels_obj, &fanout, &ib, &vb)) return NULL;
    Levels lv;
    PyObject *result = NULL;
    if (get_levels(levels_obj, &lv) < 0) goto done_bufs;
    Py_ssize_t n = ib.len / 8;
    if (vb.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "indices (int64) and values (float64) must have the same length");
        goto done;
    }
    const int64_t *idx = (const int64_t *)ib.buf;
    const double *val = (const double *)vb.buf;
    double *leaves = lv.data[lv.n - 1];
    for (Py_ssize_t i = 0; i < n; i++) {
        if (idx[i] < 0 || idx[i] >= lv.len[lv.n - 1]) {
            PyErr_SetString(PyExc_IndexError, "leaf index out of range");
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) leaves[idx[i]] = val[i];
    /* Recompute ancestors level by level; indices are sorted, so the parents of
     * consecutive leaves repeat consecutively and each parent is summed once.
     * node[] holds each leaf's ancestor on the level being recomputed. */
    int64_t *node = (int64_t *)PyMem_Malloc((n + 1) * sizeof(int64_t));
    if (node == NULL) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) node[i] = idx[i];
    const int shift = pow2_shift(fanout);
    for (int d = lv.n - 2; d >= 0; d--) {
        const double *child = lv.data[d + 1];
        double *parent = lv.data[d];
        int64_t last = -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t p = node[i] = shift >= 0 ? node[i] >> shift : node[i] / fanout;
            if (p == last) continue;
            last = p;
            parent[p] = sum_block(child + p * fanout, fanout);
        }
    }
    PyMem_Free(node);
    result = Py_None;
    Py_INCREF(result);
done:
    release_levels(&lv);
done_bufs:
    PyBuffer_Release(&ib);
    PyBuffer_Release(&vb);
    return result;
}

static PyObject *take_rows(PyObject *self, PyObject *args) {
    /* take_rows(src: int64[N, k], idx: int64[B], out: int64[k, B]): out = src[idx].T, with
     * every source row prefetched first so the B cache misses overlap (numpy's take
     * meets them one after another: 14 us instead of 3 for 256 rows of a 10^7-row table). */
    Py_buffer sb, ib, ob;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "y*ny*w*", &sb, &k, &ib, &ob)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t B = ib.len / 8, N = k > 0 ? sb.len / (8 * k) : 0;
    if (k < 1 || ob.len != B * k * 8) {
        PyErr_SetString(PyExc_ValueError, "take_rows: out must be int64 [k, len(idx)]");
        goto done;
    }
    const int64_t *src = (const int64_t *)sb.buf, *idx = (const int64_t *)ib.buf;
    int64_t *out = (int64_t *)ob.buf;
    for (Py_ssize_t b = 0; b < B; b++) {
        if (idx[b] < 0 || idx[b] >= N) {
            PyErr_SetString(PyExc_IndexError, "take_rows: index out of range");
            goto done;
        }
        __builtin_prefetch(src + idx[b] * k);
    }
    for (Py_ssize_t b = 0; b < B; b++)
        for (Py_ssize_t j = 0; j < k; j++) out[j * B + b] = src[idx[b] * k + j];  /* column-major */
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&sb);
    PyBuffer_Release(&ib);
    PyBuffer_Release(&ob);
    return result;
}

/* ------------------------------------------------------------------------------------------
 * Incremental priority updates, liveness lists, keys and the ingest of item records.
 * Each is one pass over its batch; the numpy code in selectors.py / table.py stays the
 * reference and the fallback.
 * ---------------------------------------------------------------------------------------- */

/* A contiguous 1-D buffer of float64 or float32 (priorities come as either). */
typedef struct { Py_buffer view; int is_f32; Py_ssize_t n; } Floats;

static int get_floats(PyObject *obj, Floats *f, const char *what) {
    if (PyObject_GetBuffer(obj, &f->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *fmt = f->view.format ? f->view.format : "B";
    if (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@') fmt++;
    if (fmt[0] == 'd' && f->view.itemsize == 8) f->is_f32 = 0;
    else if (fmt[0] == 'f' && f->view.itemsize == 4) f->is_f32 = 1;
    else {
        PyErr_Format(PyExc_TypeError, "%s must be float64 or float32", what);
        PyBuffer_Release(&f->view);
        return -1;
    }
    f->n = f->view.len / f->view.itemsize;
    return 0;
}

static inline double float_at(const Floats *f, Py_ssize_t i) {
    return f->is_f32 ? (double)((const float *)f->view.buf)[i] : ((const double *)f->view.buf)[i];
}

static inline double mass_of(double p, double alpha) {
    if (!(p > 0.0)) return 0.0;  /* zero priority: never drawn, whatever alpha */
    if (alpha == 1.0) return p;
    if (alpha == 0.0) return 1.0;
    if (alpha == 0.5) return sqrt(p);
    return exp(alpha * log(p));  /* pow's result to ~1e-15 relative, about a third cheaper */
}

/* Leaf `leaf` := m, and each ancestor changes by its child's change: one add per level
 * instead of re-summing F children. Where the change cancels almost all of a node (the
 * node falls below 2^-10 of the change, e.g. its last positive leaf went to 0), the node
 * is re-summed from its children instead, so a node over only zero leaves is exactly 0
 * and rounding cannot build up in a shrinking node; the next level then gets the exact
 * difference. */
static inline void tree_put(const Levels *lv, Py_ssize_t fanout, int shift, int64_t leaf, double m) {
    const int last = lv->n - 1;
    double *leaves = lv->data[last];
    double delta = m - leaves[leaf];
    leaves[leaf] = m;
    int64_t node = leaf;
    for (int d = last - 1; d >= 0 && delta != 0.0; d--) {
        node = shift >= 0 ? node >> shift : node / fanout;
        double *x = lv->data[d] + node;
        const double old = *x;
        double v = old + delta;
        if (v < fabs(delta) * (1.0 / 1024.0)) v = sum_block(lv->data[d + 1] + node * fanout, fanout);
        *x = v;
        delta = v - old;
    }
}

/* 0 when every priority is finite and >= 0, else -1 with ValueError naming the first bad one */
static int check_priorities(const Floats *pr) {
    for (Py_ssize_t i = 0; i < pr->n; i++) {
        const double p = float_at(pr, i);
        if (p >= 0.0 && !isinf(p)) continue;
        Py_ssize_t nbad = 0;
        for (Py_ssize_t j = i; j < pr->n; j++) { const double q = float_at(pr, j); nbad += !(q >= 0.0) || isinf(q); }
        PyObject *v = PyFloat_FromDouble(p);
        PyErr_Format(PyExc_ValueError, "priority must be finite and %s 0, got %R at index %zd (%zd bad of %zd)",
                     GE, v, i, nbad, pr->n);
        Py_XDECREF(v);
        return -1;
    }
    return 0;
}

/* Writer.create_items' checks of m items, in the order and with the messages of replay/checks.py's
 * check_items (its Python reference): priorities finite and >= 0, every length in [1, S], no item
 * ending after its stream's next step, none reaching back over its stream's episode start. Item j:
 * length len[j] (len_all when len is NULL), end end[j], stream stream[j] (stream_all when stream
 * is NULL); its stream's next step pos[k] and episode start ep0[k], k = stream[j] (0 when stream is
 * NULL). 0, or -1 with ValueError set. The one copy of these checks in C: stream_items (one stream,
 * the extend path) and nstep_publish (the n-step adder's flush) call it. */
static int check_item_batch(const Floats *prio, Py_ssize_t m, const int64_t *len, int64_t len_all, const int64_t *end,
                            const int64_t *stream, int64_t stream_all, const int64_t *pos, const int64_t *ep0,
                            Py_ssize_t S) {
    #define ITEM_LEN(j) (len ? len[j] : len_all)
    #define ITEM_STREAM(j) (stream ? stream[j] : 0)
    if (check_priorities(prio) < 0) return -1;
    for (Py_ssize_t j = 0; j < m; j++)
        if (ITEM_LEN(j) < 1 || ITEM_LEN(j) > S) {
            PyErr_Format(PyExc_ValueError, "num_steps must be in [1, %zd], got %lld", S, (long long)ITEM_LEN(j));
            return -1;
        }
    for (Py_ssize_t j = 0; j < m; j++)
        if (end[j] > pos[ITEM_STREAM(j)]) {
            PyErr_SetString(PyExc_ValueError, "an item ends after the last appended step");
            return -1;
        }
    for (Py_ssize_t j = 0; j < m; j++)
        if (end[j] - ITEM_LEN(j) < ep0[ITEM_STREAM(j)]) {
            PyErr_Format(PyExc_ValueError, "item of %lld steps crosses an episode boundary: stream %lld has %lld "
                         "steps in its current episode", (long long)ITEM_LEN(j),
                         (long long)(stream ? stream[j] : stream_all), (long long)(end[j] - ep0[ITEM_STREAM(j)]));
            return -1;
        }
    #undef ITEM_LEN
    #undef ITEM_STREAM
    return 0;
}

/* The slot that holds item ``key`` (seq * P + p lives in slot p * R + seq % R), or -1 when the
 * slot no longer holds that very item (evicted, overwritten, never ingested). */
static inline int64_t key_slot(int64_t k, Py_ssize_t P, Py_ssize_t R, const int64_t *rec, const char *live) {
    if (k < 0) return -1;
    const int64_t seq = k / P, s = (k % P) * R + seq % R;
    return live[s] && rec[s * 3 + 1] == seq ? s : -1;
}

/* A selector's packed live list: add a dead slot at the end / remove a live one, the hole taking
 * the list's last entry. Both return the new count. */
static inline Py_ssize_t live_add(int64_t *pos, int64_t *live, Py_ssize_t count, int64_t s) {
    if (pos[s] < 0) { live[count] = s; pos[s] = count++; }
    return count;
}

static inline Py_ssize_t live_remove(int64_t *pos, int64_t *live, Py_ssize_t count, int64_t s) {
    const int64_t hole = pos[s];
    if (hole < 0) return count;
    pos[s] = -1;
    if (hole != --count) { const int64_t mover = live[count]; live[hole] = mover; pos[mover] = hole; }
    return count;
}

/* update_by_key's work once its arguments are checked: priorities checked (ValueError, nothing
 * changed), then each key still held takes p ** alpha. Returns the leaves set, or -1 on error. */
static Py_ssize_t apply_by_key(const Levels *lv, Py_ssize_t fanout, const int64_t *keys, const Floats *pr,
                               Py_ssize_t P, Py_ssize_t R, const int64_t *rec, const char *live, double alpha) {
    if (check_priorities(pr) < 0) return -1;
    const int shift = pow2_shift(fanout);
    Py_ssize_t applied = 0;
    for (Py_ssize_t i = 0; i < pr->n; i++) {
        const int64_t s = key_slot(keys[i], P, R, rec, live);
        if (s < 0) continue;
        tree_put(lv, fanout, shift, s, mass_of(float_at(pr, i), alpha));
        applied++;
    }
    return applied;
}

/* update_by_key(levels, fanout, keys: int64[n], P, R, slot_rec: int64[P*R, 3], slot_live: bool[P*R],
 *               priorities: float64|float32[n], alpha) -> applied
 * The learner's priority write-back in one pass: every priority checked first (a bad one
 * raises ValueError, nothing changes); then each key's slot (seq * P + p lives in slot
 * p * R + seq % R), skipped unless the slot still holds that very item, takes p ** alpha. */
static PyObject *update_by_key(PyObject *self, PyObject *args) {
    PyObject *levels_obj, *prio_obj;
    Py_ssize_t fanout, P, R;
    double alpha;
    Py_buffer kb, rb, lb;
    if (!PyArg_ParseTuple(args, "Ony*nny*y*Od", &levels_obj, &fanout, &kb, &P, &R, &rb, &lb, &prio_obj, &alpha))
        return NULL;
    Floats pr;
    Levels lv;
    PyObject *result = NULL;
    if (get_floats(prio_obj, &pr, "priorities") < 0) { PyBuffer_Release(&kb); PyBuffer_Release(&rb); PyBuffer_Release(&lb); return NULL; }
    if (get_levels(levels_obj, &lv) < 0) goto done_bufs;
    const Py_ssize_t n = kb.len / 8, N = lb.len;
    if (pr.n != n) {
        PyErr_Format(PyExc_ValueError, "%zd keys but %zd priorities", n, pr.n);
        goto done;
    }
    if (rb.len != N * 24 || P < 1 || R < 1 || P * R != N || lv.len[lv.n - 1] < N) {
        PyErr_SetString(PyExc_ValueError, "update_by_key: slot_rec int64[P*R, 3], slot_live bool[P*R], tree >= P*R leaves");
        goto done;
    }
    const Py_ssize_t applied = apply_by_key(&lv, fanout, (const int64_t *)kb.buf, &pr, P, R, (const int64_t *)rb.buf,
                                            (const char *)lb.buf, alpha);
    if (applied >= 0) result = PyLong_FromSsize_t(applied);
done:
    release_levels(&lv);
done_bufs:
    PyBuffer_Release(&kb);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&pr.view);
    return result;
}

/* update_by_key_raw(levels, fanout, keys_addr, prios_addr, n, prios_f32, P, R, slot_rec, slot_live, alpha)
 * update_by_key for two contiguous CPU tensors the caller holds (int64 keys; float32 or float64
 * priorities), given by address and length: a learner's batch keys and new priorities without
 * building numpy arrays around them. The same checks and effect as update_by_key. */
static PyObject *update_by_key_raw(PyObject *self, PyObject *args) {
    PyObject *levels_obj;
    Py_ssize_t fanout, n, P, R;
    unsigned long long kaddr, paddr;
    int f32;
    double alpha;
    Py_buffer rb, lb;
    if (!PyArg_ParseTuple(args, "OnKKnpnny*y*d", &levels_obj, &fanout, &kaddr, &paddr, &n, &f32, &P, &R, &rb, &lb, &alpha))
        return NULL;
    Levels lv;
    PyObject *result = NULL;
    if (get_levels(levels_obj, &lv) < 0) goto done_bufs;
    const Py_ssize_t N = lb.len;
    if (n < 0 || (n && (!kaddr || !paddr)) || rb.len != N * 24 || P < 1 || R < 1 || P * R != N || lv.len[lv.n - 1] < N) {
        PyErr_SetString(PyExc_ValueError, "update_by_key_raw: bad addresses, or slot_rec/slot_live/tree do not fit P*R");
        goto done;
    }
    Floats pr = {.is_f32 = f32, .n = n};
    pr.view.buf = (void *)(uintptr_t)paddr;
    const Py_ssize_t applied = apply_by_key(&lv, fanout, (const int64_t *)(uintptr_t)kaddr, &pr, P, R,
                                            (const int64_t *)rb.buf, (const char *)lb.buf, alpha);
    if (applied >= 0) result = PyLong_FromSsize_t(applied);
done:
    release_levels(&lv);
done_bufs:
    PyBuffer_Release(&rb);
    PyBuffer_Release(&lb);
    return result;
}

/* set_priorities(levels, fanout, size, slots: int64[n], priorities: float64|float32[n],
 *                alpha, skip_negative) -> leaves set
 * Every priority is checked first (finite, >= 0) and every slot (in [0, size), or < 0 and
 * skipped when skip_negative): a bad one raises ValueError and changes nothing. Then the
 * leaves take p ** alpha (0 for p == 0) in order, so a repeated slot keeps its last one. */
static PyObject *set_priorities(PyObject *self, PyObject *args) {
    PyObject *levels_obj, *prio_obj;
    Py_ssize_t fanout, size;
    double alpha;
    int skip_negative;
    Py_buffer sb;
    if (!PyArg_ParseTuple(args, "Onny*Odp", &levels_obj, &fanout, &size, &sb, &prio_obj, &alpha, &skip_negative))
        return NULL;
    Floats pr;
    Levels lv;
    PyObject *result = NULL;
    if (get_floats(prio_obj, &pr, "priorities") < 0) { PyBuffer_Release(&sb); return NULL; }
    if (get_levels(levels_obj, &lv) < 0) goto done_bufs;
    const Py_ssize_t n = sb.len / 8;
    const int64_t *slots = (const int64_t *)sb.buf;
    if (pr.n != n) {
        PyErr_Format(PyExc_ValueError, "%zd priorities for %zd slots", pr.n, n);
        goto done;
    }
    if (check_priorities(&pr) < 0) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (slots[i] >= size || (slots[i] < 0 && !skip_negative)) {
            PyErr_Format(PyExc_ValueError, "slot %lld out of range [0, %zd)", (long long)slots[i], size);
            goto done;
        }
    }
    const int shift = pow2_shift(fanout);
    Py_ssize_t applied = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (slots[i] < 0) continue;
        tree_put(&lv, fanout, shift, slots[i], mass_of(float_at(&pr, i), alpha));
        applied++;
    }
    result = PyLong_FromSsize_t(applied);
done:
    release_levels(&lv);
done_bufs:
    PyBuffer_Release(&sb);
    PyBuffer_Release(&pr.view);
    return result;
}

/* rebuild(levels, fanout): every parent re-summed from its children (exact). */
static PyObject *rebuild(PyObject *self, PyObject *args) {
    PyObject *levels_obj;
    Py_ssize_t fanout;
    if (!PyArg_ParseTuple(args, "On", &levels_obj, &fanout)) return NULL;
    Levels lv;
    if (get_levels(levels_obj, &lv) < 0) return NULL;
    for (int d = lv.n - 2; d >= 0; d--)
        for (Py_ssize_t p = 0; p < lv.len[d]; p++)
            lv.data[d][p] = (p + 1) * fanout <= lv.len[d + 1] ? sum_block(lv.data[d + 1] + p * fanout, fanout) : 0.0;
    release_levels(&lv);
    Py_RETURN_NONE;
}

/* make_live(position: int64[N], live: int64[N], count, slots: int64[n]) -> count
 * Appends the dead ones among slots to the packed live list. */
static PyObject *make_live(PyObject *self, PyObject *args) {
    Py_buffer pb, lb, sb;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "w*w*ny*", &pb, &lb, &count, &sb)) return NULL;
    int64_t *pos = (int64_t *)pb.buf, *live = (int64_t *)lb.buf;
    const int64_t *slots = (const int64_t *)sb.buf;
    const Py_ssize_t N = pb.len / 8, n = sb.len / 8;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= N) { PyErr_SetString(PyExc_IndexError, "make_live: slot out of range"); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) count = live_add(pos, live, count, slots[i]);
    result = PyLong_FromSsize_t(count);
done:
    PyBuffer_Release(&pb);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&sb);
    return result;
}

/* make_dead(position, live, count, slots) -> count
 * Removes the live ones among slots from the packed list; each hole takes the list's last
 * entry (the same state as Selector._make_dead up to the order of the live list). */
static PyObject *make_dead(PyObject *self, PyObject *args) {
    Py_buffer pb, lb, sb;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "w*w*ny*", &pb, &lb, &count, &sb)) return NULL;
    int64_t *pos = (int64_t *)pb.buf, *live = (int64_t *)lb.buf;
    const int64_t *slots = (const int64_t *)sb.buf;
    const Py_ssize_t N = pb.len / 8, n = sb.len / 8;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= N) { PyErr_SetString(PyExc_IndexError, "make_dead: slot out of range"); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) count = live_remove(pos, live, count, slots[i]);
    result = PyLong_FromSsize_t(count);
done:
    PyBuffer_Release(&pb);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&sb);
    return result;
}

/* key_slots(keys: int64[n], P, R, slot_rec: int64[N, 3], slot_live: bool[N], out: int64[n]) -> valid
 * The slot of each key (seq * P + p lives in slot p * R + seq % R) when that slot holds that
 * very item, else -1 (evicted, overwritten or never ingested). */
static PyObject *key_slots(PyObject *self, PyObject *args) {
    Py_buffer kb, rb, lb, ob;
    Py_ssize_t P, R;
    if (!PyArg_ParseTuple(args, "y*nny*y*w*", &kb, &P, &R, &rb, &lb, &ob)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = kb.len / 8, N = lb.len;
    if (ob.len != kb.len || rb.len != N * 24 || P < 1 || R < 1 || P * R != N) {
        PyErr_SetString(PyExc_ValueError, "key_slots: keys/out int64[n], slot_rec int64[P*R, 3], slot_live bool[P*R]");
        goto done;
    }
    const int64_t *keys = (const int64_t *)kb.buf, *rec = (const int64_t *)rb.buf;
    const char *live = (const char *)lb.buf;
    int64_t *out = (int64_t *)ob.buf;
    Py_ssize_t valid = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = key_slot(keys[i], P, R, rec, live);
        valid += out[i] >= 0;
    }
    result = PyLong_FromSsize_t(valid);
done:
    PyBuffer_Release(&kb);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&ob);
    return result;
}

/* stream_items(item_start: int64[R], item_length: int32[R], item_priority: float64[R],
 *              counters: int64[8] (the partition's, shared), ends: int64[m], num_steps: int | int64[m],
 *              priorities: float64[m], S, pos, episode_start, last_item_start, stream,
 *              published_field, rec_reserve_field, trusted_steps) -> start of the last item
 * Writer.create_items for m items of one stream (item j: steps [ends[j] - n_j, ends[j])):
 * every check of the Python path, in its order and with its messages, then the record
 * ring's write protocol: REC_RESERVE bumped, records written (ring wrap included),
 * PUBLISHED bumped, each store ordered after the one before. */
static PyObject *stream_items(PyObject *self, PyObject *args) {
    Py_buffer stb, lnb, prb, cb, eb, pb;
    PyObject *nobj;
    Py_ssize_t S, pos, ep0, last_start, stream, f_pub, f_rres, trust;
    if (!PyArg_ParseTuple(args, "w*w*w*w*y*Oy*nnnnnnnn", &stb, &lnb, &prb, &cb, &eb, &nobj, &pb, &S, &pos, &ep0,
                          &last_start, &stream, &f_pub, &f_rres, &trust))
        return NULL;
    PyObject *result = NULL;
    Py_buffer nb = {0};
    int n_is_array = 0;
    int64_t n_scalar = 0;
    const Py_ssize_t R = stb.len / 8, m = eb.len / 8;
    if (lnb.len != R * 4 || prb.len != R * 8 || cb.len < 64 || f_pub < 0 || f_pub > 7 || f_rres < 0 || f_rres > 7) {
        PyErr_SetString(PyExc_ValueError, "stream_items: record rows or counters disagree");
        goto done;
    }
    if (PyLong_Check(nobj)) {
        n_scalar = PyLong_AsLongLong(nobj);
        if (n_scalar == -1 && PyErr_Occurred()) goto done;
    } else {
        if (PyObject_GetBuffer(nobj, &nb, PyBUF_C_CONTIGUOUS) < 0) goto done;
        n_is_array = 1;
        if (nb.len != m * 8) { PyErr_SetString(PyExc_ValueError, "num_steps: one int64 per item"); goto done; }
    }
    if (pb.len != m * 8) {
        PyErr_Format(PyExc_ValueError, "%zd priorities but %zd ends", pb.len / 8, m);
        goto done;
    }
    const int64_t *ends = (const int64_t *)eb.buf;
    const double *prios = (const double *)pb.buf;
    #define NSTEPS(j) (n_is_array ? ((const int64_t *)nb.buf)[j] : n_scalar)
    Floats pf = {.view = pb, .is_f32 = 0, .n = m};
    const int64_t pos64 = pos, ep064 = ep0;
    if (check_item_batch(&pf, m, n_is_array ? (const int64_t *)nb.buf : NULL, n_scalar, ends, NULL, stream,
                         &pos64, &ep064, S) < 0)
        goto done;
    for (Py_ssize_t j = 0; j < m; j++)  /* Reverb's CreateItemRejectsExpiredCellRefs: steps the ring overwrote */
        if (ends[j] - NSTEPS(j) < pos - trust) {
            PyErr_Format(PyExc_ValueError, "item starting at step %lld of stream %zd refers to steps the ring already "
                         "overwrote: the stream holds steps >= %lld (%zd steps behind its next step %zd)",
                         (long long)(ends[j] - NSTEPS(j)), stream, (long long)(pos - trust), trust, pos);
            goto done;
        }
    if (m > R) { PyErr_Format(PyExc_ValueError, "more than %zd items for one stream in one call", R); goto done; }
    for (Py_ssize_t j = 0; j < m; j++) {
        const int64_t start = ends[j] - NSTEPS(j), before = j ? ends[j - 1] - NSTEPS(j - 1) : last_start;
        if (start < before) {
            PyErr_SetString(PyExc_ValueError, "items of a stream must be created in order of their first step");
            goto done;
        }
    }
    int64_t *c = (int64_t *)cb.buf, *rec_start = (int64_t *)stb.buf;
    int32_t *rec_len = (int32_t *)lnb.buf;
    double *rec_prio = (double *)prb.buf;
    const int64_t seq0 = __atomic_load_n(&c[f_pub], __ATOMIC_RELAXED);
    if (m) {
        const int64_t rres = __atomic_load_n(&c[f_rres], __ATOMIC_RELAXED);
        if (seq0 + m > rres) __atomic_store_n(&c[f_rres], seq0 + m, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_RELEASE);  /* the announcement before the slots change */
        for (Py_ssize_t j = 0; j < m; j++) {
            const Py_ssize_t r = (seq0 + j) % R;
            rec_start[r] = ends[j] - NSTEPS(j);
            rec_len[r] = (int32_t)NSTEPS(j);
            rec_prio[r] = prios[j];
        }
        __atomic_store_n(&c[f_pub], seq0 + m, __ATOMIC_RELEASE);  /* publish after the records */
    }
    #undef NSTEPS
    result = PyLong_FromLongLong(m ? ends[m - 1] - (n_is_array ? ((const int64_t *)nb.buf)[m - 1] : n_scalar) : last_start);
done:
    if (n_is_array) PyBuffer_Release(&nb);
    PyBuffer_Release(&stb); PyBuffer_Release(&lnb); PyBuffer_Release(&prb); PyBuffer_Release(&cb);
    PyBuffer_Release(&eb); PyBuffer_Release(&pb);
    return result;
}

/* scan(counters: int64[P, 8], item_start: int64[P, R], item_length: int32[P, R], item_priority: float64[P, R],
 *      ingested: int64[P], live_lo: int64[P], seen_reserve: int64[P], S, max_len, seen_total, first_p,
 *      slot_rec: int64[P*R, 3], slot_live: bool[P*R],
 *      new_slots: int64[C], new_prios: float64[C], gone: int64[C])
 *   -> (total, next_p, n_new, n_gone, n_replaced, n_bad)
 * The table's scan over every partition in one pass (Table.scan's numpy code is the reference):
 * - total: the sum of every partition's RESERVE, COMMIT and PUBLISHED; when it equals
 *   seen_total no writer moved and nothing else is done (next_p = P).
 * - ingest: the item records of partition p's seqs [max(ingested, PUBLISHED - R), PUBLISHED)
 *   are copied, then checked against the record ring's seqlock (REC_RESERVE and PUBLISHED read
 *   after the copy: records of seqs below max(them) - R may have been rewritten meanwhile and
 *   are dropped); the rest become the table's records (slot_rec, slot_live) and are listed in
 *   new_* for the selector. A record whose priority is not finite and >= 0 (a writer that
 *   bypassed its checks) is dropped and counted in n_bad.
 * - evict: from live_lo on, items whose first step is older than RESERVE - S (RESERVE read at
 *   the start of the partition's turn) are marked dead and listed in gone.
 * The outputs hold C entries: a partition that would not fit is done in part (its ingested /
 * live_lo say how far) and next_p < P says where to go on after the caller emptied them. */
#define F_RESERVE 0
#define F_COMMIT 1
#define F_PUBLISHED 2
#define F_REC_RESERVE 6
#define F_WAIT_SINCE_NS 7  /* storage.WAIT_SINCE_NS: a writer waits for the insert limit since (ns; 0: none) */
/* Optional trailing arguments (a prioritized selector's own state, for the fused path):
 *   position: int64[N], live: int64[N], count, levels, fanout, alpha
 * With them every ingested item is also made live in the selector with mass p ** alpha and
 * every evicted one dead with mass 0 (make_live / make_dead / tree_put as above), and the
 * result gains the selector's new count and the number of leaves changed. */
static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer cb, stb, lnb, prb, ib, llb, srb, rb, lvb, nsb, npb, gb;
    Py_buffer posb = {0}, liveb = {0};
    PyObject *levels_obj = NULL;
    Py_ssize_t S, max_len, seen_total, first_p, sel_count = 0, fanout = 0;
    double alpha = 1.0;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*w*w*nnnnw*w*w*w*w*|w*w*nOnd", &cb, &stb, &lnb, &prb, &ib, &llb, &srb, &S,
                          &max_len, &seen_total, &first_p, &rb, &lvb, &nsb, &npb, &gb, &posb, &liveb, &sel_count,
                          &levels_obj, &fanout, &alpha))
        return NULL;
    PyObject *result = NULL;
    int64_t *starts = NULL;
    int32_t *lengths = NULL;
    Levels lv = {.n = 0};
    const int fused = levels_obj != NULL;
    int64_t *sel_pos = NULL, *sel_live = NULL;
    int shift = -1;
    Py_ssize_t leaves_changed = 0;
    const Py_ssize_t P = ib.len / 8, N = lvb.len, R = P ? N / P : 0, cap = nsb.len / 8;
    if (fused) {
        if (get_levels(levels_obj, &lv) < 0) goto done;
        if (posb.len != N * 8 || liveb.len != N * 8 || lv.len[lv.n - 1] < N || fanout < 2) {
            PyErr_SetString(PyExc_ValueError, "scan: the selector's position/live arrays or tree do not fit the table");
            goto done;
        }
        sel_pos = (int64_t *)posb.buf;
        sel_live = (int64_t *)liveb.buf;
        shift = pow2_shift(fanout);
    }
    if (P < 1 || cb.len != P * 64 || stb.len != N * 8 || lnb.len != N * 4 || prb.len != N * 8 || llb.len != P * 8
        || srb.len != P * 8 || rb.len != N * 24 || N % P || npb.len != cap * 8 || gb.len != cap * 8 || cap < 1) {
        PyErr_SetString(PyExc_ValueError, "scan: counters, records and table arrays disagree");
        goto done;
    }
    const int64_t *c = (const int64_t *)cb.buf, *src_start = (const int64_t *)stb.buf;
    const int32_t *src_len = (const int32_t *)lnb.buf;
    const double *src_prio = (const double *)prb.buf;
    int64_t *ingested = (int64_t *)ib.buf, *live_lo = (int64_t *)llb.buf, *seen_res = (int64_t *)srb.buf;
    int64_t *rec = (int64_t *)rb.buf, *new_slots = (int64_t *)nsb.buf, *gone = (int64_t *)gb.buf;
    char *live = (char *)lvb.buf;
    double *new_prios = (double *)npb.buf;
    int64_t total = 0;
    for (Py_ssize_t p = 0; p < P; p++)
        total += __atomic_load_n(&c[p * 8 + F_RESERVE], __ATOMIC_RELAXED) + __atomic_load_n(&c[p * 8 + F_COMMIT], __ATOMIC_RELAXED)
               + __atomic_load_n(&c[p * 8 + F_PUBLISHED], __ATOMIC_RELAXED);
    if (total == seen_total && first_p == 0) {
        result = Py_BuildValue("Lnnnnnnn", (long long)total, P, (Py_ssize_t)0, (Py_ssize_t)0, (Py_ssize_t)0,
                               (Py_ssize_t)0, sel_count, (Py_ssize_t)0);
        goto done;
    }
    starts = (int64_t *)PyMem_Malloc((cap + 1) * sizeof(int64_t));
    lengths = (int32_t *)PyMem_Malloc((cap + 1) * sizeof(int32_t));
    if (!starts || !lengths) { PyErr_NoMemory(); goto done; }
    Py_ssize_t n_new = 0, n_gone = 0, n_rep = 0, n_bad = 0, p = first_p;
    for (; p < P; p++) {
        const int64_t *cp = c + p * 8;
        const int64_t pub = __atomic_load_n(&cp[F_PUBLISHED], __ATOMIC_RELAXED);
        const int64_t res = __atomic_load_n(&cp[F_RESERVE], __ATOMIC_RELAXED);
        if (pub == ingested[p] && res == seen_res[p]) continue;
        if (pub > ingested[p]) {  /* ---- ingest */
            const int64_t lo = ingested[p] > pub - R ? ingested[p] : pub - R;  /* a lapped reader keeps the newest R */
            int64_t hi = pub;
            if (hi - lo > cap - n_new) hi = lo + (cap - n_new);  /* the rest on the next call */
            if (hi <= lo) break;
            const Py_ssize_t n = (Py_ssize_t)(hi - lo);
            const int64_t *ps = src_start + p * R;
            const int32_t *pl = src_len + p * R;
            const double *pp = src_prio + p * R;
            const Py_ssize_t base = n_new;  /* new_prios[base:] is the copy's scratch; kept ones compact into it */
            for (Py_ssize_t i = 0; i < n; i++) {  /* copy: a writer may be rewriting these slots */
                const Py_ssize_t r = (Py_ssize_t)((lo + i) % R);
                starts[i] = ps[r];
                lengths[i] = pl[r];
                new_prios[base + i] = pp[r];
            }
            __atomic_thread_fence(__ATOMIC_ACQUIRE);  /* the record loads above stay above */
            const int64_t rres = __atomic_load_n(&cp[F_REC_RESERVE], __ATOMIC_RELAXED);
            const int64_t pub2 = __atomic_load_n(&cp[F_PUBLISHED], __ATOMIC_RELAXED);
            const int64_t valid_from = (rres > pub2 ? rres : pub2) - R;
            for (Py_ssize_t i = 0; i < n; i++) {
                const int64_t seq = lo + i;
                const double pr = new_prios[base + i];
                if (seq < valid_from) continue;  /* rewritten while we copied it */
                if (!(pr >= 0.0) || isinf(pr)) { n_bad++; continue; }
                const int64_t s = p * R + seq % R;
                int64_t len = lengths[i] < max_len ? lengths[i] : max_len;  /* cut to the kind's window */
                n_rep += live[s] != 0;
                rec[s * 3] = starts[i];
                rec[s * 3 + 1] = seq;
                rec[s * 3 + 2] = len;
                live[s] = 1;
                new_slots[n_new] = s;
                new_prios[n_new] = pr;
                n_new++;
                if (fused) {  /* the selector: live, with mass p ** alpha */
                    sel_count = live_add(sel_pos, sel_live, sel_count, s);
                    tree_put(&lv, fanout, shift, s, mass_of(pr, alpha));
                    leaves_changed++;
                }
            }
            ingested[p] = hi;
            if (hi - R > live_lo[p]) live_lo[p] = hi - R;
            if (hi < pub) break;  /* outputs full */
        }
        /* ---- evict the oldest items whose first step is older than RESERVE - S */
        const int64_t limit = res - S, hi = ingested[p];
        int64_t seq = live_lo[p];
        for (; seq < hi; seq++) {
            const int64_t s = p * R + seq % R;
            if (rec[s * 3] >= limit) break;  /* starts ascend with seq in a partition */
            if (live[s]) {
                if (n_gone == cap) break;
                live[s] = 0;
                gone[n_gone++] = s;
                if (fused && sel_pos[s] >= 0) {  /* the selector: dead, mass 0 */
                    sel_count = live_remove(sel_pos, sel_live, sel_count, s);
                    tree_put(&lv, fanout, shift, s, 0.0);
                    leaves_changed++;
                }
            }
        }
        live_lo[p] = seq;
        if (seq < hi && rec[(p * R + seq % R) * 3] < limit) break;  /* gone full: go on from here */
        seen_res[p] = res;
    }
    result = Py_BuildValue("Lnnnnnnn", (long long)total, p, n_new, n_gone, n_rep, n_bad, sel_count, leaves_changed);
done:
    if (lv.n) release_levels(&lv);
    if (posb.buf) PyBuffer_Release(&posb);
    if (liveb.buf) PyBuffer_Release(&liveb);
    PyMem_Free(starts);
    PyMem_Free(lengths);
    PyBuffer_Release(&cb); PyBuffer_Release(&stb); PyBuffer_Release(&lnb); PyBuffer_Release(&prb);
    PyBuffer_Release(&ib); PyBuffer_Release(&llb); PyBuffer_Release(&srb); PyBuffer_Release(&rb);
    PyBuffer_Release(&lvb); PyBuffer_Release(&nsb); PyBuffer_Release(&npb); PyBuffer_Release(&gb);
    return result;
}

/* counter_total(counters: int64[P, 8]) -> the sum of every partition's RESERVE, COMMIT, PUBLISHED */
static PyObject *counter_total(PyObject *self, PyObject *args) {
    Py_buffer cb;
    if (!PyArg_ParseTuple(args, "y*", &cb)) return NULL;
    const int64_t *c = (const int64_t *)cb.buf;
    int64_t total = 0;
    for (Py_ssize_t p = 0; p < cb.len / 64; p++)
        total += __atomic_load_n(&c[p * 8 + F_RESERVE], __ATOMIC_RELAXED) + __atomic_load_n(&c[p * 8 + F_COMMIT], __ATOMIC_RELAXED)
               + __atomic_load_n(&c[p * 8 + F_PUBLISHED], __ATOMIC_RELAXED);
    PyBuffer_Release(&cb);
    return PyLong_FromLongLong(total);
}

/* ------------------------------------------------------------------------------------------
 * The Ape-X n-step adder (gearflow/actors/adders.py TransitionAdder; its numpy code is the
 * reference and the fallback). One call per recv does the whole batch: every staged step of
 * an env takes the new reward (ret += disc * r, disc *= gamma), the step that became complete
 * is appended as a row straight into the table's columns under the writer's seqlock
 * (RESERVE, row bytes, step offset, COMMIT), its item (or an ended episode's items) goes to
 * a pending list, and the new step is staged. Items are published by nstep_publish with the
 * record ring's protocol. The float arithmetic is the numpy path's, in its order, so rows,
 * items and priorities are bit for bit the same (tests/test_adders_native.py).
 *
 *   ctx = nstep_context(arrays: dict, E, n, S, R, gamma, offset_max)
 *       arrays (each C-contiguous, held by the context; lengths are checked):
 *         staging  s_obs uint8[E, n, obs_bytes], s_action int64|int32[E, n], s_version int64|int32[E, n],
 *                  acc float64[E, n, 2] (ret, disc; disc 0 = empty slot), qsa float64[E, n],
 *                  item_prio float64[E, n], t int64[E], episode_row int64[E], end_pending bool[E]
 *         pending  p_prio float64[C], p_len int64[C], p_stream int64[C], p_end int64[C], p_count int64[1]
 *         writer   c_obs, c_action, c_ret (float32|float64), c_disc, c_version (P*S rows of the
 *                  staging dtypes), partitions int64[E], counters int64[P, 8], pos int64[E],
 *                  episode_start int64[E], last_start int64[E], offsets uint8[P*S] or None,
 *                  rec_start int64[P, R], rec_len int32[P, R], rec_prio float64[P, R], header int64[16]
 *   nstep_add(ctx, ids int64[b], obs (b, obs_bytes) rows (first axis may be strided),
 *             reward float32|float64[b], terminated bool[b], truncated bool[b], actions int64[b],
 *             values float32|float64[b, A] or None, version) -> pending items
 *       -1: an env of the batch ends while its last episode end is still pending (publish
 *       first); -2: the pending list could overflow (grow it). Both change nothing.
 *   nstep_publish(ctx, mode) -> items published
 *       mode 0: only if the rate limiter allows them now, else -1 (nothing changed);
 *       mode 1: publish (the caller waited for the limiter); mode 2: drop the pending items.
 *       Then (modes 0 when published, 1, 2) the ended episodes are closed in the writer.
 * ---------------------------------------------------------------------------------------- */
#define F_EPISODES 3
#define H_INSERT_LIMIT_F 8
#define NO_LIMIT_V INT64_MAX

typedef struct {
    PyObject *arrays;                      /* the dict of arrays (keeps every pointer alive) */
    Py_ssize_t E, n, S, R, P, cap, obs_bytes, act8, ver8, ret8, disc8;
    double gamma;
    int64_t offset_max;
    char *s_obs, *s_action, *s_version, *end_pending;
    double *acc, *qsa, *item_prio;
    int64_t *t, *episode_row;
    double *p_prio;
    int64_t *p_len, *p_stream, *p_end, *p_count;
    char *c_obs, *c_action, *c_ret, *c_disc, *c_version;
    const int64_t *parts;
    int64_t *counters, *wpos, *ep_start, *last_start, *rec_start, *header;
    uint8_t *offsets;
    int32_t *rec_len;
    double *rec_prio;
    int64_t trust;                         /* an item's first step must be >= pos - trust */
    int64_t *expired;                      /* items dropped for starting before that (or NULL) */
} NStep;

static void nstep_free(PyObject *capsule) {
    NStep *c = (NStep *)PyCapsule_GetPointer(capsule, "gearflow.nstep");
    if (c == NULL) return;
    Py_XDECREF(c->arrays);
    PyMem_Free(c);
}

/* The data pointer of arrays[name] (C-contiguous, writable), its length in bytes in *len. */
static char *array_ptr(PyObject *arrays, const char *name, Py_ssize_t *len, int optional) {
    PyObject *obj = PyDict_GetItemString(arrays, name);  /* borrowed */
    if (obj == NULL || (optional && obj == Py_None)) {
        if (!optional) PyErr_Format(PyExc_KeyError, "nstep_context: no array %s", name);
        *len = 0;
        return NULL;
    }
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    char *p = (char *)v.buf;
    *len = v.len;
    PyBuffer_Release(&v);  /* the dict holds the array, whose data never moves */
    return p;
}

static PyObject *nstep_context(PyObject *self, PyObject *args) {
    PyObject *arrays;
    Py_ssize_t E, n, S, R, offset_max;
    double gamma;
    if (!PyArg_ParseTuple(args, "O!nnnndn", &PyDict_Type, &arrays, &E, &n, &S, &R, &gamma, &offset_max)) return NULL;
    if (E < 1 || n < 1 || S < 1 || R < 1) { PyErr_SetString(PyExc_ValueError, "nstep_context: E, n, S, R must be >= 1"); return NULL; }
    NStep *c = PyMem_Calloc(1, sizeof(NStep));
    if (c == NULL) return PyErr_NoMemory();
    c->E = E; c->n = n; c->S = S; c->R = R; c->gamma = gamma; c->offset_max = offset_max;
    Py_ssize_t L[32];
    const Py_ssize_t En = E * n;
    int bad = 0;
#define GET(field, type, name, k, opt) do { \
        c->field = (type)array_ptr(arrays, name, &L[k], opt); \
        if (PyErr_Occurred()) goto fail; \
    } while (0)
    GET(s_obs, char *, "s_obs", 0, 0);
    GET(s_action, char *, "s_action", 1, 0);
    GET(s_version, char *, "s_version", 2, 0);
    GET(acc, double *, "acc", 3, 0);
    GET(qsa, double *, "qsa", 4, 0);
    GET(item_prio, double *, "item_prio", 5, 0);
    GET(t, int64_t *, "t", 6, 0);
    GET(episode_row, int64_t *, "episode_row", 7, 0);
    GET(end_pending, char *, "end_pending", 8, 0);
    GET(p_prio, double *, "p_prio", 9, 0);
    GET(p_len, int64_t *, "p_len", 10, 0);
    GET(p_stream, int64_t *, "p_stream", 11, 0);
    GET(p_end, int64_t *, "p_end", 12, 0);
    GET(p_count, int64_t *, "p_count", 13, 0);
    GET(c_obs, char *, "c_obs", 14, 0);
    GET(c_action, char *, "c_action", 15, 0);
    GET(c_ret, char *, "c_ret", 16, 0);
    GET(c_disc, char *, "c_disc", 17, 0);
    GET(c_version, char *, "c_version", 18, 0);
    GET(parts, const int64_t *, "partitions", 19, 0);
    GET(counters, int64_t *, "counters", 20, 0);
    GET(wpos, int64_t *, "pos", 21, 0);
    GET(ep_start, int64_t *, "episode_start", 22, 0);
    GET(last_start, int64_t *, "last_start", 23, 0);
    GET(offsets, uint8_t *, "offsets", 24, 1);
    GET(rec_start, int64_t *, "rec_start", 25, 0);
    GET(rec_len, int32_t *, "rec_len", 26, 0);
    GET(rec_prio, double *, "rec_prio", 27, 0);
    GET(header, int64_t *, "header", 28, 0);
    int64_t *trusted;
    GET(expired, int64_t *, "expired", 29, 1);
    trusted = (int64_t *)array_ptr(arrays, "trusted", &L[30], 1);
    if (PyErr_Occurred()) goto fail;
#undef GET
    c->trust = trusted && L[30] == 8 ? trusted[0] : S;
    bad |= (c->expired && L[29] != 8) || (trusted && L[30] != 8) || c->trust < 1 || c->trust > S;
    c->obs_bytes = L[0] / En;
    c->act8 = L[1] == En * 8;
    c->ver8 = L[2] == En * 8;
    c->cap = L[9] / 8;
    c->P = L[20] / 64;
    const Py_ssize_t PS = c->P * S;
    c->ret8 = L[16] == PS * 8;
    c->disc8 = L[17] == PS * 8;
    bad |= c->obs_bytes < 1 || L[0] != En * c->obs_bytes || (L[1] != En * 8 && L[1] != En * 4) || (L[2] != En * 8 && L[2] != En * 4);
    bad |= L[3] != En * 16 || L[4] != En * 8 || L[5] != En * 8 || L[6] != E * 8 || L[7] != E * 8 || L[8] != E;
    bad |= c->cap < 1 || L[10] != c->cap * 8 || L[11] != c->cap * 8 || L[12] != c->cap * 8 || L[13] != 8;
    bad |= c->P < 1 || L[14] != PS * c->obs_bytes || L[15] != PS * (c->act8 ? 8 : 4) || L[18] != PS * (c->ver8 ? 8 : 4);
    bad |= (L[16] != PS * 8 && L[16] != PS * 4) || (L[17] != PS * 8 && L[17] != PS * 4);
    bad |= L[19] != E * 8 || L[21] != E * 8 || L[22] != E * 8 || L[23] != E * 8 || (c->offsets && L[24] != PS);
    bad |= L[25] != c->P * R * 8 || L[26] != c->P * R * 4 || L[27] != c->P * R * 8 || L[28] < (H_INSERT_LIMIT_F + 1) * 8;
    if (bad) { PyErr_SetString(PyExc_ValueError, "nstep_context: array sizes disagree with E, n, S, R"); goto fail; }
    for (Py_ssize_t e = 0; e < E; e++)
        if (c->parts[e] < 0 || c->parts[e] >= c->P) { PyErr_SetString(PyExc_ValueError, "nstep_context: partition out of range"); goto fail; }
    Py_INCREF(arrays);
    c->arrays = arrays;
    PyObject *cap = PyCapsule_New(c, "gearflow.nstep", nstep_free);
    if (cap == NULL) { Py_DECREF(arrays); PyMem_Free(c); }
    return cap;
fail:
    PyMem_Free(c);
    return NULL;
}

/* Append one row to stream e (Writer.append / extend for one step): RESERVE, the row's bytes,
 * its step offset (stacked frames), COMMIT, each store ordered after the one before. */
static inline void nstep_row(NStep *c, Py_ssize_t e, const char *obs, const char *action, double ret, double disc,
                             const char *version) {
    const int64_t p = c->parts[e], pos = c->wpos[e];
    int64_t *cnt = c->counters + p * 8;
    const int64_t row = p * c->S + pos % c->S;
    __atomic_store_n(&cnt[F_RESERVE], pos + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);  /* the reservation before the row changes */
    memcpy(c->c_obs + row * c->obs_bytes, obs, c->obs_bytes);
    memcpy(c->c_action + row * (c->act8 ? 8 : 4), action, c->act8 ? 8 : 4);
    memcpy(c->c_version + row * (c->ver8 ? 8 : 4), version, c->ver8 ? 8 : 4);
    if (c->ret8) ((double *)c->c_ret)[row] = ret; else ((float *)c->c_ret)[row] = (float)ret;
    if (c->disc8) ((double *)c->c_disc)[row] = disc; else ((float *)c->c_disc)[row] = (float)disc;
    if (c->offsets) {
        const int64_t o = pos - c->ep_start[e];
        c->offsets[row] = (uint8_t)(o < c->offset_max ? o : c->offset_max);
    }
    __atomic_store_n(&cnt[F_COMMIT], pos + 1, __ATOMIC_RELEASE);  /* commit after the row */
    c->wpos[e] = pos + 1;
}

static inline void nstep_item(NStep *c, double prio, int64_t len, int64_t stream, int64_t end) {
    const int64_t k = (*c->p_count)++;
    c->p_prio[k] = prio; c->p_len[k] = len; c->p_stream[k] = stream; c->p_end[k] = end;
}

/* A strided (b, row) view of a batch: rows of `row_bytes` contiguous bytes, `stride` apart. */
static int batch_rows(PyObject *obj, Py_buffer *v, Py_ssize_t b, Py_ssize_t row_bytes, const char *what) {
    if (PyObject_GetBuffer(obj, v, PyBUF_STRIDED_RO) < 0) return -1;
    Py_ssize_t inner = v->itemsize, ok = v->ndim >= 1 && v->shape[0] == b;
    for (int d = v->ndim - 1; ok && d >= 1; d--) {  /* every axis but the first C-contiguous */
        ok = v->strides[d] == inner;
        inner *= v->shape[d];
    }
    if (!ok || inner != row_bytes) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd rows of %zd contiguous bytes", what, b, row_bytes);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static PyObject *nstep_add(PyObject *self, PyObject *args) {
    PyObject *cap, *obs_obj, *reward_obj, *values_obj;
    Py_buffer ib, tb, ub, ab, ob = {0};
    Floats rf = {{0}}, qf = {{0}};
    long long version_ll;
    if (!PyArg_ParseTuple(args, "Oy*OOy*y*y*OL", &cap, &ib, &obs_obj, &reward_obj, &tb, &ub, &ab, &values_obj,
                          &version_ll))
        return NULL;
    PyObject *result = NULL;
    NStep *c = (NStep *)PyCapsule_GetPointer(cap, "gearflow.nstep");
    if (c == NULL) goto done;
    const Py_ssize_t b = ib.len / 8, n = c->n, E = c->E, ob_bytes = c->obs_bytes;
    if (tb.len != b || ub.len != b || ab.len != b * 8) {
        PyErr_SetString(PyExc_ValueError, "nstep_add: ids (int64), terminated, truncated (bool) and actions (int64) "
                                          "need one entry per env of the batch");
        goto done;
    }
    if (get_floats(reward_obj, &rf, "reward") < 0) goto done;
    if (rf.n != b) { PyErr_Format(PyExc_ValueError, "nstep_add: %zd rewards for %zd envs", rf.n, b); goto done; }
    Py_ssize_t A = 0;
    if (values_obj != Py_None) {
        if (get_floats(values_obj, &qf, "values") < 0) goto done;
        A = b ? qf.n / b : 0;
        if (b && (A < 1 || A * b != qf.n)) { PyErr_Format(PyExc_ValueError, "nstep_add: values must be (%zd, A)", b); goto done; }
    }
    if (batch_rows(obs_obj, &ob, b, ob_bytes, "nstep_add: obs") < 0) goto done;
    const int64_t *ids = (const int64_t *)ib.buf, *actions = (const int64_t *)ab.buf;
    const char *term = (const char *)tb.buf, *trunc = (const char *)ub.buf;
    /* checks first: nothing changes unless the whole batch can be taken */
    Py_ssize_t ndone = 0;
    for (Py_ssize_t i = 0; i < b; i++) {
        const int64_t e = ids[i];
        if (e < 0 || e >= E) { PyErr_Format(PyExc_ValueError, "streams [%lld] out of range [0, %zd)", (long long)e, E); goto done; }
        if (A && (actions[i] < 0 || actions[i] >= A)) {
            PyErr_Format(PyExc_IndexError, "index %lld is out of bounds for axis 1 with size %zd", (long long)actions[i], A);
            goto done;
        }
        if (term[i] || trunc[i]) {
            ndone++;
            if (c->end_pending[e]) { result = PyLong_FromLong(-1); goto done; }
        }
    }
    if (*c->p_count + b + ndone * 2 * n > c->cap) { result = PyLong_FromLong(-2); goto done; }
    const Py_ssize_t asz = c->act8 ? 8 : 4, vsz = c->ver8 ? 8 : 4;
    const int64_t v64 = (int64_t)version_ll;
    const int32_t v32 = (int32_t)version_ll;
    const char *vbytes = c->ver8 ? (const char *)&v64 : (const char *)&v32;
    const int64_t zero = 0;
    for (Py_ssize_t i = 0; i < b; i++) {
        const int64_t e = ids[i], t = c->t[e], en = e * n;
        const char *obs_i = (const char *)ob.buf + i * ob.strides[0];
        double *acc = c->acc + en * 2;
        /* 1. the reward that came with obs_t belongs to every staged step of its env */
        const double r = float_at(&rf, i);
        for (Py_ssize_t k = 0; k < n; k++) {
            acc[2 * k] = acc[2 * k] + acc[2 * k + 1] * r;
            acc[2 * k + 1] = acc[2 * k + 1] * c->gamma;
        }
        double qsa = 0.0, mq = 0.0;  /* Q(s_t, a_t), max_a Q(s_t, a); 0 without values */
        if (A) {
            const Py_ssize_t q0 = i * A;
            qsa = float_at(&qf, q0 + actions[i]);
            mq = float_at(&qf, q0);
            for (Py_ssize_t j = 1; j < A; j++) {
                const double x = float_at(&qf, q0 + j);
                if (x > mq || x != x) mq = x;  /* numpy's max: NaN wins */
            }
        }
        if (!(term[i] || trunc[i])) {
            /* 2. obs_t continues the episode: row t-n is complete (item t-2n has its last row) */
            const Py_ssize_t s = t % n;
            if (t >= n) {
                const double ret = acc[2 * s], disc = acc[2 * s + 1];
                const double prio = fabs(ret + disc * mq - c->qsa[en + s]);
                nstep_row(c, e, c->s_obs + (en + s) * ob_bytes, c->s_action + (en + s) * asz, ret, disc,
                          c->s_version + (en + s) * vsz);
                if (t >= 2 * n) nstep_item(c, c->item_prio[en + s], n + 1, e, c->episode_row[e] + t - n + 1);
                c->item_prio[en + s] = prio;  /* item t-n waits for row t */
            }
            /* stage step t: obs_t, the action taken, the weights' version, Q(s_t, a_t) */
            memcpy(c->s_obs + (en + s) * ob_bytes, obs_i, ob_bytes);
            if (c->act8) ((int64_t *)c->s_action)[en + s] = actions[i];
            else ((int32_t *)c->s_action)[en + s] = (int32_t)actions[i];
            memcpy(c->s_version + (en + s) * vsz, vbytes, vsz);
            c->qsa[en + s] = qsa;
            acc[2 * s] = 0.0;
            acc[2 * s + 1] = 1.0;
            c->t[e] = t + 1;
            continue;
        }
        /* 3. obs_t is the final obs_L: the episode's outstanding items (steps L-2n .. L-1; the
         * first n have rows, the last n are staged: ret truncated at L, disc 0 if terminated) */
        const int64_t L = t, row0 = c->episode_row[e];
        const int is_term = term[i] != 0;
        for (Py_ssize_t j = 0; j < 2 * n; j++) {
            const int64_t g = L - 2 * n + j;
            if (g < 0) continue;
            const Py_ssize_t sl = g % n;
            if (j < n) {
                nstep_item(c, c->item_prio[en + sl], n + 1, e, row0 + g + n + 1);
            } else {
                const double disc = is_term ? 0.0 : acc[2 * sl + 1];
                nstep_item(c, fabs(acc[2 * sl] + disc * mq - c->qsa[en + sl]), L + 1 - g, e, row0 + L + 1);
            }
        }
        /* rows: the staged steps max(0, L-n) .. L-1, then obs_L (action 0, ret 0, disc 0) */
        for (int64_t g = L > n ? L - n : 0; g < L; g++) {
            const Py_ssize_t sl = g % n;
            nstep_row(c, e, c->s_obs + (en + sl) * ob_bytes, c->s_action + (en + sl) * asz, acc[2 * sl],
                      is_term ? 0.0 : acc[2 * sl + 1], c->s_version + (en + sl) * vsz);
        }
        nstep_row(c, e, obs_i, (const char *)&zero, 0.0, 0.0, vbytes);
        /* close: the writer's episode ends at the next publish, after its items */
        c->end_pending[e] = 1;
        c->episode_row[e] += L + 1;
        c->t[e] = 0;
        for (Py_ssize_t k = 0; k < 2 * n; k++) acc[k] = 0.0;  /* empty slots: the reset step's reward reaches nothing */
    }
    result = PyLong_FromLongLong(*c->p_count);
done:
    if (ob.buf) PyBuffer_Release(&ob);
    if (rf.view.buf) PyBuffer_Release(&rf.view);
    if (qf.view.buf) PyBuffer_Release(&qf.view);
    PyBuffer_Release(&ib); PyBuffer_Release(&tb); PyBuffer_Release(&ub); PyBuffer_Release(&ab);
    return result;
}

static PyObject *nstep_publish(PyObject *self, PyObject *args) {
    PyObject *cap;
    int mode;
    if (!PyArg_ParseTuple(args, "Oi", &cap, &mode)) return NULL;
    NStep *c = (NStep *)PyCapsule_GetPointer(cap, "gearflow.nstep");
    if (c == NULL) return NULL;
    const Py_ssize_t m = *c->p_count, R = c->R, S = c->S;
    Py_ssize_t dropped = 0;
    if (mode == 0 && m) {  /* the rate limiter: the table's inserts + m within its limit */
        const int64_t limit = __atomic_load_n(&c->header[H_INSERT_LIMIT_F], __ATOMIC_RELAXED);
        if (limit != NO_LIMIT_V) {
            int64_t total = 0, waiting = 0;
            for (Py_ssize_t p = 0; p < c->P; p++) {
                total += __atomic_load_n(&c->counters[p * 8 + F_PUBLISHED], __ATOMIC_RELAXED);
                waiting |= __atomic_load_n(&c->counters[p * 8 + F_WAIT_SINCE_NS], __ATOMIC_RELAXED);
            }
            /* a writer waits for room: Python's wait_for_insert decides who goes first */
            if (total + m > limit || waiting) return PyLong_FromLong(-1);
        }
    }
    if (mode != 2 && m) {
        /* Writer.create_items' checks, with its messages; nothing is written unless all pass */
        Floats pf = {.is_f32 = 0, .n = m};
        pf.view.buf = c->p_prio;
        if (check_item_batch(&pf, m, c->p_len, 0, c->p_end, c->p_stream, 0, c->wpos, c->ep_start, S) < 0) return NULL;
        int64_t *last = PyMem_Malloc(c->E * sizeof(int64_t));
        if (last == NULL) return PyErr_NoMemory();
        memcpy(last, c->last_start, c->E * sizeof(int64_t));
        for (Py_ssize_t k = 0; k < m; k++) {
            const int64_t s = c->p_stream[k], start = c->p_end[k] - c->p_len[k];
            if (start < last[s]) {
                PyMem_Free(last);
                PyErr_SetString(PyExc_ValueError, "items of a stream must be created in order of their first step");
                return NULL;
            }
            last[s] = start;
        }
        PyMem_Free(last);
        /* the record ring's protocol, item by item: REC_RESERVE, the record, PUBLISHED; an item
         * the ring overtook since it was queued is dropped and counted (Writer.create_items'
         * expired="drop": the table would evict it unseen) */
        for (Py_ssize_t k = 0; k < m; k++) {
            const int64_t s = c->p_stream[k], p = c->parts[s], start = c->p_end[k] - c->p_len[k];
            if (start < c->wpos[s] - c->trust) {
                dropped++;
                continue;
            }
            int64_t *cnt = c->counters + p * 8;
            const int64_t seq = __atomic_load_n(&cnt[F_PUBLISHED], __ATOMIC_RELAXED);
            if (__atomic_load_n(&cnt[F_REC_RESERVE], __ATOMIC_RELAXED) < seq + 1)
                __atomic_store_n(&cnt[F_REC_RESERVE], seq + 1, __ATOMIC_RELAXED);
            __atomic_thread_fence(__ATOMIC_RELEASE);  /* the announcement before the slot changes */
            const Py_ssize_t r = p * R + seq % R;
            c->rec_start[r] = start;
            c->rec_len[r] = (int32_t)c->p_len[k];
            c->rec_prio[r] = c->p_prio[k];
            __atomic_store_n(&cnt[F_PUBLISHED], seq + 1, __ATOMIC_RELEASE);  /* publish after the record */
            c->last_start[s] = start;
        }
    }
    *c->p_count = 0;
    /* the episodes that ended: later items cannot reach back into them (Writer.end_episode) */
    for (Py_ssize_t e = 0; e < c->E; e++)
        if (c->end_pending[e]) {
            c->ep_start[e] = c->wpos[e];
            c->counters[c->parts[e] * 8 + F_EPISODES] += 1;
            c->end_pending[e] = 0;
        }
    if (dropped && c->expired) *c->expired += dropped;
    return PyLong_FromSsize_t(mode == 2 ? 0 : m - dropped);
}

/* put_rows(dst (N, ...) C-contiguous, rows int64[k], src (k, ...) rows of contiguous bytes)
 * dst[rows[i]] = src[i], one memcpy per row: Writer.append's copy of large rows (numpy's
 * fancy assignment moves them at ~0.5 GB/s, a Python loop of slice copies costs ~1 us a
 * row). The rows are checked against N before anything is copied. */
static PyObject *put_rows(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    Py_buffer db, rb, sb = {0};
    if (!PyArg_ParseTuple(args, "Oy*O", &dst_obj, &rb, &src_obj)) return NULL;
    if (PyObject_GetBuffer(dst_obj, &db, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0) { PyBuffer_Release(&rb); return NULL; }
    PyObject *result = NULL;
    const Py_ssize_t k = rb.len / 8, N = db.ndim >= 1 ? db.shape[0] : 0;
    const Py_ssize_t row = N ? db.len / N : 0;
    if (N < 1 || row < 1) { PyErr_SetString(PyExc_ValueError, "put_rows: dst needs rows"); goto done; }
    if (batch_rows(src_obj, &sb, k, row, "put_rows: src") < 0) goto done;
    const int64_t *rows = (const int64_t *)rb.buf;
    for (Py_ssize_t i = 0; i < k; i++)
        if (rows[i] < 0 || rows[i] >= N) {
            PyErr_Format(PyExc_IndexError, "put_rows: row %lld out of range [0, %zd)", (long long)rows[i], N);
            goto done;
        }
    for (Py_ssize_t i = 0; i < k; i++)
        memcpy((char *)db.buf + rows[i] * row, (const char *)sb.buf + i * sb.strides[0], row);
    result = Py_None;
    Py_INCREF(result);
done:
    if (sb.buf) PyBuffer_Release(&sb);
    PyBuffer_Release(&db);
    PyBuffer_Release(&rb);
    return result;
}

/* episode_stats(ids int64[b], reward float32|float64[b], terminated bool[b], truncated bool[b],
 *               ret float64[E], length int64[E], new_episode bool[E]) -> episodes that ended
 * An actor's per-recv episode statistics (ActorBase._observe; its numpy code is the
 * reference): ret[e] += r, new_episode[e] = done, length[e] += 1 unless done (an ended
 * episode is reported, then zeroed, by the caller). */
static PyObject *episode_stats(PyObject *self, PyObject *args) {
    Py_buffer ib, tb, ub, rb, lb, nb;
    PyObject *reward_obj;
    Floats rf = {{0}};
    if (!PyArg_ParseTuple(args, "y*Oy*y*w*w*w*", &ib, &reward_obj, &tb, &ub, &rb, &lb, &nb)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t b = ib.len / 8, E = nb.len;
    if (get_floats(reward_obj, &rf, "reward") < 0) goto done;
    if (rf.n != b || tb.len != b || ub.len != b || rb.len != E * 8 || lb.len != E * 8) {
        PyErr_SetString(PyExc_ValueError, "episode_stats: one reward and flag per id; ret, length, new_episode per env");
        goto done;
    }
    const int64_t *ids = (const int64_t *)ib.buf;
    const char *term = (const char *)tb.buf, *trunc = (const char *)ub.buf;
    for (Py_ssize_t i = 0; i < b; i++)
        if (ids[i] < 0 || ids[i] >= E) { PyErr_Format(PyExc_ValueError, "env id %lld out of range [0, %zd)", (long long)ids[i], E); goto done; }
    double *ret = (double *)rb.buf;
    int64_t *len = (int64_t *)lb.buf;
    char *fresh = (char *)nb.buf;
    long ended = 0;
    for (Py_ssize_t i = 0; i < b; i++) {
        const int64_t e = ids[i];
        const int d = term[i] || trunc[i];
        ret[e] = ret[e] + float_at(&rf, i);
        fresh[e] = (char)d;
        len[e] += !d;
        ended += d;
    }
    result = PyLong_FromLong(ended);
done:
    if (rf.view.buf) PyBuffer_Release(&rf.view);
    PyBuffer_Release(&ib); PyBuffer_Release(&tb); PyBuffer_Release(&ub); PyBuffer_Release(&rb);
    PyBuffer_Release(&lb); PyBuffer_Release(&nb);
    return result;
}

static PyMethodDef methods[] = {
    {"find", sumtree_find, METH_VARARGS, "find(levels, fanout, targets, out): leaf of each target"},
    {"set", sumtree_set, METH_VARARGS, "set(levels, fanout, indices, values): set leaves, recompute ancestors"},
    {"sample_proportional", sample_proportional, METH_VARARGS,
     "sample_proportional(levels, fanout, uniforms, count, beta, slots, probs, weights, group=B)"},
    {"window_rows", window_rows, METH_VARARGS, "window_rows(parts, starts, lengths, S, T, rows) -> padded"},
    {"take_rows", take_rows, METH_VARARGS, "take_rows(src, k, idx, out): out = src[idx].T with prefetching"},
    {"set_priorities", set_priorities, METH_VARARGS,
     "set_priorities(levels, fanout, size, slots, priorities, alpha, skip_negative) -> leaves set"},
    {"rebuild", rebuild, METH_VARARGS, "rebuild(levels, fanout): every parent re-summed from its children"},
    {"make_live", make_live, METH_VARARGS, "make_live(position, live, count, slots) -> count"},
    {"make_dead", make_dead, METH_VARARGS, "make_dead(position, live, count, slots) -> count"},
    {"update_by_key", update_by_key, METH_VARARGS,
     "update_by_key(levels, fanout, keys, P, R, slot_rec, slot_live, priorities, alpha) -> applied"},
    {"update_by_key_raw", update_by_key_raw, METH_VARARGS,
     "update_by_key_raw(levels, fanout, keys_addr, prios_addr, n, prios_f32, P, R, slot_rec, slot_live, alpha) -> applied"},
    {"stream_items", stream_items, METH_VARARGS,
     "stream_items(start, length, priority, counters, ends, num_steps, priorities, S, pos, ep0, last_start, "
     "stream, published_field, rec_reserve_field, trusted_steps) -> last start"},
    {"scan", scan, METH_VARARGS,
     "scan(counters, item_start, item_length, item_priority, ingested, live_lo, seen_reserve, S, max_len, "
     "seen_total, first_p, slot_rec, slot_live, new_slots, new_prios, gone) -> (total, next_p, new, gone, replaced, bad)"},
    {"counter_total", counter_total, METH_VARARGS, "counter_total(counters) -> sum of RESERVE, COMMIT, PUBLISHED"},
    {"key_slots", key_slots, METH_VARARGS, "key_slots(keys, P, R, slot_rec, slot_live, out) -> valid"},
    {"put_rows", put_rows, METH_VARARGS, "put_rows(dst, rows, src): dst[rows[i]] = src[i], a memcpy per row"},
    {"episode_stats", episode_stats, METH_VARARGS,
     "episode_stats(ids, reward, terminated, truncated, ret, length, new_episode) -> episodes ended"},
    {"nstep_context", nstep_context, METH_VARARGS, "nstep_context(arrays, E, n, S, R, gamma, offset_max) -> context"},
    {"nstep_add", nstep_add, METH_VARARGS,
     "nstep_add(ctx, ids, obs, reward, terminated, truncated, actions, values, version) -> pending items (-1, -2: see source)"},
    {"nstep_publish", nstep_publish, METH_VARARGS, "nstep_publish(ctx, mode) -> items published (-1: held by the rate limiter)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hotpath", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hotpath(void) { return PyModule_Create(&module); }
