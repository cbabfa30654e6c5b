/* collective_gc._speedups: the per-object hot spots of collective_gc, in C.
 *
 * Optional: without it (no C compiler at install) the package does the same
 * from Python, more slowly. Python's GIL is held throughout.
 *
 * new_registration: a Registration with its slots set, in one call (see
 * collective_gc._registration.make_registration).
 *
 * on_finalize: the weak-reference callback of every Registration (see
 * collective_gc._registration._py_on_finalize, the Python version it mirrors line by
 * line). It runs once per dropped managed object; from C it costs about a
 * third of the Python function's call.
 *
 * keys_of: the keys a sync point drains from its inbox, in one pass.
 *
 * pack_window, window_keys: the agreement's bitmap of pending keys, packed
 * and read back (see collective_gc._agree, whose numpy version they mirror):
 * a handful of numpy calls per sync point cost more than the work when
 * numpy's own code and data are out of cache, as after many destroys.
 *
 * take_batch, run_each: a sync point's bookkeeping for the keys every rank
 * agreed on, in one pass, and the calls of their destroys (see
 * collective_gc._registration.take_batch_py and collective_gc._destroy.run_each_py,
 * the Python versions).
 *
 * handlers_changed, region_enter, region_leave: a protected region's entry and
 * exit (see collective_gc._interrupts, whose Python versions they mirror): a
 * sync point enters and leaves one, and in Python the two cost more than the
 * rest of an empty sync point's bookkeeping.
 *
 * destroy_each: a sync point that destroys many PETSc objects spends more time
 * calling obj.destroy() from Python than it must. This runs a batch in one C
 * loop: for each object, PETSc's PetscObjectDestroy() on the handle slot
 * petsc4py gives through its C API (PyPetscObject_GetPtr), which is what
 * petsc4py's destroy() methods do (XDestroy(&handle): the handle is nulled, a
 * second destroy is a no-op). Objects of other types, and petsc4py subclasses
 * that override destroy(), get their own destroy() method called. It needs
 * neither PETSc's nor petsc4py's headers at build time: the three C functions
 * come in as addresses, found at run time by collective_gc.petsc.
 *
 * petsc_garbage: what the PETSc participant's vote reads at every sync point
 * (PETSc's inner communicator of a user's one, and how many entries its
 * garbage map holds), from C: through ctypes the same reads cost a quarter
 * of an empty sync point. It mirrors collective_gc.petsc._internals.
 * Internals.garbage_py; MPI_Comm_get_attr and PETSc's keyvals come in as
 * addresses (set_petsc_reader), found at run time by that module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_OBJECT_EX */
#include <limits.h> /* LLONG_MAX */
#include <stdint.h>
#include <string.h> /* memset, strcmp */
#ifdef CGC_HAVE_MPI
#include <time.h> /* clock_gettime, nanosleep */
#include <sched.h> /* sched_yield */
#include <mpi.h>
#include <mpi4py/mpi4py.h>
#endif

typedef void *PetscObject;
typedef int (*destroy_fn)(PetscObject *);
typedef PetscObject *(*getptr_fn)(PyObject *);
typedef int (*seterr_fn)(int);

/* -- petsc_garbage ------------------------------------------------------- */

/* MPI_Comm is a pointer in Open MPI and an int in MPICH: MPI_Comm_get_attr is
 * called through the type that matches (int_handles). */
typedef int (*get_attr_ptr_fn)(void *, int, void *, int *);
typedef int (*get_attr_int_fn)(int, int, void *, int *);

static void *pr_get_attr = NULL; /* NULL until set_petsc_reader */
static const int *pr_inner_kv, *pr_counter_kv, *pr_garbage_kv;
static int pr_invalid, pr_int_handles;

/* The khash table behind PETSc's PetscHMapObj, as _internals._KHash reads it. */
typedef struct {
    uint32_t n_buckets, size, n_occupied, upper_bound;
    uint32_t *flags;
    int64_t *keys;
    void **vals;
} khash_obj;

PyDoc_STRVAR(set_petsc_reader_doc,
"set_petsc_reader(get_attr, inner_kv, counter_kv, garbage_kv, invalid, int_handles)\n\n"
"The addresses petsc_garbage reads through: MPI_Comm_get_attr, and PETSc's\n"
"Petsc_InnerComm_keyval, Petsc_Counter_keyval and Petsc_Garbage_HMap_keyval\n"
"(ints PETSc sets when it first needs them; read at each call). ``invalid``\n"
"is MPI_KEYVAL_INVALID; ``int_handles`` whether MPI_Comm is an int.");

static PyObject *
set_petsc_reader(PyObject *module, PyObject *args)
{
    unsigned long long get_attr, inner, counter, garbage;
    int invalid, int_handles;
    (void)module;
    if (!PyArg_ParseTuple(args, "KKKKip:set_petsc_reader", &get_attr, &inner, &counter,
                          &garbage, &invalid, &int_handles)) {
        return NULL;
    }
    if (!get_attr || !inner || !counter || !garbage) {
        PyErr_SetString(PyExc_ValueError, "set_petsc_reader: a null address");
        return NULL;
    }
    pr_inner_kv = (const int *)(uintptr_t)inner;
    pr_counter_kv = (const int *)(uintptr_t)counter;
    pr_garbage_kv = (const int *)(uintptr_t)garbage;
    pr_invalid = invalid;
    pr_int_handles = int_handles;
    pr_get_attr = (void *)(uintptr_t)get_attr;
    Py_RETURN_NONE;
}

/* The attribute ``*kvp`` of the communicator ``handle`` into ``*out``: 1 if
 * it is set, 0 if not (or PETSc has not made that keyval yet). */
static int
petsc_attr(long long handle, const int *kvp, uintptr_t *out)
{
    int kv = *kvp;
    if (kv == pr_invalid) {
        return 0;
    }
    void *value = NULL;
    int flag = 0, err;
    if (pr_int_handles) {
        err = ((get_attr_int_fn)pr_get_attr)((int)handle, kv, &value, &flag);
    }
    else {
        err = ((get_attr_ptr_fn)pr_get_attr)((void *)(intptr_t)handle, kv, &value, &flag);
    }
    if (err || !flag) {
        return 0;
    }
    *out = (uintptr_t)value;
    return 1;
}

PyDoc_STRVAR(petsc_garbage_doc,
"petsc_garbage(handle) -> int: see collective_gc.petsc._internals.Internals.garbage_py.");

static PyObject *
petsc_garbage(PyObject *module, PyObject *arg)
{
    (void)module;
    if (pr_get_attr == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "petsc_garbage: set_petsc_reader was not called");
        return NULL;
    }
    long long handle = PyLong_AsLongLong(arg);
    if (handle == -1 && PyErr_Occurred()) {
        return NULL;
    }
    uintptr_t raw = 0;
    long long inner;
    if (petsc_attr(handle, pr_inner_kv, &raw)) {
        /* PETSc keeps an MPI_Comm in a union with a void *: for int handles
         * the value is in the low 32 bits. */
        inner = pr_int_handles ? (long long)(int32_t)(uint32_t)raw : (long long)(intptr_t)raw;
    }
    else if (petsc_attr(handle, pr_counter_kv, &raw)) {
        inner = handle; /* the communicator is itself a PETSc inner one */
    }
    else {
        return PyLong_FromLong(-1);
    }
    if (!petsc_attr(inner, pr_garbage_kv, &raw) || raw == 0) {
        return PyLong_FromLong(0);
    }
    const khash_obj *kh = (const khash_obj *)raw;
    uint32_t n = kh->n_buckets;
    /* As _internals.Internals._table: anything but a whole khash table is
     * not the table we know, and nothing more of it is read. */
    if ((n & (n - 1)) || !(kh->size <= kh->n_occupied && kh->n_occupied <= n)
        || (n && !(kh->flags && kh->keys && kh->vals))) {
        return PyLong_FromLong(-2);
    }
    return PyLong_FromUnsignedLong(kh->size);
}

/* Take the pending exception as (index, exception) and append it to failures. */
static int
record_failure(PyObject *failures, Py_ssize_t index)
{
    PyObject *type, *value, *tb;
    if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_SystemError, "destroy_each: a destroy failed without an exception");
    }
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value == NULL) {
        Py_XDECREF(type);
        Py_XDECREF(tb);
        PyErr_SetString(PyExc_SystemError, "destroy_each: an exception could not be normalized");
        return -1;
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

/* After the loop: every call was made. If some failures could not be
 * recorded (out of memory), say so by raising MemoryError, which the caller
 * counts as a failure of the batch: no rank may believe its destroys all
 * succeeded when one did not. */
static PyObject *
finish(PyObject *failures, Py_ssize_t unrecorded)
{
    if (unrecorded == 0) {
        return failures;
    }
    Py_DECREF(failures);
    PyErr_Format(PyExc_MemoryError, "%zd destroy failure(s) could not be recorded", unrecorded);
    return NULL;
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
"method. Every object is tried, whatever raises (KeyboardInterrupt too);\n"
"returns a list of (index, exception) for those that raised, or raises\n"
"MemoryError after trying them all if a failure could not be recorded.\n"
"``getptr``, ``destroy`` and ``seterr`` are the addresses\n"
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
    Py_ssize_t unrecorded = 0;
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
                    if (!ierr && PyErr_Occurred()) {
                        failed = 1; /* Python code in the destroy raised, PETSc did not say */
                    }
                    else if (ierr) {
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
            PyErr_Clear(); /* go on: every object must be tried */
            unrecorded++;
        }
    }
    return finish(failures, unrecorded);
}

/* -- Registration's slots --------------------------------------------------- */

/* Where collective_gc._registration.Registration keeps its slots, by offset
 * (set_registration_type); reg_type is NULL until then. */
static PyTypeObject *reg_type = NULL;
static Py_ssize_t off_state = -1, off_destroy = -1, off_args = -1;
static Py_ssize_t off_key = -1, off_name = -1, off_origin = -1, off_cyclic = -1,
                  off_queued_at = -1, off_owner = -1, off_push = -1, off_typename = -1;

#define SLOT(reg, off) (*(PyObject **)((char *)(reg) + (off)))

/* -- on_finalize ---------------------------------------------------------- */

/* collective_gc._registration._FLAGS: [ident of the thread running the cyclic
 * collector or 0, nonzero once shut down or forked]. Set once by set_flags. */
static PyObject *flags = NULL;
static PyObject *s_state, *s_cyclic, *s_push;

