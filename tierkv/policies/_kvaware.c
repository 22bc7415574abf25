/* kvaware's inner loops in C: insert, evict and the admission of a chain's run, step for step as
 * kvaware_loops.py and kvaware_admission.admit_chain; and the batch operations of the ghost
 * history every policy keeps (history.py: trim, put_many).
 *
 * The Python functions are the reference; these run the same steps over the same state (the
 * policy's state tuple: int tables in array('q')s, read here as memory, and the dicts and sets
 * of keys), so a policy can switch between them at any call and test_policies.py requires both
 * to leave the same state. Built by setup.py where a compiler is (optional;
 * TIERKV_NO_EXTENSIONS=1 skips it).
 *
 * The file stays whole (over 400 lines): the three loops splice the same queues and write the
 * same history through the helpers above them, and it is read side by side with the Python.
 *
 * State tuple: (links, history, kids, slot_of, where, code, qcode, key_of, parent_of, back,
 *               fanout, pending, small); links: Links(flat=True) (prev, next, size, queue:
 *               array('q'); base: int); history: History (value: key -> stamp << 4 | count,
 *               order: stamp -> key, stamp, oldest: int); where, code, qcode, back, fanout:
 *               array('q') per slot; key_of, parent_of: dicts slot -> key (untracked by
 *               the collector while their keys are atomic; a missing parent is None).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAX_COUNT 15
#define MASK 63
#define ORPHANS 64
#define ORPHAN (-1)
#define UNLINKED (-1)
#define DECAY 0.999 /* kvaware_admission.SCAN_DECAY (checked at import by kvaware_loops) */
#define ABI 3       /* kvaware_loops.ABI: raise both when a function's arguments change */

static const int64_t VALUE[16] = {0, 2, 5, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32};

/* attribute names, interned once */
static PyObject *S_prev, *S_next, *S_size, *S_queue, *S_base, *S_value, *S_order, *S_stamp,
    *S_oldest;

/* -- a growable array of slots ---------------------------------------------------------- */

typedef struct {
    int64_t *v;
    Py_ssize_t n, cap;
} Vec;

