/* collective_gc._cpetsc: destroy a batch of petsc4py objects from C.
 *
 * A sync point that destroys many PETSc objects spends more time calling
 * obj.destroy() from Python than in PETSc's own destroy. This module runs the
 * batch in one C loop: for each object, PETSc's PetscObjectDestroy() on the
 * handle slot petsc4py gives through its C API (PyPetscObject_GetPtr), which
 * is what petsc4py's destroy() methods do (XDestroy(&handle): the handle is
 * nulled, a second destroy is a no-op). Objects of other types, and petsc4py
 * subclasses that override destroy(), get their own destroy() method called.
 *
 * It needs neither PETSc's nor petsc4py's headers at build time: the three C
 * functions come in as addresses, found at run time by collective_gc.petsc
 * (see _fast_destroyer there). Python's GIL is held throughout: a destroy may
 * run Python code (a Python-context Mat, say) and finalizers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef void *PetscObject;
typedef int (*destroy_fn)(PetscObject *);
typedef PetscObject *(*getptr_fn)(PyObject *);
typedef int (*seterr_fn)(int);

/* Take the pending exception as (index, exception) and append it to failures. */
static int
record_failure(PyObject *failures, Py_ssize_t index)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value == NULL) {
        value = Py_None;
        Py_INCREF(value);
    }
    if (tb != NULL) {
        PyException_SetTraceback(value, tb);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
    PyObject *item = Py_BuildValue("(nN)", index, value);
    if (item == NULL) {
        return -1;
    }
    int rc = PyList_Append(failures, item);
    Py_DECREF(item);
    return rc;
}

static int
is_fast(PyObject *obj, PyObject *fast_types)
{
    PyObject *tp = (PyObject *)Py_TYPE(obj);
    Py_ssize_t n = PyTuple_GET_SIZE(fast_types);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyTuple_GET_ITEM(fast_types, i) == tp) {
            return 1;
        }
    }
    return 0;
}

PyDoc_STRVAR(destroy_each_doc,
"destroy_each(calls, pos, fast_types, getptr, destroy, seterr) -> failures\n\n"
"For each tuple in the list ``calls``, destroy the petsc4py object at index\n"
"``pos`` of the tuple, in list order: with PETSc's PetscObjectDestroy when\n"
"its exact type is in the tuple ``fast_types``, else with its destroy()\n"
"method. Every object is tried; returns a list of (index, exception) for\n"
"those that raised. ``getptr``, ``destroy`` and ``seterr`` are the addresses\n"
"of petsc4py's PyPetscObject_GetPtr, PETSc's PetscObjectDestroy and\n"
"petsc4py's PyPetscError_Set.");

static PyObject *
destroy_each(PyObject *module, PyObject *args)
{
    PyObject *calls, *fast_types;
    Py_ssize_t pos;
    unsigned long long a_getptr, a_destroy, a_seterr;
    (void)module;
    if (!PyArg_ParseTuple(args, "O!nO!KKK:destroy_each", &PyList_Type, &calls, &pos,
                          &PyTuple_Type, &fast_types, &a_getptr, &a_destroy, &a_seterr)) {
        return NULL;
    }
    if (!a_getptr || !a_destroy || !a_seterr) {
        PyErr_SetString(PyExc_ValueError, "destroy_each: a null function address");
        return NULL;
    }
    getptr_fn getptr = (getptr_fn)(uintptr_t)a_getptr;
    destroy_fn destroy = (destroy_fn)(uintptr_t)a_destroy;
    seterr_fn seterr = (seterr_fn)(uintptr_t)a_seterr;

    PyObject *failures = PyList_New(0);
    if (failures == NULL) {
        return NULL;
    }
    /* The list is ours (the caller built it), but a destroy runs arbitrary
     * code: hold each item while we use it and re-read the size every turn. */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(calls); i++) {
        PyObject *call = PyList_GET_ITEM(calls, i);
        Py_INCREF(call);
        int failed = 0;
        if (!PyTuple_Check(call) || PyTuple_GET_SIZE(call) <= pos || pos < 0) {
            PyErr_Format(PyExc_TypeError, "destroy_each: item %zd is not a tuple of more "
                         "than %zd items", i, pos);
            failed = 1;
        }
        else {
            PyObject *obj = PyTuple_GET_ITEM(call, pos);
            if (is_fast(obj, fast_types)) {
                PetscObject *slot = getptr(obj);
                if (slot == NULL) {
                    failed = 1; /* getptr set the exception */
                }
                else if (*slot != NULL) {
                    int ierr = destroy(slot);
                    if (ierr) {
                        /* A Python-context object's destroy leaves its Python
                         * exception set; for a PETSc error, let petsc4py make
                         * its PETSc.Error, as CHKERR does. */
                        if (!PyErr_Occurred()) {
                            seterr(ierr);
                        }
                        if (!PyErr_Occurred()) {
                            PyErr_Format(PyExc_RuntimeError, "PETSc error code %d", ierr);
                        }
                        failed = 1;
                    }
                }
            }
            else {
                PyObject *res = PyObject_CallMethod(obj, "destroy", NULL);
                if (res == NULL) {
                    failed = 1;
                }
                Py_XDECREF(res);
            }
        }
        Py_DECREF(call);
        if (failed && record_failure(failures, i) < 0) {
            Py_DECREF(failures);
            return NULL;
        }
    }
    return failures;
}

static PyMethodDef methods[] = {
    {"destroy_each", destroy_each, METH_VARARGS, destroy_each_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "collective_gc._cpetsc",
    "Batch destroys of petsc4py objects in C (see collective_gc.petsc).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__cpetsc(void)
{
    return PyModule_Create(&module_def);
}