PyDoc_STRVAR(set_flags_doc,
"set_flags(flags) -> None\n\n"
"Give on_finalize collective_gc._registration's process-wide flags list.");

static PyObject *
set_flags(PyObject *module, PyObject *list)
{
    (void)module;
    if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) < 2) {
        PyErr_SetString(PyExc_TypeError, "set_flags: expected a list of two ints");
        return NULL;
    }
    Py_INCREF(list);
    Py_XSETREF(flags, list);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(on_finalize_doc,
"on_finalize(reg) -> None\n\n"
"The weak-reference callback of a Registration: record and queue, nothing else.");

static PyObject *
on_finalize(PyObject *module, PyObject *reg)
{
    (void)module;
    if (flags == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "on_finalize: set_flags was not called");
        return NULL;
    }
    /* Shut down or forked: do nothing at all. */
    int off = PyObject_IsTrue(PyList_GET_ITEM(flags, 1));
    if (off != 0) {
        return off < 0 ? NULL : Py_NewRef(Py_None);
    }
    /* An exact Registration has its slots where set_registration_type found
     * them: read them in place (a lookup by name costs more than the rest of
     * the callback); anything else goes by name. */
    int exact = Py_TYPE(reg) == reg_type && SLOT(reg, off_state) != NULL
                && SLOT(reg, off_push) != NULL;
    /* Destroyed or detached already: nothing to queue. */
    PyObject *state = exact ? Py_NewRef(SLOT(reg, off_state)) : PyObject_GetAttr(reg, s_state);
    if (state == NULL) {
        return NULL;
    }
    int done = PyObject_IsTrue(state);
    Py_DECREF(state);
    if (done != 0) {
        return done < 0 ? NULL : Py_NewRef(Py_None);
    }
    /* Inside the cyclic collector on this very thread: a cyclic-GC death. */
    unsigned long collecting = PyLong_AsUnsignedLong(PyList_GET_ITEM(flags, 0));
    if (collecting == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (collecting && collecting == PyThread_get_thread_ident()) {
        if (exact) {
            Py_XSETREF(SLOT(reg, off_cyclic), Py_NewRef(Py_True)); /* was False: no code runs */
        }
        else if (PyObject_SetAttr(reg, s_cyclic, Py_True) < 0) {
            return NULL;
        }
    }
    PyObject *push = exact ? Py_NewRef(SLOT(reg, off_push)) : PyObject_GetAttr(reg, s_push);
    if (push == NULL) {
        return NULL;
    }
    PyObject *res = PyObject_CallOneArg(push, reg);
    Py_DECREF(push);
    if (res == NULL) {
        return NULL;
    }
    Py_DECREF(res);
    Py_RETURN_NONE;
}

/* -- take_batch, run_each -------------------------------------------------- */

/* The offset of the writable object slot ``name`` of ``type``'s instances,
 * defined by the type or a base (a Registry's ``live`` is its Ledger's).
 * The C code stores into these slots in place, so a class that lacks one (the
 * Python file changed, the extension was built from another version) must
 * not get this far: ImportError, raised while collective_gc imports, naming
 * the slot and the way out. */
static Py_ssize_t
slot_offset(PyTypeObject *type, const char *name)
{
    PyObject *descr = PyObject_GetAttrString((PyObject *)type, name);
    if (descr == NULL) {
        PyErr_Clear();
    }
    Py_ssize_t off = -1;
    if (descr != NULL && PyObject_TypeCheck(descr, &PyMemberDescr_Type)
        && PyType_IsSubtype(type, PyDescr_TYPE(descr))) {
        PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY)) {
            off = m->offset;
        }
    }
    Py_XDECREF(descr);
    if (off < 0) {
        PyErr_Format(PyExc_ImportError,
                     "collective_gc._speedups does not match the Python code: %s has no "
                     "writable object slot '%s' (declare it in __slots__, or rebuild the "
                     "extension from this source; COLLECTIVE_GC_PURE_PYTHON=1 runs without it)",
                     type->tp_name, name);
    }
    return off;
}

PyDoc_STRVAR(set_registration_type_doc,
"set_registration_type(cls) -> None\n\n"
"Tell take_batch where collective_gc's Registration keeps _state, _destroy\n"
"and _args.");

static PyObject *
set_registration_type(PyObject *module, PyObject *cls)
{
    (void)module;
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "set_registration_type: expected a class");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)cls;
    Py_ssize_t s = slot_offset(type, "_state");
    Py_ssize_t d = s < 0 ? -1 : slot_offset(type, "_destroy");
    Py_ssize_t a = d < 0 ? -1 : slot_offset(type, "_args");
    Py_ssize_t k = a < 0 ? -1 : slot_offset(type, "key");
    Py_ssize_t n = k < 0 ? -1 : slot_offset(type, "name");
    Py_ssize_t o = n < 0 ? -1 : slot_offset(type, "origin");
    Py_ssize_t c = o < 0 ? -1 : slot_offset(type, "cyclic");
    Py_ssize_t q = c < 0 ? -1 : slot_offset(type, "queued_at");
    Py_ssize_t w = q < 0 ? -1 : slot_offset(type, "_owner");
    Py_ssize_t p = w < 0 ? -1 : slot_offset(type, "_push");
    Py_ssize_t t = p < 0 ? -1 : slot_offset(type, "_typename");
    if (t < 0) {
        return NULL;
    }
    off_key = k;
    off_name = n;
    off_origin = o;
    off_cyclic = c;
    off_queued_at = q;
    off_owner = w;
    off_push = p;
    off_typename = t;
    Py_INCREF(cls);
    Py_XSETREF(reg_type, type);
    off_state = s;
    off_destroy = d;
    off_args = a;
    Py_RETURN_NONE;
}


/* Move an object slot's value out (the caller takes the reference) and put
 * ``value`` in its place. Runs no Python code. */
static PyObject *
swap_slot(PyObject *reg, Py_ssize_t off, PyObject *value)
{
    PyObject *old = SLOT(reg, off);
    SLOT(reg, off) = Py_NewRef(value);
    return old;
}

static Py_ssize_t
batch_index(PyObject *fn, PyObject *batched)
{
    Py_ssize_t n = PyTuple_GET_SIZE(batched);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyTuple_GET_ITEM(batched, i) == fn) {
            return i;
        }
    }
    return -1;
}

static int
add_segment(PyObject *segments, Py_ssize_t start, Py_ssize_t end, Py_ssize_t index)
{
    PyObject *seg = Py_BuildValue("(nnn)", start, end, index);
    if (seg == NULL) {
        return -1;
    }
    int rc = PyList_Append(segments, seg);
    Py_DECREF(seg);
    return rc;
}

static PyObject *
segments_of(PyObject *fns, PyObject *batched)
{
    PyObject *segments = PyList_New(0);
    if (segments == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(fns), start = 0, current = -2;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t index = batch_index(PyList_GET_ITEM(fns, i), batched);
        if (index != current) {
            if (current != -2 && add_segment(segments, start, i, current) < 0) {
                Py_DECREF(segments);
                return NULL;
            }
            start = i;
            current = index;
        }
    }
    if (current != -2 && add_segment(segments, start, n, current) < 0) {
        Py_DECREF(segments);
        return NULL;
    }
    return segments;
}

PyDoc_STRVAR(new_registration_doc,
"new_registration(callback, obj, owner, push, key, destroy, args, name, origin) -> reg\n\n"
"What collective_gc._registration.make_registration does once kwargs are folded\n"
"in: a Registration (weak reference to obj with callback) in the alive state,\n"
"its slots set directly. TypeError if obj cannot be weakly referenced.");

/* A Registration (weak reference to obj with callback) in the alive state,
 * its slots set directly; NULL with TypeError if obj cannot be weakly referenced. */
static PyObject *
build_registration(PyObject *callback, PyObject *obj, PyObject *owner, PyObject *push,
                   PyObject *key, PyObject *destroy, PyObject *fargs, PyObject *name,
                   PyObject *origin)
{
    PyObject *typename = PyType_GetName(Py_TYPE(obj));
    if (typename == NULL) {
        return NULL;
    }
    PyObject *ctor_args[2] = {obj, callback};
    PyObject *reg = PyObject_Vectorcall((PyObject *)reg_type, ctor_args, 2, NULL);
    if (reg == NULL) {
        Py_DECREF(typename);
        return NULL;
    }
    /* A new object: its slots are all NULL, so plain stores, nothing to release. */
    SLOT(reg, off_key) = Py_NewRef(key);
    SLOT(reg, off_name) = Py_NewRef(name == Py_None ? typename : name);
    SLOT(reg, off_typename) = typename; /* the reference PyType_GetName gave */
    SLOT(reg, off_origin) = Py_NewRef(origin);
    SLOT(reg, off_cyclic) = Py_NewRef(Py_False);
    SLOT(reg, off_queued_at) = PyLong_FromLong(-1);
    SLOT(reg, off_state) = PyLong_FromLong(0);
    SLOT(reg, off_owner) = Py_NewRef(owner);
    SLOT(reg, off_push) = Py_NewRef(push);
    SLOT(reg, off_destroy) = Py_NewRef(destroy);
    SLOT(reg, off_args) = Py_NewRef(fargs);
    return reg;
}

static PyObject *
new_registration(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "new_registration: expected 9 arguments");
        return NULL;
    }
    if (reg_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "new_registration: set_registration_type was not called");
        return NULL;
    }
    if (!PyTuple_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError, "new_registration: args must be a tuple");
        return NULL;
    }
    /* The callback first, so that functools.partial can bind it. */
    return build_registration(args[0], args[1], args[2], args[3], args[4], args[5], args[6],
                              args[7], args[8]);
}

/* -- add_plain ------------------------------------------------------------- */

/* collective_gc._registry.Registry's slots, by offset (set_registry_type),
 * the finalizer new registrations get (fixed for the process), and
 * _registration.TRACK_ORIGINS, a one-item list because it changes at run time
 * (collective_scope and the pytest plugin turn origin tracking on and off). */
static PyTypeObject *registry_type = NULL;
static Py_ssize_t off_live = -1, off_next_key = -1, off_busy = -1, off_rpush = -1,
                  off_thread = -1, off_order = -1;
static PyObject *origins_switch = NULL, *plain_callback = NULL;

PyDoc_STRVAR(set_registry_type_doc,
"set_registry_type(cls, track_origins, callback) -> None\n\n"
"Tell add_plain where collective_gc's Registry keeps its slots (ImportError\n"
"naming a slot it lacks), give it the one-item list that says whether\n"
"origins are tracked (read per call) and the finalizer new registrations get.");