static int vec_push(Vec *a, int64_t x) {
    if (a->n == a->cap) {
        Py_ssize_t cap = a->cap ? 2 * a->cap : 64;
        int64_t *v = PyMem_Realloc(a->v, (size_t)cap * sizeof(int64_t));
        if (v == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = x;
    return 0;
}

/* -- the state ---------------------------------------------------------------------------- */

enum { B_PRV, B_NXT, B_SIZE, B_QUEUE, B_WHERE, B_CODE, B_QCODE, B_BACK, B_FANOUT, N_BUF };

typedef struct {
    PyObject *hist, *kids, *slot_of, *key_of, *parent_of, *pending, *small; /* borrowed */
    PyObject *value, *order;                                               /* new references */
    Py_buffer buf[N_BUF];
    int held[N_BUF];
    int64_t *prv, *nxt, *size, *queue, *where, *code, *qcode, *back, *fanout;
    Py_ssize_t base, capacity;
    long long stamp, oldest;
} State;

static void state_release(State *st) {
    for (int i = 0; i < N_BUF; i++) {
        if (st->held[i]) {
            PyBuffer_Release(&st->buf[i]);
            st->held[i] = 0;
        }
    }
    Py_CLEAR(st->value);
    Py_CLEAR(st->order);
}

/* A writable array('q') of exactly len items (len < 0: any), as memory. */
static int64_t *table(State *st, int which, PyObject *obj, Py_ssize_t len, const char *what) {
    Py_buffer *b = &st->buf[which];
    if (PyObject_GetBuffer(obj, b, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "kvaware state: %s is not a writable array('q')", what);
        return NULL;
    }
    st->held[which] = 1;
    if (b->itemsize != 8 || b->format == NULL || strcmp(b->format, "q") != 0 ||
        (len >= 0 && b->len != len * 8)) {
        PyErr_Format(PyExc_TypeError, "kvaware state: %s is not an array('q') of %zd", what, len);
        return NULL;
    }
    return (int64_t *)b->buf;
}

static int64_t *attr_table(State *st, int which, PyObject *obj, PyObject *name, Py_ssize_t len) {
    PyObject *o = PyObject_GetAttr(obj, name);
    if (o == NULL)
        return NULL;
    int64_t *t = table(st, which, o, len, PyUnicode_AsUTF8(name));
    Py_DECREF(o);
    return t;
}

static int get_ll(PyObject *obj, PyObject *name, long long *out) {
    PyObject *o = PyObject_GetAttr(obj, name);
    if (o == NULL)
        return -1;
    *out = PyLong_AsLongLong(o);
    Py_DECREF(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* The history's dicts and counters. */
static int hist_load(State *st, PyObject *hist) {
    st->hist = hist;
    st->value = PyObject_GetAttr(hist, S_value);
    st->order = PyObject_GetAttr(hist, S_order);
    if (st->value == NULL || st->order == NULL)
        return -1;
    if (!PyDict_CheckExact(st->value) || !PyDict_CheckExact(st->order)) {
        PyErr_SetString(PyExc_TypeError, "kvaware state: the history is not two dicts");
        return -1;
    }
    if (get_ll(hist, S_stamp, &st->stamp) < 0 || get_ll(hist, S_oldest, &st->oldest) < 0)
        return -1;
    return 0;
}

static int state_load(State *st, PyObject *tuple) {
    memset(st, 0, sizeof(*st));
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != 13) {
        PyErr_SetString(PyExc_TypeError, "kvaware state: a tuple of 13 expected");
        return -1;
    }
    PyObject **it = &PyTuple_GET_ITEM(tuple, 0);
    PyObject *links = it[0];
    st->kids = it[2];
    st->slot_of = it[3];
    st->key_of = it[7];
    st->parent_of = it[8];
    st->pending = it[11];
    st->small = it[12];
    if (!PyDict_CheckExact(st->kids) || !PyDict_CheckExact(st->pending) ||
        !PyAnySet_Check(st->small) || !PyDict_CheckExact(st->key_of) ||
        !PyDict_CheckExact(st->parent_of)) {
        PyErr_SetString(PyExc_TypeError, "kvaware state: unexpected container types");
        goto fail;
    }
    long long base;
    if (get_ll(links, S_base, &base) < 0)
        goto fail;
    if (base < 0) {
        PyErr_SetString(PyExc_TypeError, "kvaware state: links of a negative capacity");
        goto fail;
    }
    Py_ssize_t cap = st->capacity = (Py_ssize_t)base;
    st->base = (Py_ssize_t)base;
    if ((st->prv = attr_table(st, B_PRV, links, S_prev, cap + ORPHANS + 1)) == NULL ||
        (st->nxt = attr_table(st, B_NXT, links, S_next, cap + ORPHANS + 1)) == NULL ||
        (st->size = attr_table(st, B_SIZE, links, S_size, ORPHANS + 1)) == NULL ||
        (st->queue = attr_table(st, B_QUEUE, links, S_queue, cap)) == NULL ||
        (st->where = table(st, B_WHERE, it[4], cap, "where")) == NULL ||
        (st->code = table(st, B_CODE, it[5], cap, "code")) == NULL ||
        (st->qcode = table(st, B_QCODE, it[6], cap, "qcode")) == NULL ||
        (st->back = table(st, B_BACK, it[9], cap, "back")) == NULL ||
        (st->fanout = table(st, B_FANOUT, it[10], cap, "fanout")) == NULL)
        goto fail;
    if (hist_load(st, it[1]) < 0)
        goto fail;
    return 0;
fail:
    state_release(st);
    return -1;
}

/* Writes the history's counters back (also after an error: the dicts are in step with them). */
static int state_store(State *st) {
    PyObject *t = PyLong_FromLongLong(st->stamp);
    PyObject *o = PyLong_FromLongLong(st->oldest);
    int rc = -1;
    if (t != NULL && o != NULL && PyObject_SetAttr(st->hist, S_stamp, t) == 0 &&
        PyObject_SetAttr(st->hist, S_oldest, o) == 0)
        rc = 0;
    Py_XDECREF(t);
    Py_XDECREF(o);
    return rc;
}

/* Keeps the current exception while the counters are written back. */
static void state_store_on_error(State *st) {
    if (st->hist == NULL || st->value == NULL)
        return;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    state_store(st);
    PyErr_Restore(et, ev, tb);
}

static int check_slot(State *st, Py_ssize_t s) {
    if (s < 0 || s >= st->capacity) {
        PyErr_Format(PyExc_IndexError, "kvaware: slot %zd outside 0..%zd", s, st->capacity - 1);
        return -1;
    }
    return 0;
}

/* slot_of[key] (a KeyError when missing), checked to be a slot. */
static Py_ssize_t slot_of(State *st, PyObject *key) {
    PyObject *o;
    if (PyDict_CheckExact(st->slot_of)) {
        o = PyDict_GetItemWithError(st->slot_of, key);
        if (o == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        Py_INCREF(o);
    } else if ((o = PyObject_GetItem(st->slot_of, key)) == NULL) {
        return -1;
    }
    Py_ssize_t s = PyLong_AsSsize_t(o);
    Py_DECREF(o);
    if (s == -1 && PyErr_Occurred())
        return -1;
    return check_slot(st, s) < 0 ? -1 : s;
}

/* -- the history (History.put / pop / trim) ---------------------------------------------- */

static int hist_put(State *st, PyObject *key, long long count) {
    PyObject *old = PyDict_GetItemWithError(st->value, key);
    if (old != NULL) {
        long long v = PyLong_AsLongLong(old);
        if (v == -1 && PyErr_Occurred())
            return -1;
        PyObject *t = PyLong_FromLongLong(v >> 4);
        if (t == NULL)
            return -1;
        int rc = PyDict_DelItem(st->order, t);
        Py_DECREF(t);
        if (rc < 0)
            return -1;
    } else if (PyErr_Occurred()) {
        return -1;
    }
    PyObject *v = PyLong_FromLongLong((st->stamp << 4) | count);
    PyObject *t = PyLong_FromLongLong(st->stamp);
    int rc = -1;
    if (v != NULL && t != NULL && PyDict_SetItem(st->value, key, v) == 0 &&
        PyDict_SetItem(st->order, t, key) == 0) {
        st->stamp++;
        rc = 0;
    }
    Py_XDECREF(v);
    Py_XDECREF(t);
    return rc;
}

/* Forget key; its count in *count (0 when it was not remembered). */
static int hist_pop(State *st, PyObject *key, long long *count) {
    *count = 0;
    PyObject *old = PyDict_GetItemWithError(st->value, key);
    if (old == NULL)
        return PyErr_Occurred() ? -1 : 0;
    long long v = PyLong_AsLongLong(old);
    if (v == -1 && PyErr_Occurred())
        return -1;
    PyObject *t = PyLong_FromLongLong(v >> 4);
    if (t == NULL)
        return -1;
    int rc = PyDict_DelItem(st->order, t);
    Py_DECREF(t);
    if (rc < 0 || PyDict_DelItem(st->value, key) < 0)
        return -1;
    *count = v & 15;
    return 0;
}

static int hist_trim(State *st, double limit) {
    if ((double)PyDict_GET_SIZE(st->value) <= limit)
        return 0;
    long long t = st->oldest;
    if (limit < 0)
        limit = 0;
    while ((double)PyDict_GET_SIZE(st->value) > limit) {
        PyObject *kt = PyLong_FromLongLong(t);
        if (kt == NULL)
            return -1;
        PyObject *key = PyDict_GetItemWithError(st->order, kt);
        if (key == NULL) {
            Py_DECREF(kt);
            if (PyErr_Occurred())
                return -1;
            t++;
            continue;
        }
        Py_INCREF(key);
        int rc = PyDict_DelItem(st->order, kt);
        Py_DECREF(kt);
        if (rc == 0)
            rc = PyDict_DelItem(st->value, key);
        Py_DECREF(key);
        if (rc < 0)
            return -1;
        t++;
    }
    st->oldest = t;
    return 0;
}

/* -- queue splices (Links) ------------------------------------------------------------------ */

static void unlink_slot(State *st, int64_t c) {
    int64_t a = st->prv[c], z = st->nxt[c];
    st->nxt[a] = z;
    st->prv[z] = a;
    st->prv[c] = UNLINKED;
    st->size[st->queue[c]]--;
}

static void append_slot(State *st, int64_t q, int64_t s) {
    int64_t h = st->base + q, t = st->prv[h];
    st->nxt[t] = s;
    st->prv[s] = t;
    st->nxt[s] = h;
    st->prv[h] = s;
    st->queue[s] = q;
    st->size[q]++;
}

static void extend_slots(State *st, int64_t q, const int64_t *slots, Py_ssize_t k) {
    int64_t h = st->base + q, t = st->prv[h];
    for (Py_ssize_t i = 0; i < k; i++) {
        st->nxt[t] = slots[i];
        st->prv[slots[i]] = t;
        st->queue[slots[i]] = q;
        t = slots[i];
    }
    st->nxt[t] = h;
    st->prv[h] = t;
    st->size[q] += k;
}

/* The slot of the next child of mine (kids.get(key): a key or a set of keys); *it and *done
 * track the walk (start them at NULL and 0; the caller releases *it). Returns the slot, -1 at
 * the end, -2 on error (an exception is set). */
static Py_ssize_t next_child_slot(State *st, PyObject *mine, PyObject **it, int *done) {
    PyObject *child;
    if (PySet_Check(mine)) {
        if (*it == NULL && (*it = PyObject_GetIter(mine)) == NULL)
            return -2;
        if ((child = PyIter_Next(*it)) == NULL)
            return PyErr_Occurred() ? -2 : -1;
    } else {
        if ((*done)++)
            return -1;
        child = mine;
        Py_INCREF(child);
    }
    Py_ssize_t c = slot_of(st, child);
    Py_DECREF(child);
    return c < 0 ? -2 : c;
}

/* Strand the children of a victim (mine: kids.get(key), a key or a set of keys): each one
 * still in a bucket leaves it, becomes an orphan and is pushed on fresh. */
static int strand(State *st, PyObject *mine, Vec *fresh) {
    PyObject *it = NULL;
    int done = 0, rc = 0;
    Py_ssize_t c;
    while ((c = next_child_slot(st, mine, &it, &done)) >= 0) {
        if (st->where[c] != ORPHAN) { /* out of its bucket (Links.unlink) */
            unlink_slot(st, c);
            st->where[c] = ORPHAN; /* (an orphan's qcode is never read) */
            if (vec_push(fresh, c) < 0) {
                rc = -1;
                break;
            }
        }
    }
    Py_XDECREF(it);
    return c == -2 ? -1 : rc;
}

/* The victim key leaves its parent's children (orphan path: kids.pop, put back if others). */
static int leave_parent_popping(State *st, PyObject *parent, PyObject *key) {
    PyObject *sibs = PyDict_GetItemWithError(st->kids, parent);
    if (sibs == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, parent);
        return -1;
    }
    Py_INCREF(sibs);
    int rc = PyDict_DelItem(st->kids, parent);
    if (rc == 0 && sibs != key) {
        if (PySet_Check(sibs)) {
            rc = PySet_Discard(sibs, key) < 0 ? -1 : 0;
            if (rc == 0 && PySet_GET_SIZE(sibs))
                rc = PyDict_SetItem(st->kids, parent, sibs);
        } else {
            int ne = PyObject_RichCompareBool(sibs, key, Py_NE);
            if (ne < 0)
                rc = -1;
            else if (ne)
                rc = PyDict_SetItem(st->kids, parent, sibs);
        }
    }
    Py_DECREF(sibs);
    return rc;
}

/* The victim key leaves its parent's children (bucket path: in place). */
static int leave_parent(State *st, PyObject *parent, PyObject *key) {
    PyObject *sibs = PyDict_GetItemWithError(st->kids, parent);
    if (sibs == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, parent);
        return -1;
    }
    if (PySet_Check(sibs)) {
        if (PySet_Discard(sibs, key) < 0)
            return -1;
        if (!PySet_GET_SIZE(sibs))
            return PyDict_DelItem(st->kids, parent);
        return 0;
    }
    Py_INCREF(sibs);
    int eq = PyObject_RichCompareBool(sibs, key, Py_EQ);
    Py_DECREF(sibs);
    if (eq < 0)
        return -1;
    return eq ? PyDict_DelItem(st->kids, parent) : 0;
}

/* A victim leaves: its parent's children, its own stranded (pushed on fresh), remembered. */
static int leave(State *st, int64_t s, int popping, int look, Vec *fresh) {
    PyObject *i = PyLong_FromLongLong(s);
    if (i == NULL)
        return -1;
    PyObject *key = PyDict_GetItemWithError(st->key_of, i);
    PyObject *parent = key != NULL ? PyDict_GetItemWithError(st->parent_of, i) : NULL;
    Py_DECREF(i);
    if (key == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_RuntimeError, "kvaware: slot %lld has no key", (long long)s);
        return -1;
    }
    if (parent == NULL) {
        if (PyErr_Occurred())
            return -1;
        parent = Py_None; /* kept: restore_slots reads it */
    }
    int rc = 0;
    Py_INCREF(key);
    Py_INCREF(parent);
    if (parent != Py_None)
        rc = popping ? leave_parent_popping(st, parent, key) : leave_parent(st, parent, key);
    if (rc == 0 && look) {
        PyObject *mine = PyDict_GetItemWithError(st->kids, key);
        if (mine != NULL) {
            Py_INCREF(mine);
            rc = strand(st, mine, fresh);
            Py_DECREF(mine);
        } else if (PyErr_Occurred()) {
            rc = -1;
        }
    }
    if (rc == 0)
        rc = hist_put(st, key, st->code[s] & 15);
    Py_DECREF(parent);
    Py_DECREF(key);
    return rc;
}

static int can_go(PyObject *can_evict, int64_t s) {
    if (can_evict == Py_None)
        return 1;
    PyObject *arg = PyLong_FromLongLong(s);
    if (arg == NULL)
        return -1;
    PyObject *r = PyObject_CallOneArg(can_evict, arg);
    Py_DECREF(arg);
    if (r == NULL)
        return -1;
    int ok = PyObject_IsTrue(r);
    Py_DECREF(r);
    return ok;
}

/* skips: bucket priority -> unevictable pages still to pass over (a short list of pairs) */
typedef struct {
    int64_t *prio, *left;
    Py_ssize_t n, cap;
} Skips;

static int64_t *skips_find(Skips *k, int64_t prio) {
    for (Py_ssize_t i = 0; i < k->n; i++)
        if (k->prio[i] == prio)
            return &k->left[i];
    return NULL;
}

static int skips_set(Skips *k, int64_t prio, int64_t left) {
    int64_t *at = skips_find(k, prio);
    if (at != NULL) {
        *at = left;
        return 0;
    }
    if (k->n == k->cap) {
        Py_ssize_t cap = k->cap ? 2 * k->cap : 16;
        int64_t *p = PyMem_Realloc(k->prio, (size_t)cap * sizeof(int64_t));
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        k->prio = p;
        int64_t *l = PyMem_Realloc(k->left, (size_t)cap * sizeof(int64_t));
        if (l == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        k->left = l;
        k->cap = cap;
    }
    k->prio[k->n] = prio;
    k->left[k->n++] = left;
    return 0;
}

/* On an error: the history trimmed and written back on the way out, as the Python does (the
 * current exception kept). */
static void unwind(State *st, double limit) {
    if (PyErr_Occurred()) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (hist_trim(st, limit) < 0)
            PyErr_Clear();
        PyErr_Restore(et, ev, tb);
    }
    state_store_on_error(st);
}

/* -- evict ------------------------------------------------------------------------------------ */

/* evict(st, n, can_evict, limit, floor, left, used, seen)
 *   -> (victims, floor, left, used, seen); see kvaware_loops.evict. */
static PyObject *evict(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "evict() takes 8 arguments");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    PyObject *can_evict = args[2];
    double limit = PyFloat_AsDouble(args[3]);
    long long floor = PyLong_AsLongLong(args[4]);
    double left = PyFloat_AsDouble(args[5]);
    double used = PyFloat_AsDouble(args[6]);
    Py_ssize_t seen = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred())
        return NULL;
    State st;
    if (state_load(&st, args[0]) < 0)
        return NULL;
    PyObject *result = NULL;
    Vec out = {0}, fresh = {0}, passed = {0}, merged = {0};
    Skips skips = {0};
    int64_t prio = floor, top = floor + MASK + 1, moved = 0, lap = -1;
    int64_t *size = st.size, *nxt = st.nxt, *prv = st.prv, *code = st.code, *back = st.back;
    int orphans = size[ORPHANS] > 0, ok;
    while (out.n < n) {
        if (orphans) { /* the orphan queue, then the fresh ones; evicting one strands its kids */
            orphans = 0;
            int64_t sz = size[ORPHANS];
            if (sz) { /* fresh[:0] = links.take(ORPHANS, sz, None) */
                int64_t h = st.base + ORPHANS, s = nxt[h];
                merged.n = 0;
                for (int64_t i = 0; i < sz; i++) {
                    if (vec_push(&merged, s) < 0)
                        goto error;
                    prv[s] = UNLINKED;
                    s = nxt[s];
                }
                nxt[h] = s;
                prv[s] = h;
                size[ORPHANS] = 0;
                for (Py_ssize_t i = 0; i < fresh.n; i++)
                    if (vec_push(&merged, fresh.v[i]) < 0)
                        goto error;
                Vec tmp = fresh;
                fresh = merged;
                merged = tmp;
            }
            passed.n = 0;
            Py_ssize_t need = n - out.n; /* >= 1 here */
            Py_ssize_t i = 0;
            while (i < fresh.n) { /* grows as children are stranded */
                int64_t s = fresh.v[i++];
                ok = can_go(can_evict, s);
                if (ok < 0)
                    goto error;
                if (!ok) {
                    if (vec_push(&passed, s) < 0)
                        goto error;
                    continue;
                }
                if (back[s] >= 0) {
                    left = left * DECAY + 1.0;
                    used = used * DECAY + (code[s] != back[s]);
                    seen++;
                }
                if (leave(&st, s, 1, 1, &fresh) < 0 || vec_push(&out, s) < 0)
                    goto error;
                if (!--need)
                    break;
            }
            if (i < fresh.n)
                extend_slots(&st, ORPHANS, fresh.v + i, fresh.n - i);
            if (passed.n)
                extend_slots(&st, ORPHANS, passed.v, passed.n);
            fresh.n = 0;
            continue;
        }
        int64_t b = prio & MASK;
        int64_t *skip = skips.n ? skips_find(&skips, prio) : NULL;
        if (!size[b] || (skip != NULL && *skip <= 0)) {
            prio++;
            if (prio >= top) { /* see Laps (kvaware.py) */
                if (out.n + moved == lap)
                    break;
                lap = out.n + moved;
                top = prio + MASK + 1;
            }
            continue;
        }
        int64_t hb = st.base + b, s = nxt[hb], cd = code[s];
        if (cd != st.qcode[s]) { /* used since it was queued: to its bucket now (Links.move) */
            int64_t p = (cd >> 4) + VALUE[cd & 15], q = p & MASK, h = st.base + q, z, a;
            st.qcode[s] = cd;
            st.where[s] = p;
            moved++;
            z = nxt[s];
            nxt[hb] = z;
            prv[z] = hb;
            a = prv[h];
            nxt[a] = s;
            prv[s] = a;
            nxt[s] = h;
            prv[h] = s;
            size[b]--;
            size[q]++;
            st.queue[s] = q;
            continue;
        }
        ok = can_go(can_evict, s);
        if (ok < 0)
            goto error;
        if (ok) {
            floor = prio;
            if (back[s] >= 0) {
                left = left * DECAY + 1.0;
                used = used * DECAY + (cd != back[s]);
                seen++;
            }
            int64_t z = nxt[s]; /* out of its bucket (Links.unlink) */
            nxt[hb] = z;
            prv[z] = hb;
            prv[s] = UNLINKED;
            size[b]--;
            if (leave(&st, s, 0, PyDict_GET_SIZE(st.kids) > 0, &fresh) < 0 ||
                vec_push(&out, s) < 0)
                goto error;
            orphans = fresh.n > 0 || size[ORPHANS] > 0; /* the victim's kids go next */
        } else { /* to the back of its queue (Links.move): passed over this call */
            int64_t p = prv[s], z = nxt[s], t;
            nxt[p] = z;
            prv[z] = p;
            t = prv[hb];
            nxt[t] = s;
            prv[s] = t;
            nxt[s] = hb;
            prv[hb] = s;
            if (skips_set(&skips, prio, (skip != NULL ? *skip : size[b]) - 1) < 0)
                goto error;
        }
    }
    if (fresh.n) /* stranded by the last victim, with no room left to evict them: queued */
        extend_slots(&st, ORPHANS, fresh.v, fresh.n);
    /* the history trimmed once for the call, as kvaware_loops.evict does */
    if (hist_trim(&st, limit) < 0 || state_store(&st) < 0)
        goto error;
    PyObject *victims = PyList_New(out.n);
    if (victims == NULL)
        goto error;
    for (Py_ssize_t i = 0; i < out.n; i++) {
        PyObject *o = PyLong_FromLongLong(out.v[i]);
        if (o == NULL) {
            Py_DECREF(victims);
            goto error;
        }
        PyList_SET_ITEM(victims, i, o);
    }
    result = Py_BuildValue("(NLddn)", victims, floor, left, used, seen);
    goto done;
