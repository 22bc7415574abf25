/* The tenants' counts in C: tenant_counts.tally and tenant_counts.TierCounts' hooks, step for step.
 *
 * tally(of, keys, nobody, plus, minus) -> int
 *   For each key of ``keys`` (a list or tuple): its tenant ``i = of.get(key, nobody)`` (``of``
 *   a dict of key -> int); ``plus[i] += 1`` and ``minus[i] -= 1`` (lists of ints, or None).
 *   Returns the tenant every key had, or -1 when they differ (or ``keys`` is empty). The
 *   indices are checked before anything changes: a bad one raises ValueError (the Python
 *   reference's InvalidInputError is one) / TypeError and leaves both lists as they were.
 *
 * Counts(of, caused, reserve, limit)
 *   One tier's pages per tenant (held, evicted) and the quota rules' fast check: the hooks
 *   the page table calls on every eviction and store (any_pick, cause, evicted, replaced,
 *   put_back, assign, left), each one C call where the Python reference (tenant_counts.PyCounts)
 *   costs a Python frame and a few dozen bytecodes. The counts are C arrays; ``caused`` is
 *   the Python list shared by every tier's counts (the tenants' owner reads it).
 *
 * The Python code is the reference (tenant_counts.tally_py, tenant_counts.PyCounts);
 * tests/tierkv/test_tenant_counts.py requires both to give the same results. Built by setup.py
 * where a compiler is (optional; TIERKV_NO_EXTENSIONS=1 skips it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define SMALL 64 /* tenants' indices kept on the stack for a batch up to this size */

static int bump(PyObject *list, Py_ssize_t i, long d) {
    PyObject *old = PyList_GET_ITEM(list, i);
    long v = PyLong_AsLong(old);
    if (v == -1 && PyErr_Occurred())
        return -1;
    PyObject *nv = PyLong_FromLong(v + d);
    if (nv == NULL)
        return -1;
    PyList_SET_ITEM(list, i, nv);
    Py_DECREF(old);
    return 0;
}