static PyObject *
set_registry_type(PyObject *module, PyObject *args)
{
    PyObject *cls, *origins, *callback;
    (void)module;
    if (!PyArg_ParseTuple(args, "O!O!O:set_registry_type", &PyType_Type, &cls, &PyList_Type,
                          &origins, &callback)) {
        return NULL;
    }
    if (PyList_GET_SIZE(origins) != 1 || !PyCallable_Check(callback)) {
        PyErr_SetString(PyExc_TypeError,
                        "set_registry_type: expected a one-item list and a callable");
        return NULL;
    }
    Py_ssize_t l = slot_offset((PyTypeObject *)cls, "live");
    Py_ssize_t k = l < 0 ? -1 : slot_offset((PyTypeObject *)cls, "next_key");
    Py_ssize_t b = k < 0 ? -1 : slot_offset((PyTypeObject *)cls, "busy");
    Py_ssize_t p = b < 0 ? -1 : slot_offset((PyTypeObject *)cls, "push");
    Py_ssize_t t = p < 0 ? -1 : slot_offset((PyTypeObject *)cls, "thread");
    Py_ssize_t o = t < 0 ? -1 : slot_offset((PyTypeObject *)cls, "order");
    if (o < 0) {
        return NULL;
    }
    off_live = l;
    off_next_key = k;
    off_busy = b;
    off_rpush = p;
    off_thread = t;
    off_order = o;
    Py_INCREF(cls);
    Py_XSETREF(registry_type, (PyTypeObject *)cls);
    Py_INCREF(origins);
    Py_XSETREF(origins_switch, origins);
    Py_INCREF(callback);
    Py_XSETREF(plain_callback, callback);
    Py_RETURN_NONE;
}

/* collective_gc._registry.order_step: what a registration with ``key`` on
 * the member tagged ``tag`` adds to the family's order fingerprint (the
 * finalizer of splitmix64 over key * golden + tag; 0 for tag 0). */
static uint64_t
order_step(uint64_t key, uint64_t tag)
{
    if (tag == 0) {
        return 0;
    }
    uint64_t x = key * 0x9E3779B97F4A7C15ULL + tag;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

PyDoc_STRVAR(add_plain_doc,
"add_plain(registry, owner, tag, obj, destroy, args, name) -> reg or None\n\n"
"Registry.add's common case in one call (see _registry.add_plain_py, its\n"
"Python twin): ``destroy`` a plain function without a closure, ``args`` a\n"
"tuple of objects that are not ``obj`` and not callable, ``obj`` weakly\n"
"referenceable and with no other weak reference, no origin to record, no\n"
"other registration half-way through on ``registry`` (its busy count 0), and\n"
"its ``thread`` -1 (any thread may register) or this thread's ident (the\n"
"thread that has registered since the last sync point). Then the\n"
"registration of ``owner`` is made, given the next key and stored (and the\n"
"family's order fingerprint advanced, for a member ``tag`` other than 0),\n"
"with no Python code run between reading the key and storing the next one\n"
"(so it needs no lock). Otherwise None, having changed nothing:\n"
"Registry.add then does it (or says what is wrong).");

static PyObject *
add_plain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "add_plain: expected 7 arguments");
        return NULL;
    }
    PyObject *registry = args[0], *owner = args[1], *tag_obj = args[2], *obj = args[3];
    PyObject *destroy = args[4], *fargs = args[5], *name = args[6];
    if (registry_type == NULL || reg_type == NULL || Py_TYPE(registry) != registry_type
        || !PyList_CheckExact(origins_switch) || PyList_GET_SIZE(origins_switch) < 1
        || PyList_GET_ITEM(origins_switch, 0) != Py_False || !PyLong_CheckExact(tag_obj)) {
        Py_RETURN_NONE;
    }
    long tag = PyLong_AsLong(tag_obj);
    if (tag < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    /* What check_destroy would find nothing to refuse in, decided without
     * calling anything: it looks only into callables (and obj itself). */
    if (!Py_IS_TYPE(destroy, &PyFunction_Type) || PyFunction_GET_CLOSURE(destroy) != NULL
        || !PyTuple_CheckExact(fargs) || !(name == Py_None || PyUnicode_CheckExact(name))) {
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(fargs); i++) {
        PyObject *a = PyTuple_GET_ITEM(fargs, i);
        if (a == obj || Py_TYPE(a)->tp_call != NULL) {
            Py_RETURN_NONE;
        }
    }
    PyObject *push = SLOT(registry, off_rpush);
    if (push == NULL) {
        Py_RETURN_NONE;
    }
    Py_INCREF(owner);
    Py_INCREF(push);
    PyObject *callback = Py_NewRef(plain_callback);
    /* Allocating it may start the collector, whose finalizers may run Python
     * code and let other threads run: nothing of the registry is read before. */
    PyObject *reg = build_registration(callback, obj, owner, push, Py_None, destroy, fargs, name,
                                       Py_None);
    Py_DECREF(callback);
    Py_DECREF(owner);
    Py_DECREF(push);
    if (reg == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear(); /* not weakly referenceable: Registry.add says so */
            Py_RETURN_NONE;
        }
        return NULL;
    }
    PyObject *next = NULL, *order_next = NULL;
    /* From here to the stores, no Python code runs (an int's allocation does
     * not start the collector, an int key's hash and comparison call nothing),
     * so no other thread can take a key in between. */
    PyWeakReference *wr = (PyWeakReference *)reg;
    PyObject *busy = SLOT(registry, off_busy);
    PyObject *key = SLOT(registry, off_next_key);
    PyObject *live = SLOT(registry, off_live);
    PyObject *thread = SLOT(registry, off_thread);
    PyObject *order = SLOT(registry, off_order);
    if (wr->wr_prev != NULL || wr->wr_next != NULL /* another weak reference to obj */
        || busy == NULL || !PyLong_CheckExact(busy) || PyLong_AsLong(busy) != 0
        || key == NULL || !PyLong_CheckExact(key) || live == NULL || !PyDict_CheckExact(live)
        || thread == NULL || !PyLong_CheckExact(thread) || order == NULL
        || !PyLong_CheckExact(order)) {
        /* (busy: another registration is between taking its key and storing
         * the next one, on another thread or below us on this one) */
        goto slow;
    }
    /* The one thread that registers between two sync points on a family of
     * size > 1 (ranks would number two threads' objects in different
     * orders): another one goes to Registry.add, which refuses it. */
    /* PyLong_AsLong: PyLong_AsLongLong goes through a byte array for a
     * two-digit int such as a thread ident (about 40 ns here). */
    long owner_ident = PyLong_AsLong(thread);
    if (owner_ident == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        goto slow;
    }
    /* 0: the first registration since the last sync point, which
     * Registry.add makes (it records the thread's name, for a refusal). */
    if (owner_ident == 0
        || (owner_ident != -1 && (unsigned long)owner_ident != PyThread_get_thread_ident())) {
        goto slow;
    }
    long long k = PyLong_AsLongLong(key);
    if (k < 0 || k == LLONG_MAX) {
        PyErr_Clear();
        goto slow;
    }
    if (tag != 0) {
        unsigned long long before = PyLong_AsUnsignedLongLong(order);
        if (before == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto slow;
        }
        order_next = PyLong_FromUnsignedLongLong(
            (unsigned long long)((uint64_t)before + order_step((uint64_t)k, (uint64_t)tag)));
        if (order_next == NULL) {
            Py_DECREF(reg);
            return NULL;
        }
    }
    next = PyLong_FromLongLong(k + 1);
    if (next == NULL) {
        Py_XDECREF(order_next);
        Py_DECREF(reg);
        return NULL;
    }
    Py_INCREF(key);
    Py_SETREF(SLOT(reg, off_key), key); /* was None */
    if (PyDict_SetItem(live, key, reg) < 0) {
        Py_XDECREF(order_next);
        Py_DECREF(next);
        Py_DECREF(reg);
        return NULL;
    }
    Py_SETREF(SLOT(registry, off_next_key), next);
    if (order_next != NULL) {
        Py_SETREF(SLOT(registry, off_order), order_next);
    }
    return reg;
slow:
    Py_DECREF(reg); /* unlinked from obj's weak references; its callback never runs */
    Py_RETURN_NONE;
}

PyDoc_STRVAR(take_batch_doc,
"take_batch(regs, keys, state, batched) -> (taken, fns, argss, segments)\n\n"
"For each key of the list ``keys`` still in the dict ``regs``, in order: pop\n"
"its registration, set its _state to ``state``, take its _destroy and _args\n"
"(leaving None and ()). Returns the registrations, their destroys, their\n"
"argument tuples, and the runs of destroys as (start, end, index) triples:\n"
"index is the position in the tuple ``batched`` of the destroy function\n"
"(identity) of every call of the run, or -1 for a run of others.\n"
"``segments`` is None if it could not be made (out of memory): then run\n"
"every call one by one. Nothing can fail, and no Python code runs, between\n"
"the first key popped and the last, so no registration is ever lost. If\n"
"``regs`` is then empty, it is cleared (its memory given back).");