error:
    unwind(&st, limit);
    result = NULL;
done:
    PyMem_Free(out.v);
    PyMem_Free(fresh.v);
    PyMem_Free(passed.v);
    PyMem_Free(merged.v);
    PyMem_Free(skips.prio);
    PyMem_Free(skips.left);
    state_release(&st);
    return result;
}

/* -- evict_given ------------------------------------------------------------------------------ */

/* evict_given(st, slots, limit, left, used, seen) -> (left, used, seen); see
 * kvaware_loops.evict_given: the victims a caller chose, each taken as evict() takes one. */
static PyObject *evict_given(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "evict_given() takes 6 arguments");
        return NULL;
    }
    double limit = PyFloat_AsDouble(args[2]);
    double left = PyFloat_AsDouble(args[3]);
    double used = PyFloat_AsDouble(args[4]);
    Py_ssize_t seen = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *slots = PySequence_Fast(args[1], "evict_given: slots must be a sequence");
    if (slots == NULL)
        return NULL;
    State st;
    if (state_load(&st, args[0]) < 0) {
        Py_DECREF(slots);
        return NULL;
    }
    PyObject *result = NULL;
    Vec fresh = {0};
    int64_t *prv = st.prv, *code = st.code, *back = st.back;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(slots);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t s = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(slots, i));
        if (s == -1 && PyErr_Occurred())
            goto error;
        if (check_slot(&st, s) < 0)
            goto error;
        if (back[s] >= 0) {
            left = left * DECAY + 1.0;
            used = used * DECAY + (code[s] != back[s]);
            seen++;
        }
        if (prv[s] == UNLINKED) { /* stranded by an earlier victim of this call */
            Py_ssize_t j = 0;
            while (j < fresh.n && fresh.v[j] != s)
                j++;
            if (j == fresh.n) { /* not held: the caller broke the contract (del fresh[s]) */
                PyErr_Format(PyExc_KeyError, "kvaware: slot %zd is not held", s);
                goto error;
            }
            memmove(fresh.v + j, fresh.v + j + 1, (size_t)(fresh.n - j - 1) * sizeof(int64_t));
            fresh.n--;
        } else {
            unlink_slot(&st, s);
        }
        if (leave(&st, s, 0, PyDict_GET_SIZE(st.kids) > 0, &fresh) < 0)
            goto error;
    }
    if (fresh.n)
        extend_slots(&st, ORPHANS, fresh.v, fresh.n);
    if (hist_trim(&st, limit) < 0 || state_store(&st) < 0)
        goto error;
    result = Py_BuildValue("(ddn)", left, used, seen);
    goto done;