static PyObject *tally(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "tally(of, keys, nobody, plus, minus)");
        return NULL;
    }
    PyObject *of = args[0], *keys = args[1], *plus = args[3], *minus = args[4];
    if (!PyDict_Check(of)) {
        PyErr_SetString(PyExc_TypeError, "tally: of must be a dict");
        return NULL;
    }
    Py_ssize_t nobody = PyLong_AsSsize_t(args[2]);
    if (nobody == -1 && PyErr_Occurred())
        return NULL;
    if (plus != Py_None && !PyList_Check(plus)) {
        PyErr_SetString(PyExc_TypeError, "tally: plus must be a list or None");
        return NULL;
    }
    if (minus != Py_None && !PyList_Check(minus)) {
        PyErr_SetString(PyExc_TypeError, "tally: minus must be a list or None");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(keys, "tally: keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t small[SMALL];
    Py_ssize_t *ids = n <= SMALL ? small : PyMem_Malloc((size_t)n * sizeof(Py_ssize_t));
    if (ids == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject *result = NULL;
    Py_ssize_t same = n ? -2 : -1; /* -2: not yet known */
    Py_ssize_t lp = plus == Py_None ? -1 : PyList_GET_SIZE(plus);
    Py_ssize_t lm = minus == Py_None ? -1 : PyList_GET_SIZE(minus);
    for (Py_ssize_t j = 0; j < n; j++) { /* the tenants first: nothing changes on a bad one */
        PyObject *v = PyDict_GetItemWithError(of, items[j]);
        Py_ssize_t i;
        if (v == NULL) {
            if (PyErr_Occurred())
                goto done;
            i = nobody;
        } else {
            i = PyLong_AsSsize_t(v);
            if (i == -1 && PyErr_Occurred())
                goto done;
        }
        if (i < 0 || (lp >= 0 && i >= lp) || (lm >= 0 && i >= lm)) {
            PyErr_Format(PyExc_ValueError, "tally: tenant index %zd out of range", i);
            goto done;
        }
        ids[j] = i;
        same = same == -2 ? i : (same == i ? i : -1);
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        if ((lp >= 0 && bump(plus, ids[j], 1) < 0) || (lm >= 0 && bump(minus, ids[j], -1) < 0))
            goto done; /* (only a failed allocation of a small int: the count is off by one) */
    }
    result = PyLong_FromSsize_t(same);
done:
    if (ids != small)
        PyMem_Free(ids);
    Py_DECREF(seq);
    return result;
}


/* ---- Counts ------------------------------------------------------------------------------ */

#define NO_LIMIT ((Py_ssize_t)1 << 62)

typedef struct {
    PyObject_HEAD
    PyObject *of;        /* dict: page key -> tenant index (shared, its owner changes it) */
    PyObject *caused;    /* list of ints: evictions caused per tenant (shared by every tier) */
    Py_ssize_t nb;       /* tenants; the index of pages nobody is charged for */
    Py_ssize_t *used;    /* nb + 1 */
    Py_ssize_t *lost;    /* nb + 1 */
    Py_ssize_t *limit;   /* nb, or NULL: no limit binds */
    Py_ssize_t *guard_i; /* the tenants with a reservation here, and it */
    Py_ssize_t *guard_r;
    Py_ssize_t nguards;
    int32_t *cause;      /* per slot of the tier: the tenant a MOVING page went for (-1 none) */
    Py_ssize_t slots;
} Counts;

static void counts_free_arrays(Counts *c) {
    PyMem_Free(c->used);
    PyMem_Free(c->lost);
    PyMem_Free(c->limit);
    PyMem_Free(c->guard_i);
    PyMem_Free(c->guard_r);
    c->used = c->lost = c->limit = c->guard_i = c->guard_r = NULL;
    PyMem_Free(c->cause);
    c->cause = NULL;
    c->slots = 0;
}

static void counts_dealloc(Counts *c) {
    /* (a subclass's instance: its subtype_dealloc calls this, then drops the type's ref) */
    Py_CLEAR(c->of);
    Py_CLEAR(c->caused);
    counts_free_arrays(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* A sequence of ints as a new C array of ``n`` (checked: ``n`` long, ints). */
static Py_ssize_t *int_array(PyObject *obj, Py_ssize_t n, const char *what) {
    PyObject *seq = PySequence_Fast(obj, what);
    if (seq == NULL)
        return NULL;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd values for %zd tenants", what,
                     PySequence_Fast_GET_SIZE(seq), n);
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t *out = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_ssize_t));
    if (out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(out);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return out;
}

static int counts_init(Counts *c, PyObject *args, PyObject *kwds) {
    PyObject *of, *caused, *reserve, *limit;
    static char *names[] = {"of", "caused", "reserve", "limit", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!OO:Counts", names, &PyDict_Type, &of,
                                     &PyList_Type, &caused, &reserve, &limit))
        return -1;
    Py_ssize_t nb = PyObject_Length(reserve);
    if (nb < 0)
        return -1;
    if (PyList_GET_SIZE(caused) != nb) {
        PyErr_Format(PyExc_ValueError, "Counts: caused has %zd values for %zd tenants",
                     PyList_GET_SIZE(caused), nb);
        return -1;
    }
    Py_ssize_t *res = int_array(reserve, nb, "Counts: reserve");
    if (res == NULL)
        return -1;
    Py_ssize_t *lim = int_array(limit, nb, "Counts: limit");
    if (lim == NULL) {
        PyMem_Free(res);
        return -1;
    }
    counts_free_arrays(c); /* (__init__ called again) */
    c->nb = nb;
    c->used = PyMem_Calloc((size_t)nb + 1, sizeof(Py_ssize_t));
    c->lost = PyMem_Calloc((size_t)nb + 1, sizeof(Py_ssize_t));
    c->guard_i = PyMem_Calloc((size_t)nb + 1, sizeof(Py_ssize_t));
    c->guard_r = PyMem_Calloc((size_t)nb + 1, sizeof(Py_ssize_t));
    if (!c->used || !c->lost || !c->guard_i || !c->guard_r) {
        PyMem_Free(res);
        PyMem_Free(lim);
        counts_free_arrays(c);
        PyErr_NoMemory();
        return -1;
    }
    c->nguards = 0;
    int binds = 0;
    for (Py_ssize_t i = 0; i < nb; i++) {
        if (res[i]) {
            c->guard_i[c->nguards] = i;
            c->guard_r[c->nguards++] = res[i];
        }
        binds |= lim[i] < NO_LIMIT;
    }
    PyMem_Free(res);
    if (binds) {
        c->limit = lim;
    } else {
        PyMem_Free(lim);
        c->limit = NULL;
    }
    Py_INCREF(of);
    Py_XSETREF(c->of, of);
    Py_INCREF(caused);
    Py_XSETREF(c->caused, caused);
    return 0;
}

/* The tenant of each of ``n`` keys into ``ids`` (checked: 0 <= i <= nb); returns the tenant
 * they all had, -1 when they differ or n == 0, -2 on an error (set). */
static Py_ssize_t ids_of(Counts *c, PyObject *const *items, Py_ssize_t n, Py_ssize_t *ids) {
    Py_ssize_t same = n ? -3 : -1;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *v = PyDict_GetItemWithError(c->of, items[j]);
        Py_ssize_t i;
        if (v == NULL) {
            if (PyErr_Occurred())
                return -2;
            i = c->nb;
        } else {
            i = PyLong_AsSsize_t(v);
            if (i == -1 && PyErr_Occurred())
                return -2;
        }
        if (i < 0 || i > c->nb) {
            PyErr_Format(PyExc_ValueError, "tally: tenant index %zd out of range", i);
            return -2;
        }
        ids[j] = i;
        same = same == -3 ? i : (same == i ? i : -1);
    }
    return same;
}