static PyObject *
take_batch(PyObject *module, PyObject *args)
{
    PyObject *regs, *keys, *state, *batched;
    (void)module;
    if (!PyArg_ParseTuple(args, "O!O!OO!:take_batch", &PyDict_Type, &regs, &PyList_Type, &keys,
                          &state, &PyTuple_Type, &batched)) {
        return NULL;
    }
    if (reg_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "take_batch: set_registration_type was not called");
        return NULL;
    }
    /* Everything that can fail (or start Python's collector) first. */
    Py_ssize_t nkeys = PyList_GET_SIZE(keys);
    PyObject *empty = PyTuple_New(0);
    PyObject *taken = PyList_New(nkeys);
    PyObject *fns = PyList_New(nkeys);
    PyObject *argss = PyList_New(nkeys);
    PyObject *result = PyTuple_New(4);
    if (empty == NULL || taken == NULL || fns == NULL || argss == NULL || result == NULL) {
        Py_XDECREF(empty);
        Py_XDECREF(taken);
        Py_XDECREF(fns);
        Py_XDECREF(argss);
        Py_XDECREF(result);
        return NULL;
    }
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < nkeys; i++) {
        /* Keys are ints: looking them up and deleting them runs no Python code. */
        PyObject *key = PyList_GET_ITEM(keys, i);
        PyObject *reg = PyDict_GetItemWithError(regs, key); /* borrowed */
        if (reg == NULL || Py_TYPE(reg) != reg_type || SLOT(reg, off_destroy) == NULL
            || SLOT(reg, off_destroy) == Py_None || SLOT(reg, off_args) == NULL) {
            /* Destroyed explicitly meanwhile (registrations are always exact
             * Registrations with a destroy while in the dict). */
            PyErr_Clear();
            continue;
        }
        Py_INCREF(reg);
        if (PyDict_DelItem(regs, key) < 0) {
            PyErr_Clear(); /* present a moment ago: cannot fail */
        }
        Py_XDECREF(swap_slot(reg, off_state, state)); /* a small int: no code runs */
        PyList_SET_ITEM(taken, count, reg);
        PyList_SET_ITEM(fns, count, swap_slot(reg, off_destroy, Py_None));
        PyList_SET_ITEM(argss, count, swap_slot(reg, off_args, empty));
        count++;
    }
    Py_DECREF(empty);
    if (PyDict_GET_SIZE(regs) == 0) {
        /* A dict never shrinks: an empty one gives a large backlog's memory
         * back here, where no registration can be stored in between (one
         * stored while Python code runs after the check would be wiped). */
        PyDict_Clear(regs);
    }
    /* Cut the lists to the keys taken: their tail is still NULL, and a list
     * may be shorter than its allocation, so this cannot fail (PyList_SetSlice
     * may allocate, and failing here would leave NULLs in the lists). */
    Py_SET_SIZE((PyVarObject *)taken, count);
    Py_SET_SIZE((PyVarObject *)fns, count);
    Py_SET_SIZE((PyVarObject *)argss, count);
    PyObject *segments = segments_of(fns, batched);
    if (segments == NULL) {
        PyErr_Clear(); /* the caller runs every call one by one */
        segments = Py_NewRef(Py_None);
    }
    PyTuple_SET_ITEM(result, 0, taken);
    PyTuple_SET_ITEM(result, 1, fns);
    PyTuple_SET_ITEM(result, 2, argss);
    PyTuple_SET_ITEM(result, 3, segments);
    return result;
}

PyDoc_STRVAR(run_each_doc,
"run_each(fns, argss) -> failures\n\n"
"Call fns[i](*argss[i]) for each i, in order, whatever raises (KeyboardInterrupt\n"
"too); returns (index, exception) for the calls that raised, or raises\n"
"MemoryError after making them all if a failure could not be recorded.");

static PyObject *
run_each(PyObject *module, PyObject *args)
{
    PyObject *fns, *argss;
    (void)module;
    if (!PyArg_ParseTuple(args, "O!O!:run_each", &PyList_Type, &fns, &PyList_Type, &argss)) {
        return NULL;
    }
    PyObject *failures = PyList_New(0);
    if (failures == NULL) {
        return NULL;
    }
    Py_ssize_t unrecorded = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(fns) && i < PyList_GET_SIZE(argss); i++) {
        PyObject *fn = PyList_GET_ITEM(fns, i);
        PyObject *a = PyList_GET_ITEM(argss, i);
        Py_INCREF(fn);
        Py_INCREF(a);
        PyObject *res;
        if (PyTuple_Check(a)) {
            res = PyObject_Call(fn, a, NULL);
        }
        else {
            res = NULL;
            PyErr_SetString(PyExc_TypeError, "run_each: arguments are not a tuple");
        }
        Py_DECREF(fn);
        Py_DECREF(a);
        if (res != NULL) {
            Py_DECREF(res);
        }
        else if (record_failure(failures, i) < 0) {
            PyErr_Clear(); /* go on: every call must be made */
            unrecorded++;
        }
    }
    return finish(failures, unrecorded);
}

/* Ascending in place if the keys are in one order or the other (a list is
 * freed from its end, so finalizers queue its keys descending); 0 if they are
 * in neither, left as they are for a sort that finds runs (numpy's stable
 * sort), which a qsort here would be slower than. */
static int
sort_keys(int64_t *keys, Py_ssize_t n)
{
    Py_ssize_t i = 1;
    while (i < n && keys[i - 1] <= keys[i]) {
        i++;
    }
    if (i >= n) {
        return 1;
    }
    for (i = 1; i < n && keys[i - 1] >= keys[i]; i++) {
    }
    if (i < n) {
        return 0;
    }
    for (Py_ssize_t a = 0, b = n - 1; a < b; a++, b--) {
        int64_t t = keys[a];
        keys[a] = keys[b];
        keys[b] = t;
    }
    return 1;
}

PyDoc_STRVAR(keys_of_doc,
"keys_of(regs) -> (keys, cyclic, ascending)\n\n"
"The keys of the Registrations in the list ``regs`` as a bytearray of native\n"
"int64 (writable, for numpy.frombuffer), whether any has its ``cyclic`` flag\n"
"set, and whether the keys are ascending: they are made so if they were in\n"
"one order or the other, else left in list order. What a sync point's drain\n"
"reads of its inbox.\n"
"TypeError if an item is not an exact Registration with its key and flag\n"
"set (the caller then reads them from Python).");

static PyObject *
keys_of(PyObject *module, PyObject *regs)
{
    (void)module;
    if (reg_type == NULL || !PyList_CheckExact(regs)) {
        PyErr_SetString(PyExc_TypeError, "keys_of: expected a list of Registrations");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(regs);
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL) {
        return NULL;
    }
    /* No Python code runs from here on (a bytearray is not tracked by the
     * collector, and exact ints convert without calls): the list cannot change. */
    int64_t *keys = (int64_t *)PyByteArray_AS_STRING(out);
    int cyclic = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *reg = PyList_GET_ITEM(regs, i);
        PyObject *key = Py_TYPE(reg) == reg_type ? SLOT(reg, off_key) : NULL;
        PyObject *flag = key == NULL ? NULL : SLOT(reg, off_cyclic);
        if (flag == NULL || !PyLong_CheckExact(key)) {
            Py_DECREF(out);
            PyErr_SetString(PyExc_TypeError, "keys_of: not a Registration with a key");
            return NULL;
        }
        long long k = PyLong_AsLongLong(key);
        if (k == -1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        keys[i] = (int64_t)k;
        cyclic |= flag == Py_True;
    }
    int sorted = sort_keys(keys, n);
    return Py_BuildValue("(NOO)", out, cyclic ? Py_True : Py_False,
                         sorted ? Py_True : Py_False);
}

/* -- the agreement's key window -------------------------------------------- */

/* A contiguous int64 buffer of the object, for reading or writing; -1 if not. */
static int
int64_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT
                                          | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        return -1;
    }
    const char *f = view->format == NULL ? "B" : view->format;
    if (*f == '<' || *f == '=' || *f == '@') {
        f++;
    }
    if (view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s: expected a buffer of int64", what);
        return -1;
    }
    return 0;
}

#if defined(__GNUC__) || defined(__clang__)
#define POPCOUNT64(x) __builtin_popcountll(x)
#define LOWEST_BIT64(x) __builtin_ctzll(x)
#else
static int
POPCOUNT64(uint64_t x)
{
    int c = 0;
    for (; x; x &= x - 1) {
        c++;
    }
    return c;
}
static int
LOWEST_BIT64(uint64_t x)
{
    int b = 0;
    while (!(x & 1)) {
        x >>= 1;
        b++;
    }
    return b;
}
#endif

/* Fibonacci hashing into 64 bits, as collective_gc._agree's filter does. */
#define KEY_HASH 0x9E3779B97F4A7C15ULL

PyDoc_STRVAR(pack_window_doc,
"pack_window(keys, lo, nbits, buf, at) -> (first, last, filter)\n\n"
"For the ascending int64 ``keys``: zero the nbits // 64 words of the int64\n"
"buffer ``buf`` from word ``at`` and set bit k - lo (bit i is bit i % 64 of\n"
"word i // 64) for each key k in [lo, lo + nbits); return the index range of\n"
"those keys in ``keys`` and the 64-bit hash filter of the others, as\n"
"collective_gc._agree's Python version does.");

static PyObject *
pack_window(PyObject *module, PyObject *args)
{
    PyObject *keys_obj, *buf_obj;
    long long lo;
    Py_ssize_t nbits, at;
    (void)module;
    if (!PyArg_ParseTuple(args, "OLnOn:pack_window", &keys_obj, &lo, &nbits, &buf_obj, &at)) {
        return NULL;
    }
    Py_buffer kv, bv;
    if (int64_buffer(keys_obj, &kv, 0, "pack_window") < 0) {
        return NULL;
    }
    if (int64_buffer(buf_obj, &bv, 1, "pack_window") < 0) {
        PyBuffer_Release(&kv);
        return NULL;
    }
    Py_ssize_t nwords = nbits / 64, n = kv.len / 8;
    if (nbits < 0 || nbits % 64 || at < 0 || at + nwords > bv.len / 8) {
        PyBuffer_Release(&kv);
        PyBuffer_Release(&bv);
        PyErr_SetString(PyExc_ValueError, "pack_window: the window does not fit the buffer");
        return NULL;
    }
    const int64_t *keys = (const int64_t *)kv.buf;
    uint64_t *words = (uint64_t *)bv.buf + at;
    memset(words, 0, (size_t)nwords * 8);
    Py_ssize_t first = 0, last;
    while (first < n && keys[first] < lo) {
        first++;
    }
    uint64_t filter = 0;
    for (Py_ssize_t i = 0; i < first; i++) {
        filter |= 1ULL << (((uint64_t)keys[i] * KEY_HASH) >> 58);
    }
    for (last = first; last < n && keys[last] - lo < nbits; last++) {
        uint64_t bit = (uint64_t)(keys[last] - lo);
        words[bit >> 6] |= 1ULL << (bit & 63);
    }
    for (Py_ssize_t i = last; i < n; i++) {
        filter |= 1ULL << (((uint64_t)keys[i] * KEY_HASH) >> 58);
    }
    PyBuffer_Release(&kv);
    PyBuffer_Release(&bv);
    return Py_BuildValue("(nnL)", first, last, (long long)filter);
}

PyDoc_STRVAR(window_keys_doc,
"window_keys(buf, at, nbits, lo) -> bytearray\n\n"
"The keys lo + i, ascending, for each bit i set in the nbits // 64 words of\n"
"the int64 buffer ``buf`` from word ``at`` (the layout of pack_window), as\n"
"native int64.");