error:
    unwind(&st, limit);
    result = NULL;
done:
    PyMem_Free(fresh.v);
    Py_DECREF(slots);
    state_release(&st);
    return result;
}

/* -- insert ----------------------------------------------------------------------------------- */

/* Requeue the stranded children of a page that came back (orphans no more): to their buckets
 * with their priority counting from floor. */
static int unstrand(State *st, PyObject *mine, long long floor) {
    PyObject *it = NULL;
    int done = 0;
    Py_ssize_t c;
    while ((c = next_child_slot(st, mine, &it, &done)) >= 0) {
        if (st->where[c] != ORPHAN)
            continue;
        unlink_slot(st, c);
        int64_t cd = (floor << 4) + (st->code[c] & 15), p = (cd >> 4) + VALUE[cd & 15];
        st->code[c] = st->qcode[c] = cd;
        st->where[c] = p;
        append_slot(st, p & MASK, c);
    }
    Py_XDECREF(it);
    return c == -2 ? -1 : 0;
}

static int set_obj(PyObject *dict, Py_ssize_t i, PyObject *o) {
    PyObject *k = PyLong_FromSsize_t(i);
    if (k == NULL)
        return -1;
    int rc = PyDict_SetItem(dict, k, o);
    Py_DECREF(k);
    return rc;
}