/* A hook's result: None, or NULL with the error set (rc < 0). */
static PyObject *done_or_error(int rc) {
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* A hook on a Counts whose __init__ did not run (Counts.__new__ alone) raises, not crashes. */
#define NEED_INIT(c)                                                                           \
    do {                                                                                       \
        if ((c)->of == NULL) {                                                                 \
            PyErr_SetString(PyExc_TypeError, "Counts: __init__ was not called");              \
            return NULL;                                                                       \
        }                                                                                      \
    } while (0)

/* A batch of keys: the sequence, its items, its tenants. */
typedef struct {
    PyObject *seq;
    PyObject **items;
    Py_ssize_t n;
    Py_ssize_t *ids;
    Py_ssize_t small[SMALL];
} Batch;

static int batch_open(Batch *b, PyObject *keys) {
    b->seq = PySequence_Fast(keys, "keys must be a sequence");
    if (b->seq == NULL)
        return -1;
    b->n = PySequence_Fast_GET_SIZE(b->seq);
    b->items = PySequence_Fast_ITEMS(b->seq);
    b->ids = b->n <= SMALL ? b->small : PyMem_Malloc((size_t)b->n * sizeof(Py_ssize_t));
    if (b->ids == NULL) {
        Py_CLEAR(b->seq);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void batch_close(Batch *b) {
    if (b->ids != b->small)
        PyMem_Free(b->ids);
    Py_XDECREF(b->seq);
}

static int add_caused(Counts *c, Py_ssize_t by, Py_ssize_t d) {
    if (by < 0 || by >= PyList_GET_SIZE(c->caused)) {
        PyErr_Format(PyExc_ValueError, "tenant index %zd out of range", by);
        return -1;
    }
    return bump(c->caused, by, (long)d);
}

/* The tenant argument of a hook: None -> -1, else a checked index. */
static int tenant_arg(Counts *c, PyObject *obj, Py_ssize_t *by) {
    if (obj == Py_None) {
        *by = -1;
        return 0;
    }
    *by = PyLong_AsSsize_t(obj);
    if (*by == -1 && PyErr_Occurred())
        return -1;
    if (*by < 0 || *by >= c->nb) {
        PyErr_Format(PyExc_ValueError, "tenant index %zd out of range", *by);
        return -1;
    }
    return 0;
}

static int over_limit(Counts *c) {
    if (c->limit == NULL)
        return 0;
    for (Py_ssize_t i = 0; i < c->nb; i++)
        if (c->used[i] > c->limit[i])
            return 1;
    return 0;
}

static PyObject *counts_over_limit(Counts *c, PyObject *unused) { return PyBool_FromLong(over_limit(c)); }

static int any_pick(Counts *c, Py_ssize_t n) {
    if (over_limit(c))
        return 0;
    for (Py_ssize_t g = 0; g < c->nguards; g++)
        if (c->used[c->guard_i[g]] - c->guard_r[g] < n)
            return 0;
    return 1;
}

static PyObject *counts_any_pick(Counts *c, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(any_pick(c, n));
}

static PyObject *counts_cause(Counts *c, PyObject *const *args, Py_ssize_t nargs) {
    NEED_INIT(c);
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "cause(keys, n)");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    Batch b;
    if (batch_open(&b, args[0]) < 0)
        return NULL;
    if ((c->nguards > 0 || c->limit != NULL) && !any_pick(c, n)) {
        batch_close(&b);
        return PyLong_FromLong(-2); /* QUOTA: the quotas choose */
    }
    PyObject *out = NULL;
    Py_ssize_t m = b.n;
    if (n == 1 && m == 1) {
        PyObject *v = PyDict_GetItemWithError(c->of, b.items[0]);
        if (v != NULL)
            out = Py_NewRef(v);
        else if (!PyErr_Occurred())
            out = Py_NewRef(Py_None);
    } else if (!(0 < n && n <= m)) {
        out = n > 0 ? PyLong_FromLong(-1) : Py_NewRef(Py_None);
    } else {
        Py_ssize_t i = ids_of(c, b.items + (m - n), n, b.ids);
        if (i != -2)
            out = i < 0 ? PyLong_FromLong(-1) : (i == c->nb ? Py_NewRef(Py_None) : PyLong_FromSsize_t(i));
    }
    batch_close(&b);
    return out;
}

/* ``keys`` out of ``used`` (and into ``lost``), as chosen by an eviction for tenant ``by``. */
static int evicted(Counts *c, Batch *b, Py_ssize_t by) {
    if (b->n == 0)
        return 0;
    if (ids_of(c, b->items, b->n, b->ids) == -2)
        return -1;
    if (by >= 0 && add_caused(c, by, b->n) < 0)
        return -1;
    for (Py_ssize_t j = 0; j < b->n; j++) {
        c->lost[b->ids[j]] += 1;
        c->used[b->ids[j]] -= 1;
    }
    return 0;
}

/* ``slots`` (a sequence of n ints) checked: each a slot of the bound tier. */
static PyObject *slots_arg(Counts *c, PyObject *obj, Py_ssize_t n) {
    PyObject *seq = PySequence_Fast(obj, "slots must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    if (m != n) {
        PyErr_Format(PyExc_ValueError, "%zd slots for %zd pages", m, n);
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t j = 0; j < m; j++) {
        Py_ssize_t s = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, j));
        if (s == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        if (s < 0 || s >= c->slots) {
            PyErr_Format(PyExc_ValueError, "a slot past the tier's %zd", c->slots);
            Py_DECREF(seq);
            return NULL;
        }
    }
    return seq;
}

static PyObject *counts_evicted(Counts *c, PyObject *const *args, Py_ssize_t nargs) {
    NEED_INIT(c);
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "evicted(keys, by, slots=())");
        return NULL;
    }
    Py_ssize_t by;
    if (tenant_arg(c, args[1], &by) < 0)
        return NULL;
    Batch b;
    if (batch_open(&b, args[0]) < 0)
        return NULL;
    PyObject *slots = NULL;
    int rc = -1;
    if (nargs == 3 && PyObject_IsTrue(args[2])) {
        slots = slots_arg(c, args[2], b.n);
        if (slots == NULL)
            goto done;
    } else if (nargs == 3 && PyErr_Occurred()) {
        goto done;
    }
    if (evicted(c, &b, by) < 0)
        goto done;
    if (slots != NULL)
        for (Py_ssize_t j = 0; j < b.n; j++)
            c->cause[PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(slots, j))] = (int32_t)by;
    rc = 0;