static PyObject *
window_keys(PyObject *module, PyObject *args)
{
    PyObject *buf_obj;
    long long lo;
    Py_ssize_t nbits, at;
    (void)module;
    if (!PyArg_ParseTuple(args, "OnnL:window_keys", &buf_obj, &at, &nbits, &lo)) {
        return NULL;
    }
    Py_buffer bv;
    if (int64_buffer(buf_obj, &bv, 0, "window_keys") < 0) {
        return NULL;
    }
    Py_ssize_t nwords = nbits / 64;
    if (nbits < 0 || nbits % 64 || at < 0 || at + nwords > bv.len / 8) {
        PyBuffer_Release(&bv);
        PyErr_SetString(PyExc_ValueError, "window_keys: the window does not fit the buffer");
        return NULL;
    }
    const uint64_t *words = (const uint64_t *)bv.buf + at;
    Py_ssize_t count = 0;
    for (Py_ssize_t w = 0; w < nwords; w++) {
        count += POPCOUNT64(words[w]);
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, count * 8);
    if (out == NULL) {
        PyBuffer_Release(&bv);
        return NULL;
    }
    int64_t *keys = (int64_t *)PyByteArray_AS_STRING(out);
    Py_ssize_t j = 0;
    for (Py_ssize_t w = 0; w < nwords; w++) {
        uint64_t word = words[w];
        while (word) {
            int b = LOWEST_BIT64(word);
            keys[j++] = (int64_t)(lo + (long long)w * 64 + b);
            word &= word - 1;
        }
    }
    PyBuffer_Release(&bv);
    return out;
}

/* -- handlers_changed --------------------------------------------------- */

PyDoc_STRVAR(handlers_changed_doc,
"handlers_changed(getsignal, signals, expected) -> bool\n\n"
"Whether getsignal(signals[i]) is not expected[i] for some i (identity).");

static PyObject *
handlers_changed(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2])
        || PyTuple_GET_SIZE(args[1]) != PyTuple_GET_SIZE(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "handlers_changed: expected getsignal and two tuples of one length");
        return NULL;
    }
    PyObject *getsignal = args[0];
    Py_ssize_t n = PyTuple_GET_SIZE(args[1]);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *handler = PyObject_CallOneArg(getsignal, PyTuple_GET_ITEM(args[1], i));
        if (handler == NULL) {
            return NULL;
        }
        int changed = handler != PyTuple_GET_ITEM(args[2], i);
        Py_DECREF(handler);
        if (changed) {
            Py_RETURN_TRUE;
        }
    }
    Py_RETURN_FALSE;
}

/* _interrupts' state, given once by region_setup: the main thread's ident, the
 * one-item depth list, the deferred list, the signals, the one-item list of
 * their expected handlers, getsignal, and the Python functions for the rare
 * steps (wrapping handlers, delivering deferred signals). */
static unsigned long region_main = 0;
static PyObject *region_depth = NULL, *region_deferred = NULL, *region_signals = NULL,
                *region_guarded = NULL, *region_getsignal = NULL, *region_guard = NULL,
                *region_deliver = NULL;

PyDoc_STRVAR(region_setup_doc,
"region_setup(main_ident, depth, deferred, signals, guarded, getsignal, guard, deliver)\n\n"
"Give region_enter and region_leave collective_gc._interrupts' state.");

static PyObject *
region_setup(PyObject *module, PyObject *args)
{
    unsigned long main_ident;
    PyObject *depth, *deferred, *signals, *guarded, *getsignal, *guard, *deliver;
    (void)module;
    if (!PyArg_ParseTuple(args, "kO!O!O!O!OOO:region_setup", &main_ident, &PyList_Type, &depth,
                          &PyList_Type, &deferred, &PyTuple_Type, &signals, &PyList_Type,
                          &guarded, &getsignal, &guard, &deliver)) {
        return NULL;
    }
    if (PyList_GET_SIZE(depth) != 1 || PyList_GET_SIZE(guarded) != 1) {
        PyErr_SetString(PyExc_TypeError, "region_setup: expected one-item lists");
        return NULL;
    }
    region_main = main_ident;
    Py_XSETREF(region_depth, Py_NewRef(depth));
    Py_XSETREF(region_deferred, Py_NewRef(deferred));
    Py_XSETREF(region_signals, Py_NewRef(signals));
    Py_XSETREF(region_guarded, Py_NewRef(guarded));
    Py_XSETREF(region_getsignal, Py_NewRef(getsignal));
    Py_XSETREF(region_guard, Py_NewRef(guard));
    Py_XSETREF(region_deliver, Py_NewRef(deliver));
    Py_RETURN_NONE;
}

/* depth[0] + delta, stored; -1 on error. */
static long
region_add(long delta)
{
    PyObject *d = PyList_GET_ITEM(region_depth, 0);
    long depth = PyLong_AsLong(d);
    if (depth == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (depth + delta < 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "collective_gc: a protected region was left that was not entered");
        return -1;
    }
    PyObject *next = PyLong_FromLong(depth + delta);
    if (next == NULL) {
        return -1;
    }
    PyList_SetItem(region_depth, 0, next); /* steals; the old item is released */
    return depth + delta;
}

PyDoc_STRVAR(region_enter_doc, "region_enter() -> bool: see collective_gc._interrupts.enter.");

static PyObject *
region_enter(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    if (region_depth == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "region_enter: region_setup was not called");
        return NULL;
    }
    if (PyThread_get_thread_ident() != region_main) {
        Py_RETURN_FALSE;
    }
    PyObject *d = PyList_GET_ITEM(region_depth, 0);
    if (d == NULL || !PyLong_CheckExact(d)) {
        PyErr_SetString(PyExc_TypeError, "region_enter: the depth is not an int");
        return NULL;
    }
    if (PyLong_AsLong(d) == 0) {
        PyObject *expected = PyList_GET_ITEM(region_guarded, 0);
        PyObject *a[3] = {region_getsignal, region_signals, expected};
        PyObject *changed = handlers_changed(NULL, a, 3);
        if (changed == NULL) {
            return NULL;
        }
        Py_DECREF(changed);
        if (changed == Py_True) {
            PyObject *r = PyObject_CallNoArgs(region_guard);
            if (r == NULL) {
                return NULL;
            }
            Py_DECREF(r);
        }
    }
    if (region_add(1) < 0) {
        return NULL;
    }
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(region_leave_doc,
"region_leave(entered) -> None: see collective_gc._interrupts.leave.");

