/* kvaware's two inner loops in C: insert and evict, step for step as kvaware_loops.py.
 *
 * The Python functions in tierkv/policies/kvaware_loops.py are the reference; these run the
 * same steps over the same Python lists and dicts (the policy's state tuple), so a policy can
 * switch between them at any call and test_policies.py requires both to leave the same state.
 * Built by setup.py where a compiler is (optional; TIERKV_NO_EXTENSIONS=1 skips it).
 *
 * The file stays whole (over 400 lines): both loops splice the same queues and write the same
 * history through the helpers above them, and it is read side by side with kvaware_loops.py.
 *
 * State tuple: (links, history, kids, slot_of, where, code, qcode, key_of, parent_of, back,
 *               fanout, pending, small); links: Links (prev, next, size, queue: lists of int;
 *               base: int); history: History (value: key -> stamp << 4 | count, order:
 *               stamp -> key, stamp, oldest: int).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MAX_COUNT 15
#define MASK 63
#define ORPHANS 64
#define ORPHAN (-1)
#define UNLINKED (-1)
#define DECAY 0.999 /* kvaware_admission.SCAN_DECAY (checked at import by kvaware_loops) */

static const Py_ssize_t VALUE[16] = {0, 2, 5, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32};

/* -- list helpers: the lists hold ints; a read that fails (not an int) is an error ---------- */

#define GET(list, i, out)                                               \
    do {                                                                \
        (out) = PyLong_AsSsize_t(PyList_GET_ITEM((list), (i)));         \
        if ((out) == -1 && PyErr_Occurred())                            \
            goto error;                                                 \
    } while (0)

#define SET(list, i, v)                                                 \
    do {                                                                \
        if (set_int((list), (i), (v)) < 0)                              \
            goto error;                                                 \
    } while (0)

static int set_int(PyObject *list, Py_ssize_t i, Py_ssize_t v) {
    PyObject *o = PyLong_FromSsize_t(v);
    if (o == NULL)
        return -1;
    PyObject *old = PyList_GET_ITEM(list, i);
    PyList_SET_ITEM(list, i, o);
    Py_DECREF(old);
    return 0;
}

static void set_obj(PyObject *list, Py_ssize_t i, PyObject *o) {
    Py_INCREF(o);
    PyObject *old = PyList_GET_ITEM(list, i);
    PyList_SET_ITEM(list, i, o);
    Py_DECREF(old);
}

/* -- a growable array of slots ---------------------------------------------------------- */

typedef struct {
    Py_ssize_t *v;
    Py_ssize_t n, cap;
} Vec;