done:
    Py_XDECREF(slots);
    batch_close(&b);
    return done_or_error(rc);
}

static PyObject *counts_replaced(Counts *c, PyObject *const *args, Py_ssize_t nargs) {
    NEED_INIT(c);
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "replaced(out, new)");
        return NULL;
    }
    Batch nw, out;
    if (batch_open(&nw, args[1]) < 0)
        return NULL;
    if (batch_open(&out, args[0]) < 0) {
        batch_close(&nw);
        return NULL;
    }
    int rc = -1;
    if (nw.n == 0) { /* (nothing is evicted for no new page) */
        rc = 0;
        goto done;
    }
    Py_ssize_t by = ids_of(c, nw.items, nw.n, nw.ids);
    if (by == -2)
        goto done;
    for (Py_ssize_t j = 0; j < nw.n; j++)
        c->used[nw.ids[j]] += 1;
    if (by >= 0) { /* one tenant's (or nobody's), as nearly every batch */
        rc = evicted(c, &out, by == c->nb ? -1 : by);
        goto done;
    }
    if (out.n) { /* several tenants' pages: an eviction for each of the last len(out) */
        if (evicted(c, &out, -1) < 0)
            goto done;
        for (Py_ssize_t j = nw.n > out.n ? nw.n - out.n : 0; j < nw.n; j++)
            if (nw.ids[j] != c->nb && add_caused(c, nw.ids[j], 1) < 0)
                goto done;
    }
    rc = 0;