static PyObject *
region_leave(PyObject *module, PyObject *entered)
{
    (void)module;
    if (entered != Py_True) {
        Py_RETURN_NONE;
    }
    PyObject *d = PyList_GET_ITEM(region_depth, 0);
    if (d == NULL || !PyLong_CheckExact(d)) {
        PyErr_SetString(PyExc_TypeError, "region_leave: the depth is not an int");
        return NULL;
    }
    if (PyLong_AsLong(d) == 1 && PyList_GET_SIZE(region_deferred) > 0) {
        /* Rare: the Python version delivers, decrements and raises. */
        return PyObject_CallOneArg(region_deliver, entered);
    }
    if (region_add(-1) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* -- the steady state of a sync point (built with MPI only) ------------------ */

#ifdef CGC_HAVE_MPI
/* collective_gc._collective.steady_py in C, step for step: see its docstring
 * for what it does and returns. The communicator and the requests are
 * mpi4py's objects, reached through mpi4py's C API (PyMPIComm_Get,
 * PyMPIRequest_Get, PyMPIRequest_New), against the MPI library mpi4py uses
 * (mpi_ready checks that it is the one this module was built with). The
 * message is the agreement's own buffer, with the datatype mpi4py gives its
 * typecode 'q' (MPI_LONG_LONG): a rank in the steady state and one in the
 * Python steps make the same collective. The wait releases the GIL. */

static int mpi_is_ready = 0;
static PyTypeObject *fam_type = NULL, *agree_type = NULL, *window_type = NULL,
                    *watch_type = NULL, *stats_type = NULL;
static Py_ssize_t oc_registry, oc_agreement, oc_seq, oc_destroyed, oc_state, oc_destroying,
    oc_inside, oc_unreported, oc_leaving, oc_children, oc_participants, oc_owners,
    oc_fingerprint, oc_reached;
static Py_ssize_t or_inbox, or_stale, or_last_cyclic, or_pend, or_pend_seq;
static Py_ssize_t oa_comm, oa_arr, oa_lo, oa_nbits, oa_persistent, oa_preq, oa_window,
    oa_watch, oa_dirty;
static Py_ssize_t ow_lo, ow_bits, ow_marks, ow_idle;
static Py_ssize_t ot_req, ot_gone, ot_seq, ot_closed;
static long window_memory = 0;
static PyObject *state_open = NULL, *unreached = NULL, *reach_epoch = NULL, *destroy_run = NULL,
                *as_keys = NULL, *ages_of = NULL;
static PyObject *s_quiet_finish = NULL, *s_field = NULL, *s_vote = NULL, *s_advance = NULL,
                *s_idle = NULL;

PyDoc_STRVAR(mpi_ready_doc,
"mpi_ready() -> bool\n\n"
"Whether the steady state can run in this process: mpi4py's C API imported,\n"
"and MPI_Get_library_version the same for this module as for mpi4py (the\n"
"module was built against the MPI library mpi4py uses).");

static PyObject *
mpi_ready(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    if (mpi_is_ready) {
        Py_RETURN_TRUE;
    }
    if (import_mpi4py() < 0) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    char mine[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    if (MPI_Get_library_version(mine, &len) != MPI_SUCCESS) {
        Py_RETURN_FALSE;
    }
    PyObject *mod = PyImport_ImportModule("mpi4py.MPI");
    PyObject *theirs = mod == NULL ? NULL : PyObject_CallMethod(mod, "Get_library_version", NULL);
    Py_XDECREF(mod);
    if (theirs == NULL) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    PyObject *ours = PyUnicode_DecodeLatin1(mine, len, NULL);
    int same = ours != NULL && PyUnicode_Compare(ours, theirs) == 0;
    Py_XDECREF(ours);
    Py_DECREF(theirs);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        same = 0;
    }
    mpi_is_ready = same;
    return PyBool_FromLong(same);
}

static int
offsets(PyTypeObject *type, const char *const *names, Py_ssize_t *const *outs)
{
    for (; *names != NULL; names++, outs++) {
        Py_ssize_t off = slot_offset(type, *names);
        if (off < 0) {
            return -1;
        }
        **outs = off;
    }
    return 0;
}

PyDoc_STRVAR(steady_setup_doc,
"steady_setup(Collective, Registry, Agreement, Window, Watch, CollectStats, OPEN,\n"
"             unreached, reach_epoch, destroy_run, as_keys, ages_of) -> None\n\n"
"Where steady finds the slots of collective_gc's classes (ImportError naming\n"
"one they lack), the usable state, the list of unreached families and its\n"
"epoch (a one-item list), and the\n"
"Python functions it calls: _destroy.run, and the two that make the pending\n"
"keys' arrays when a sync point goes on in Python.");

static PyObject *
steady_setup(PyObject *module, PyObject *args)
{
    PyObject *fam, *reg, *agr, *win, *wat, *st, *open_, *unr, *epoch, *run, *keys, *ages;
    (void)module;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!OO!O!OOO:steady_setup", &PyType_Type, &fam,
                          &PyType_Type, &reg, &PyType_Type, &agr, &PyType_Type, &win,
                          &PyType_Type, &wat, &PyType_Type, &st, &open_, &PyList_Type, &unr,
                          &PyList_Type, &epoch, &run, &keys, &ages)) {
        return NULL;
    }
    if (PyList_GET_SIZE(epoch) != 1) {
        PyErr_SetString(PyExc_ValueError, "steady_setup: reach_epoch must hold one item");
        return NULL;
    }
    static const char *const fnames[] = {"registry", "agreement", "seq", "destroyed", "state",
        "destroying", "inside", "unreported", "leaving", "children", "participants", "owners",
        "fingerprint", "reached", NULL};
    Py_ssize_t *const fouts[] = {&oc_registry, &oc_agreement, &oc_seq, &oc_destroyed, &oc_state,
        &oc_destroying, &oc_inside, &oc_unreported, &oc_leaving, &oc_children,
        &oc_participants, &oc_owners, &oc_fingerprint, &oc_reached};
    static const char *const rnames[] = {"inbox", "stale", "last_cyclic", "pend", "pend_seq",
        NULL};
    Py_ssize_t *const routs[] = {&or_inbox, &or_stale, &or_last_cyclic, &or_pend, &or_pend_seq};
    static const char *const anames[] = {"comm", "_arr", "_lo", "_nbits", "_persistent",
        "_preq", "window", "watch", "_dirty", NULL};
    Py_ssize_t *const aouts[] = {&oa_comm, &oa_arr, &oa_lo, &oa_nbits, &oa_persistent, &oa_preq,
        &oa_window, &oa_watch, &oa_dirty};
    static const char *const wnames[] = {"lo", "bits", "marks", "idle", NULL};
    Py_ssize_t *const wouts[] = {&ow_lo, &ow_bits, &ow_marks, &ow_idle};
    static const char *const tnames[] = {"_req", "gone", "seq", "_closed", NULL};
    Py_ssize_t *const touts[] = {&ot_req, &ot_gone, &ot_seq, &ot_closed};
    if (registry_type == NULL || (PyTypeObject *)reg != registry_type) {
        PyErr_SetString(PyExc_ImportError,
                        "steady_setup: set_registry_type must be called first, with the same class");
        return NULL;
    }
    if (offsets((PyTypeObject *)fam, fnames, fouts) < 0
        || offsets((PyTypeObject *)reg, rnames, routs) < 0
        || offsets((PyTypeObject *)agr, anames, aouts) < 0
        || offsets((PyTypeObject *)win, wnames, wouts) < 0
        || offsets((PyTypeObject *)wat, tnames, touts) < 0) {
        return NULL;
    }
    PyObject *memory = PyObject_GetAttrString(win, "MEMORY");
    if (memory == NULL) {
        return NULL;
    }
    window_memory = PyLong_AsLong(memory);
    Py_DECREF(memory);
    if (window_memory == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!(s_quiet_finish = PyUnicode_InternFromString("quiet_finish"))
        || !(s_field = PyUnicode_InternFromString("field"))
        || !(s_vote = PyUnicode_InternFromString("vote"))
        || !(s_advance = PyUnicode_InternFromString("advance"))
        || !(s_idle = PyUnicode_InternFromString("idle"))) {
        return NULL;
    }
    Py_XSETREF(fam_type, (PyTypeObject *)Py_NewRef(fam));
    Py_XSETREF(agree_type, (PyTypeObject *)Py_NewRef(agr));
    Py_XSETREF(window_type, (PyTypeObject *)Py_NewRef(win));
    Py_XSETREF(watch_type, (PyTypeObject *)Py_NewRef(wat));
    Py_XSETREF(stats_type, (PyTypeObject *)Py_NewRef(st));
    Py_XSETREF(state_open, Py_NewRef(open_));
    Py_XSETREF(unreached, Py_NewRef(unr));
    Py_XSETREF(reach_epoch, Py_NewRef(epoch));
    Py_XSETREF(destroy_run, Py_NewRef(run));
    Py_XSETREF(as_keys, Py_NewRef(keys));
    Py_XSETREF(ages_of, Py_NewRef(ages));
    Py_RETURN_NONE;
}

/* An exact int's value, or -1 with no error set if it is not one (callers
 * read only non-negative values or compare with small constants). */
static long long
int_of(PyObject *o, int *ok)
{
    if (o == NULL || !PyLong_CheckExact(o)) {
        *ok = 0;
        return -1;
    }
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        *ok = 0;
    }
    return v;
}

static int
set_int(PyObject *obj, Py_ssize_t off, long long value)
{
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL) {
        return -1;
    }
    Py_XSETREF(SLOT(obj, off), v);
    return 0;
}

/* The drained keys become the registry's pending keys (drained at sync
 * point seq), as Registry.drain makes them: before the sync point goes on in
 * Python, and before any error leaves it, so that none is lost. */
static int
store_pending(PyObject *registry, const int64_t *keys, Py_ssize_t n, long long seq)
{
    if (n == 0) {
        return 0;
    }
    PyObject *raw = PyByteArray_FromStringAndSize((const char *)keys, n * 8);
    PyObject *arr = raw == NULL ? NULL : PyObject_CallOneArg(as_keys, raw);
    Py_XDECREF(raw);
    PyObject *ages = arr == NULL ? NULL : PyObject_CallFunction(ages_of, "nL", n, seq);
    if (ages == NULL) {
        Py_XDECREF(arr);
        return -1;
    }
    Py_XSETREF(SLOT(registry, or_pend), arr);
    Py_XSETREF(SLOT(registry, or_pend_seq), ages);
    return 0;
}