/* insert(st, slots, keys, parents, lasts, check, floor) -> None; see kvaware_loops.insert. */
static PyObject *insert(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "insert() takes 7 arguments");
        return NULL;
    }
    int check = PyObject_IsTrue(args[5]);
    long long floor = PyLong_AsLongLong(args[6]);
    if (check < 0 || PyErr_Occurred())
        return NULL;
    State st;
    if (state_load(&st, args[0]) < 0)
        return NULL;
    PyObject *slots = NULL, *keys = NULL, *parents = NULL, *lasts = NULL, *result = NULL;
    PyObject *newset = NULL;
    slots = PySequence_Fast(args[1], "insert(): slots must be a sequence");
    keys = PySequence_Fast(args[2], "insert(): keys must be a sequence");
    parents = PySequence_Fast(args[3], "insert(): parents must be a sequence");
    lasts = PySequence_Fast(args[4], "insert(): lasts must be a sequence");
    if (!slots || !keys || !parents || !lasts)
        goto error;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(slots); /* zip: the shortest */
    n = Py_MIN(n, PySequence_Fast_GET_SIZE(keys));
    n = Py_MIN(n, PySequence_Fast_GET_SIZE(parents));
    n = Py_MIN(n, PySequence_Fast_GET_SIZE(lasts));
    PyObject *prev = NULL; /* the page inserted just before (see kvaware_loops.insert) */
    int free_ = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t s = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(slots, i));
        if ((s == -1 && PyErr_Occurred()) || check_slot(&st, s) < 0)
            goto error;
        PyObject *k = PySequence_Fast_GET_ITEM(keys, i);
        PyObject *parent = PySequence_Fast_GET_ITEM(parents, i);
        int last = PyObject_IsTrue(PySequence_Fast_GET_ITEM(lasts, i));
        long long seen;
        if (last < 0 || hist_pop(&st, k, &seen) < 0)
            goto error;
        int64_t c = last && !seen ? 0 : Py_MIN(seen + 1, MAX_COUNT);
        if (c == 1 && PySet_GET_SIZE(st.small)) {
            int in = PySet_Contains(st.small, k);
            if (in < 0)
                goto error;
            if (in)
                c = 2;
        }
        int64_t cd = (floor << 4) + c;
        st.code[s] = st.qcode[s] = cd;
        st.back[s] = seen ? cd : -1;
        if (set_obj(st.key_of, s, k) < 0)
            goto error;
        PyObject *fan = PyDict_GetItemWithError(st.pending, k);
        if (fan != NULL) {
            Py_ssize_t f = PyLong_AsSsize_t(fan);
            if ((f == -1 && PyErr_Occurred()) || PyDict_DelItem(st.pending, k) < 0)
                goto error;
            st.fanout[s] = f;
        } else if (PyErr_Occurred()) {
            goto error;
        } else {
            st.fanout[s] = 0;
        }
        if (set_obj(st.parent_of, s, parent) < 0)
            goto error;
        int64_t q, p = floor + VALUE[c];
        if (parent == Py_None) {
            st.where[s] = p;
            q = p & MASK;
        } else if (parent == prev && free_) {
            if (PyDict_SetItem(st.kids, parent, k) < 0)
                goto error;
            st.where[s] = p;
            q = p & MASK;
        } else {
            int orphan = 0;
            if (check && parent != prev) {
                int in = PyDict_Contains(st.value, parent);
                if (in < 0)
                    goto error;
                if (in) { /* slot_of.get(parent): gone, or in no queue */
                    PyObject *pso = PyObject_CallMethod(st.slot_of, "get", "O", parent);
                    if (pso == NULL)
                        goto error;
                    if (pso == Py_None) {
                        orphan = 1;
                    } else {
                        Py_ssize_t ps = PyLong_AsSsize_t(pso);
                        if ((ps == -1 && PyErr_Occurred()) || check_slot(&st, ps) < 0) {
                            Py_DECREF(pso);
                            goto error;
                        }
                        orphan = st.prv[ps] == UNLINKED;
                    }
                    Py_DECREF(pso);
                }
            }
            if (orphan) {
                st.where[s] = ORPHAN;
                q = ORPHANS;
            } else {
                st.where[s] = p;
                q = p & MASK;
            }
            PyObject *sibs = PyDict_GetItemWithError(st.kids, parent);
            if (sibs == NULL) {
                if (PyErr_Occurred() || PyDict_SetItem(st.kids, parent, k) < 0)
                    goto error;
            } else if (PySet_Check(sibs)) {
                if (PySet_Add(sibs, k) < 0)
                    goto error;
            } else {
                newset = PySet_New(NULL);
                if (newset == NULL || PySet_Add(newset, sibs) < 0 || PySet_Add(newset, k) < 0 ||
                    PyDict_SetItem(st.kids, parent, newset) < 0)
                    goto error;
                Py_CLEAR(newset);
            }
        }
        /* (the Python loop batches runs of one queue; appending each at once is the same) */
        append_slot(&st, q, s);
        PyObject *mine = PyDict_GetItemWithError(st.kids, k);
        if (mine == NULL && PyErr_Occurred())
            goto error;
        free_ = mine == NULL;
        if (!free_) { /* its stranded children are orphans no more: to their buckets */
            Py_INCREF(mine);
            int rc = unstrand(&st, mine, floor);
            Py_DECREF(mine);
            if (rc < 0)
                goto error;
        }
        prev = k;
    }
    if (state_store(&st) < 0)
        goto error;
    result = Py_None;
    Py_INCREF(result);
    goto done;