done:
    batch_close(&out);
    batch_close(&nw);
    return done_or_error(rc);
}

static PyObject *counts_put_back(Counts *c, PyObject *const *args, Py_ssize_t nargs) {
    NEED_INIT(c);
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "put_back(keys, slots)");
        return NULL;
    }
    Batch b;
    if (batch_open(&b, args[0]) < 0)
        return NULL;
    PyObject *slots = NULL;
    int rc = -1;
    if (b.n == 0) {
        rc = 0;
        goto done;
    }
    slots = slots_arg(c, args[1], b.n);
    if (slots == NULL || ids_of(c, b.items, b.n, b.ids) == -2)
        goto done;
    for (Py_ssize_t j = 0; j < b.n; j++) {
        c->used[b.ids[j]] += 1;
        c->lost[b.ids[j]] -= 1;
    }
    for (Py_ssize_t j = 0; j < b.n; j++) {
        Py_ssize_t s = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(slots, j));
        int32_t by = c->cause[s];
        if (by >= 0) {
            c->cause[s] = -1;
            if (bump(c->caused, by, -1) < 0)
                goto done;
        }
    }
    rc = 0;
done:
    Py_XDECREF(slots);
    batch_close(&b);
    return done_or_error(rc);
}

/* assign(keys, n, slots): the victims in ``slots`` (MOVING, in the order chosen) made room
 * for the pages of ``keys``: victim j for page len(keys) - n + j (the free room went to the
 * first pages; before the first page: for nobody); each slot's cause becomes that page's
 * tenant, the evictions caused moving with it. Checked before anything changes. */
static PyObject *counts_assign(Counts *c, PyObject *const *args, Py_ssize_t nargs) {
    NEED_INIT(c);
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "assign(keys, n, slots)");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t k = PyObject_Length(args[2]);
    if (k < 0)
        return NULL;
    if (n < 0 || k > n) {
        PyErr_Format(PyExc_ValueError, "assign: %zd victims for room of %zd", k, n);
        return NULL;
    }
    Batch b;
    if (batch_open(&b, args[0]) < 0)
        return NULL;
    PyObject *slots = NULL;
    Py_ssize_t *delta = NULL;
    int rc = -1;
    Py_ssize_t lo = b.n - n > 0 ? b.n - n : 0; /* the first page a victim is for */
    if (ids_of(c, b.items + lo, b.n - lo, b.ids) == -2)
        goto done;
    slots = slots_arg(c, args[2], k);
    if (slots == NULL)
        goto done;
    delta = PyMem_Calloc((size_t)c->nb + 1, sizeof(Py_ssize_t));
    if (delta == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        Py_ssize_t s = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(slots, j));
        Py_ssize_t p = b.n - n + j;
        Py_ssize_t who = p >= 0 ? b.ids[p - lo] : c->nb;
        int32_t old = c->cause[s];
        if (old >= 0)
            delta[old] -= 1;
        if (who != c->nb)
            delta[who] += 1;
        c->cause[s] = who == c->nb ? -1 : (int32_t)who;
    }
    for (Py_ssize_t i = 0; i < c->nb; i++)
        if (delta[i] && bump(c->caused, i, (long)delta[i]) < 0)
            goto done;
    rc = 0;
done:
    PyMem_Free(delta);
    Py_XDECREF(slots);
    batch_close(&b);
    return done_or_error(rc);
}

static PyObject *counts_bind_slots(Counts *c, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "bind_slots: a capacity >= 0");
        return NULL;
    }
    int32_t *cause = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    if (cause == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t s = 0; s < n; s++)
        cause[s] = -1;
    PyMem_Free(c->cause);
    c->cause = cause;
    c->slots = n;
    Py_RETURN_NONE;
}