static int
qsort_cmp(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static double
now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* what time.perf_counter reads on Linux */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Leave the protected region region_enter entered (``entered``), when
 * nothing has to be delivered: 1 if left, 0 if the caller must leave it
 * (signals are deferred: their handlers run there), -1 with an exception
 * set if a handler raised before it was left.
 *
 * A signal that arrived while the GIL was released (the steady state's
 * wait) has its Python handler run at the next bytecode, which, after a C
 * call that ran no Python code since, is after that call returned: outside
 * the region, where the handler raises between the sync point's end and
 * its caller's bookkeeping (the region left twice). So the handlers run
 * here first, still inside, where the library's wrapper defers them; a
 * handler that is not wrapped raises here, as it would have at any bytecode
 * of the Python twin inside the region. */
static int
region_leave_quietly(PyObject *entered)
{
    if (entered != Py_True) {
        return 1;
    }
    if (PyErr_CheckSignals() < 0) {
        return -1;
    }
    PyObject *d = PyList_GET_ITEM(region_depth, 0);
    if (d == NULL || !PyLong_CheckExact(d)
        || (PyLong_AsLong(d) == 1 && PyList_GET_SIZE(region_deferred) > 0)) {
        PyErr_Clear();
        return 0;
    }
    if (region_add(-1) < 0) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* How the steady state waits (as collective_gc._transport.wait without a
 * deadline): MPI_Testany between yields of the core for the first
 * WAIT_SPIN_S seconds (a collective is progressed only inside a test, and
 * the rank it waits for may share this core), then between sleeps that grow
 * to a millisecond; the GIL is taken back every WAIT_SLICE_S seconds to run
 * the signal handlers. A blocking MPI_Waitany runs no handler until it
 * returns: a second Ctrl-C, which the library's wrapper raises at once
 * inside a protected region, would wait for the late rank. */
#define WAIT_SPIN_S 0.05
#define WAIT_SLICE_S 0.01

/* Wait until one of ``reqs`` (the allreduce, the watch's receive) completes:
 * an MPI error code (``*index`` as MPI_Testany sets it), or -1 with a Python
 * exception set when a signal handler raised (the requests left as they
 * are, still active). Called with the GIL held. */
static int
wait_either(MPI_Request reqs[2], int *index)
{
    int flag = 0, ierr = MPI_SUCCESS;
    double spin_until = now_seconds() + WAIT_SPIN_S;
    long delay_ns = 0;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        double slice_end = now_seconds() + WAIT_SLICE_S;
        for (;;) {
            ierr = MPI_Testany(2, reqs, index, &flag, MPI_STATUS_IGNORE);
            if (ierr != MPI_SUCCESS || flag) {
                break;
            }
            double now = now_seconds();
            if (now >= slice_end) {
                break;
            }
            if (now < spin_until) {
                sched_yield();
            }
            else {
                struct timespec ts = {0, delay_ns};
                nanosleep(&ts, NULL);
                delay_ns = delay_ns * 2 + 20000;
                if (delay_ns > 1000000) {
                    delay_ns = 1000000;
                }
            }
        }
        Py_END_ALLOW_THREADS
        if (ierr != MPI_SUCCESS || flag) {
            return ierr;
        }
        if (PyErr_CheckSignals() < 0) {
            return -1;
        }
    }
}

PyDoc_STRVAR(steady_doc,
"steady(family, t0, collected, extra, owner, fingerprint, entered) -> None | CollectStats | tuple\n\n"
"collective_gc._collective.steady_py, in C (see there).");

static PyObject *
steady(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "steady: expected 7 arguments");
        return NULL;
    }
    PyObject *fam = args[0], *collected = args[2], *extra = args[3], *extra_owner = args[4];
    PyObject *fp_obj = args[5], *entered = args[6];
    double t0 = PyFloat_AsDouble(args[1]);
    if (t0 == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    /* The caller entered the protected region (``entered``: what
     * region_enter returned): whatever this returns but a CollectStats leaves
     * it entered, for the caller to leave once the sync point's steps are
     * done (so that no signal's handler runs between here and there); a
     * CollectStats has left it, when no signal is deferred (else ("leave",
     * stats): the caller's leave runs the handlers). */
    int finalized = 1;
    if (!mpi_is_ready || fam_type == NULL || Py_TYPE(fam) != fam_type
        || MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) {
        Py_RETURN_NONE; /* the Python steps refuse after MPI_Finalize */
    }
    int ok = 1;
    PyObject *registry = SLOT(fam, oc_registry), *agreement = SLOT(fam, oc_agreement);
    PyObject *unreported = SLOT(fam, oc_unreported), *leaving = SLOT(fam, oc_leaving);
    PyObject *children = SLOT(fam, oc_children);
    if (registry == NULL || Py_TYPE(registry) != registry_type || agreement == NULL
        || Py_TYPE(agreement) != agree_type || unreported == NULL || !PyList_Check(unreported)
        || PyList_GET_SIZE(unreported) || leaving == NULL || !PyList_Check(leaving)
        || PyList_GET_SIZE(leaving) || children == NULL || !PyList_Check(children)
        || int_of(SLOT(fam, oc_destroying), &ok) != 0 || !ok) {
        Py_RETURN_NONE;
    }
    /* Families waiting to be reached: none this family's sync points have
     * not looked through yet (see REACH_EPOCH in _syncpoint). */
    if (PyList_GET_SIZE(unreached)
        && SLOT(fam, oc_reached) != PyList_GET_ITEM(reach_epoch, 0)) {
        Py_RETURN_NONE;
    }
    /* Derived families: each idle here (nothing for its sync point on this
     * rank); the agreement tells whether one is wanted on another rank. */
    if (PyList_GET_SIZE(children)) {
        Py_INCREF(children); /* the family's list may be replaced while idle() runs */
        int all_idle = 1;
        for (Py_ssize_t i = 0; all_idle && i < PyList_GET_SIZE(children); i++) {
            PyObject *child = Py_NewRef(PyList_GET_ITEM(children, i));
            PyObject *idle = PyObject_CallMethodNoArgs(child, s_idle);
            Py_DECREF(child);
            if (idle == NULL) {
                Py_DECREF(children);
                return NULL; /* the caller leaves the region and reports it */
            }
            all_idle = idle == Py_True;
            Py_DECREF(idle);
        }
        Py_DECREF(children);
        if (!all_idle) {
            Py_RETURN_NONE;
        }
    }
    PyObject *inbox = SLOT(registry, or_inbox), *pend = SLOT(registry, or_pend);
    PyObject *last_cyclic = SLOT(registry, or_last_cyclic);
    if (inbox == NULL || !PyList_CheckExact(inbox) || SLOT(registry, or_stale) != Py_False
        || last_cyclic == NULL || !PyList_Check(last_cyclic) || PyList_GET_SIZE(last_cyclic)
        || pend == NULL) {
        Py_RETURN_NONE;
    }
    Py_ssize_t npend = PyObject_Length(pend);
    if (npend != 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *window = SLOT(agreement, oa_window), *watch = SLOT(agreement, oa_watch);
    PyObject *arr = SLOT(agreement, oa_arr), *persistent = SLOT(agreement, oa_persistent);
    PyObject *preq_obj = SLOT(agreement, oa_preq), *comm_obj = SLOT(agreement, oa_comm);
    if (window == NULL || Py_TYPE(window) != window_type || watch == NULL
        || Py_TYPE(watch) != watch_type || arr == NULL || persistent == NULL
        || preq_obj == NULL || comm_obj == NULL || SLOT(watch, ot_gone) != Py_None
        || SLOT(watch, ot_closed) != Py_False || SLOT(watch, ot_req) == NULL) {
        Py_RETURN_NONE;
    }
    long long nbits = int_of(SLOT(window, ow_bits), &ok), lo = int_of(SLOT(window, ow_lo), &ok);
    long long shaped = int_of(SLOT(agreement, oa_nbits), &ok);
    if (!ok || nbits != shaped || nbits < 0 || nbits % 64
        || (persistent != Py_None && preq_obj == Py_None)) {
        Py_RETURN_NONE;
    }
    /* Votes: only participants that a quiet sync point needs nothing of, all 0. */
    PyObject *parts = SLOT(fam, oc_participants), *owners = SLOT(fam, oc_owners);
    if (parts == NULL || !PyList_Check(parts) || owners == NULL || !PyList_Check(owners)
        || PyList_GET_SIZE(owners) != PyList_GET_SIZE(parts)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t nparts = PyList_GET_SIZE(parts);
    for (Py_ssize_t i = 0; i <= nparts; i++) {
        PyObject *p = i < nparts ? PyList_GET_ITEM(parts, i) : extra;
        if (p == Py_None) {
            break; /* no participant of its own */
        }
        PyObject *owner = i < nparts ? PyList_GET_ITEM(owners, i) : extra_owner;
        Py_INCREF(p);
        Py_INCREF(owner);
        PyObject *quiet = PyObject_GetAttr(p, s_quiet_finish);
        PyObject *field = quiet == NULL ? NULL : PyObject_GetAttr(p, s_field);
        long long vote = 0;
        int voted = 1;
        if (field != NULL && quiet == Py_True && field != Py_None) {
            PyObject *v = PyObject_CallMethodOneArg(p, s_vote, owner);
            vote = int_of(v, &voted);
            if (v == NULL) {
                voted = 0;
            }
            Py_XDECREF(v);
        }
        int steady_here = quiet == Py_True && field != NULL && voted && vote == 0;
        Py_XDECREF(quiet);
        Py_XDECREF(field);
        Py_DECREF(owner);
        Py_DECREF(p);
        if (PyErr_Occurred()) {
            /* A vote that raises: the Python steps make the same call and say so. */
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (!steady_here) {
            Py_RETURN_NONE;
        }
    }
    /* Votes may run Python code (and so let other threads register): the
     * registry is read from here on, with no Python code run before the
     * inbox is drained. */
    inbox = SLOT(registry, or_inbox);
    Py_ssize_t n = PyList_GET_SIZE(inbox);
    int64_t *keys = NULL;
    if (n) {
        keys = PyMem_Malloc((size_t)n * sizeof(int64_t));
        if (keys == NULL) {
            return PyErr_NoMemory();
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *reg = PyList_GET_ITEM(inbox, i);
            PyObject *key = Py_TYPE(reg) == reg_type ? SLOT(reg, off_key) : NULL;
            PyObject *flag = key == NULL ? NULL : SLOT(reg, off_cyclic);
            int kok = 1;
            long long k = int_of(key, &kok);
            if (flag != Py_False || !kok) {
                PyMem_Free(keys); /* a cyclic death (or not ours): the Python steps */
                Py_RETURN_NONE;
            }
            keys[i] = (int64_t)k;
        }
        if (!sort_keys(keys, n)) {
            qsort(keys, (size_t)n, sizeof(int64_t), qsort_cmp);
        }
        /* Registrations stay in registry.live: removing them from the inbox
         * frees nothing, so runs no code. */
        if (PyList_SetSlice(inbox, 0, n, NULL) < 0) {
            PyMem_Free(keys);
            return NULL;
        }
    }
    PyObject *result = NULL;
    long long seq = int_of(SLOT(fam, oc_seq), &ok);
    long long next_key = int_of(SLOT(registry, off_next_key), &ok);
    if (fp_obj == Py_None) {
        fp_obj = SLOT(fam, oc_fingerprint);
    }
    PyObject *order_obj = SLOT(registry, off_order);
    long long fp = fp_obj == NULL ? 0 : PyLong_AsLongLong(fp_obj);
    unsigned long long order = order_obj == NULL ? 0 : PyLong_AsUnsignedLongLong(order_obj);
    if (!ok || PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_RuntimeError, "steady: a sync point number or key is not an int");
        goto fail_store;
    }
    Py_buffer view;
    if (int64_buffer(arr, &view, 1, "steady") < 0) {
        goto fail_store;
    }
    int64_t *buf = (int64_t *)view.buf;
    Py_ssize_t nwords = view.len / 8, wwords = (Py_ssize_t)(nbits / 64);
    const Py_ssize_t head = 9; /* _agree.WORDS */
    if (nwords != head + wwords) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_RuntimeError, "steady: the buffer does not fit the window");
        goto fail_store;
    }
    long long seqword = seq * 2;
    long long parts_word = (long long)((uint64_t)fp ^ (uint64_t)order);
    buf[0] = seqword;
    buf[1] = ~seqword;
    buf[2] = next_key;
    buf[3] = ~next_key;
    buf[4] = parts_word;
    buf[5] = ~parts_word;
    buf[6] = ~0LL; /* ~flags: nothing voted */
    buf[8] = ~0LL; /* ~children: no derived family here */
    Py_ssize_t first = 0, last = 0;
    uint64_t filter = 0;
    uint64_t *words = (uint64_t *)buf + head;
    if (n) {
        memset(words, 0, (size_t)wwords * 8);
        while (first < n && keys[first] < lo) {
            first++;
        }
        for (Py_ssize_t i = 0; i < first; i++) {
            filter |= 1ULL << (((uint64_t)keys[i] * KEY_HASH) >> 58);
        }
        for (last = first; last < n && keys[last] - lo < nbits; last++) {
            uint64_t bit = (uint64_t)(keys[last] - lo);
            words[bit >> 6] |= 1ULL << (bit & 63);
        }
        for (Py_ssize_t i = last; i < n; i++) {
            filter |= 1ULL << (((uint64_t)keys[i] * KEY_HASH) >> 58);
        }
        Py_XSETREF(SLOT(agreement, oa_dirty), Py_NewRef(Py_True));
    }
    else if (SLOT(agreement, oa_dirty) == Py_True) {
        memset(words, 0, (size_t)wwords * 8); /* the AND of bits this rank sent */
        Py_XSETREF(SLOT(agreement, oa_dirty), Py_NewRef(Py_False));
    }
    buf[7] = (int64_t)filter;
    if (set_int(agreement, oa_lo, lo) < 0 || set_int(watch, ot_seq, seq) < 0) {
        PyBuffer_Release(&view);
        goto fail_store;
    }
    /* From the start of the allreduce, leaving by an exception makes the
     * family unusable (Collective.sync): the other ranks are in it. */
    Py_XSETREF(SLOT(fam, oc_inside), Py_NewRef(Py_True));
    MPI_Comm *comm = PyMPIComm_Get(comm_obj);
    MPI_Request *wreq = PyMPIRequest_Get(SLOT(watch, ot_req));
    if (comm == NULL || wreq == NULL) {
        PyBuffer_Release(&view);
        goto fail_store;
    }
    MPI_Request reqs[2], *preq = NULL;
    int ierr, index = MPI_UNDEFINED;
    if (persistent != Py_None) {
        preq = PyMPIRequest_Get(preq_obj);
        if (preq == NULL) {
            PyBuffer_Release(&view);
            goto fail_store;
        }
        ierr = MPI_Start(preq);
        reqs[0] = *preq;
    }
    else {
        ierr = MPI_Iallreduce(MPI_IN_PLACE, buf, (int)nwords, MPI_LONG_LONG, MPI_BAND, *comm,
                              &reqs[0]);
    }
    if (ierr == MPI_SUCCESS) {
        reqs[1] = *wreq;
        ierr = wait_either(reqs, &index);
        *wreq = reqs[1]; /* MPI nulled it if the notice arrived */
        if (preq != NULL) {
            *preq = reqs[0];
        }
    }
    PyBuffer_Release(&view); /* the array is not resized while MPI may write: see _agree */
    if (ierr == -1) {
        /* A handler raised in the wait (a second Ctrl-C): the allreduce is
         * still active; it and its buffer are kept for ever (as "watch"
         * below), the drained keys are pending again, and the exception
         * leaves the sync point (Collective.quick makes the family unusable
         * and tells the other ranks: inside is set). */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *req = preq != NULL ? Py_NewRef(Py_None) : PyMPIRequest_New(reqs[0]);
        PyObject *kept = req == NULL ? NULL : PyObject_CallMethod(agreement, "abandoned", "O", req);
        Py_XDECREF(req);
        Py_XDECREF(kept);
        PyErr_Clear(); /* the handler's exception matters more */
        if (store_pending(registry, keys, n, seq) < 0) {
            PyErr_Clear();
        }
        PyErr_Restore(type, value, tb);
        goto fail;
    }
    if (ierr != MPI_SUCCESS) {
        char text[MPI_MAX_ERROR_STRING];
        int tlen = 0;
        MPI_Error_string(ierr, text, &tlen);
        PyErr_Format(PyExc_RuntimeError, "steady: the agreement's allreduce failed: %.*s", tlen,
                     text);
        goto fail_store;
    }
    if (index == 1) {
        /* A rank gave up (or left) while this one waited: the allreduce is
         * still active, and is handed back to be kept for ever. */
        if (store_pending(registry, keys, n, seq) < 0) {
            goto fail;
        }
        PyObject *req = preq != NULL ? Py_NewRef(Py_None) : PyMPIRequest_New(reqs[0]);
        if (req == NULL) {
            goto fail;
        }
        result = Py_BuildValue("(sN)", "watch", req);
        goto done;
    }
    Py_ssize_t agreed = 0;
    int unusual = buf[6] != ~0LL || buf[7] != 0 || buf[8] != ~0LL || buf[0] != ~buf[1]
                  || buf[2] != ~buf[3] || buf[4] != ~buf[5];
    if (!unusual && last > first) {
        for (Py_ssize_t w = 0; w < wwords; w++) {
            agreed += POPCOUNT64(words[w]);
        }
    }
    if (unusual || agreed != n) {
        /* The Python steps go on from the agreement, with these keys pending. */
        if (store_pending(registry, keys, n, seq) < 0) {
            goto fail;
        }
        result = Py_BuildValue("(snn)", "resume", first, last);
        goto done;
    }
    /* The steady state: every drained key agreed, nothing else. */
    PyObject *marks = SLOT(window, ow_marks);
    long long idle = int_of(SLOT(window, ow_idle), &ok);
    long long last_mark = -1;
    if (marks != NULL && PyList_Check(marks) && PyList_GET_SIZE(marks)) {
        last_mark = int_of(PyList_GET_ITEM(marks, PyList_GET_SIZE(marks) - 1), &ok);
    }
    if (!(ok && next_key == last_mark && idle == window_memory)) {
        PyObject *nk = PyLong_FromLongLong(next_key);
        PyObject *r = nk == NULL ? NULL : PyObject_CallMethodOneArg(window, s_advance, nk);
        Py_XDECREF(nk);
        if (r == NULL) {
            goto fail;
        }
        Py_DECREF(r);
    }
    ok = 1;
    long long thread = int_of(SLOT(registry, off_thread), &ok);
    if (ok && thread > 0 && set_int(registry, off_thread, 0) < 0) { /* new_interval */
        goto fail;
    }
    if (set_int(fam, oc_seq, seq + 1) < 0) {
        goto fail;
    }
    Py_XSETREF(SLOT(fam, oc_inside), Py_NewRef(Py_False));
    long long count = 0;
    PyObject *failures = NULL;
    if (n) {
        PyObject *raw = PyByteArray_FromStringAndSize((const char *)keys, n * 8);
        PyObject *karr = raw == NULL ? NULL : PyObject_CallOneArg(as_keys, raw);
        Py_XDECREF(raw);
        if (karr == NULL || set_int(fam, oc_destroying, (long long)PyThread_get_thread_ident()) < 0) {
            Py_XDECREF(karr);
            goto fail;
        }
        PyObject *ran = PyObject_CallFunctionObjArgs(destroy_run, registry, karr, NULL);
        Py_DECREF(karr);
        set_int(fam, oc_destroying, 0);
        if (ran == NULL) {
            goto fail;
        }
        int cok = 1;
        count = PyTuple_Check(ran) && PyTuple_GET_SIZE(ran) == 3
                    ? int_of(PyTuple_GET_ITEM(ran, 0), &cok)
                    : 0;
        long long before = int_of(SLOT(fam, oc_destroyed), &cok);
        if (!cok || set_int(fam, oc_destroyed, before + count) < 0) {
            Py_DECREF(ran);
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_RuntimeError, "steady: _destroy.run returned no count");
            }
            goto fail;
        }
        PyObject *fl = PyTuple_GET_ITEM(ran, 1), *interrupt = PyTuple_GET_ITEM(ran, 2);
        if (PyList_Check(fl) && (PyList_GET_SIZE(fl) || interrupt != Py_None)) {
            failures = PyList_GetSlice(fl, 0, PyList_GET_SIZE(fl));
            if (failures != NULL && interrupt != Py_None) {
                PyObject *own = Py_BuildValue(
                    "(isO)", -1, "the sync point's own steps between its destroys", interrupt);
                if (own == NULL || PyList_Append(failures, own) < 0) {
                    Py_CLEAR(failures);
                }
                Py_XDECREF(own);
            }
        }
        Py_DECREF(ran);
        if (PyErr_Occurred()) {
            Py_XDECREF(failures);
            goto fail;
        }
    }
    PyObject *fields = Py_BuildValue("(LnidLOi)", count, PyList_GET_SIZE(inbox), 0,
                                     now_seconds() - t0, seq, collected, 0);
    PyObject *targs = fields == NULL ? NULL : PyTuple_Pack(1, fields);
    Py_XDECREF(fields);
    PyObject *stats = targs == NULL ? NULL : PyTuple_Type.tp_new(stats_type, targs, NULL);
    Py_XDECREF(targs);
    if (stats == NULL) {
        Py_XDECREF(failures);
        goto fail;
    }
    if (failures != NULL) {
        result = Py_BuildValue("(sNN)", "failed", stats, failures);
    }
    else {
        int left = region_leave_quietly(entered);
        if (left < 0) {
            /* The sync point is done (nothing to restore): the handler's
             * exception is what the call raises; the caller leaves the region. */
            Py_DECREF(stats);
            result = NULL;
        }
        else if (left) {
            result = stats;
        }
        else {
            result = Py_BuildValue("(sN)", "leave", stats);
        }
    }
    goto done;