error:
    state_store_on_error(&st);
    result = NULL;
done:
    Py_XDECREF(newset);
    Py_XDECREF(slots);
    Py_XDECREF(keys);
    Py_XDECREF(parents);
    Py_XDECREF(lasts);
    state_release(&st);
    return result;
}

/* -- admission of a ChainHint's run ---------------------------------------------------------- */

/* Call judge(k, depth, last, hits, parent, blocks, head, step) with the history's counters
 * written back first and read again after (judge puts and trims through History). */
static int call_judge(State *hs, PyObject *judge, PyObject *k, Py_ssize_t depth, int last,
                      Py_ssize_t hits, PyObject *parent, Py_ssize_t blocks, Py_ssize_t head,
                      Py_ssize_t step) {
    if (state_store(hs) < 0)
        return -1;
    PyObject *d = PyLong_FromSsize_t(depth), *h = PyLong_FromSsize_t(hits);
    PyObject *b = PyLong_FromSsize_t(blocks), *hd = PyLong_FromSsize_t(head);
    PyObject *sp = PyLong_FromSsize_t(step);
    int ok = -1;
    if (d != NULL && h != NULL && b != NULL && hd != NULL && sp != NULL) {
        PyObject *argv[8] = {k, d, last ? Py_True : Py_False, h, parent, b, hd, sp};
        PyObject *r = PyObject_Vectorcall(judge, argv, 8, NULL);
        if (r != NULL) {
            ok = PyObject_IsTrue(r);
            Py_DECREF(r);
        }
    }
    Py_XDECREF(d);
    Py_XDECREF(h);
    Py_XDECREF(b);
    Py_XDECREF(hd);
    Py_XDECREF(sp);
    if (ok >= 0 &&
        (get_ll(hs->hist, S_stamp, &hs->stamp) < 0 || get_ll(hs->hist, S_oldest, &hs->oldest) < 0))
        return -1;
    return ok;
}