static PyObject *counts_left(Counts *c, PyObject *keys) {
    NEED_INIT(c);
    Batch b;
    if (batch_open(&b, keys) < 0)
        return NULL;
    int rc = ids_of(c, b.items, b.n, b.ids) == -2 ? -1 : 0;
    if (rc == 0)
        for (Py_ssize_t j = 0; j < b.n; j++)
            c->used[b.ids[j]] -= 1;
    batch_close(&b);
    return done_or_error(rc);
}

static PyObject *as_list(const Py_ssize_t *a, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromSsize_t(a[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *counts_pages(Counts *c, PyObject *unused) { return as_list(c->used, c->nb); }
static PyObject *counts_evictions(Counts *c, PyObject *unused) { return as_list(c->lost, c->nb); }
static PyObject *counts_active(Counts *c, void *unused) {
    return PyBool_FromLong(c->nguards > 0 || c->limit != NULL);
}
static PyObject *counts_get_of(Counts *c, void *unused) { return Py_NewRef(c->of); }
static PyObject *counts_get_nobody(Counts *c, void *unused) { return PyLong_FromSsize_t(c->nb); }

static PyMethodDef counts_methods[] = {
    {"pages", (PyCFunction)counts_pages, METH_NOARGS, "Pages held per tenant (not counting MOVING)."},
    {"evictions", (PyCFunction)counts_evictions, METH_NOARGS,
     "Pages evicted per tenant (suffered; put-backs not counted)."},
    {"any_pick", (PyCFunction)counts_any_pick, METH_O,
     "Whether any n victims keep the quotas (the policy's own pick stands unchecked)."},
    {"over_limit", (PyCFunction)counts_over_limit, METH_NOARGS,
     "Whether a tenant is over its limit."},
    {"cause", (PyCFunction)(void (*)(void))counts_cause, METH_FASTCALL,
     "The tenant the n evictions making room for keys are made for (None; -1: mixed; -2: "
     "the quotas choose)."},
    {"evicted", (PyCFunction)(void (*)(void))counts_evicted, METH_FASTCALL,
     "Pages of keys (in slots, if MOVING) were chosen by an eviction for tenant by."},
    {"replaced", (PyCFunction)(void (*)(void))counts_replaced, METH_FASTCALL,
     "Pages of new arrived in the room of out's, evicted for them."},
    {"put_back", (PyCFunction)(void (*)(void))counts_put_back, METH_FASTCALL,
     "MOVING pages of keys (in slots) came back: no longer evicted, nor caused."},
    {"assign", (PyCFunction)(void (*)(void))counts_assign, METH_FASTCALL,
     "The victims in slots made room for the pages of keys (victim j for page len(keys) - n + "
     "j): each slot's cause becomes that page's tenant."},
    {"bind_slots", (PyCFunction)counts_bind_slots, METH_O,
     "The tier has capacity slots: each remembers the tenant its MOVING page went for."},
    {"left", (PyCFunction)counts_left, METH_O, "Pages of keys left (not by an eviction)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef counts_getset[] = {
    {"active", (getter)counts_active, NULL,
     "Whether evictions here must check the quotas (a reservation or a limit binds).", NULL},
    {"of", (getter)counts_get_of, NULL, "page key -> tenant index (shared, read here).", NULL},
    {"nobody", (getter)counts_get_nobody, NULL, "The index of pages nobody is charged for.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CountsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tierkv._tally.Counts",
    .tp_basicsize = sizeof(Counts),
    .tp_dealloc = (destructor)counts_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "One tier's pages per tenant (tenant_counts.PyCounts in C).",
    .tp_methods = counts_methods,
    .tp_getset = counts_getset,
    .tp_init = (initproc)counts_init,
    .tp_new = PyType_GenericNew,
};

static PyMethodDef methods[] = {
    {"tally", (PyCFunction)(void (*)(void))tally, METH_FASTCALL,
     "tally(of, keys, nobody, plus, minus) -> the tenant every key had, or -1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tally", "The tenants' counts (tierkv.tenant_counts) in C.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__tally(void) {
    if (PyType_Ready(&CountsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Counts", (PyObject *)&CountsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