static int vec_push(Vec *a, Py_ssize_t x) {
    if (a->n == a->cap) {
        Py_ssize_t cap = a->cap ? 2 * a->cap : 64;
        Py_ssize_t *v = PyMem_Realloc(a->v, (size_t)cap * sizeof(Py_ssize_t));
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

typedef struct {
    PyObject *links, *hist, *kids, *slot_of, *where, *code, *qcode, *key_of, *parent_of, *back;
    PyObject *fanout, *pending, *small;
    PyObject *prv, *nxt, *size, *queue; /* new references (from links) */
    PyObject *value, *order;            /* new references (from hist) */
    Py_ssize_t base, capacity;
    long long stamp, oldest;
} State;

static void state_release(State *st) {
    Py_CLEAR(st->prv);
    Py_CLEAR(st->nxt);
    Py_CLEAR(st->size);
    Py_CLEAR(st->queue);
    Py_CLEAR(st->value);
    Py_CLEAR(st->order);
}

static int get_list(PyObject *obj, const char *name, PyObject **out, Py_ssize_t min_len) {
    PyObject *o = PyObject_GetAttrString(obj, name);
    if (o == NULL)
        return -1;
    if (!PyList_CheckExact(o) || PyList_GET_SIZE(o) < min_len) {
        PyErr_Format(PyExc_TypeError, "kvaware state: %s is not a list of %zd ints", name,
                     min_len);
        Py_DECREF(o);
        return -1;
    }
    *out = o;
    return 0;
}

static int get_ll(PyObject *obj, const char *name, long long *out) {
    PyObject *o = PyObject_GetAttrString(obj, name);
    if (o == NULL)
        return -1;
    *out = PyLong_AsLongLong(o);
    Py_DECREF(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int state_load(State *st, PyObject *tuple) {
    memset(st, 0, sizeof(*st));
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != 13) {
        PyErr_SetString(PyExc_TypeError, "kvaware state: a tuple of 13 expected");
        return -1;
    }
    PyObject **it = &PyTuple_GET_ITEM(tuple, 0);
    st->links = it[0];
    st->hist = it[1];
    st->kids = it[2];
    st->slot_of = it[3];
    st->where = it[4];
    st->code = it[5];
    st->qcode = it[6];
    st->key_of = it[7];
    st->parent_of = it[8];
    st->back = it[9];
    st->fanout = it[10];
    st->pending = it[11];
    st->small = it[12];
    if (!PyList_CheckExact(st->where) || !PyDict_CheckExact(st->kids) ||
        !PyDict_CheckExact(st->pending) || !PyAnySet_Check(st->small)) {
        PyErr_SetString(PyExc_TypeError, "kvaware state: unexpected container types");
        return -1;
    }
    Py_ssize_t cap = st->capacity = PyList_GET_SIZE(st->where);
    PyObject *lists[5] = {st->code, st->qcode, st->key_of, st->parent_of, st->back};
    for (int i = 0; i < 5; i++) {
        if (!PyList_CheckExact(lists[i]) || PyList_GET_SIZE(lists[i]) != cap) {
            PyErr_SetString(PyExc_TypeError, "kvaware state: per-slot lists differ in length");
            return -1;
        }
    }
    if (!PyList_CheckExact(st->fanout) || PyList_GET_SIZE(st->fanout) != cap) {
        PyErr_SetString(PyExc_TypeError, "kvaware state: per-slot lists differ in length");
        return -1;
    }
    long long base;
    if (get_ll(st->links, "base", &base) < 0)
        goto fail;
    if (base != cap) {
        PyErr_SetString(PyExc_TypeError, "kvaware state: links and slots differ in capacity");
        goto fail;
    }
    st->base = (Py_ssize_t)base;
    if (get_list(st->links, "prev", &st->prv, cap + ORPHANS + 1) < 0 ||
        get_list(st->links, "next", &st->nxt, cap + ORPHANS + 1) < 0 ||
        get_list(st->links, "size", &st->size, ORPHANS + 1) < 0 ||
        get_list(st->links, "queue", &st->queue, cap) < 0)
        goto fail;
    st->value = PyObject_GetAttrString(st->hist, "value");
    st->order = PyObject_GetAttrString(st->hist, "order");
    if (st->value == NULL || st->order == NULL)
        goto fail;
    if (!PyDict_CheckExact(st->value) || !PyDict_CheckExact(st->order)) {
        PyErr_SetString(PyExc_TypeError, "kvaware state: the history is not two dicts");
        goto fail;
    }
    if (get_ll(st->hist, "stamp", &st->stamp) < 0 || get_ll(st->hist, "oldest", &st->oldest) < 0)
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
    if (t != NULL && o != NULL && PyObject_SetAttrString(st->hist, "stamp", t) == 0 &&
        PyObject_SetAttrString(st->hist, "oldest", o) == 0)
        rc = 0;
    Py_XDECREF(t);
    Py_XDECREF(o);
    return rc;
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
    PyObject *o = PyObject_GetItem(st->slot_of, key);
    if (o == NULL)
        return -1;
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
        for (;;) {
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
            break;
        }
    }
    st->oldest = t;
    return 0;
}

/* -- queue splices (Links) ------------------------------------------------------------------ */

static int unlink_slot(State *st, Py_ssize_t c) {
    Py_ssize_t a, z, q, n;
    GET(st->prv, c, a);
    GET(st->nxt, c, z);
    SET(st->nxt, a, z);
    SET(st->prv, z, a);
    SET(st->prv, c, UNLINKED);
    GET(st->queue, c, q);
    GET(st->size, q, n);
    SET(st->size, q, n - 1);
    return 0;
error:
    return -1;
}

static int append_slot(State *st, Py_ssize_t q, Py_ssize_t s) {
    Py_ssize_t h = st->base + q, t, n;
    GET(st->prv, h, t);
    SET(st->nxt, t, s);
    SET(st->prv, s, t);
    SET(st->nxt, s, h);
    SET(st->prv, h, s);
    SET(st->queue, s, q);
    GET(st->size, q, n);
    SET(st->size, q, n + 1);
    return 0;
error:
    return -1;
}

static int extend_slots(State *st, Py_ssize_t q, const Py_ssize_t *slots, Py_ssize_t k) {
    Py_ssize_t h = st->base + q, t, n;
    GET(st->prv, h, t);
    for (Py_ssize_t i = 0; i < k; i++) {
        SET(st->nxt, t, slots[i]);
        SET(st->prv, slots[i], t);
        SET(st->queue, slots[i], q);
        t = slots[i];
    }
    SET(st->nxt, t, h);
    SET(st->prv, h, t);
    GET(st->size, q, n);
    SET(st->size, q, n + k);
    return 0;
error:
    return -1;
}

/* Strand the children of key (kids.get(key)): each one still in a bucket leaves it, becomes
 * an orphan and is pushed on fresh. */
static int strand(State *st, PyObject *mine, Vec *fresh) {
    PyObject *it = NULL, *child = NULL;
    PyObject *single[1] = {mine};
    Py_ssize_t i = 0, w;
    int is_set = PySet_Check(mine);
    if (is_set && (it = PyObject_GetIter(mine)) == NULL)
        return -1;
    for (;;) {
        if (is_set) {
            child = PyIter_Next(it);
            if (child == NULL) {
                if (PyErr_Occurred())
                    goto error;
                break;
            }
        } else {
            if (i++)
                break;
            child = single[0];
            Py_INCREF(child);
        }
        Py_ssize_t c = slot_of(st, child);
        Py_CLEAR(child);
        if (c < 0)
            goto error;
        GET(st->where, c, w);
        if (w != ORPHAN) {
            if (unlink_slot(st, c) < 0)
                goto error;
            SET(st->where, c, ORPHAN); /* (an orphan's qcode is never read) */
            if (vec_push(fresh, c) < 0)
                goto error;
        }
    }
    Py_XDECREF(it);
    return 0;
error:
    Py_XDECREF(child);
    Py_XDECREF(it);
    return -1;
}

/* The victim key leaves its parent's children (orphan path: kids.pop then put back). */
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

static int can_go(PyObject *can_evict, Py_ssize_t s) {
    if (can_evict == Py_None)
        return 1;
    PyObject *arg = PyLong_FromSsize_t(s);
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
    Py_ssize_t *prio, *left;
    Py_ssize_t n, cap;
} Skips;

static Py_ssize_t *skips_find(Skips *k, Py_ssize_t prio) {
    for (Py_ssize_t i = 0; i < k->n; i++)
        if (k->prio[i] == prio)
            return &k->left[i];
    return NULL;
}

static int skips_set(Skips *k, Py_ssize_t prio, Py_ssize_t left) {
    Py_ssize_t *at = skips_find(k, prio);
    if (at != NULL) {
        *at = left;
        return 0;
    }
    if (k->n == k->cap) {
        Py_ssize_t cap = k->cap ? 2 * k->cap : 16;
        Py_ssize_t *p = PyMem_Realloc(k->prio, (size_t)cap * sizeof(Py_ssize_t));
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        k->prio = p;
        Py_ssize_t *l = PyMem_Realloc(k->left, (size_t)cap * sizeof(Py_ssize_t));
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

/* Remember the victim key with count cd & 15 (History.put). */
#define REMEMBER(key, cd)                                               \
    do {                                                                \
        if (hist_put(&st, (key), (cd) & 15) < 0)                        \
            goto error;                                                 \
    } while (0)

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
    Py_ssize_t floor = PyLong_AsSsize_t(args[4]);
    double left = PyFloat_AsDouble(args[5]);
    double used = PyFloat_AsDouble(args[6]);
    Py_ssize_t seen = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred())
        return NULL;
    State st;
    if (state_load(&st, args[0]) < 0)
        return NULL;
    PyObject *out = PyList_New(0), *result = NULL;
    Vec fresh = {0}, passed = {0}, merged = {0};
    Skips skips = {0};
    Py_ssize_t prio = floor, top = floor + MASK + 1, moved = 0, lap = -1, sz;
    int orphans, ok;
    if (out == NULL)
        goto error;
    GET(st.size, ORPHANS, sz);
    orphans = sz > 0;
    while (PyList_GET_SIZE(out) < n) {
        if (orphans) { /* the orphan queue, then the fresh ones */
            orphans = 0;
            GET(st.size, ORPHANS, sz);
            if (sz) { /* fresh[:0] = links.take(ORPHANS, sz, None) */
                Py_ssize_t h = st.base + ORPHANS, s;
                merged.n = 0;
                GET(st.nxt, h, s);
                for (Py_ssize_t i = 0; i < sz; i++) {
                    if (vec_push(&merged, s) < 0)
                        goto error;
                    SET(st.prv, s, UNLINKED);
                    GET(st.nxt, s, s);
                }
                SET(st.nxt, h, s);
                SET(st.prv, s, h);
                SET(st.size, ORPHANS, 0);
                for (Py_ssize_t i = 0; i < fresh.n; i++)
                    if (vec_push(&merged, fresh.v[i]) < 0)
                        goto error;
                Vec tmp = fresh;
                fresh = merged;
                merged = tmp;
            }
            passed.n = 0;
            Py_ssize_t need = n - PyList_GET_SIZE(out); /* >= 1 here */
            Py_ssize_t i = 0;
            while (i < fresh.n) { /* grows as children are stranded */
                Py_ssize_t s = fresh.v[i++], cd, bk;
                ok = can_go(can_evict, s);
                if (ok < 0)
                    goto error;
                if (!ok) {
                    if (vec_push(&passed, s) < 0)
                        goto error;
                    continue;
                }
                PyObject *key = PyList_GET_ITEM(st.key_of, s);
                GET(st.code, s, cd);
                GET(st.back, s, bk);
                if (bk >= 0) {
                    left = left * DECAY + 1.0;
                    used = used * DECAY + (cd != bk);
                    seen++;
                }
                Py_INCREF(key);
                PyObject *parent = PyList_GET_ITEM(st.parent_of, s); /* kept: restore reads it */
                if (parent != Py_None && leave_parent_popping(&st, parent, key) < 0) {
                    Py_DECREF(key);
                    goto error;
                }
                PyObject *mine = PyDict_GetItemWithError(st.kids, key);
                if (mine == NULL && PyErr_Occurred()) {
                    Py_DECREF(key);
                    goto error;
                }
                if (mine != NULL) { /* its children, stranded in turn */
                    Py_INCREF(mine);
                    int rc = strand(&st, mine, &fresh);
                    Py_DECREF(mine);
                    if (rc < 0) {
                        Py_DECREF(key);
                        goto error;
                    }
                }
                int rc = hist_put(&st, key, cd & 15);
                Py_DECREF(key);
                if (rc < 0)
                    goto error;
                PyObject *so = PyLong_FromSsize_t(s);
                if (so == NULL || PyList_Append(out, so) < 0) {
                    Py_XDECREF(so);
                    goto error;
                }
                Py_DECREF(so);
                if (!--need)
                    break;
            }
            if (hist_trim(&st, limit) < 0)
                goto error;
            if (i < fresh.n && extend_slots(&st, ORPHANS, fresh.v + i, fresh.n - i) < 0)
                goto error;
            if (passed.n && extend_slots(&st, ORPHANS, passed.v, passed.n) < 0)
                goto error;
            fresh.n = 0;
            continue;
        }
        Py_ssize_t b = prio & MASK, bsize;
        GET(st.size, b, bsize);
        Py_ssize_t *skip = skips.n ? skips_find(&skips, prio) : NULL;
        if (!bsize || (skip != NULL && *skip <= 0)) {
            prio++;
            if (prio >= top) { /* see Laps (kvaware.py) */
                if (PyList_GET_SIZE(out) + moved == lap)
                    break;
                lap = PyList_GET_SIZE(out) + moved;
                top = prio + MASK + 1;
            }
            continue;
        }
        Py_ssize_t hb = st.base + b, s, cd, qcd, z;
        GET(st.nxt, hb, s); /* the head of the bucket */
        GET(st.code, s, cd);
        GET(st.qcode, s, qcd);
        if (cd != qcd) { /* used since it was queued: to its bucket now (Links.move) */
            Py_ssize_t p = (cd >> 4) + VALUE[cd & 15], q = p & MASK, h = st.base + q, a, sq;
            set_obj(st.qcode, s, PyList_GET_ITEM(st.code, s));
            SET(st.where, s, p);
            moved++;
            GET(st.nxt, s, z);
            SET(st.nxt, hb, z);
            SET(st.prv, z, hb);
            GET(st.prv, h, a);
            SET(st.nxt, a, s);
            SET(st.prv, s, a);
            SET(st.nxt, s, h);
            SET(st.prv, h, s);
            SET(st.size, b, bsize - 1);
            GET(st.size, q, sq);
            SET(st.size, q, sq + 1);
            SET(st.queue, s, q);
            continue;
        }
        ok = can_go(can_evict, s);
        if (ok < 0)
            goto error;
        if (ok) {
            Py_ssize_t bk;
            floor = prio;
            GET(st.back, s, bk);
            if (bk >= 0) {
                left = left * DECAY + 1.0;
                used = used * DECAY + (cd != bk);
                seen++;
            }
            GET(st.nxt, s, z); /* out of its bucket (Links.unlink) */
            SET(st.nxt, hb, z);
            SET(st.prv, z, hb);
            SET(st.prv, s, UNLINKED);
            SET(st.size, b, bsize - 1);
            PyObject *key = PyList_GET_ITEM(st.key_of, s);
            Py_INCREF(key);
            PyObject *parent = PyList_GET_ITEM(st.parent_of, s); /* kept for restore */
            if (parent != Py_None && leave_parent(&st, parent, key) < 0) {
                Py_DECREF(key);
                goto error;
            }
            if (PyDict_GET_SIZE(st.kids)) {
                PyObject *mine = PyDict_GetItemWithError(st.kids, key);
                if (mine == NULL && PyErr_Occurred()) {
                    Py_DECREF(key);
                    goto error;
                }
                if (mine != NULL) { /* stranded: orphans now */
                    Py_INCREF(mine);
                    int rc = strand(&st, mine, &fresh);
                    Py_DECREF(mine);
                    if (rc < 0) {
                        Py_DECREF(key);
                        goto error;
                    }
                }
            }
            int rc = hist_put(&st, key, cd & 15);
            Py_DECREF(key);
            if (rc < 0 || hist_trim(&st, limit) < 0)
                goto error;
            PyObject *so = PyLong_FromSsize_t(s);
            if (so == NULL || PyList_Append(out, so) < 0) {
                Py_XDECREF(so);
                goto error;
            }
            Py_DECREF(so);
            GET(st.size, ORPHANS, sz);
            orphans = fresh.n > 0 || sz > 0; /* the victim's kids go next */
        } else { /* to the back of its queue (Links.move), passed over this call */
            Py_ssize_t h = hb, t, p;
            GET(st.prv, s, p);
            GET(st.nxt, s, z);
            SET(st.nxt, p, z);
            SET(st.prv, z, p);
            GET(st.prv, h, t);
            SET(st.nxt, t, s);
            SET(st.prv, s, t);
            SET(st.nxt, s, h);
            SET(st.prv, h, s);
            /* the same queue: its size is unchanged */
            Py_ssize_t left_here = skip != NULL ? *skip : bsize;
            if (skips_set(&skips, prio, left_here - 1) < 0)
                goto error;
        }
    }
    if (fresh.n && extend_slots(&st, ORPHANS, fresh.v, fresh.n) < 0)
        goto error;
    if (state_store(&st) < 0)
        goto error;
    result = Py_BuildValue("(Onddn)", out, floor, left, used, seen);
    goto done;
error:
    if (PyErr_Occurred()) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        state_store(&st);
        PyErr_Restore(et, ev, tb);
    }
    result = NULL;
done:
    Py_XDECREF(out);
    PyMem_Free(fresh.v);
    PyMem_Free(passed.v);
    PyMem_Free(merged.v);
    PyMem_Free(skips.prio);
    PyMem_Free(skips.left);
    state_release(&st);
    return result;
}

/* insert(st, slots, keys, parents, lasts, check, start, start_prio, floor) -> None;
 * see kvaware_loops.insert. */
static PyObject *insert(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "insert() takes 9 arguments");
        return NULL;
    }
    int check = PyObject_IsTrue(args[5]);
    PyObject *start = args[6], *start_prio = args[7];
    Py_ssize_t floor = PyLong_AsSsize_t(args[8]);
    if (check < 0 || PyErr_Occurred())
        return NULL;
    if (!PyList_CheckExact(start) || PyList_GET_SIZE(start) != 16 ||
        !PyList_CheckExact(start_prio) || PyList_GET_SIZE(start_prio) != 16) {
        PyErr_SetString(PyExc_TypeError, "insert(): start tables of 16 expected");
        return NULL;
    }
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
    Py_ssize_t n = PySequence_Fast_GET_SIZE(slots);
    if (PySequence_Fast_GET_SIZE(keys) < n || PySequence_Fast_GET_SIZE(parents) < n ||
        PySequence_Fast_GET_SIZE(lasts) < n)
        n = Py_MIN(Py_MIN(PySequence_Fast_GET_SIZE(keys), PySequence_Fast_GET_SIZE(parents)),
                   Py_MIN(PySequence_Fast_GET_SIZE(lasts), n)); /* zip: the shortest */
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
        Py_ssize_t c = last && !seen ? 0 : Py_MIN(seen + 1, MAX_COUNT);
        if (c == 1 && PySet_GET_SIZE(st.small)) {
            int in = PySet_Contains(st.small, k);
            if (in < 0)
                goto error;
            if (in)
                c = 2;
        }
        PyObject *cd = PyList_GET_ITEM(start, c);
        set_obj(st.code, s, cd);
        set_obj(st.qcode, s, cd);
        if (seen)
            set_obj(st.back, s, cd);
        else
            SET(st.back, s, -1);
        set_obj(st.key_of, s, k);
        PyObject *fan = PyDict_GetItemWithError(st.pending, k);
        if (fan != NULL) {
            Py_INCREF(fan);
            if (PyDict_DelItem(st.pending, k) < 0) {
                Py_DECREF(fan);
                goto error;
            }
            set_obj(st.fanout, s, fan);
            Py_DECREF(fan);
        } else if (PyErr_Occurred()) {
            goto error;
        } else {
            SET(st.fanout, s, 0);
        }
        set_obj(st.parent_of, s, parent);
        Py_ssize_t q;
        if (parent == Py_None) {
            set_obj(st.where, s, PyList_GET_ITEM(start_prio, c));
            GET(st.where, s, q);
            q &= MASK;
        } else if (parent == prev && free_) {
            if (PyDict_SetItem(st.kids, parent, k) < 0)
                goto error;
            set_obj(st.where, s, PyList_GET_ITEM(start_prio, c));
            GET(st.where, s, q);
            q &= MASK;
        } else {
            int orphan = 0;
            if (check && parent != prev) {
                int in = PyDict_Contains(st.value, parent);
                if (in < 0)
                    goto error;
                if (in) {
                    PyObject *pso = PyObject_CallMethod(st.slot_of, "get", "O", parent);
                    if (pso == NULL)
                        goto error;
                    if (pso == Py_None) {
                        orphan = 1;
                    } else {
                        Py_ssize_t ps = PyLong_AsSsize_t(pso), pp;
                        if ((ps == -1 && PyErr_Occurred()) || check_slot(&st, ps) < 0) {
                            Py_DECREF(pso);
                            goto error;
                        }
                        GET(st.prv, ps, pp);
                        orphan = pp == UNLINKED;
                    }
                    Py_DECREF(pso);
                }
            }
            if (orphan) {
                SET(st.where, s, ORPHAN);
                q = ORPHANS;
            } else {
                set_obj(st.where, s, PyList_GET_ITEM(start_prio, c));
                GET(st.where, s, q);
                q &= MASK;
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
        if (append_slot(&st, q, s) < 0)
            goto error;
        PyObject *mine = PyDict_GetItemWithError(st.kids, k);
        if (mine == NULL && PyErr_Occurred())
            goto error;
        free_ = mine == NULL;
        if (!free_) { /* its stranded children are orphans no more: to their buckets */
            Py_INCREF(mine);
            PyObject *it = NULL, *child = NULL;
            int is_set = PySet_Check(mine), done = 0, failed = 0;
            if (is_set && (it = PyObject_GetIter(mine)) == NULL)
                failed = 1;
            while (!failed && !done) {
                if (is_set) {
                    child = PyIter_Next(it);
                    if (child == NULL) {
                        failed = PyErr_Occurred() != NULL;
                        break;
                    }
                } else {
                    child = mine;
                    Py_INCREF(child);
                    done = 1;
                }
                Py_ssize_t cs = slot_of(&st, child), w, ccd, p;
                Py_CLEAR(child);
                if (cs < 0) {
                    failed = 1;
                    break;
                }
                w = PyLong_AsSsize_t(PyList_GET_ITEM(st.where, cs));
                ccd = PyLong_AsSsize_t(PyList_GET_ITEM(st.code, cs));
                if (PyErr_Occurred()) {
                    failed = 1;
                    break;
                }
                if (w != ORPHAN)
                    continue;
                ccd = (floor << 4) + (ccd & 15);
                p = (ccd >> 4) + VALUE[ccd & 15];
                if (unlink_slot(&st, cs) < 0 || set_int(st.code, cs, ccd) < 0 ||
                    set_int(st.qcode, cs, ccd) < 0 || set_int(st.where, cs, p) < 0 ||
                    append_slot(&st, p & MASK, cs) < 0) {
                    failed = 1;
                    break;
                }
            }
            Py_XDECREF(it);
            Py_DECREF(mine);
            if (failed)
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
    if (PyErr_Occurred()) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        state_store(&st);
        PyErr_Restore(et, ev, tb);
    }
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

static PyMethodDef methods[] = {
    {"evict", (PyCFunction)(void (*)(void))evict, METH_FASTCALL,
     "evict(state, n, can_evict, limit, floor, left, used, seen) -> (victims, floor, left, "
     "used, seen): kvaware's eviction loop (kvaware_loops.evict)."},
    {"insert", (PyCFunction)(void (*)(void))insert, METH_FASTCALL,
     "insert(state, slots, keys, parents, lasts, check, start, start_prio, floor) -> None: "
     "kvaware's insertion loop (kvaware_loops.insert)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_kvaware",
    "kvaware's inner loops in C (the reference: tierkv/policies/kvaware_loops.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kvaware(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (m != NULL && PyModule_AddObject(m, "DECAY", PyFloat_FromDouble(DECAY)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