/* Decline k: remembered with one use, the history trimmed, a False verdict. */
static int decline(State *hs, PyObject *k, double limit, PyObject *out) {
    if (hist_put(hs, k, 1) < 0 || hist_trim(hs, limit) < 0)
        return -1;
    return PyList_Append(out, Py_False);
}

/* admit_chain(keys, first, parent, hits, blocks, head, step, gate_open, gone, run, pending,
 *             small, slot_of, limit, fanout_max, short, judge)
 *   -> (verdicts, every, judged, admitted, lasts, fanned, stepped);
 * see kvaware_admission.admit_chain. */
static PyObject *admit_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 17) {
        PyErr_SetString(PyExc_TypeError, "admit_chain() takes 17 arguments");
        return NULL;
    }
    Py_ssize_t first = PyLong_AsSsize_t(args[1]);
    PyObject *parent = args[2];
    Py_ssize_t hits = PyLong_AsSsize_t(args[3]);
    Py_ssize_t blocks = PyLong_AsSsize_t(args[4]);
    Py_ssize_t head = PyLong_AsSsize_t(args[5]);
    Py_ssize_t step = PyLong_AsSsize_t(args[6]);
    int gate_open = PyObject_IsTrue(args[7]);
    PyObject *run = args[9], *pending = args[10], *small = args[11], *slot_of_ = args[12];
    double limit = PyFloat_AsDouble(args[13]);
    Py_ssize_t fanout_max = PyLong_AsSsize_t(args[14]);
    Py_ssize_t short_ = PyLong_AsSsize_t(args[15]);
    PyObject *judge = args[16];
    if (gate_open < 0 || PyErr_Occurred())
        return NULL;
    if (!PyDict_CheckExact(run) || !PyDict_CheckExact(pending) || !PyAnySet_Check(small)) {
        PyErr_SetString(PyExc_TypeError, "admit_chain(): unexpected container types");
        return NULL;
    }
    State hs;
    memset(&hs, 0, sizeof(hs));
    PyObject *keys = NULL, *out = NULL, *zero = NULL, *result = NULL;
    if (hist_load(&hs, args[8]) < 0) {
        state_release(&hs);
        return NULL;
    }
    keys = PySequence_Fast(args[0], "admit_chain(): keys must be a sequence");
    out = PyList_New(0);
    zero = PyLong_FromLong(0);
    if (keys == NULL || out == NULL || zero == NULL)
        goto error;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), last = blocks - 1;
    Py_ssize_t judged = 0, admitted = 0, lasts = 0, fanned = 0, stepped = 0;
    int every = 1, fresh = 0, big = step && hits > 1, ok, in;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(keys, i);
        Py_ssize_t depth = first + i;
        in = PyDict_Contains(hs.value, k);
        if (in < 0)
            goto error;
        if (in) {
            if (gate_open) { /* readmitted, as _judge would (the gate is open) */
                if (PyDict_SetDefault(pending, k, zero) == NULL || PyList_Append(out, Py_True) < 0)
                    goto error;
                parent = k;
                fresh = 1;
                continue;
            }
            ok = call_judge(&hs, judge, k, depth, depth == last, hits, parent, blocks, head, step);
        } else if (depth == last) { /* a never-seen last block: declined */
            if (decline(&hs, k, limit, out) < 0)
                goto error;
            lasts++;
            every = 0;
            parent = k;
            fresh = 0;
            continue;
        } else if (big && parent != Py_None) { /* a later turn's never-seen block */
            Py_ssize_t start = depth;
            PyObject *so = PyDict_GetItemWithError(run, parent);
            if (so != NULL) {
                start = PyLong_AsSsize_t(so);
                if (start == -1 && PyErr_Occurred())
                    goto error;
            } else if (PyErr_Occurred()) {
                goto error;
            }
            PyObject *sv = PyLong_FromSsize_t(start);
            if (sv == NULL)
                goto error;
            int rc = PyDict_SetItem(run, k, sv);
            Py_DECREF(sv);
            if (rc < 0)
                goto error;
            if (blocks - start >= step) { /* a large step: declined and remembered */
                if (decline(&hs, k, limit, out) < 0)
                    goto error;
                stepped++;
                every = 0;
                parent = k;
                fresh = 0;
                continue;
            }
            in = 1;
            if (fresh && (in = PySequence_Contains(slot_of_, parent)) < 0)
                goto error;
            if (!in) { /* a small step off the page before (admitted here) */
                PyObject *fo = PyDict_GetItemWithError(pending, parent);
                if (fo == NULL) {
                    if (!PyErr_Occurred())
                        PyErr_SetObject(PyExc_KeyError, parent);
                    goto error;
                }
                Py_ssize_t fan = PyLong_AsSsize_t(fo);
                if (fan == -1 && PyErr_Occurred())
                    goto error;
                PyObject *fv = PyLong_FromSsize_t(fan + 1);
                if (fv == NULL)
                    goto error;
                rc = PyDict_SetItem(pending, parent, fv);
                Py_DECREF(fv);
                if (rc < 0)
                    goto error;
                if (fan < fanout_max || (0 < blocks && blocks <= short_)) {
                    admitted++;
                    if (PySet_Add(small, k) < 0 || PyDict_SetDefault(pending, k, zero) == NULL ||
                        PyList_Append(out, Py_True) < 0)
                        goto error;
                    parent = k;
                    continue;
                }
                if (decline(&hs, k, limit, out) < 0)
                    goto error;
                fanned++;
                every = 0;
                parent = k;
                fresh = 0;
                continue;
            }
            ok = call_judge(&hs, judge, k, depth, 0, hits, parent, blocks, head, step);
        } else {
            ok = call_judge(&hs, judge, k, depth, 0, hits, parent, blocks, head, step);
        }
        if (ok < 0)
            goto error;
        if (ok) {
            if (PyDict_SetDefault(pending, k, zero) == NULL)
                goto error;
            judged++;
        } else {
            every = 0;
        }
        if (PyList_Append(out, ok ? Py_True : Py_False) < 0)
            goto error;
        parent = k;
        fresh = ok;
    }
    if (state_store(&hs) < 0)
        goto error;
    result = Py_BuildValue("(OOnnnnn)", out, every ? Py_True : Py_False, judged, admitted, lasts,
                           fanned, stepped);
    goto done;
