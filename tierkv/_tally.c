/* The tenants' per-batch count in C: tenant_counts.tally, step for step.
 *
 * tally(of, keys, nobody, plus, minus) -> int
 *   For each key of ``keys`` (a list or tuple): its tenant ``i = of.get(key, nobody)`` (``of``
 *   a dict of key -> int); ``plus[i] += 1`` and ``minus[i] -= 1`` (lists of ints, or None).
 *   Returns the tenant every key had, or -1 when they differ (or ``keys`` is empty). The
 *   indices are checked before anything changes: a bad one raises ValueError (the Python
 *   reference's InvalidInputError is one) / TypeError and leaves both lists as they were.
 *
 * The Python function is the reference (tenant_counts._tally_py); tests/tierkv/test_tenant_counts.py
 * requires both to give the same results. Built by setup.py where a compiler is (optional;
 * TIERKV_NO_EXTENSIONS=1 skips it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

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

static PyMethodDef methods[] = {
    {"tally", (PyCFunction)(void (*)(void))tally, METH_FASTCALL,
     "tally(of, keys, nobody, plus, minus) -> the tenant every key had, or -1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tally", "The tenants' per-batch count (tenant_counts.tally).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__tally(void) { return PyModule_Create(&module); }