fail_store:
    /* Nothing may be lost: the keys drained here are pending again. */
    if (n) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (store_pending(registry, keys, n, seq) < 0) {
            PyErr_Clear();
        }
        PyErr_Restore(type, value, tb);
    }
fail:
    result = NULL;
done:
    PyMem_Free(keys);
    return result;
}
#endif /* CGC_HAVE_MPI */

static PyMethodDef methods[] = {
    {"region_setup", region_setup, METH_VARARGS, region_setup_doc},
    {"region_enter", region_enter, METH_NOARGS, region_enter_doc},
    {"region_leave", region_leave, METH_O, region_leave_doc},
    {"handlers_changed", (PyCFunction)(void (*)(void))handlers_changed, METH_FASTCALL,
     handlers_changed_doc},
    {"set_registration_type", set_registration_type, METH_O, set_registration_type_doc},
    {"take_batch", take_batch, METH_VARARGS, take_batch_doc},
    {"new_registration", (PyCFunction)(void (*)(void))new_registration, METH_FASTCALL,
     new_registration_doc},
    {"run_each", run_each, METH_VARARGS, run_each_doc},
    {"set_flags", set_flags, METH_O, set_flags_doc},
    {"on_finalize", on_finalize, METH_O, on_finalize_doc},
    {"destroy_each", destroy_each, METH_VARARGS, destroy_each_doc},
    {"set_petsc_reader", set_petsc_reader, METH_VARARGS, set_petsc_reader_doc},
    {"petsc_garbage", petsc_garbage, METH_O, petsc_garbage_doc},
    {"keys_of", keys_of, METH_O, keys_of_doc},
    {"pack_window", pack_window, METH_VARARGS, pack_window_doc},
    {"window_keys", window_keys, METH_VARARGS, window_keys_doc},
    {"set_registry_type", set_registry_type, METH_VARARGS, set_registry_type_doc},
    {"add_plain", (PyCFunction)(void (*)(void))add_plain, METH_FASTCALL, add_plain_doc},
#ifdef CGC_HAVE_MPI
    {"mpi_ready", mpi_ready, METH_NOARGS, mpi_ready_doc},
    {"steady_setup", steady_setup, METH_VARARGS, steady_setup_doc},
    {"steady", (PyCFunction)(void (*)(void))steady, METH_FASTCALL, steady_doc},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "collective_gc._speedups",
    "The per-object hot spots of collective_gc in C (see the source's header).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    if (!(s_state = PyUnicode_InternFromString("_state"))
        || !(s_cyclic = PyUnicode_InternFromString("cyclic"))
        || !(s_push = PyUnicode_InternFromString("_push"))) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module_def);
#ifdef CGC_HAVE_MPI
    const int have_mpi = 1;
#else
    const int have_mpi = 0;
#endif
    if (m != NULL && PyModule_AddObject(m, "HAVE_MPI", PyBool_FromLong(have_mpi)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