error:
    state_store_on_error(&hs);
    result = NULL;
done:
    Py_XDECREF(keys);
    Py_XDECREF(out);
    Py_XDECREF(zero);
    state_release(&hs);
    return result;
}

/* -- touch ------------------------------------------------------------------------------------ */

/* touch(code, slots, floor): each slot's use code becomes floor's, its count one up (to 15);
 * see KVAwarePolicy.touch_slots. */
static PyObject *touch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "touch() takes 3 arguments");
        return NULL;
    }
    long long floor = PyLong_AsLongLong(args[2]);
    if (floor == -1 && PyErr_Occurred())
        return NULL;
    State st;
    memset(&st, 0, sizeof(st));
    int64_t *code = table(&st, B_CODE, args[0], -1, "code");
    PyObject *slots = code ? PySequence_Fast(args[1], "touch(): slots must be a sequence") : NULL;
    PyObject *result = NULL;
    if (slots != NULL) {
        Py_ssize_t cap = st.buf[B_CODE].len / 8, n = PySequence_Fast_GET_SIZE(slots);
        int64_t now = floor << 4;
        result = Py_None;
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t s = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(slots, i));
            if ((s == -1 && PyErr_Occurred()) || s < 0 || s >= cap) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_IndexError, "kvaware: slot %zd outside the table", s);
                result = NULL;
                break;
            }
            int64_t c = code[s] & 15;
            code[s] = now + (c < MAX_COUNT ? c + 1 : c);
        }
        Py_XINCREF(result);
        Py_DECREF(slots);
    }
    state_release(&st);
    return result;
}

/* -- the history's batch operations (History.trim, History.put_many) ------------------------ */

/* history_trim(history, limit) -> None: History.trim. */
static PyObject *history_trim(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "history_trim() takes 2 arguments");
        return NULL;
    }
    double limit = PyFloat_AsDouble(args[1]);
    if (limit == -1.0 && PyErr_Occurred())
        return NULL;
    State hs;
    memset(&hs, 0, sizeof(hs));
    PyObject *result = NULL;
    if (hist_load(&hs, args[0]) == 0) {
        if (hist_trim(&hs, limit) == 0 && state_store(&hs) == 0) {
            result = Py_None;
            Py_INCREF(result);
        } else {
            state_store_on_error(&hs);
        }
    }
    state_release(&hs);
    return result;
}

/* history_put_many(history, keys, count) -> None: History.put_many. */
static PyObject *history_put_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "history_put_many() takes 3 arguments");
        return NULL;
    }
    long long count = PyLong_AsLongLong(args[2]);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    if (count < 0 || count > 15) {
        PyErr_SetString(PyExc_ValueError, "history_put_many(): a count is 0..15");
        return NULL;
    }
    State hs;
    memset(&hs, 0, sizeof(hs));
    PyObject *keys = NULL, *result = NULL;
    if (hist_load(&hs, args[0]) < 0)
        goto done;
    keys = PySequence_Fast(args[1], "history_put_many(): keys must be a sequence");
    if (keys == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (hist_put(&hs, PySequence_Fast_GET_ITEM(keys, i), count) < 0) {
            state_store_on_error(&hs);
            goto done;
        }
    }
    if (state_store(&hs) == 0) {
        result = Py_None;
        Py_INCREF(result);
    }
done:
    Py_XDECREF(keys);
    state_release(&hs);
    return result;
}

static PyMethodDef methods[] = {
    {"evict", (PyCFunction)(void (*)(void))evict, METH_FASTCALL,
     "evict(state, n, can_evict, limit, floor, left, used, seen) -> (victims, floor, left, "
     "used, seen): kvaware's eviction loop (kvaware_loops.evict)."},
    {"evict_given", (PyCFunction)(void (*)(void))evict_given, METH_FASTCALL,
     "evict_given(state, slots, limit, left, used, seen) -> (left, used, seen): the victims a "
     "caller chose, taken as evict() takes one (kvaware_loops.evict_given)."},
    {"admit_chain", (PyCFunction)(void (*)(void))admit_chain, METH_FASTCALL,
     "admit_chain(keys, first, parent, hits, blocks, head, step, gate_open, gone, run, pending, "
     "small, slot_of, limit, fanout_max, short, judge) -> (verdicts, every, judged, admitted, "
     "lasts, fanned, stepped): the admission of a ChainHint's run "
     "(kvaware_admission.admit_chain)."},
    {"insert", (PyCFunction)(void (*)(void))insert, METH_FASTCALL,
     "insert(state, slots, keys, parents, lasts, check, floor) -> None: "
     "kvaware's insertion loop (kvaware_loops.insert)."},
    {"history_trim", (PyCFunction)(void (*)(void))history_trim, METH_FASTCALL,
     "history_trim(history, limit) -> None: History.trim."},
    {"history_put_many", (PyCFunction)(void (*)(void))history_put_many, METH_FASTCALL,
     "history_put_many(history, keys, count) -> None: History.put_many."},
    {"touch", (PyCFunction)(void (*)(void))touch, METH_FASTCALL,
     "touch(code, slots, floor) -> None: kvaware's uses (kvaware_loops.touch)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_kvaware",
    "kvaware's inner loops in C (the reference: tierkv/policies/kvaware_loops.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kvaware(void) {
    struct {
        PyObject **at;
        const char *name;
    } names[] = {{&S_prev, "prev"},   {&S_next, "next"},   {&S_size, "size"},
                 {&S_queue, "queue"}, {&S_base, "base"},   {&S_value, "value"},
                 {&S_order, "order"}, {&S_stamp, "stamp"}, {&S_oldest, "oldest"}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*names[i].at == NULL && (*names[i].at = PyUnicode_InternFromString(names[i].name)) == NULL)
            return NULL;
    }
    PyObject *m = PyModule_Create(&module_def);
    if (m != NULL && (PyModule_AddObject(m, "DECAY", PyFloat_FromDouble(DECAY)) < 0 ||
                      PyModule_AddIntConstant(m, "ABI", ABI) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
