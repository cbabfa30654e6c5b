/* collective_gc._speedups: collective_gc's typed state, in C.
 *
 * Built with MPI's compiler wrapper and mpi4py's C API (see setup.py); where
 * it is not built, or its MPI is not the one mpi4py uses, the Python twins in
 * collective_gc/_state.py do the same (collective_gc/_switch.py decides once).
 *
 * Who owns what. Each type is the one writer of its declared fields, as
 * mpi4py's Comm keeps MPI_Comm ob_mpi; the C reads no other Python object's
 * attributes, by name or by offset. It reaches communicators and requests
 * through mpi4py's C API (PyMPIComm_Get), and calls into Python only to run
 * destroys and what participants must run in Python (their votes and
 * finishes), plus the rare steps a twin hands back (wrapping signal
 * handlers, delivering deferred ones).
 *
 * GcState            one per process: the thread running the cyclic collector
 *                    (its gc.callbacks hook, `phase`), finalizers off, origins
 *                    tracked; `finalize`, every registration's weak-reference
 *                    callback: record and queue, nothing else.
 * RegistrationFields the fields of a registration (a weakref.ref subclass);
 *                    collective_gc._registration.Registration adds methods.
 * Region             one per process: the depth of protected regions and the
 *                    signals deferred to their end (collective_gc._interrupts).
 * FamilyState        one per family of congruent communicators: usable or not
 *                    and why; the sync-point count, the region flag (inside),
 *                    the destroys; the registrations (key counter, order
 *                    fingerprint, registering thread, inbox, live ones, the
 *                    pending keys); the agreement (private communicator,
 *                    message buffer, persistent request, key window); the
 *                    watch (the standing receive of a rank's notice). Its
 *                    `steady` runs a sync point whose every step takes its fast
 *                    case, in one call: steady_prepare, _agree, _destroy,
 *                    _finish, _report (the steps of collective_gc._syncpoint,
 *                    named alike), and hands anything unusual back to them
 *                    (`progress`).
 * Petsc              what collective_gc.petsc reads and runs of PETSc, given
 *                    the addresses of PETSc's and petsc4py's functions once, at
 *                    construction: how many garbage entries PETSc holds on a
 *                    communicator (read where PETSc keeps them), `sort`
 *                    (whether cp.manage's objects take its fast path), and
 *                    the runners, and the families' CommStates.
 * CommState          one per family that manages PETSc objects (and one for
 *                    serial objects): its failed destroys, the PETSc inner
 *                    communicators it holds, the handles its vote reads; the
 *                    cleanup participant's vote (collective_gc.petsc's
 *                    _destroyers.CommState is its twin and owns the NOTE).
 * PetscRun           a runner: a run of managed PETSc destroys in one loop
 *                    (PetscObjectDestroy on petsc4py's handle, every object
 *                    tried whatever raises), holding each parallel object's
 *                    inner communicator first (CommState.hold, its NOTE in
 *                    collective_gc/petsc/_destroyers.py); FamilyState.destroy
 *                    calls it from C directly.
 *
 * The GIL is held throughout, except in a wait's polling. Every method does
 * what its Python twin does; where the two must agree on layout (the message),
 * collective_gc/_agree.py has the table.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sched.h>
#include <mpi.h>
#include <mpi4py/mpi4py.h>

#define WORDS 9             /* the message's header (collective_gc._agree) */
#define FLAG_DEADLINE 4     /* collective_gc._agree.FLAG_DEADLINE */
#define SYNC_FLAGS 0xFF     /* the sync point's own flags: the low byte */
#define ALIVE 0
#define DESTROYED 2
#define DETACHED 3
#define OPEN 0
#define HOLD_LEAVING 1
#define HOLD_PARTS 2
#define HOLD_GONE 8
#define WINDOW_MIN 256
#define WINDOW_LIMIT (1 << 20)
#define MEMORY 8
#define SPAN 4
#define TAG_GAVE_UP 25
#define GAVE_UP 0
#define LEFT 1
#define WOKEN 2
#define DONE 0
#define WATCHED 1
#define LATE 2
#define STEP_AGREE 1        /* collective_gc._syncpoint.AGREE */
#define STEP_REPORT 7       /* collective_gc._syncpoint.REPORT */
#define SPIN_S 0.05         /* a wait only yields the core this long (_transport.SPIN) */
#define SLICE_S 0.01        /* the GIL is taken back this often to run handlers */
#define QUICK_TESTS 32      /* Tests before a wait yields or releases the GIL */
#define KEY_HASH 0x9E3779B97F4A7C15ULL
/* MPI-4's persistent collectives: MPICH 4, and Open MPI 5 (which still says MPI 3.1). */
#if MPI_VERSION >= 4 || (defined(OMPI_MAJOR_VERSION) && OMPI_MAJOR_VERSION >= 5)
#define HAVE_PERSISTENT 1
#else
#define HAVE_PERSISTENT 0
#endif

static double
now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The exception set, normalized, with its traceback on it (taken: none is set after). */
static PyObject *
take_exception(void)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL) {
        return NULL;
    }
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) {
        PyException_SetTraceback(value, tb);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

static void
restore_exception(PyObject *exc)
{
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
}

static int
no_keywords(const char *what, PyObject *kw)
{
    if (kw != NULL && PyDict_GET_SIZE(kw)) {
        PyErr_Format(PyExc_TypeError, "%s takes no keyword arguments", what);
        return 0;
    }
    return 1;
}

static int
as_int(PyObject *o)
{
    long v = PyLong_AsLong(o);
    return (int)v;
}

static uint64_t
order_step(uint64_t key, uint64_t tag)
{
    if (tag == 0) {
        return 0;
    }
    uint64_t x = key * KEY_HASH + tag;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static int
cmp_keys(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Ascending: the keys finalizers queue are often in one order or the other. */
static void
sort_keys(int64_t *k, Py_ssize_t n)
{
    Py_ssize_t i = 1;
    while (i < n && k[i - 1] <= k[i]) {
        i++;
    }
    if (i >= n) {
        return;
    }
    for (i = 1; i < n && k[i - 1] >= k[i]; i++) {
    }
    if (i >= n) {
        for (Py_ssize_t a = 0, b = n - 1; a < b; a++, b--) {
            int64_t t = k[a];
            k[a] = k[b];
            k[b] = t;
        }
        return;
    }
    qsort(k, (size_t)n, sizeof(int64_t), cmp_keys);
}

/* The collector's walks of a type's object fields, from one list per type:
 * FIELDS(X) applies X to each field's name, so that a type's traverse, clear
 * and dealloc cannot disagree on which fields they walk (a field visited but
 * never cleared keeps a cycle alive; one cleared but never visited hides a
 * reference from the collector). GC_WALKS defines <prefix>_traverse and
 * <prefix>_clear; GC_DEALLOC the dealloc of a type with nothing else to free. */
#define VISIT_FIELD(f) Py_VISIT(self->f);
#define CLEAR_FIELD(f) Py_CLEAR(self->f);
#define GC_WALKS(prefix, Type, FIELDS)                                    \
    static int prefix##_traverse(Type *self, visitproc visit, void *arg) \
    {                                                                     \
        FIELDS(VISIT_FIELD)                                               \
        return 0;                                                         \
    }                                                                     \
    static int prefix##_clear(Type *self)                                 \
    {                                                                     \
        FIELDS(CLEAR_FIELD)                                               \
        return 0;                                                         \
    }
#define GC_DEALLOC(prefix, Type)                  \
    static void prefix##_dealloc(Type *self)      \
    {                                             \
        PyObject_GC_UnTrack(self);                \
        prefix##_clear(self);                     \
        Py_TYPE(self)->tp_free((PyObject *)self); \
    }

/* ======================================================================== */
/* GcState                                                                   */

typedef struct {
    PyObject_HEAD
    unsigned long main;
    unsigned long collecting;
    char off;
    Py_ssize_t origins; /* how many ask registrations to record their origin */
    Py_ssize_t seen;
} GcState;

static PyTypeObject GcStateType;
static PyTypeObject RegType;

typedef struct {
    PyWeakReference wr;
    long long key;
    long long queued_at;
    int state;
    char cyclic;
    PyObject *name, *origin, *owner, *push, *destroy, *args, *typename;
} Reg;

static PyObject *
gc_phase(GcState *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "phase(phase, info)");
        return NULL;
    }
    if (PyUnicode_CompareWithASCIIString(args[0], "start") == 0) {
        self->collecting = PyThread_get_thread_ident();
        self->seen++;
    }
    else {
        self->collecting = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *
gc_switch_off(GcState *self, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0) {
        return NULL;
    }
    self->off = (char)on;
    Py_RETURN_NONE;
}

static PyObject *
gc_track(GcState *self, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0) {
        return NULL;
    }
    /* Counted (see the Python twin); one step under the GIL. */
    PyObject *was = PyBool_FromLong(self->origins > 0);
    if (on) {
        self->origins++;
    }
    else if (self->origins > 0) {
        self->origins--;
    }
    return was;
}

static PyObject *
gc_forked(GcState *self, PyObject *unused)
{
    self->collecting = 0;
    Py_RETURN_NONE;
}

/* Record whether the cyclic collector runs on this thread, and queue: the
 * only code that runs when a managed object dies (no lock, no MPI, no destroy). */
static PyObject *
gc_finalize(GcState *self, PyObject *arg)
{
    if (self->off || !PyObject_TypeCheck(arg, &RegType)) {
        Py_RETURN_NONE;
    }
    Reg *reg = (Reg *)arg;
    if (reg->state != ALIVE || reg->push == NULL) {
        Py_RETURN_NONE;
    }
    if (self->collecting && self->collecting == PyThread_get_thread_ident()) {
        reg->cyclic = 1;
    }
    PyObject *res = PyObject_CallOneArg(reg->push, arg);
    if (res == NULL) {
        return NULL;
    }
    Py_DECREF(res);
    Py_RETURN_NONE;
}

static PyObject *
gc_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    unsigned long main_ident;
    if (!no_keywords("GcState", kw) || !PyArg_ParseTuple(args, "k:GcState", &main_ident)) {
        return NULL;
    }
    GcState *g = (GcState *)type->tp_alloc(type, 0);
    if (g != NULL) {
        g->main = main_ident;
    }
    return (PyObject *)g;
}

static PyMethodDef gc_methods[] = {
    {"phase", (PyCFunction)(void (*)(void))gc_phase, METH_FASTCALL, "The gc.callbacks hook."},
    {"switch_off", (PyCFunction)gc_switch_off, METH_O, "Finalizers off (exit, fork), or on."},
    {"track", (PyCFunction)gc_track, METH_O, "One more asker for origins, or one fewer; whether on before."},
    {"forked", (PyCFunction)gc_forked, METH_NOARGS, "In a forked child: nobody collects."},
    {"finalize", (PyCFunction)gc_finalize, METH_O, "Every registration's callback."},
    {NULL},
};

static PyMemberDef gc_members[] = {
    {"main", T_ULONG, offsetof(GcState, main), READONLY, NULL},
    {"collecting", T_ULONG, offsetof(GcState, collecting), READONLY, NULL},
    {"off", T_BOOL, offsetof(GcState, off), READONLY, NULL},
    {"origins", T_PYSSIZET, offsetof(GcState, origins), READONLY, NULL},
    {"seen", T_PYSSIZET, offsetof(GcState, seen), READONLY, NULL},
    {NULL},
};

static PyTypeObject GcStateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "collective_gc._speedups.GcState",
    .tp_basicsize = sizeof(GcState),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "collective_gc._state.GcState, in C.",
    .tp_methods = gc_methods,
    .tp_members = gc_members,
    .tp_new = gc_new,
};

/* ======================================================================== */
/* RegistrationFields                                                        */

/* Walked, then the weak reference's own fields (its base's walks). */
#define REG_OBJECTS(X) X(name) X(origin) X(owner) X(push) X(destroy) X(args) X(typename)

static int
reg_traverse(Reg *self, visitproc visit, void *arg)
{
    REG_OBJECTS(VISIT_FIELD)
    return _PyWeakref_RefType.tp_traverse((PyObject *)self, visit, arg);
}

static int
reg_clear(Reg *self)
{
    REG_OBJECTS(CLEAR_FIELD)
    return _PyWeakref_RefType.tp_clear((PyObject *)self);
}

static void
reg_dealloc(Reg *self)
{
    PyObject_GC_UnTrack(self);
    REG_OBJECTS(CLEAR_FIELD)
    /* weakref's own dealloc unlinks it from its referent and frees it */
    _PyWeakref_RefType.tp_dealloc((PyObject *)self);
}

/* Read-only from Python: C writes them (make_reg, claim_c, destroy_c,
 * fs_forget, gc_finalize, the key in registration) and note_queued below.
 * Written from Python, a non-tuple _args would reach PyObject_Call and a
 * deleted name a failure's row; a destroy rebound to None while alive would
 * be skipped by the destroy pass (it reads the call, not the state). */
static PyMemberDef reg_members[] = {
    {"key", T_LONGLONG, offsetof(Reg, key), READONLY, NULL},
    {"queued_at", T_LONGLONG, offsetof(Reg, queued_at), READONLY, NULL},
    {"_state", T_INT, offsetof(Reg, state), READONLY, NULL},
    {"cyclic", T_BOOL, offsetof(Reg, cyclic), READONLY, NULL},
    {"name", T_OBJECT, offsetof(Reg, name), READONLY, NULL},
    {"origin", T_OBJECT, offsetof(Reg, origin), READONLY, NULL},
    {"_owner", T_OBJECT, offsetof(Reg, owner), READONLY, NULL},
    {"_push", T_OBJECT, offsetof(Reg, push), READONLY, NULL},
    {"_destroy", T_OBJECT, offsetof(Reg, destroy), READONLY, NULL},
    {"_args", T_OBJECT, offsetof(Reg, args), READONLY, NULL},
    {"_typename", T_OBJECT, offsetof(Reg, typename), READONLY, NULL},
    {NULL},
};

static PyTypeObject RegType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "collective_gc._speedups.RegistrationFields",
    .tp_basicsize = sizeof(Reg),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "collective_gc._state.RegistrationFields, in C.",
    .tp_traverse = (traverseproc)reg_traverse,
    .tp_clear = (inquiry)reg_clear,
    .tp_dealloc = (destructor)reg_dealloc,
    .tp_members = reg_members,
};

/* A registration of ``cls`` (a subclass of RegType) with its fields set;
 * NULL with TypeError if obj cannot be weakly referenced. */
static PyObject *
make_reg(PyTypeObject *cls, PyObject *callback, PyObject *obj, PyObject *owner, PyObject *push,
         long long key, PyObject *destroy, PyObject *args, PyObject *name, PyObject *origin)
{
    PyObject *typename = PyType_GetName(Py_TYPE(obj));
    if (typename == NULL) {
        return NULL;
    }
    PyObject *pair = PyTuple_Pack(2, obj, callback);
    if (pair == NULL) {
        Py_DECREF(typename);
        return NULL;
    }
    /* weakref's tp_new takes (obj, callback) and allocates cls; no __init__. */
    Reg *reg = (Reg *)cls->tp_new(cls, pair, NULL);
    Py_DECREF(pair);
    if (reg != NULL && !PyObject_TypeCheck((PyObject *)reg, &RegType)) {
        /* a subclass whose __new__ made something else: no fields to set */
        PyErr_SetString(PyExc_TypeError, "new_registration: cls made no registration");
        Py_CLEAR(reg);
    }
    if (reg == NULL) {
        Py_DECREF(typename);
        return NULL;
    }
    reg->key = key;
    reg->queued_at = -1;
    reg->state = ALIVE;
    reg->cyclic = 0;
    Py_XSETREF(reg->name, Py_NewRef(name == Py_None ? typename : name));
    Py_XSETREF(reg->typename, typename);
    Py_XSETREF(reg->origin, Py_NewRef(origin));
    Py_XSETREF(reg->owner, Py_NewRef(owner));
    Py_XSETREF(reg->push, Py_NewRef(push));
    Py_XSETREF(reg->destroy, Py_NewRef(destroy));
    Py_XSETREF(reg->args, Py_NewRef(args));
    return (PyObject *)reg;
}

static PyObject *
new_registration(PyObject *module, PyObject *const *a, Py_ssize_t n)
{
    if (n != 10 || !PyType_Check(a[0]) || !PyType_IsSubtype((PyTypeObject *)a[0], &RegType)
        || !PyTuple_Check(a[7])) {
        PyErr_SetString(PyExc_TypeError,
                        "new_registration(cls, callback, obj, owner, push, key, destroy, args, "
                        "name, origin): cls a RegistrationFields type, args a tuple");
        return NULL;
    }
    long long key = PyLong_AsLongLong(a[5]);
    if (key == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return make_reg((PyTypeObject *)a[0], a[1], a[2], a[3], a[4], key, a[6], a[7], a[8], a[9]);
}

/* note_queued(reg, seq): the twin of _state.note_queued. */
static PyObject *
note_queued(PyObject *module, PyObject *const *a, Py_ssize_t n)
{
    if (n != 2 || !PyObject_TypeCheck(a[0], &RegType)) {
        PyErr_SetString(PyExc_TypeError, "note_queued(reg, seq)");
        return NULL;
    }
    long long seq = PyLong_AsLongLong(a[1]);
    if (seq == -1 && PyErr_Occurred()) {
        return NULL;
    }
    ((Reg *)a[0])->queued_at = seq;
    Py_RETURN_NONE;
}

/* ======================================================================== */
/* Region                                                                    */

typedef struct {
    PyObject_HEAD
    unsigned long main;
    long depth;
    PyObject *deferred, *signals, *guarded, *getsignal, *guard, *deliver;
} Region;

#define REGION_OBJECTS(X) X(deferred) X(signals) X(guarded) X(getsignal) X(guard) X(deliver)
GC_WALKS(region, Region, REGION_OBJECTS)
GC_DEALLOC(region, Region)

static PyObject *
region_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    unsigned long main_ident;
    PyObject *signals, *getsignal, *guard, *deliver;
    if (!no_keywords("Region", kw)
        || !PyArg_ParseTuple(args, "kO!OOO:Region", &main_ident, &PyTuple_Type, &signals,
                             &getsignal, &guard, &deliver)) {
        return NULL;
    }
    Region *self = (Region *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->main = main_ident;
    self->deferred = PyList_New(0);
    Py_ssize_t n = PyTuple_GET_SIZE(signals);
    self->guarded = PyTuple_New(n);
    if (self->deferred == NULL || self->guarded == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *mark = PyBaseObject_Type.tp_alloc(&PyBaseObject_Type, 0); /* matches no handler */
        if (mark == NULL) {
            Py_DECREF(self);
            return NULL;
        }
        PyTuple_SET_ITEM(self->guarded, i, mark);
    }
    self->signals = Py_NewRef(signals);
    self->getsignal = Py_NewRef(getsignal);
    self->guard = Py_NewRef(guard);
    self->deliver = Py_NewRef(deliver);
    return (PyObject *)self;
}

/* Whether getsignal(s) is not guarded[i] for some signal (identity). */
static int
handlers_changed(Region *self)
{
    Py_ssize_t n = PyTuple_GET_SIZE(self->signals);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyObject_CallOneArg(self->getsignal, PyTuple_GET_ITEM(self->signals, i));
        if (h == NULL) {
            return -1;
        }
        int changed = h != PyTuple_GET_ITEM(self->guarded, i);
        Py_DECREF(h);
        if (changed) {
            return 1;
        }
    }
    return 0;
}

static PyObject *
region_enter(Region *self, PyObject *unused)
{
    if (PyThread_get_thread_ident() != self->main) {
        Py_RETURN_FALSE;
    }
    /* Counted first: a signal arriving while guard() runs (Python code) is
     * deferred already. */
    if (self->depth++ == 0) {
        int changed = handlers_changed(self);
        if (changed < 0) {
            self->depth--;
            return NULL;
        }
        if (changed) {
            PyObject *g = PyObject_CallNoArgs(self->guard);
            if (g == NULL || !PyTuple_Check(g)) {
                if (g != NULL) {
                    Py_DECREF(g);
                    PyErr_SetString(PyExc_TypeError, "Region: guard() must return a tuple");
                }
                self->depth--;
                return NULL;
            }
            Py_SETREF(self->guarded, g);
        }
    }
    Py_RETURN_TRUE;
}

static PyObject *
region_leave(Region *self, PyObject *entered)
{
    if (entered != Py_True) {
        Py_RETURN_NONE;
    }
    if (self->depth < 1) {
        PyErr_SetString(PyExc_RuntimeError,
                        "collective_gc: a protected region was left that was not entered");
        return NULL;
    }
    PyObject *first = NULL;
    if (self->depth == 1 && PyList_GET_SIZE(self->deferred) > 0) {
        /* Delivered while the region still counts as entered: a signal
         * arriving meanwhile is deferred, and delivered by the same loop. */
        first = PyObject_CallNoArgs(self->deliver);
        if (first == NULL) {
            self->depth--;
            return NULL;
        }
    }
    self->depth--;
    if (first == NULL || first == Py_None) {
        Py_XDECREF(first);
        Py_RETURN_NONE;
    }
    PyObject *r = PyObject_CallMethod(
        first, "add_note", "s",
        "collective_gc: its signal arrived while this rank was inside a sync point (or another "
        "collective of collective_gc), and its handler ran once the collectives were done, so "
        "that every rank left them alike");
    Py_XDECREF(r);
    PyErr_Clear();
    PyErr_SetObject((PyObject *)Py_TYPE(first), first);
    Py_DECREF(first);
    return NULL;
}

static PyMethodDef region_methods[] = {
    {"enter", (PyCFunction)region_enter, METH_NOARGS, "Enter a protected region."},
    {"leave", (PyCFunction)region_leave, METH_O, "Leave the region enter() entered."},
    {NULL},
};

static PyMemberDef region_members[] = {
    {"main", T_ULONG, offsetof(Region, main), READONLY, NULL},
    {"depth", T_LONG, offsetof(Region, depth), READONLY, NULL},
    {"deferred", T_OBJECT, offsetof(Region, deferred), READONLY, NULL},
    {"signals", T_OBJECT, offsetof(Region, signals), READONLY, NULL},
    {"guarded", T_OBJECT, offsetof(Region, guarded), READONLY, NULL},
    {NULL},
};

static PyTypeObject RegionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "collective_gc._speedups.Region",
    .tp_basicsize = sizeof(Region),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "collective_gc._state.Region, in C.",
    .tp_traverse = (traverseproc)region_traverse,
    .tp_clear = (inquiry)region_clear,
    .tp_dealloc = (destructor)region_dealloc,
    .tp_methods = region_methods,
    .tp_members = region_members,
    .tp_new = region_new,
};

/* ======================================================================== */
/* FamilyState                                                               */

static PyTypeObject PetscRunType;
static PyObject *petsc_run_any(PyObject *runner, PyObject *argss);

typedef struct FamilyState {
    PyObject_HEAD
    int rank, size;
    int code;
    PyObject *reason;
    long long seq;
    char inside;
    unsigned long destroying;
    long long destroyed;
    int progress;
    long hold;
    PyObject *unreported; /* list of (seq, failure) */
    PyObject *failed;     /* list of failures of the last steady() */
    /* registrations and the queue */
    long long next_key;
    unsigned long long order;
    /* next_key and order as the last drain cut them: what the exchange sends
     * (see the Python twin's drain) */
    long long cut_key;
    unsigned long long cut_order;
    long thread;
    int busy;
    PyObject *live;  /* dict: key -> registration */
    PyObject *inbox; /* list */
    PyObject *push;  /* inbox.append */
    PyObject *finalize; /* gc.finalize, every registration's callback */
    char stale;
    int64_t *pend, *ages; /* pending keys, ascending, and the sync point each was drained at */
    Py_ssize_t npend, cap;
    GcState *gc;
    PyTypeObject *reg_type;
    PyObject *stats;    /* CollectStats */
    PyObject *parts;    /* tuple of (shift, vote, finish, raises, name) */
    PyObject *children; /* tuple of FamilyState */
    /* the key window */
    long long marks[SPAN];
    int nmarks;
    long long growths[MEMORY];
    int ngrowths, idle;
    long long wlo, wbits;
    /* the agreement */
    PyObject *comm; /* the private duplicate (mpi4py), or None */
    MPI_Comm mcomm;
    long long first, last;
    int64_t *buf; /* WORDS + nbits / 64 words; dropped (never freed) once abandoned to MPI */
    Py_ssize_t nwords;
    long long lo, nbits;
    char dirty, persistent, have_preq;
    MPI_Request preq;
    /* the watch */
    int64_t *wbuf; /* 3 words the standing receive writes into */
    MPI_Request wreq;
    char sent, closed, received; /* received: the standing receive took a notice */
    long long wseq;
    PyObject *gone; /* (rank, sync point, why) or None */
} FamilyState;

static PyTypeObject FamilyStateType;

#define FS_OBJECTS(X)                                                                     \
    X(reason) X(unreported) X(failed) X(live) X(inbox) X(push) X(finalize) X(gc) X(reg_type) \
    X(stats) X(parts) X(children) X(comm) X(gone)
GC_WALKS(fs, FamilyState, FS_OBJECTS)

static void
fs_dealloc(FamilyState *s)
{
    PyObject_GC_UnTrack(s);
    fs_clear(s);
    PyMem_Free(s->pend);
    PyMem_Free(s->ages);
    /* No MPI here (a finalizer may be what frees it): a buffer MPI may still
     * use (the watch's receive posted, a request active) is left, not freed. */
    if (!s->have_preq) {
        PyMem_Free(s->buf);
    }
    if (s->wreq == MPI_REQUEST_NULL) {
        PyMem_Free(s->wbuf);
    }
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *
fs_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    int rank, size;
    PyObject *gc, *reg_type, *stats;
    if (!no_keywords("FamilyState", kw)
        || !PyArg_ParseTuple(args, "iiO!O!O:FamilyState", &rank, &size, &GcStateType, &gc,
                             &PyType_Type, &reg_type, &stats)) {
        return NULL;
    }
    if (!PyType_IsSubtype((PyTypeObject *)reg_type, &RegType)) {
        PyErr_SetString(PyExc_TypeError, "FamilyState: reg_type must be a RegistrationFields type");
        return NULL;
    }
    FamilyState *s = (FamilyState *)type->tp_alloc(type, 0);
    if (s == NULL) {
        return NULL;
    }
    s->rank = rank;
    s->size = size;
    s->reason = Py_NewRef(Py_None);
    s->thread = size > 1 ? 0 : -1;
    s->unreported = PyList_New(0);
    s->failed = PyList_New(0);
    s->live = PyDict_New();
    s->inbox = PyList_New(0);
    s->gc = (GcState *)Py_NewRef(gc);
    s->reg_type = (PyTypeObject *)Py_NewRef(reg_type);
    s->stats = Py_NewRef(stats);
    s->parts = PyTuple_New(0);
    s->children = PyTuple_New(0);
    s->comm = Py_NewRef(Py_None);
    s->gone = Py_NewRef(Py_None);
    s->nmarks = 1;
    s->wbits = WINDOW_MIN;
    s->lo = s->nbits = -1;
    s->preq = MPI_REQUEST_NULL;
    s->wreq = MPI_REQUEST_NULL;
    if (s->unreported == NULL || s->failed == NULL || s->live == NULL || s->inbox == NULL
        || s->parts == NULL || s->children == NULL) {
        Py_DECREF(s);
        return NULL;
    }
    s->push = PyObject_GetAttrString(s->inbox, "append"); /* a list's own method */
    s->finalize = PyObject_GetAttrString(gc, "finalize"); /* GcState's own method */
    if (s->push == NULL || s->finalize == NULL) {
        Py_DECREF(s);
        return NULL;
    }
    return (PyObject *)s;
}

/* -- usable or not, holds, participants, children ------------------------- */

static PyObject *
fs_become(FamilyState *s, PyObject *const *a, Py_ssize_t n)
{
    if (n != 3) {
        PyErr_SetString(PyExc_TypeError, "become(code, reason, first)");
        return NULL;
    }
    int code = as_int(a[0]);
    int first = PyObject_IsTrue(a[2]);
    if ((code == -1 && PyErr_Occurred()) || first < 0) {
        return NULL;
    }
    if (first && s->reason != Py_None) {
        Py_RETURN_NONE;
    }
    s->code = code;
    Py_SETREF(s->reason, Py_NewRef(a[1]));
    Py_RETURN_NONE;
}

static PyObject *
fs_set_hold(FamilyState *s, PyObject *const *a, Py_ssize_t n)
{
    long bit;
    int on;
    if (n != 2 || ((bit = PyLong_AsLong(a[0])) == -1 && PyErr_Occurred())
        || (on = PyObject_IsTrue(a[1])) < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "set_hold(bit, on)");
        }
        return NULL;
    }
    s->hold = on ? s->hold | bit : s->hold & ~bit;
    Py_RETURN_NONE;
}

static PyObject *
fs_set_participants(FamilyState *s, PyObject *parts)
{
    if (!PyTuple_Check(parts)) {
        PyErr_SetString(PyExc_TypeError, "set_participants: a tuple");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(parts); i++) {
        PyObject *p = PyTuple_GET_ITEM(parts, i);
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) < 4) {
            PyErr_SetString(PyExc_TypeError, "set_participants: tuples (shift, vote, finish, raises)");
            return NULL;
        }
    }
    Py_SETREF(s->parts, Py_NewRef(parts));
    Py_RETURN_NONE;
}

static PyObject *
fs_set_children(FamilyState *s, PyObject *children)
{
    if (!PyTuple_Check(children)) {
        PyErr_SetString(PyExc_TypeError, "set_children: a tuple of FamilyState");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(children); i++) {
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(children, i), &FamilyStateType)) {
            PyErr_SetString(PyExc_TypeError, "set_children: a tuple of FamilyState");
            return NULL;
        }
    }
    Py_SETREF(s->children, Py_NewRef(children));
    Py_RETURN_NONE;
}

/* A participant's vote, its voter given the family's count of sync points
 * (seq): -1 (with an exception, or not an int in 0..255), else it. */
static int
vote_of(PyObject *part, long long seq, long *vote)
{
    long shift = PyLong_AsLong(PyTuple_GET_ITEM(part, 0));
    if (shift == -1 && PyErr_Occurred()) {
        return -1;
    }
    *vote = 0;
    if (shift < 0) {
        return 0;
    }
    PyObject *clock = PyLong_FromLongLong(seq);
    PyObject *v = clock == NULL ? NULL : PyObject_CallOneArg(PyTuple_GET_ITEM(part, 1), clock);
    Py_XDECREF(clock);
    if (v == NULL) {
        return -1;
    }
    long x = PyLong_CheckExact(v) ? PyLong_AsLong(v) : -1;
    Py_DECREF(v);
    if (x < 0 || x > 0xFF) {
        PyErr_Clear();
        return -1;
    }
    *vote = x << shift;
    return 0;
}

static int fs_wants_c(FamilyState *s);

#define LOOK (-1) /* _state.LOOK: a parent's look, not the family's own vote */

/* Whether every child on this rank is idle: there, and wanting nothing. */
static int
children_idle(FamilyState *s)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(s->children); i++) {
        FamilyState *c = (FamilyState *)PyTuple_GET_ITEM(s->children, i);
        if (c->hold & HOLD_GONE) {
            return 0;
        }
        int w = fs_wants_c(c);
        if (w != 0) {
            return w < 0 ? -1 : 0;
        }
    }
    return 1;
}

static int
fs_wants_c(FamilyState *s)
{
    if (s->reason != Py_None || (s->hold & HOLD_GONE)) {
        return 0;
    }
    if (PyList_GET_SIZE(s->inbox) || s->stale || PyList_GET_SIZE(s->unreported)
        || (s->hold & (HOLD_LEAVING | HOLD_PARTS))) {
        return 1;
    }
    if (s->comm != Py_None && s->marks[s->nmarks - 1] != s->next_key) {
        return 1; /* registered since its last sync point */
    }
    /* Held: a vote may set other participants, freeing the tuple. */
    PyObject *parts = Py_NewRef(s->parts);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(parts); i++) {
        long v;
        int rc = vote_of(PyTuple_GET_ITEM(parts, i), LOOK, &v);
        if (rc < 0 || v) {
            Py_DECREF(parts);
            /* A vote, or a bad one, or one that raised (an interrupt too:
             * see the Python twin): its own sync point, visited, asks it
             * again and refuses it on every rank alike. */
            PyErr_Clear();
            return 1;
        }
    }
    Py_DECREF(parts);
    int idle = children_idle(s);
    return idle < 0 ? -1 : !idle;
}

static PyObject *
fs_wants(FamilyState *s, PyObject *unused)
{
    int w = fs_wants_c(s);
    return w < 0 ? NULL : PyBool_FromLong(w);
}

/* -- registrations ---------------------------------------------------------- */

static PyObject *
fs_take_key(FamilyState *s, PyObject *arg)
{
    long long tag = PyLong_AsLongLong(arg);
    if (tag == -1 && PyErr_Occurred()) {
        return NULL;
    }
    long long key = s->next_key++;
    s->order += order_step((uint64_t)key, (uint64_t)tag);
    return PyLong_FromLongLong(key);
}

static PyObject *
fs_give_back(FamilyState *s, PyObject *const *a, Py_ssize_t n)
{
    long long key, tag;
    if (n != 2 || ((key = PyLong_AsLongLong(a[0])) == -1 && PyErr_Occurred())
        || ((tag = PyLong_AsLongLong(a[1])) == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "give_back(key, tag)");
        }
        return NULL;
    }
    if (s->next_key == key + 1) {
        s->next_key = key;
        s->order -= order_step((uint64_t)key, (uint64_t)tag);
    }
    Py_RETURN_NONE;
}

static PyObject *
fs_begin_interval(FamilyState *s, PyObject *arg)
{
    long t = PyLong_AsLong(arg);
    if (t == -1 && PyErr_Occurred()) {
        return NULL;
    }
    s->thread = t;
    Py_RETURN_NONE;
}

static PyObject *
fs_add_busy(FamilyState *s, PyObject *arg)
{
    long d = PyLong_AsLong(arg);
    if (d == -1 && PyErr_Occurred()) {
        return NULL;
    }
    s->busy += (int)d;
    Py_RETURN_NONE;
}

static PyObject *
fs_store(FamilyState *s, PyObject *reg)
{
    if (!PyObject_TypeCheck(reg, &RegType)) {
        PyErr_SetString(PyExc_TypeError, "store: a registration");
        return NULL;
    }
    PyObject *key = PyLong_FromLongLong(((Reg *)reg)->key);
    if (key == NULL) {
        return NULL;
    }
    int rc = PyDict_SetItem(s->live, key, reg);
    Py_DECREF(key);
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* functools.partial and the type of a bound slot wrapper (``None.__str__``:
 * Python 3.13 no longer declares _PyMethodWrapper_Type), looked up once when
 * the module is made: what the destroy check looks into, with functions and
 * methods. */
static PyObject *partial_type = NULL;
static PyTypeObject *method_wrapper_type = NULL;

/* Whether an argument is ``obj`` or what collective_gc._registration's
 * destroy check looks into for a reference to it (exact types, as there):
 * then the guarded path registers it (a petsc4py KSP, callable, is neither). */
static int
inspected(PyObject *x, PyObject *obj)
{
    PyTypeObject *t = Py_TYPE(x);
    return x == obj || t == &PyFunction_Type || t == &PyMethod_Type || t == &PyCFunction_Type
           || t == method_wrapper_type
           || (partial_type != NULL && PyObject_TypeCheck(x, (PyTypeObject *)partial_type));
}

/* Registration's common case in one call (see the Python twin's docstring),
 * or None having changed nothing. From reading the key to storing the next
 * one no Python code runs (an int's allocation does not start the collector),
 * so no other thread can take a key in between: no lock. */
static PyObject *
fs_add_plain(FamilyState *s, PyObject *const *a, Py_ssize_t n)
{
    if (n != 6) {
        PyErr_SetString(PyExc_TypeError, "add_plain(owner, tag, obj, destroy, args, name)");
        return NULL;
    }
    PyObject *owner = a[0], *obj = a[2], *destroy = a[3], *fargs = a[4], *name = a[5];
    long long tag = PyLong_AsLongLong(a[1]);
    if (tag < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (s->gc->origins || !Py_IS_TYPE(destroy, &PyFunction_Type)
        || PyFunction_GET_CLOSURE(destroy) != NULL || !PyTuple_CheckExact(fargs)
        || !(name == Py_None || PyUnicode_CheckExact(name))) {
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(fargs); i++) {
        if (inspected(PyTuple_GET_ITEM(fargs, i), obj)) {
            Py_RETURN_NONE;
        }
    }
    /* Allocating it may start the collector, whose finalizers may run Python
     * code and let other threads run: nothing is read before. */
    Reg *reg = (Reg *)make_reg(s->reg_type, s->finalize, obj, owner, s->push, -1, destroy, fargs,
                               name, Py_None);
    if (reg == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear(); /* not weakly referenceable: the guarded path says so */
            Py_RETURN_NONE;
        }
        return NULL;
    }
    PyWeakReference *wr = (PyWeakReference *)reg;
    unsigned long me = PyThread_get_thread_ident();
    if (wr->wr_prev != NULL || wr->wr_next != NULL || s->busy
        || (s->thread > 0 && (unsigned long)s->thread != me)
        /* the interval's first: here only on the main thread, whose name a
         * refusal always finds (others record theirs on the guarded path) */
        || (s->thread == 0 && me != s->gc->main) || s->next_key < 0) {
        Py_DECREF(reg); /* unlinked from obj's weak references; its callback never runs */
        Py_RETURN_NONE;
    }
    long long k = s->next_key;
    PyObject *key = PyLong_FromLongLong(k);
    if (key == NULL || PyDict_SetItem(s->live, key, (PyObject *)reg) < 0) {
        Py_XDECREF(key);
        Py_DECREF(reg);
        return NULL;
    }
    Py_DECREF(key);
    if (s->thread == 0) {
        s->thread = (long)me; /* the interval's first: this thread is its registrar */
    }
    reg->key = k;
    s->next_key = k + 1;
    s->order += order_step((uint64_t)k, (uint64_t)tag);
    return (PyObject *)reg;
}

/* reg alive -> state, once, and out of live (its owner's registrations by
 * key): its (destroy, args), or None. No Python code runs. The kernel of a
 * family's claim and of take_call (a local owner's), _state.take_call's twin. */
static PyObject *
take_c(Reg *reg, int state, PyObject *live)
{
    if (reg->state != ALIVE) {
        Py_RETURN_NONE;
    }
    PyObject *key = PyLong_FromLongLong(reg->key);
    if (key == NULL) {
        return NULL;
    }
    PyObject *fn = reg->destroy ? reg->destroy : Py_None;
    PyObject *args = reg->args ? reg->args : Py_None;
    PyObject *call = PyTuple_Pack(2, fn, args);
    PyObject *empty = PyTuple_New(0);
    if (call == NULL || empty == NULL) {
        Py_DECREF(key);
        Py_XDECREF(call);
        Py_XDECREF(empty);
        return NULL;
    }
    reg->state = state;
    if (PyDict_DelItem(live, key) < 0) {
        PyErr_Clear();
    }
    Py_DECREF(key);
    Py_XSETREF(reg->destroy, Py_NewRef(Py_None));
    Py_XSETREF(reg->args, empty);
    return call;
}

static PyObject *
claim_c(FamilyState *s, Reg *reg, int state)
{
    PyObject *call = take_c(reg, state, s->live);
    if (call != NULL && call != Py_None && PyWeakref_GET_OBJECT((PyObject *)reg) == Py_None) {
        s->stale = 1; /* its key may be queued: the next drain drops it */
    }
    return call;
}

/* take_call(reg, state, live): the twin of _state.take_call. */
static PyObject *
take_call(PyObject *module, PyObject *const *a, Py_ssize_t n)
{
    int state;
    if (n != 3 || !PyObject_TypeCheck(a[0], &RegType) || !PyDict_CheckExact(a[2])
        || ((state = as_int(a[1])) == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "take_call(reg, state, live): live a dict");
        }
        return NULL;
    }
    return take_c((Reg *)a[0], state, a[2]);
}

static PyObject *
fs_claim(FamilyState *s, PyObject *const *a, Py_ssize_t n)
{
    int state;
    if (n != 2 || !PyObject_TypeCheck(a[0], &RegType)
        || ((state = as_int(a[1])) == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "claim(reg, state)");
        }
        return NULL;
    }
    return claim_c(s, (Reg *)a[0], state);
}

static PyObject *
fs_destroy_now(FamilyState *s, PyObject *reg)
{
    if (!PyObject_TypeCheck(reg, &RegType)) {
        PyErr_SetString(PyExc_TypeError, "destroy_now: a registration");
        return NULL;
    }
    PyObject *call = claim_c(s, (Reg *)reg, DESTROYED);
    if (call == NULL || call == Py_None) {
        return call;
    }
    s->destroyed++;
    PyObject *fn = Py_NewRef(PyTuple_GET_ITEM(call, 0)), *args = Py_NewRef(PyTuple_GET_ITEM(call, 1));
    Py_DECREF(call);
    PyObject *res = PyObject_Call(fn, args, NULL);
    Py_DECREF(fn);
    Py_DECREF(args);
    if (res == NULL) {
        return NULL;
    }
    Py_DECREF(res);
    Py_RETURN_NONE;
}

/* Detach the live registrations (``owner``'s only, unless None) without
 * running them: the list of them. Their calls are appended to ``calls`` if
 * given (a forked child keeps them: see _state.FamilyState.after_fork), else
 * let go of. */
static PyObject *
forget_c(FamilyState *s, PyObject *owner, PyObject *calls)
{
    PyObject *values = PyDict_Values(s->live); /* a snapshot: allocations below may run code */
    PyObject *out = values == NULL ? NULL : PyList_New(0);
    if (out == NULL) {
        Py_XDECREF(values);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(values); i++) {
        Reg *reg = (Reg *)PyList_GET_ITEM(values, i);
        if (!PyObject_TypeCheck((PyObject *)reg, &RegType)
            || (owner != Py_None && reg->owner != owner) || reg->state != ALIVE) {
            continue;
        }
        if (PyList_Append(out, (PyObject *)reg) < 0) {
            goto fail;
        }
        PyObject *call = take_c(reg, DETACHED, s->live);
        int kept = call == NULL ? -1 : calls == NULL || call == Py_None ? 0 : PyList_Append(calls, call);
        Py_XDECREF(call);
        if (kept < 0) {
            goto fail;
        }
    }
    if (owner == Py_None) {
        if (PyList_SetSlice(s->inbox, 0, PyList_GET_SIZE(s->inbox), NULL) < 0) {
            goto fail;
        }
        s->npend = 0;
    }
    else if (PyList_GET_SIZE(out)) {
        s->stale = 1;
    }
    Py_DECREF(values);
    return out;
fail:
    Py_DECREF(values);
    Py_DECREF(out);
    return NULL;
}

static PyObject *
fs_forget(FamilyState *s, PyObject *const *a, Py_ssize_t n)
{
    return forget_c(s, n > 0 ? a[0] : Py_None, NULL);
}

/* -- the queue ------------------------------------------------------------ */

static int
reserve(FamilyState *s, Py_ssize_t n)
{
    if (n <= s->cap) {
        return 0;
    }
    Py_ssize_t cap = s->cap ? s->cap : 64;
    while (cap < n) {
        cap *= 2;
    }
    int64_t *p = PyMem_Realloc(s->pend, (size_t)cap * sizeof(int64_t));
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->pend = p;
    int64_t *g = PyMem_Realloc(s->ages, (size_t)cap * sizeof(int64_t));
    if (g == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->ages = g;
    s->cap = cap;
    return 0;
}

/* Merge the ascending keys[0..n) (drained at sync point seq) into the pending ones. */
static int
add_pending(FamilyState *s, const int64_t *keys, Py_ssize_t n, long long seq)
{
    if (n == 0) {
        return 0;
    }
    if (reserve(s, s->npend + n) < 0) {
        return -1;
    }
    Py_ssize_t i = s->npend - 1, j = n - 1, w = s->npend + n - 1;
    while (j >= 0) {
        if (i >= 0 && s->pend[i] > keys[j]) {
            s->pend[w] = s->pend[i];
            s->ages[w] = s->ages[i];
            i--;
        }
        else {
            s->pend[w] = keys[j];
            s->ages[w] = seq;
            j--;
        }
        w--;
    }
    s->npend += n;
    return 0;
}

static PyObject *
fs_drain(FamilyState *s, PyObject *arg)
{
    long long seq = PyLong_AsLongLong(arg);
    if (seq == -1 && PyErr_Occurred()) {
        return NULL;
    }
    /* The cut, before the inbox is read (one C call: no registration comes
     * in between). */
    s->cut_key = s->next_key;
    s->cut_order = s->order;
    Py_ssize_t n = PyList_GET_SIZE(s->inbox);
    PyObject *cyclic = PyList_New(0);
    if (cyclic == NULL) {
        return NULL;
    }
    if (!n && !s->stale) {
        return cyclic;
    }
    PyObject *batch = PyList_GetSlice(s->inbox, 0, n);
    if (batch == NULL || PyList_SetSlice(s->inbox, 0, n, NULL) < 0) {
        Py_XDECREF(batch);
        Py_DECREF(cyclic);
        return NULL;
    }
    n = PyList_GET_SIZE(batch);
    int64_t *keys = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (keys == NULL) {
        Py_DECREF(batch);
        Py_DECREF(cyclic);
        return PyErr_NoMemory();
    }
    int stale = s->stale;
    s->stale = 0;
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Reg *reg = (Reg *)PyList_GET_ITEM(batch, i);
        if (!PyObject_TypeCheck((PyObject *)reg, &RegType) || (stale && reg->state != ALIVE)) {
            continue;
        }
        if (reg->cyclic && reg->state == ALIVE && PyList_Append(cyclic, (PyObject *)reg) < 0) {
            goto fail;
        }
        keys[m++] = reg->key;
    }
    if (stale) {
        /* Explicit destroys or detaches of dead objects since the last drain:
         * their keys leave the pending ones too. */
        Py_ssize_t w = 0;
        for (Py_ssize_t i = 0; i < s->npend; i++) {
            PyObject *key = PyLong_FromLongLong(s->pend[i]);
            if (key == NULL) {
                goto fail;
            }
            int in = PyDict_Contains(s->live, key);
            Py_DECREF(key);
            if (in < 0) {
                goto fail;
            }
            if (in) {
                s->pend[w] = s->pend[i];
                s->ages[w] = s->ages[i];
                w++;
            }
        }
        s->npend = w;
    }
    sort_keys(keys, m);
    if (add_pending(s, keys, m, seq) < 0) {
        goto fail;
    }
    PyMem_Free(keys);
    Py_DECREF(batch);
    return cyclic;
fail:
    PyMem_Free(keys);
    Py_DECREF(batch);
    Py_DECREF(cyclic);
    return NULL;
}

static PyObject *
fs_pending_keys(FamilyState *s, PyObject *unused)
{
    /* (A NULL pointer would give None for y#: an empty pair is b"".) */
    const char *k = s->npend ? (const char *)s->pend : "", *g = s->npend ? (const char *)s->ages : "";
    return Py_BuildValue("(y#y#)", k, s->npend * 8, g, s->npend * 8);
}

static int
as_keys(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    if (view->len % 8) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "keys: native int64 bytes");
        return -1;
    }
    return 0;
}

/* The ascending agreed[0..n) leave the pending keys (a subset of them). */
static void
remove_pending_c(FamilyState *s, const int64_t *agreed, Py_ssize_t n)
{
    if (n == 0 || s->npend == 0) {
        return;
    }
    Py_ssize_t w = 0, j = 0;
    for (Py_ssize_t i = 0; i < s->npend; i++) {
        while (j < n && agreed[j] < s->pend[i]) {
            j++;
        }
        if (j < n && agreed[j] == s->pend[i]) {
            continue;
        }
        s->pend[w] = s->pend[i];
        s->ages[w] = s->ages[i];
        w++;
    }
    s->npend = w;
}

static PyObject *
fs_remove_pending(FamilyState *s, PyObject *arg)
{
    Py_buffer v;
    if (as_keys(arg, &v) < 0) {
        return NULL;
    }
    remove_pending_c(s, (const int64_t *)v.buf, v.len / 8);
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

/* -- the agreement ---------------------------------------------------------- */

static PyObject *
fs_open(FamilyState *s, PyObject *const *a, Py_ssize_t n)
{
    int persistent;
    if (n != 2 || (persistent = PyObject_IsTrue(a[1])) < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "open(comm, persistent)");
        }
        return NULL;
    }
    MPI_Comm *c = PyMPIComm_Get(a[0]);
    if (c == NULL) {
        return NULL;
    }
    if (s->wbuf == NULL && (s->wbuf = PyMem_Calloc(3, sizeof(int64_t))) == NULL) {
        return PyErr_NoMemory();
    }
    s->mcomm = *c;
    Py_SETREF(s->comm, Py_NewRef(a[0]));
    /* Local: posting a receive waits for nobody. */
    if (MPI_Irecv(s->wbuf, 3, MPI_INT64_T, MPI_ANY_SOURCE, TAG_GAVE_UP, s->mcomm, &s->wreq)
        != MPI_SUCCESS) {
        PyErr_SetString(PyExc_RuntimeError, "open: the watch's receive could not be posted");
        return NULL;
    }
#if HAVE_PERSISTENT
    s->persistent = (char)persistent;
#else
    s->persistent = 0; /* MPI-4's persistent allreduce is not there: Iallreduce */
#endif
    Py_RETURN_NONE;
}

static PyObject *
fs_get_words(FamilyState *s, void *closure)
{
    return PyLong_FromSsize_t(s->nwords);
}

static PyObject *
fs_get_window(FamilyState *s, void *closure)
{
    return Py_BuildValue("(LL)", s->wlo, s->wbits);
}

/* Once an exchange was left before its allreduce completed (a timeout, a
 * notice, an interrupt): MPI may still write into the buffer and the request
 * may be active; neither is used again, and neither is ever freed. */
static void
abandon_buffer(FamilyState *s)
{
    s->buf = NULL;
    s->nwords = 0;
    s->lo = s->nbits = -1;
    s->have_preq = 0;
    s->preq = MPI_REQUEST_NULL;
}

static int
reshape(FamilyState *s)
{
    if (s->have_preq) {
        MPI_Request_free(&s->preq); /* inactive (completed): local */
        s->have_preq = 0;
    }
    Py_ssize_t nwords = WORDS + (Py_ssize_t)(s->wbits / 64);
    int64_t *buf = PyMem_Calloc((size_t)nwords, sizeof(int64_t));
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(s->buf);
    s->buf = buf;
    s->nwords = nwords;
    s->dirty = 0;
    s->nbits = s->wbits;
    return 0;
}

/* Pack the header and the bitmap of keys[0..n) (ascending) into the buffer. */
static void
pack(FamilyState *s, const int64_t *keys, Py_ssize_t n, int at_exit, long long flags,
     long long fingerprint, unsigned long long children)
{
    long long parts = (long long)((uint64_t)fingerprint ^ (uint64_t)s->cut_order);
    int64_t *buf = s->buf;
    long long lo = s->wlo, nbits = s->nbits;
    s->lo = lo;
    s->wseq = s->seq;
    long long seqword = s->seq * 2 + at_exit;
    buf[0] = seqword;
    buf[1] = ~seqword;
    buf[2] = s->cut_key;
    buf[3] = ~s->cut_key;
    buf[4] = parts;
    buf[5] = ~parts;
    buf[6] = ~flags;
    buf[8] = ~(int64_t)children;
    uint64_t *words = (uint64_t *)buf + WORDS;
    Py_ssize_t first = 0, last;
    uint64_t filter = 0;
    if (n) {
        memset(words, 0, (size_t)(nbits / 64) * 8);
        while (first < n && keys[first] < lo) {
            filter |= 1ULL << (((uint64_t)keys[first] * KEY_HASH) >> 58);
            first++;
        }
        for (last = first; last < n && keys[last] - lo < nbits; last++) {
            uint64_t bit = (uint64_t)(keys[last] - lo);
            words[bit >> 6] |= 1ULL << (bit & 63);
        }
        for (Py_ssize_t i = last; i < n; i++) {
            filter |= 1ULL << (((uint64_t)keys[i] * KEY_HASH) >> 58);
        }
        s->dirty = 1;
    }
    else {
        last = 0;
        if (s->dirty) { /* the AND of bits this rank sent: clear them */
            memset(words, 0, (size_t)(nbits / 64) * 8);
            s->dirty = 0;
        }
    }
    buf[7] = (int64_t)filter;
    s->first = first;
    s->last = last;
}

static int
fired_c(FamilyState *s)
{
    if (s->gone == Py_None && !s->closed && s->wreq != MPI_REQUEST_NULL) {
        int flag = 0;
        MPI_Test(&s->wreq, &flag, MPI_STATUS_IGNORE);
        if (flag) {
            s->received = 1;
            PyObject *g = Py_BuildValue("(LLL)", (long long)s->wbuf[0], (long long)s->wbuf[1],
                                        (long long)s->wbuf[2]);
            if (g == NULL) {
                return -1;
            }
            Py_SETREF(s->gone, g);
        }
    }
    return s->gone != Py_None;
}

static PyObject *
fs_fired(FamilyState *s, PyObject *unused)
{
    int f = fired_c(s);
    return f < 0 ? NULL : PyBool_FromLong(f);
}

/* Tell every other rank, once, why this one leaves the collectives (see the
 * Python twin: GAVE_UP, LEFT, WOKEN). Error paths only. */
/* notice(): what the standing receive took, if a notice came (see the twin). */
static PyObject *
fs_notice(FamilyState *s, PyObject *unused)
{
    if (s->closed || s->wbuf == NULL) {
        Py_RETURN_NONE;
    }
    int flag = 0;
    if (s->wreq != MPI_REQUEST_NULL) {
        MPI_Test(&s->wreq, &flag, MPI_STATUS_IGNORE);
    }
    if (flag) {
        s->received = 1;
    }
    if (!s->received) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(LLL)", (long long)s->wbuf[0], (long long)s->wbuf[1],
                         (long long)s->wbuf[2]);
}

static int
announce_c(FamilyState *s, int why)
{
    if (s->sent || s->closed || s->comm == Py_None || (s->gone != Py_None && why != WOKEN)) {
        return 0;
    }
    /* What can fail first: marked sent only when the sends are made, so a
     * failure here leaves the notice to a later call. The note is kept for
     * the life of the process (a rank that never waits again never
     * receives, and a send may use it until received); each request is
     * freed at once, which lets MPI release it once the send completes. */
    int64_t *note = PyMem_Malloc(3 * sizeof(int64_t));
    if (note == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (s->gone == Py_None) {
        PyObject *g = Py_BuildValue("(iLi)", s->rank, s->wseq, why);
        if (g == NULL) {
            PyMem_Free(note);
            return -1;
        }
        Py_SETREF(s->gone, g);
    }
    s->sent = 1;
    note[0] = s->rank;
    note[1] = s->wseq;
    note[2] = why;
    for (int other = 0; other < s->size; other++) {
        if (other != s->rank) {
            MPI_Request r;
            if (MPI_Isend(note, 3, MPI_INT64_T, other, TAG_GAVE_UP, s->mcomm, &r) == MPI_SUCCESS) {
                MPI_Request_free(&r);
            }
        }
    }
    return 0;
}

static PyObject *
fs_announce(FamilyState *s, PyObject *arg)
{
    long why = PyLong_AsLong(arg);
    if ((why == -1 && PyErr_Occurred()) || announce_c(s, (int)why) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Start the allreduce and complete it, polling, beside the watch's receive:
 * DONE, WATCHED, LATE (the deadline ``at`` passed: the others were told), or
 * -1 with the exception a signal handler raised in the wait. Polls as
 * collective_gc._transport.poll does: Tests between yields for SPIN_S, then
 * between sleeps growing to a millisecond; the GIL is released, and taken
 * back every SLICE_S to run the handlers (a second Ctrl-C leaves). */
static int
start_and_wait(FamilyState *s, double at)
{
    int ierr;
    MPI_Request req;
    if (s->gone != Py_None) {
        /* A notice taken before (fired(), between sync points): nothing
         * completes in step, and an allreduce posted now would only be
         * abandoned, on a communicator the other ranks may use once more. */
        return WATCHED;
    }
    if (s->persistent) {
#if HAVE_PERSISTENT
        if (!s->have_preq) {
            ierr = MPI_Allreduce_init(MPI_IN_PLACE, s->buf, (int)s->nwords, MPI_INT64_T, MPI_BAND,
                                      s->mcomm, MPI_INFO_NULL, &s->preq);
            if (ierr != MPI_SUCCESS) {
                /* Not there after all: a new Iallreduce each time, as on every rank. */
                s->persistent = 0;
                goto nonpersistent;
            }
            s->have_preq = 1;
        }
        ierr = MPI_Start(&s->preq);
        req = s->preq;
#else
        ierr = MPI_ERR_OTHER;
        req = MPI_REQUEST_NULL;
#endif
    }
    else {
#if HAVE_PERSISTENT
    nonpersistent:
#endif
        ierr = MPI_Iallreduce(MPI_IN_PLACE, s->buf, (int)s->nwords, MPI_INT64_T, MPI_BAND,
                              s->mcomm, &req);
    }
    if (ierr != MPI_SUCCESS) {
        PyErr_SetString(PyExc_RuntimeError, "the agreement's allreduce could not start");
        return -1;
    }
    s->inside = 1;
    MPI_Request reqs[2] = {req, s->wreq};
    int nreq = s->wreq == MPI_REQUEST_NULL || s->closed ? 1 : 2;
    int index = MPI_UNDEFINED, flag = 0, late = 0;
    /* A few Tests first, the GIL held and the core kept: a small allreduce
     * whose ranks all arrived completes within them, and a yield (a system
     * call) or the GIL's release and retake would cost more than the wait.
     * A bounded number, so that a rank sharing the core soon gets it. */
    for (int i = 0; i < QUICK_TESTS && !flag; i++) {
        ierr = MPI_Testany(nreq, reqs, &index, &flag, MPI_STATUS_IGNORE);
        if (ierr != MPI_SUCCESS) {
            break;
        }
    }
    double spin_until = now_seconds() + SPIN_S;
    long delay_ns = 0;
    for (;;) {
        if (flag || ierr != MPI_SUCCESS) {
            break;
        }
        Py_BEGIN_ALLOW_THREADS
        double slice_end = now_seconds() + SLICE_S;
        for (;;) {
            ierr = MPI_Testany(nreq, reqs, &index, &flag, MPI_STATUS_IGNORE);
            if (ierr != MPI_SUCCESS || flag) {
                break;
            }
            double now = now_seconds();
            if (at >= 0 && now > at) {
                late = 1;
                break;
            }
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
        if (flag || late || ierr != MPI_SUCCESS) {
            break;
        }
        if (PyErr_CheckSignals() < 0) {
            abandon_buffer(s);
            return -1;
        }
    }
    if (ierr != MPI_SUCCESS) {
        PyErr_SetString(PyExc_RuntimeError, "the agreement's allreduce failed");
        abandon_buffer(s);
        return -1;
    }
    if (nreq == 2) {
        s->wreq = reqs[1]; /* MPI nulled it if the notice arrived */
    }
    if (s->have_preq) {
        s->preq = reqs[0];
    }
    if (late) {
        abandon_buffer(s);
        if (announce_c(s, GAVE_UP) < 0) {
            return -1;
        }
        return LATE;
    }
    if (index == 1) {
        s->received = 1;
        abandon_buffer(s); /* first: the allreduce may still write into it, whatever fails next */
        PyObject *g = Py_BuildValue("(LLL)", (long long)s->wbuf[0], (long long)s->wbuf[1],
                                    (long long)s->wbuf[2]);
        if (g == NULL) {
            return -1;
        }
        Py_SETREF(s->gone, g);
        return WATCHED;
    }
    return DONE;
}

static int
exchange_c(FamilyState *s, const int64_t *keys, Py_ssize_t n, int at_exit, long long flags,
           long long fingerprint, unsigned long long children, double at)
{
    if ((s->nbits != s->wbits || s->buf == NULL) && reshape(s) < 0) {
        return -1;
    }
    if (at >= 0) {
        flags |= FLAG_DEADLINE;
    }
    pack(s, keys, n, at_exit, flags, fingerprint, children);
    return start_and_wait(s, at);
}

/* Collective: the agreement's one allreduce (see the Python twin). */
static PyObject *
fs_exchange(FamilyState *s, PyObject *const *a, Py_ssize_t n)
{
    if (n != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "exchange(at_exit, flags, fingerprint, children, deadline)");
        return NULL;
    }
    int at_exit = PyObject_IsTrue(a[0]);
    long long flags = PyLong_AsLongLong(a[1]);
    long long fingerprint = PyLong_AsLongLong(a[2]);
    unsigned long long children = PyLong_AsUnsignedLongLongMask(a[3]);
    double at = a[4] == Py_None ? -1.0 : PyFloat_AsDouble(a[4]);
    if (PyErr_Occurred() || at_exit < 0) {
        return NULL;
    }
    if (s->comm == Py_None) {
        PyErr_SetString(PyExc_RuntimeError, "exchange: the family has no private communicator");
        return NULL;
    }
    int found = exchange_c(s, s->pend, s->npend, at_exit, flags, fingerprint, children, at);
    if (found < 0) {
        return NULL;
    }
    if (PyErr_CheckSignals() < 0) { /* deferred inside the region: its end runs them */
        return NULL;
    }
    return PyLong_FromLong(found);
}

static PyObject *
fs_reduced(FamilyState *s, PyObject *unused)
{
    if (s->buf == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "reduced: no exchange completed");
        return NULL;
    }
    PyObject *t = PyTuple_New(WORDS);
    if (t == NULL) {
        return NULL;
    }
    for (int i = 0; i < WORDS; i++) {
        PyObject *w = PyLong_FromLongLong(s->buf[i]);
        if (w == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, w);
    }
    return t;
}

static Py_ssize_t
count_window(FamilyState *s)
{
    Py_ssize_t c = 0;
    const uint64_t *words = (const uint64_t *)s->buf + WORDS;
    for (long long w = 0; w < s->nbits / 64; w++) {
        c += __builtin_popcountll(words[w]);
    }
    return c;
}

static PyObject *
fs_window_keys(FamilyState *s, PyObject *unused)
{
    if (s->last <= s->first || s->buf == NULL) {
        return PyBytes_FromStringAndSize(NULL, 0);
    }
    Py_ssize_t count = count_window(s);
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * 8);
    if (out == NULL) {
        return NULL;
    }
    int64_t *keys = (int64_t *)PyBytes_AS_STRING(out);
    const uint64_t *words = (const uint64_t *)s->buf + WORDS;
    Py_ssize_t j = 0;
    for (long long w = 0; w < s->nbits / 64; w++) {
        uint64_t word = words[w];
        while (word) {
            keys[j++] = s->lo + w * 64 + __builtin_ctzll(word);
            word &= word - 1;
        }
    }
    return out;
}

static int
bit_length(unsigned long long x)
{
    return x ? 64 - __builtin_clzll(x) : 0;
}

/* A sync point agreed: the window moves, any one thread may register next,
 * the sync point is counted (see the Python twin). */
static void
agreed_c(FamilyState *s, long long next_key)
{
    if (next_key >= 0) {
        long long last = s->marks[s->nmarks - 1];
        if (next_key != last || s->idle != MEMORY) {
            s->idle = next_key == last ? s->idle + 1 : 0;
            if (s->ngrowths == MEMORY) {
                memmove(s->growths, s->growths + 1, (MEMORY - 1) * sizeof(long long));
                s->ngrowths--;
            }
            s->growths[s->ngrowths++] = next_key - last;
            if (s->nmarks == SPAN) {
                memmove(s->marks, s->marks + 1, (SPAN - 1) * sizeof(long long));
                s->nmarks--;
            }
            s->marks[s->nmarks++] = next_key;
            long long most = s->growths[0];
            for (int i = 1; i < s->ngrowths; i++) {
                if (s->growths[i] > most) {
                    most = s->growths[i];
                }
            }
            long long lo = s->marks[0];
            long long hi = next_key + (2 * most > 1 ? 2 * most : 1);
            if (hi - lo > WINDOW_LIMIT) {
                lo = hi - WINDOW_LIMIT;
            }
            long long bits = 1LL << bit_length((unsigned long long)(hi - lo - 1));
            s->wbits = bits > WINDOW_MIN ? bits : WINDOW_MIN;
            /* Half the bits the buffer has beyond those reach older keys (see the twin). */
            lo -= (s->wbits - (hi - lo)) / 2;
            s->wlo = lo > 0 ? lo : 0;
        }
    }
    if (s->thread > 0) {
        s->thread = 0;
    }
    s->seq++;
}

static PyObject *
fs_agreed(FamilyState *s, PyObject *arg)
{
    long long k = PyLong_AsLongLong(arg);
    if (k == -1 && PyErr_Occurred()) {
        return NULL;
    }
    agreed_c(s, k);
    Py_RETURN_NONE;
}

static PyObject *
fs_left(FamilyState *s, PyObject *unused)
{
    s->inside = 0;
    Py_RETURN_NONE;
}

static PyObject *
fs_close(FamilyState *s, PyObject *arg)
{
    int let_go = PyObject_IsTrue(arg);
    if (let_go < 0) {
        return NULL;
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) {
        Py_SETREF(s->comm, Py_NewRef(Py_None));
        Py_RETURN_NONE;
    }
    if (s->have_preq) {
        MPI_Request_free(&s->preq);
        s->have_preq = 0;
    }
    s->closed = 1;
    if (s->wreq != MPI_REQUEST_NULL) {
        MPI_Cancel(&s->wreq);
        MPI_Wait(&s->wreq, MPI_STATUS_IGNORE); /* at once: cancelled, or a notice came */
    }
    if (!let_go) {
        Py_RETURN_NONE;
    }
    /* The private duplicate is the caller's now (it keeps it a while:
       messages may still arrive on it, _transport.retire). */
    PyObject *comm = s->comm;
    s->comm = Py_NewRef(Py_None);
    return comm;
}

/* -- destroys ----------------------------------------------------------------- */

static Py_ssize_t
batch_index(PyObject *fn, PyObject *batched)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(batched); i++) {
        if (PyTuple_GET_ITEM(batched, i) == fn) {
            return i;
        }
    }
    return -1;
}

/* Take the exception set as a failure (key, name, exception) into failures. */
static int
record(PyObject *failures, long long key, PyObject *name)
{
    PyObject *exc = take_exception();
    if (exc == NULL) {
        PyErr_SetString(PyExc_SystemError, "a destroy failed without an exception");
        exc = take_exception();
        if (exc == NULL) {
            return -1;
        }
    }
    PyObject *row = Py_BuildValue("(LON)", key, name, exc);
    if (row == NULL) {
        return -1;
    }
    int rc = PyList_Append(failures, row);
    Py_DECREF(row);
    return rc;
}

/* Destroy the registrations of the ascending keys[0..n), newest first, into
 * failures; returns how many ran, or -1 (memory: every call still made). */
static Py_ssize_t
destroy_c(FamilyState *s, const int64_t *keys, Py_ssize_t n, PyObject *batched, PyObject *runners,
          PyObject *failures)
{
    /* Everything that can fail, or start the collector, first. */
    PyObject *taken = PyList_New(n), *fns = PyList_New(n), *argss = PyList_New(n);
    PyObject *empty = PyTuple_New(0);
    if (taken == NULL || fns == NULL || argss == NULL || empty == NULL) {
        Py_XDECREF(taken);
        Py_XDECREF(fns);
        Py_XDECREF(argss);
        Py_XDECREF(empty);
        return -1;
    }
    s->destroying = PyThread_get_thread_ident();
    /* From the first key taken to the last no Python code runs: no
     * registration is lost (int keys: lookups and deletes call nothing). */
    Py_ssize_t count = 0;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        PyObject *key = PyLong_FromLongLong(keys[i]);
        if (key == NULL) {
            PyErr_Clear();
            continue;
        }
        Reg *reg = (Reg *)PyDict_GetItemWithError(s->live, key);
        if (reg == NULL || !PyObject_TypeCheck((PyObject *)reg, &RegType) || reg->state != ALIVE
            || reg->destroy == NULL || reg->args == NULL) {
            PyErr_Clear(); /* destroyed or detached explicitly meanwhile, on every rank */
            Py_DECREF(key);
            continue;
        }
        Py_INCREF(reg);
        if (PyDict_DelItem(s->live, key) < 0) {
            PyErr_Clear();
        }
        Py_DECREF(key);
        reg->state = DESTROYED;
        PyList_SET_ITEM(taken, count, (PyObject *)reg);
        PyList_SET_ITEM(fns, count, reg->destroy);
        PyList_SET_ITEM(argss, count, reg->args);
        reg->destroy = Py_NewRef(Py_None);
        reg->args = Py_NewRef(empty);
        count++;
    }
    Py_DECREF(empty);
    if (PyDict_GET_SIZE(s->live) == 0) {
        PyDict_Clear(s->live); /* a dict never shrinks: an empty one gives its memory back */
    }
    Py_SET_SIZE((PyVarObject *)taken, count);
    Py_SET_SIZE((PyVarObject *)fns, count);
    Py_SET_SIZE((PyVarObject *)argss, count);
    remove_pending_c(s, keys, n);
    /* The runs: consecutive destroys by one batched function go to its runner. */
    Py_ssize_t start = 0;
    while (start < count) {
        Py_ssize_t index = batch_index(PyList_GET_ITEM(fns, start), batched), end = start + 1;
        while (end < count && batch_index(PyList_GET_ITEM(fns, end), batched) == index) {
            end++;
        }
        if (index >= 0 && index < PyTuple_GET_SIZE(runners)) {
            PyObject *runner = PyTuple_GET_ITEM(runners, index);
            PyObject *chunk = PyList_GetSlice(argss, start, end);
            PyObject *errs = chunk == NULL ? NULL
                             : Py_IS_TYPE(runner, &PetscRunType) ? petsc_run_any(runner, chunk)
                                                                  : PyObject_CallOneArg(runner, chunk);
            Py_XDECREF(chunk);
            if (errs == NULL) {
                /* The runner itself failed (memory), after trying every call. */
                PyObject *what = PyUnicode_FromFormat("one of %zd destroys", end - start);
                if (what == NULL || record(failures, -1, what) < 0) {
                    PyErr_Clear();
                }
                Py_XDECREF(what);
            }
            else {
                for (Py_ssize_t e = 0; PyList_Check(errs) && e < PyList_GET_SIZE(errs); e++) {
                    PyObject *pair = PyList_GET_ITEM(errs, e);
                    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) < 2) {
                        continue; /* a runner set with set_batch must return (index, exc) pairs */
                    }
                    Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0));
                    if (at == -1 && PyErr_Occurred()) {
                        PyErr_Clear(); /* no destroy of this run runs with it set */
                    }
                    Reg *r = at >= 0 && start + at < end ? (Reg *)PyList_GET_ITEM(taken, start + at) : NULL;
                    PyObject *row = Py_BuildValue("(LOO)", r ? r->key : -1LL,
                                                  r ? r->name : Py_None, PyTuple_GET_ITEM(pair, 1));
                    if (row == NULL || PyList_Append(failures, row) < 0) {
                        PyErr_Clear();
                    }
                    Py_XDECREF(row);
                }
                Py_DECREF(errs);
            }
        }
        else {
            for (Py_ssize_t i = start; i < end; i++) {
                PyObject *res = PyObject_Call(PyList_GET_ITEM(fns, i), PyList_GET_ITEM(argss, i), NULL);
                if (res != NULL) {
                    Py_DECREF(res);
                }
                else {
                    Reg *r = (Reg *)PyList_GET_ITEM(taken, i);
                    if (record(failures, r->key, r->name) < 0) {
                        PyErr_Clear(); /* go on: every call must be made */
                    }
                }
            }
        }
        start = end;
    }
    s->destroying = 0;
    s->destroyed += count;
    Py_DECREF(fns);
    Py_DECREF(argss); /* the destroyed objects go here, unless someone else holds them */
    Py_DECREF(taken);
    return count;
}

static PyObject *
fs_destroy(FamilyState *s, PyObject *const *a, Py_ssize_t n)
{
    if (n != 3 || !PyTuple_Check(a[1]) || !PyTuple_Check(a[2])) {
        PyErr_SetString(PyExc_TypeError, "destroy(keys, batched, runners)");
        return NULL;
    }
    Py_buffer v;
    if (as_keys(a[0], &v) < 0) {
        return NULL;
    }
    PyObject *failures = PyList_New(0);
    if (failures == NULL) {
        PyBuffer_Release(&v);
        return NULL;
    }
    Py_ssize_t count = destroy_c(s, (const int64_t *)v.buf, v.len / 8, a[1], a[2], failures);
    PyBuffer_Release(&v);
    if (count < 0) {
        Py_DECREF(failures);
        return NULL;
    }
    return Py_BuildValue("(nNO)", count, failures, Py_None);
}

/* -- failures kept ------------------------------------------------------------ */

static PyObject *
fs_keep(FamilyState *s, PyObject *arg)
{
    Py_ssize_t n = PyList_GET_SIZE(s->unreported);
    if (PyList_SetSlice(s->unreported, n, n, arg) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
take_list(PyObject **field)
{
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL) {
        return NULL;
    }
    PyObject *out = *field;
    *field = fresh;
    return out;
}

static PyObject *
fs_take_unreported(FamilyState *s, PyObject *unused)
{
    return take_list(&s->unreported);
}

static PyObject *
fs_take_failed(FamilyState *s, PyObject *unused)
{
    return take_list(&s->failed);
}

static PyObject *
fs_after_fork(FamilyState *s, PyObject *unused)
{
    PyObject *calls = PyList_New(0);
    PyObject *r = calls == NULL ? NULL : forget_c(s, Py_None, calls);
    if (r == NULL) {
        Py_XDECREF(calls);
        return NULL;
    }
    Py_DECREF(r);
    return calls;
}

/* -- the steady state ------------------------------------------------------- */

/* Whether nothing unusual is known on this rank before any collective: the
 * steady state's first look (the steps take every case this refuses). */
static int
quiet(FamilyState *s)
{
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (s->code != OPEN || s->destroying || s->hold || PyList_GET_SIZE(s->unreported) || s->stale
        || s->npend || s->comm == Py_None || s->gone != Py_None || finalized) {
        return 0;
    }
    return children_idle(s);
}

static PyObject *
fs_quiet(FamilyState *s, PyObject *unused)
{
    int q = quiet(s);
    return q < 0 ? NULL : PyBool_FromLong(q);
}

/* Whether the last exchange found nothing unusual anywhere, for the n keys
 * this rank sent (see the Python twin): the header's half of it. */
static int
plain_header(FamilyState *s, Py_ssize_t n)
{
    const int64_t *red = s->buf;
    if (red == NULL || red[0] != ~red[1] || red[2] != ~red[3] || red[4] != ~red[5] || red[7] != 0
        || red[8] != ~0LL || ((~red[6]) & SYNC_FLAGS & ~FLAG_DEADLINE)
        || (s->last - s->first) != n || count_window(s) != n) {
        return 0;
    }
    /* Some rank had a deadline: it may have given up after sending its part,
     * and this agreement completed only because of what it left behind
     * (then its notice is here, or on its way: the steps say so). */
    if ((~red[6]) & FLAG_DEADLINE) {
        int f = fired_c(s);
        if (f != 0) {
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

static PyObject *
fs_plain(FamilyState *s, PyObject *votes)
{
    if (!PyTuple_Check(votes)) {
        PyErr_SetString(PyExc_TypeError, "plain(votes): a tuple of (shift, raises)");
        return NULL;
    }
    if (!plain_header(s, s->npend)) {
        Py_RETURN_FALSE;
    }
    long long agreed = ~s->buf[6];
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(votes); i++) {
        PyObject *v = PyTuple_GET_ITEM(votes, i);
        long shift = PyTuple_Check(v) && PyTuple_GET_SIZE(v) == 2 ? PyLong_AsLong(PyTuple_GET_ITEM(v, 0)) : -1;
        int raises = PyTuple_Check(v) && PyTuple_GET_SIZE(v) == 2 ? PyObject_IsTrue(PyTuple_GET_ITEM(v, 1)) : 0;
        if (PyErr_Occurred()) {
            return NULL;
        }
        if (shift >= 0 && ((agreed >> shift) & 0xFF) && raises) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* The steady state: SyncPoint's steps (collective_gc._syncpoint), each with
 * its fast case taken and nothing else, as the functions below named after
 * them; `fs_steady` runs them in order. Each step but the last returns 1 (go
 * on), 0 (hand the sync point to the steps: `progress`, an index into
 * _syncpoint.STEPS, says from which) or -1 (an exception); the last returns
 * the stats, or NULL. What a sync point carries from step to step is a
 * Steady, on the C stack: nothing of it outlives the call but the stats, the
 * failures kept (`failed`) and the keys handed back (`add_pending`). The
 * comments number the steps as _syncpoint's docstring does (1. prepare ...
 * 8. report). */
typedef struct {
    PyObject *extra;    /* the sync point's own participant (borrowed), or None */
    PyObject *parts;    /* the family's participants at its start (owned: a vote, destroy
                           or finish may set others, freeing the tuple s->parts was) */
    Py_ssize_t np, all; /* the family's participants; with extra */
    long long flags;    /* after prepare: this rank's votes; after agree: the agreed flags */
    int64_t *keys;      /* the keys drained from the inbox, sorted (owned) */
    Py_ssize_t nk;
    long long seq;      /* this sync point's number */
    PyObject *failures; /* destroy's and finish's (owned) */
    Py_ssize_t count;   /* how many destroys ran, or -1: destroy_c's own failure (memory) */
    PyObject *error;    /* that failure's exception, raised by report (owned) */
} Steady;

static PyObject *
steady_part(FamilyState *s, Steady *st, Py_ssize_t i)
{
    return i < st->np ? PyTuple_GET_ITEM(st->parts, i) : st->extra;
}

/* The keys drained, pending again for the steps, which go on from `step`
 * (0, the start, when the sync point leaves by an exception). */
static int
steady_hand_back(FamilyState *s, Steady *st, int step)
{
    int stored = add_pending(s, st->keys, st->nk, st->seq);
    PyMem_Free(st->keys);
    st->keys = NULL;
    if (stored < 0) {
        return -1;
    }
    s->progress = step;
    return 0;
}

/* 1. prepare: nothing unusual known here, the votes, the drain. */
static int
steady_prepare(FamilyState *s, Steady *st)
{
    int q = quiet(s);
    if (q <= 0) {
        return q;
    }
    st->np = PyTuple_GET_SIZE(st->parts);
    st->all = st->np + (st->extra != Py_None);
    for (Py_ssize_t i = 0; i < st->all; i++) {
        PyObject *p = steady_part(s, st, i);
        long v;
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) < 5 || vote_of(p, s->seq, &v) < 0) {
            /* A vote that raises (an interrupt too), or is not a byte: the
             * steps ask it again, and say so on every rank alike. */
            PyErr_Clear();
            return 0;
        }
        st->flags |= v;
    }
    /* Votes may run Python code (and let other threads register): the inbox
     * is read from here on, with no Python code run before it is drained. */
    s->cut_key = s->next_key; /* the cut, as a drain makes it */
    s->cut_order = s->order;
    Py_ssize_t nk = PyList_GET_SIZE(s->inbox);
    int64_t *keys = PyMem_Malloc((size_t)(nk ? nk : 1) * sizeof(int64_t));
    if (keys == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < nk; i++) {
        Reg *reg = (Reg *)PyList_GET_ITEM(s->inbox, i);
        if (!PyObject_TypeCheck((PyObject *)reg, &RegType) || reg->cyclic) {
            PyMem_Free(keys); /* a cyclic death: the steps */
            return 0;
        }
        keys[i] = reg->key;
    }
    sort_keys(keys, nk);
    if (nk && PyList_SetSlice(s->inbox, 0, nk, NULL) < 0) { /* frees nothing: live holds them */
        PyMem_Free(keys);
        return -1;
    }
    st->keys = keys;
    st->nk = nk;
    st->seq = s->seq;
    return 1;
}

/* 2. agree: the exchange, and whether it found nothing unusual anywhere. */
static int
steady_agree(FamilyState *s, Steady *st, long long fp, double at)
{
    int found = exchange_c(s, st->keys, st->nk, 0, st->flags, fp, 0, at);
    if (found != DONE) {
        /* A handler's exception, a rank gave up, or this one did (LATE: its
         * notice names it): nothing may be lost, the drained keys are
         * pending again; the steps say what happened. */
        PyObject *exc = take_exception();
        int back = steady_hand_back(s, st, exc != NULL ? 0 : STEP_AGREE);
        if (exc != NULL) {
            PyErr_Clear();
            restore_exception(exc);
            return -1;
        }
        return back;
    }
    long long agreed = ~s->buf[6];
    int unusual = !plain_header(s, st->nk);
    for (Py_ssize_t i = 0; !unusual && i < st->all; i++) {
        PyObject *p = steady_part(s, st, i);
        long shift = PyLong_AsLong(PyTuple_GET_ITEM(p, 0));
        int raises = PyObject_IsTrue(PyTuple_GET_ITEM(p, 3));
        if (shift >= 0 && ((agreed >> shift) & 0xFF) && raises) {
            unusual = 1; /* its finish needs one more word after it: the steps */
        }
    }
    if (PyErr_Occurred()) {
        PyErr_Clear();
        unusual = 1;
    }
    if (unusual) {
        return steady_hand_back(s, st, STEP_AGREE); /* the steps go on from the agreement */
    }
    agreed_c(s, s->buf[2]); /* the next key every rank sent (plain_header: all alike), as the steps do */
    st->flags = agreed;
    return 1;
}

/* 3. destroy: the agreed keys' destroys (every one of them: the drained keys
 * are the agreed ones, or the agreement was not plain). */
static int
steady_destroy(FamilyState *s, Steady *st, PyObject *batched, PyObject *runners)
{
    st->failures = PyList_New(0);
    if (st->failures != NULL && st->nk) {
        st->count = destroy_c(s, st->keys, st->nk, batched, runners, st->failures);
        if (st->count < 0) {
            st->error = take_exception(); /* no finish runs with it set */
        }
    }
    PyMem_Free(st->keys);
    st->keys = NULL;
    return st->failures == NULL ? -1 : 1;
}

/* 7. finish: the participants whose byte is not 0 (quiet ones do nothing
 * else; 4-6, visit, release and check, have no fast case but nothing). */
static int
steady_finish(FamilyState *s, Steady *st)
{
    long long agreed = st->flags;
    for (Py_ssize_t i = 0; i < st->all && agreed; i++) {
        PyObject *p = steady_part(s, st, i);
        long shift = PyLong_AsLong(PyTuple_GET_ITEM(p, 0)); /* (read in agree already) */
        if (shift < 0 || !((agreed >> shift) & 0xFF)) {
            PyErr_Clear();
            continue;
        }
        PyObject *f = PyLong_FromLongLong(agreed);
        PyObject *res = f == NULL ? NULL : PyObject_CallOneArg(PyTuple_GET_ITEM(p, 2), f);
        Py_XDECREF(f);
        if (res != NULL) {
            Py_DECREF(res);
        }
        else if (record(st->failures, -1, PyTuple_GET_ITEM(p, 4)) < 0) {
            PyErr_Clear();
        }
    }
    s->inside = 0;
    return 1;
}

/* 8. report: the stats; failures go to the caller (`failed`, `progress`). A
 * signal that came in the wait is deferred here, inside the sync point's
 * protected region (the caller's), for the region's end to run. */
/* The failures the steady state stored for the steps to report, when it is
 * left by an exception instead (a second Ctrl-C at its end, out of memory):
 * kept, as (seq, failure), for the family's next agreement to report on every
 * rank (what the steps' report does: _syncpoint.keep_failures), not lost. */
static void
keep_failed(FamilyState *s, long long seq)
{
    PyObject *exc = take_exception();
    PyObject *failed = take_list(&s->failed);
    s->progress = 0;
    for (Py_ssize_t i = 0; failed != NULL && i < PyList_GET_SIZE(failed); i++) {
        PyObject *row = Py_BuildValue("(LO)", seq, PyList_GET_ITEM(failed, i));
        if (row == NULL || PyList_Append(s->unreported, row) < 0) {
            PyErr_Clear(); /* out of memory: the exception raised says more */
        }
        Py_XDECREF(row);
    }
    Py_XDECREF(failed);
    restore_exception(exc);
}

static PyObject *
steady_report(FamilyState *s, Steady *st, double t0, PyObject *collected)
{
    PyObject *stats = NULL;
    if (st->count >= 0) {
        PyObject *fields = Py_BuildValue("(nnidLOi)", st->count,
                                         PyList_GET_SIZE(s->inbox) + s->npend, 0,
                                         now_seconds() - t0, st->seq, collected, 0);
        /* tuple.__new__(CollectStats, fields): no Python-level __new__ runs */
        PyObject *targs = fields == NULL ? NULL : PyTuple_Pack(1, fields);
        Py_XDECREF(fields);
        stats = targs == NULL ? NULL : PyTuple_Type.tp_new((PyTypeObject *)s->stats, targs, NULL);
        Py_XDECREF(targs);
    }
    int failed = PyList_GET_SIZE(st->failures) > 0;
    if (failed) {
        Py_SETREF(s->failed, st->failures);
        s->progress = STEP_REPORT;
    }
    else {
        Py_DECREF(st->failures);
    }
    st->failures = NULL;
    if (st->error != NULL) {
        restore_exception(st->error);
        st->error = NULL;
        if (failed) {
            keep_failed(s, st->seq);
        }
        return NULL;
    }
    if (stats != NULL && PyErr_CheckSignals() < 0) {
        Py_CLEAR(stats);
        if (failed) {
            keep_failed(s, st->seq);
        }
    }
    else if (stats == NULL && failed) {
        keep_failed(s, st->seq); /* the stats could not be made (memory) */
    }
    return stats;
}

/* A sync point whose every step takes its fast case, in one call, or None
 * (with `progress` saying where the steps go on). */
static PyObject *
fs_steady(FamilyState *s, PyObject *const *a, Py_ssize_t n)
{
    if (n != 6 || !PyTuple_Check(a[4]) || PyTuple_GET_SIZE(a[4]) != 2
        || !PyTuple_Check(PyTuple_GET_ITEM(a[4], 0)) || !PyTuple_Check(PyTuple_GET_ITEM(a[4], 1))) {
        PyErr_SetString(PyExc_TypeError,
                        "steady(t0, collected, extra, fingerprint, (batched, runners), deadline)");
        return NULL;
    }
    PyObject *batched = PyTuple_GET_ITEM(a[4], 0), *runners = PyTuple_GET_ITEM(a[4], 1);
    /* time.monotonic()'s clock (CLOCK_MONOTONIC), or -1: none. */
    double at = a[5] == Py_None ? -1.0 : PyFloat_AsDouble(a[5]);
    double t0 = PyFloat_AsDouble(a[0]);
    long long fp = PyLong_AsLongLong(a[3]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Steady st = {.extra = a[2], .parts = Py_NewRef(s->parts)};
    s->progress = 0;
    int go = steady_prepare(s, &st);
    if (go > 0) {
        go = steady_agree(s, &st, fp, at);
    }
    if (go > 0) {
        go = steady_destroy(s, &st, batched, runners);
    }
    if (go > 0) {
        go = steady_finish(s, &st);
    }
    PyObject *out = go > 0 ? steady_report(s, &st, t0, a[1]) : go < 0 ? NULL : Py_NewRef(Py_None);
    Py_DECREF(st.parts);
    return out;
}

static PyMethodDef fs_methods[] = {
    {"become", (PyCFunction)(void (*)(void))fs_become, METH_FASTCALL, NULL},
    {"set_hold", (PyCFunction)(void (*)(void))fs_set_hold, METH_FASTCALL, NULL},
    {"set_participants", (PyCFunction)fs_set_participants, METH_O, NULL},
    {"set_children", (PyCFunction)fs_set_children, METH_O, NULL},
    {"wants", (PyCFunction)fs_wants, METH_NOARGS, NULL},
    {"take_key", (PyCFunction)fs_take_key, METH_O, NULL},
    {"give_back", (PyCFunction)(void (*)(void))fs_give_back, METH_FASTCALL, NULL},
    {"begin_interval", (PyCFunction)fs_begin_interval, METH_O, NULL},
    {"add_busy", (PyCFunction)fs_add_busy, METH_O, NULL},
    {"store", (PyCFunction)fs_store, METH_O, NULL},
    {"add_plain", (PyCFunction)(void (*)(void))fs_add_plain, METH_FASTCALL, NULL},
    {"claim", (PyCFunction)(void (*)(void))fs_claim, METH_FASTCALL, NULL},
    {"destroy_now", (PyCFunction)fs_destroy_now, METH_O, NULL},
    {"forget", (PyCFunction)(void (*)(void))fs_forget, METH_FASTCALL, NULL},
    {"drain", (PyCFunction)fs_drain, METH_O, NULL},
    {"pending_keys", (PyCFunction)fs_pending_keys, METH_NOARGS, NULL},
    {"remove_pending", (PyCFunction)fs_remove_pending, METH_O, NULL},
    {"open", (PyCFunction)(void (*)(void))fs_open, METH_FASTCALL, NULL},
    {"exchange", (PyCFunction)(void (*)(void))fs_exchange, METH_FASTCALL, NULL},
    {"reduced", (PyCFunction)fs_reduced, METH_NOARGS, NULL},
    {"window_keys", (PyCFunction)fs_window_keys, METH_NOARGS, NULL},
    {"agreed", (PyCFunction)fs_agreed, METH_O, NULL},
    {"left", (PyCFunction)fs_left, METH_NOARGS, NULL},
    {"fired", (PyCFunction)fs_fired, METH_NOARGS, NULL},
    {"announce", (PyCFunction)fs_announce, METH_O, NULL},
    {"notice", (PyCFunction)fs_notice, METH_NOARGS, NULL},
    {"close", (PyCFunction)fs_close, METH_O, NULL},
    {"destroy", (PyCFunction)(void (*)(void))fs_destroy, METH_FASTCALL, NULL},
    {"keep", (PyCFunction)fs_keep, METH_O, NULL},
    {"take_unreported", (PyCFunction)fs_take_unreported, METH_NOARGS, NULL},
    {"take_failed", (PyCFunction)fs_take_failed, METH_NOARGS, NULL},
    {"steady", (PyCFunction)(void (*)(void))fs_steady, METH_FASTCALL, NULL},
    {"quiet", (PyCFunction)fs_quiet, METH_NOARGS, NULL},
    {"plain", (PyCFunction)fs_plain, METH_O, NULL},
    {"after_fork", (PyCFunction)fs_after_fork, METH_NOARGS, NULL},
    {NULL},
};

static PyMemberDef fs_members[] = {
    {"rank", T_INT, offsetof(FamilyState, rank), READONLY, NULL},
    {"size", T_INT, offsetof(FamilyState, size), READONLY, NULL},
    {"code", T_INT, offsetof(FamilyState, code), READONLY, NULL},
    {"reason", T_OBJECT, offsetof(FamilyState, reason), READONLY, NULL},
    {"seq", T_LONGLONG, offsetof(FamilyState, seq), READONLY, NULL},
    {"inside", T_BOOL, offsetof(FamilyState, inside), READONLY, NULL},
    {"destroying", T_ULONG, offsetof(FamilyState, destroying), READONLY, NULL},
    {"destroyed", T_LONGLONG, offsetof(FamilyState, destroyed), READONLY, NULL},
    {"progress", T_INT, offsetof(FamilyState, progress), READONLY, NULL},
    {"hold", T_LONG, offsetof(FamilyState, hold), READONLY, NULL},
    {"unreported", T_OBJECT, offsetof(FamilyState, unreported), READONLY, NULL},
    {"next_key", T_LONGLONG, offsetof(FamilyState, next_key), READONLY, NULL},
    {"order", T_ULONGLONG, offsetof(FamilyState, order), READONLY, NULL},
    {"cut_key", T_LONGLONG, offsetof(FamilyState, cut_key), READONLY, NULL},
    {"cut_order", T_ULONGLONG, offsetof(FamilyState, cut_order), READONLY, NULL},
    {"thread", T_LONG, offsetof(FamilyState, thread), READONLY, NULL},
    {"busy", T_INT, offsetof(FamilyState, busy), READONLY, NULL},
    {"live", T_OBJECT, offsetof(FamilyState, live), READONLY, NULL},
    {"inbox", T_OBJECT, offsetof(FamilyState, inbox), READONLY, NULL},
    {"stale", T_BOOL, offsetof(FamilyState, stale), READONLY, NULL},
    {"comm", T_OBJECT, offsetof(FamilyState, comm), READONLY, NULL},
    {"first", T_LONGLONG, offsetof(FamilyState, first), READONLY, NULL},
    {"last", T_LONGLONG, offsetof(FamilyState, last), READONLY, NULL},
    {"gone", T_OBJECT, offsetof(FamilyState, gone), READONLY, NULL},
    {"persistent", T_BOOL, offsetof(FamilyState, persistent), READONLY, NULL},
    {NULL},
};

static PyGetSetDef fs_getset[] = {
    {"words", (getter)fs_get_words, NULL, NULL, NULL},
    {"window", (getter)fs_get_window, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject FamilyStateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "collective_gc._speedups.FamilyState",
    .tp_basicsize = sizeof(FamilyState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "collective_gc._state.FamilyState, in C.",
    .tp_traverse = (traverseproc)fs_traverse,
    .tp_clear = (inquiry)fs_clear,
    .tp_dealloc = (destructor)fs_dealloc,
    .tp_methods = fs_methods,
    .tp_members = fs_members,
    .tp_getset = fs_getset,
    .tp_new = fs_new,
};

/* ======================================================================== */
/* Petsc                                                                     */

/* The khash table behind PETSc's PetscHMapObj, as petsc/_internals reads it. */
typedef struct {
    uint32_t n_buckets, size, n_occupied, upper_bound;
    uint32_t *flags;
    int64_t *keys;
    void **vals;
} khash_obj;

typedef void *PetscObject;
typedef int (*destroy_fn)(PetscObject *);
typedef PetscObject *(*getptr_fn)(PyObject *);
typedef int (*seterr_fn)(int);
typedef int (*getcomm_fn)(PetscObject, MPI_Comm *);
typedef int (*commdup_fn)(MPI_Comm, MPI_Comm *, int *);
typedef int (*commfree_fn)(MPI_Comm *);

/* What collective_gc.petsc reads and runs of PETSc, from C: where PETSc keeps
 * its keyvals (read at each use: PETSc sets them when it first needs them),
 * petsc4py's and PETSc's functions (their addresses, found by
 * collective_gc.petsc at run time: neither's headers are needed here), the
 * petsc4py classes whose destroy() is PetscObjectDestroy on the handle and
 * nothing else (``fast``), and the Python function that makes a failed
 * destroy's wreck safe and says what to report (``failed``). */
typedef struct {
    PyObject_HEAD
    const int *inner_kv, *counter_kv, *garbage_kv;
    getptr_fn getptr;
    getcomm_fn getcomm;
    destroy_fn destroy;
    seterr_fn seterr;
    commdup_fn commdup;
    commfree_fn commfree;
    int self_delayed; /* PETSc keeps garbage of serial objects (< 3.20) */
    PyObject *fast, *failed;
} Petsc;

static PyTypeObject PetscType;

#define PETSC_OBJECTS(X) X(fast) X(failed)
GC_WALKS(petsc, Petsc, PETSC_OBJECTS)
GC_DEALLOC(petsc, Petsc)

static PyObject *
petsc_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    unsigned long long inner, counter, garbage, getptr, getcomm, destroy, seterr, dup, free;
    PyObject *fast, *failed;
    int self_delayed;
    if (!no_keywords("Petsc", kw)
        || !PyArg_ParseTuple(args, "KKKKKKKKKO!Op:Petsc", &inner, &counter, &garbage, &getptr,
                             &getcomm, &destroy, &seterr, &dup, &free, &PyTuple_Type, &fast,
                             &failed, &self_delayed)) {
        return NULL;
    }
    if (!inner || !counter || !garbage || !getptr || !getcomm || !destroy || !seterr || !dup
        || !free) {
        PyErr_SetString(PyExc_ValueError, "Petsc: a null address");
        return NULL;
    }
    Petsc *p = (Petsc *)type->tp_alloc(type, 0);
    if (p != NULL) {
        p->inner_kv = (const int *)(uintptr_t)inner;
        p->counter_kv = (const int *)(uintptr_t)counter;
        p->garbage_kv = (const int *)(uintptr_t)garbage;
        p->getptr = (getptr_fn)(uintptr_t)getptr;
        p->getcomm = (getcomm_fn)(uintptr_t)getcomm;
        p->destroy = (destroy_fn)(uintptr_t)destroy;
        p->seterr = (seterr_fn)(uintptr_t)seterr;
        p->commdup = (commdup_fn)(uintptr_t)dup;
        p->commfree = (commfree_fn)(uintptr_t)free;
        p->self_delayed = self_delayed;
        p->fast = Py_NewRef(fast);
        p->failed = Py_NewRef(failed);
    }
    return (PyObject *)p;
}

/* A communicator handle as mpi4py's MPI._handleof gives it: the handle cast
 * to an unsigned pointer-sized integer. An MPICH communicator is an int, and
 * a duplicate's is below 0: its integer is above 2**63, which a signed
 * conversion refuses (OverflowError). Both ways go through these two. */
static int
comm_from_int(PyObject *o, MPI_Comm *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (MPI_Comm)(uintptr_t)v;
    return 0;
}

static PyObject *
int_from_comm(MPI_Comm c)
{
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)c);
}

static int
petsc_attr(MPI_Comm comm, int kv, void **out)
{
    if (kv == MPI_KEYVAL_INVALID) {
        return 0; /* PETSc has not made that keyval yet: nothing attached */
    }
    int flag = 0;
    if (MPI_Comm_get_attr(comm, kv, out, &flag) != MPI_SUCCESS) {
        return 0;
    }
    return flag;
}

/* PETSc's inner communicator of comm (itself if it is one): 1, or 0 if none. */
static int
inner_of(Petsc *p, MPI_Comm comm, MPI_Comm *inner)
{
    void *raw = NULL;
    if (petsc_attr(comm, *p->inner_kv, &raw)) {
        /* PETSc keeps an MPI_Comm in a union with a void *. */
        *inner = sizeof(MPI_Comm) < sizeof(void *) ? (MPI_Comm)(intptr_t)(int32_t)(uintptr_t)raw
                                                   : (MPI_Comm)(intptr_t)raw;
        return 1;
    }
    if (petsc_attr(comm, *p->counter_kv, &raw)) {
        *inner = comm;
        return 1;
    }
    return 0;
}

/* How many garbage entries PETSc holds on comm: -1 if it has no inner
 * communicator, -2 if the table is not the one we know (nothing more is read). */
static long
garbage_count(Petsc *p, MPI_Comm comm)
{
    MPI_Comm inner;
    if (!inner_of(p, comm, &inner)) {
        return -1;
    }
    void *raw = NULL;
    if (!petsc_attr(inner, *p->garbage_kv, &raw) || raw == NULL) {
        return 0;
    }
    const khash_obj *kh = (const khash_obj *)raw;
    uint32_t n = kh->n_buckets;
    if ((n & (n - 1)) || !(kh->size <= kh->n_occupied && kh->n_occupied <= n)
        || (n && !(kh->flags && kh->keys && kh->vals))) {
        return -2;
    }
    return (long)kh->size;
}

/* garbage(handle): see petsc/_internals.Internals.garbage_py, its twin. */
static PyObject *
petsc_garbage(Petsc *p, PyObject *arg)
{
    MPI_Comm comm;
    if (comm_from_int(arg, &comm) < 0) {
        return NULL;
    }
    return PyLong_FromLong(garbage_count(p, comm));
}

static int
is_fast(Petsc *p, PyObject *obj)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(p->fast); i++) {
        if (PyTuple_GET_ITEM(p->fast, i) == (PyObject *)Py_TYPE(obj)) {
            return 1;
        }
    }
    return 0;
}

static int
count_referent(PyObject *o, void *n)
{
    (*(Py_ssize_t *)n)++;
    return 0;
}

/* sort(objs, comm): 1 if every object is a live petsc4py object of a fast
 * type on a communicator of size 1, 0 if each is that or lives on comm's
 * PETSc inner communicator, and none refers to anything in Python (so none
 * can refer back to its owner); -1 otherwise (collective_gc.petsc.manage's
 * Python path then looks, and says what is wrong). Local: no message. */
static PyObject *
petsc_sort(Petsc *p, PyObject *const *a, Py_ssize_t n)
{
    if (n != 2 || !PyTuple_Check(a[0])) {
        PyErr_SetString(PyExc_TypeError, "sort(objs, comm)");
        return NULL;
    }
    MPI_Comm *comm = PyMPIComm_Get(a[1]);
    if (comm == NULL) {
        PyErr_Clear();
        return PyLong_FromLong(-1);
    }
    int have_inner = -1, serial = 1;
    MPI_Comm inner = MPI_COMM_NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(a[0]); i++) {
        PyObject *obj = PyTuple_GET_ITEM(a[0], i);
        if (!is_fast(p, obj)) {
            return PyLong_FromLong(-1);
        }
        PetscObject *slot = p->getptr(obj);
        MPI_Comm c;
        int size = 0;
        if (slot == NULL || *slot == NULL || p->getcomm(*slot, &c) != 0
            || MPI_Comm_size(c, &size) != MPI_SUCCESS) {
            PyErr_Clear();
            return PyLong_FromLong(-1);
        }
        Py_ssize_t refs = 0;
        if (Py_TYPE(obj)->tp_traverse != NULL) {
            Py_TYPE(obj)->tp_traverse(obj, count_referent, &refs);
        }
        if (refs) {
            return PyLong_FromLong(-1);
        }
        if (size == 1) {
            continue;
        }
        serial = 0;
        if (have_inner < 0) {
            have_inner = inner_of(p, *comm, &inner);
        }
        if (!have_inner || c != inner) {
            return PyLong_FromLong(-1);
        }
    }
    return PyLong_FromLong(serial);
}

/* Destroy obj as petsc4py's destroy() would: 0, or -1 with the exception set. */
static int
destroy_petsc(Petsc *p, PyObject *obj)
{
    if (!is_fast(p, obj)) {
        PyObject *res = PyObject_CallMethod(obj, "destroy", NULL);
        Py_XDECREF(res);
        return res == NULL ? -1 : 0;
    }
    PetscObject *slot = p->getptr(obj);
    if (slot == NULL) {
        return -1;
    }
    if (*slot == NULL) {
        return 0; /* destroyed already: petsc4py's destroy() does nothing either */
    }
    int ierr = p->destroy(slot); /* PETSc nulls the handle */
    if (ierr || PyErr_Occurred()) {
        if (!PyErr_Occurred()) {
            p->seterr(ierr); /* petsc4py's PETSc.Error, as CHKERR makes it */
        }
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_RuntimeError, "PETSc error code %d", ierr);
        }
        return -1;
    }
    return 0;
}

/* ======================================================================== */
/* CommState                                                                 */

/* collective_gc/petsc/_destroyers.CommState, in C: a family's failed PETSc
 * destroys, the PETSc inner communicators it holds (the NOTE there says
 * why) and the handles its vote reads. Made by Petsc.comm_state; the runs
 * below hold through it directly, and a steady sync point calls its vote
 * with no Python frame. The vote's bits and UNSEEN are the twin's. */
#define VOTE_HAS_GARBAGE 1
#define VOTE_FAILED 8
#define VOTE_SELF_GARBAGE 16
#define UNSEEN (-1)

typedef struct {
    PyObject_HEAD
    Petsc *petsc;
    long failed;
    char parallel;
    MPI_Comm *held;   /* the inner communicators held, in the order first held, */
    long long *since; /* and the clock of the vote that first saw each (UNSEEN) */
    Py_ssize_t nheld, cap;
    MPI_Comm *members; /* the handles the vote reads (set_members), */
    PyObject *handles; /* as given: a tuple of ints */
    char stale;        /* a hold dropped on a member: it may be freed (see the twin's vote) */
} CommState;

static PyTypeObject CommStateType;

/* Cleared by the collector: not petsc, which every method reads, and a state
 * the collector cleared in a cycle may still be called (a module global's, at
 * the interpreter's end); the cycle's lists and dicts are cleared instead. */
#define CS_CLEARED(X) X(handles)

static int
cs_traverse(CommState *self, visitproc visit, void *arg)
{
    Py_VISIT(self->petsc);
    CS_CLEARED(VISIT_FIELD)
    return 0;
}

static int
cs_clear(CommState *self)
{
    CS_CLEARED(CLEAR_FIELD)
    return 0;
}

static void
cs_dealloc(CommState *cs)
{
    PyObject_GC_UnTrack(cs);
    cs_clear(cs);
    Py_CLEAR(cs->petsc);
    PyMem_Free(cs->held);
    PyMem_Free(cs->since);
    PyMem_Free(cs->members);
    Py_TYPE(cs)->tp_free((PyObject *)cs);
}

/* Hold c, or refresh its hold. Local, no MPI (PetscCommDuplicate of an inner
 * communicator counts a reference). */
static void
cs_hold_comm(CommState *cs, MPI_Comm c)
{
    if (!cs->parallel) {
        return; /* serial objects: nothing to differ between ranks */
    }
    for (Py_ssize_t i = 0; i < cs->nheld; i++) {
        if (cs->held[i] == c) {
            cs->since[i] = UNSEEN;
            return;
        }
    }
    if (cs->nheld == cs->cap) {
        Py_ssize_t cap = cs->cap ? 2 * cs->cap : 4;
        MPI_Comm *held = PyMem_Realloc(cs->held, (size_t)cap * sizeof(MPI_Comm));
        if (held != NULL) {
            cs->held = held;
        }
        long long *since = PyMem_Realloc(cs->since, (size_t)cap * sizeof(long long));
        if (since != NULL) {
            cs->since = since;
        }
        if (held == NULL || since == NULL) {
            return; /* best effort, as the twin's: the destroy goes on unheld */
        }
        cs->cap = cap;
    }
    MPI_Comm out = MPI_COMM_NULL;
    if (cs->petsc->commdup(c, &out, NULL) != 0) {
        return;
    }
    cs->held[cs->nheld] = c;
    cs->since[cs->nheld++] = UNSEEN;
}

static PyObject *
cs_hold(CommState *cs, PyObject *arg)
{
    MPI_Comm comm;
    if (comm_from_int(arg, &comm) < 0) {
        return NULL;
    }
    cs_hold_comm(cs, comm);
    Py_RETURN_NONE;
}

static PyObject *
cs_vote(CommState *cs, PyObject *arg)
{
    long long clock = PyLong_AsLongLong(arg);
    if (clock == -1 && PyErr_Occurred()) {
        return NULL;
    }
    /* A look (a parent's, see fs_wants_c) ages and drops nothing. */
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; clock != LOOK && i < cs->nheld; i++) {
        if (cs->since[i] == UNSEEN) {
            cs->since[i] = clock;
        }
        else if (clock - cs->since[i] >= 2) {
            MPI_Comm c = cs->held[i];
            for (Py_ssize_t m = 0; cs->handles != NULL && m < PyTuple_GET_SIZE(cs->handles); m++) {
                cs->stale |= cs->members[m] == c;
            }
            cs->petsc->commfree(&c);
            continue;
        }
        cs->held[kept] = cs->held[i];
        cs->since[kept++] = cs->since[i];
    }
    if (clock != LOOK) {
        cs->nheld = kept;
    }
    long mine = cs->failed > 0 ? VOTE_FAILED : 0;
    if (cs->petsc->self_delayed) {
        long g = garbage_count(cs->petsc, MPI_COMM_SELF);
        if (g != -1 && g != 0) {
            mine |= VOTE_SELF_GARBAGE;
        }
    }
    if (cs->stale) {
        return PyLong_FromLong(mine | VOTE_HAS_GARBAGE);
    }
    Py_ssize_t n = cs->handles == NULL ? 0 : PyTuple_GET_SIZE(cs->handles);
    for (Py_ssize_t i = 0; i < n; i++) {
        long g = garbage_count(cs->petsc, cs->members[i]);
        if (g != -1 && g != 0) {
            mine |= VOTE_HAS_GARBAGE; /* (unreadable, -2: say there is: a cleanup is harmless) */
        }
    }
    return PyLong_FromLong(mine);
}

static PyObject *
cs_failure(CommState *cs, PyObject *unused)
{
    cs->failed++;
    Py_RETURN_NONE;
}

static PyObject *
cs_forgive(CommState *cs, PyObject *unused)
{
    cs->failed = 0;
    Py_RETURN_NONE;
}

static PyObject *
cs_set_members(CommState *cs, PyObject *arg)
{
    if (!PyTuple_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "set_members(handles): a tuple of ints");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(arg);
    MPI_Comm *members = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(MPI_Comm));
    if (members == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (comm_from_int(PyTuple_GET_ITEM(arg, i), &members[i]) < 0) {
            PyMem_Free(members);
            return NULL;
        }
    }
    PyMem_Free(cs->members);
    cs->members = members;
    Py_XSETREF(cs->handles, Py_NewRef(arg));
    cs->stale = 0;
    Py_RETURN_NONE;
}

static PyObject *
cs_get_members(CommState *cs, void *closure)
{
    return cs->handles == NULL ? PyTuple_New(0) : Py_NewRef(cs->handles);
}

static PyObject *
cs_get_holds(CommState *cs, void *closure)
{
    PyObject *out = PyDict_New();
    for (Py_ssize_t i = 0; out != NULL && i < cs->nheld; i++) {
        PyObject *k = int_from_comm(cs->held[i]);
        PyObject *v = PyLong_FromLongLong(cs->since[i]);
        if (k == NULL || v == NULL || PyDict_SetItem(out, k, v) < 0) {
            Py_CLEAR(out);
        }
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    return out;
}

static PyMethodDef cs_methods[] = {
    {"hold", (PyCFunction)cs_hold, METH_O, NULL},
    {"vote", (PyCFunction)cs_vote, METH_O, NULL},
    {"set_members", (PyCFunction)cs_set_members, METH_O, NULL},
    {"failure", (PyCFunction)cs_failure, METH_NOARGS, NULL},
    {"forgive", (PyCFunction)cs_forgive, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef cs_getset[] = {
    {"members", (getter)cs_get_members, NULL, NULL, NULL},
    {"holds", (getter)cs_get_holds, NULL, NULL, NULL},
    {NULL},
};

static PyMemberDef cs_members[] = {
    {"failed", T_LONG, offsetof(CommState, failed), READONLY, NULL},
    {"parallel", T_BOOL, offsetof(CommState, parallel), READONLY, NULL},
    {"stale", T_BOOL, offsetof(CommState, stale), READONLY, NULL},
    {NULL},
};

static PyTypeObject CommStateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "collective_gc._speedups.CommState",
    .tp_basicsize = sizeof(CommState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "collective_gc.petsc._destroyers.CommState, in C (Petsc.comm_state).",
    .tp_traverse = (traverseproc)cs_traverse,
    .tp_clear = (inquiry)cs_clear,
    .tp_dealloc = (destructor)cs_dealloc,
    .tp_methods = cs_methods,
    .tp_getset = cs_getset,
    .tp_members = cs_members,
};

static PyObject *
petsc_comm_state(Petsc *p, PyObject *arg)
{
    int parallel = PyObject_IsTrue(arg);
    if (parallel < 0) {
        return NULL;
    }
    CommState *cs = PyObject_GC_New(CommState, &CommStateType);
    if (cs == NULL) {
        return NULL;
    }
    cs->petsc = (Petsc *)Py_NewRef(p);
    cs->failed = 0;
    cs->parallel = (char)parallel;
    cs->held = NULL;
    cs->since = NULL;
    cs->nheld = cs->cap = 0;
    cs->members = NULL;
    cs->handles = NULL;
    cs->stale = 0;
    PyObject_GC_Track(cs);
    return (PyObject *)cs;
}

/* Before obj's destroy: hold its communicator (PETSc's inner one) in state,
 * a CommState (the states of managed registrations all are: Petsc.comm_state
 * makes them), if it is parallel and not the one held last in this run
 * (*held): see NOTE [ A failed PETSc destroy and PETSc's inner communicator ]
 * in collective_gc/petsc/_destroyers.py. Best effort: an object it cannot
 * look into is left to its destroy, which says what is wrong. */
static void
hold_comm(Petsc *p, PyObject *state, PyObject *obj, MPI_Comm *held)
{
    if (!Py_IS_TYPE(state, &CommStateType)) {
        return; /* not a managed registration's state: nothing to hold it in */
    }
    PetscObject *slot = p->getptr(obj);
    MPI_Comm c;
    int size = 0;
    if (slot == NULL || *slot == NULL || p->getcomm(*slot, &c) != 0 || c == *held
        || MPI_Comm_size(c, &size) != MPI_SUCCESS || size < 2) {
        PyErr_Clear();
        return;
    }
    cs_hold_comm((CommState *)state, c);
    *held = c;
}

/* The destroys of a run of managed PETSc registrations: each item of argss
 * is (obj, state) (``many`` false: collective_gc.petsc's destroy_one) or
 * (state, obj, ...) (``many``: destroy_many, its objects last first), every
 * object tried whatever raises. What raised for one registration goes to
 * ``failed(state, [(obj, exc), ...])`` (Python: the wreck made safe, the
 * exception to report); returns [(index, exception)]. */
static PyObject *
petsc_run(Petsc *p, PyObject *argss, int many)
{
    PyObject *failures = PyList_New(0);
    if (failures == NULL) {
        return NULL;
    }
    MPI_Comm held = MPI_COMM_NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(argss); i++) {
        PyObject *call = Py_NewRef(PyList_GET_ITEM(argss, i));
        PyObject *bad = NULL; /* [(obj, exc)] of this registration */
        if (!PyTuple_Check(call) || PyTuple_GET_SIZE(call) < 2) {
            PyErr_SetString(PyExc_TypeError, "a managed PETSc destroy without its objects");
            bad = PyList_New(0);
            PyObject *exc = take_exception();
            PyObject *pair = exc == NULL ? NULL : Py_BuildValue("(ON)", Py_None, exc);
            if (bad == NULL || pair == NULL || PyList_Append(bad, pair) < 0) {
                PyErr_Clear();
            }
            Py_XDECREF(pair);
        }
        else {
            Py_ssize_t n = PyTuple_GET_SIZE(call);
            PyObject *state = PyTuple_GET_ITEM(call, many ? 0 : 1);
            for (Py_ssize_t j = many ? n - 1 : 0; many ? j >= 1 : j < 1; many ? j-- : j++) {
                PyObject *obj = PyTuple_GET_ITEM(call, j);
                hold_comm(p, state, obj, &held);
                if (destroy_petsc(p, obj) == 0) {
                    continue;
                }
                PyObject *exc = take_exception();
                if (bad == NULL) {
                    bad = PyList_New(0);
                }
                PyObject *pair = exc == NULL ? NULL : Py_BuildValue("(ON)", obj, exc);
                if (bad == NULL || pair == NULL || PyList_Append(bad, pair) < 0) {
                    PyErr_Clear(); /* go on: every object must be tried */
                }
                Py_XDECREF(pair);
            }
        }
        if (bad != NULL) {
            PyObject *state = PyTuple_Check(call) && PyTuple_GET_SIZE(call) >= 2
                                  ? PyTuple_GET_ITEM(call, many ? 0 : 1)
                                  : Py_None;
            PyObject *exc = PyObject_CallFunctionObjArgs(p->failed, state, bad, NULL);
            if (exc == NULL) {
                exc = take_exception(); /* its own failure is what is reported */
            }
            PyObject *row = exc == NULL ? NULL : Py_BuildValue("(nN)", i, exc);
            if (row == NULL || PyList_Append(failures, row) < 0) {
                PyErr_Clear();
            }
            Py_XDECREF(row);
            Py_DECREF(bad);
        }
        Py_DECREF(call);
    }
    return failures;
}

/* A run's runner, one of two kinds, for FamilyState.destroy's batches: called
 * from C directly there, from Python as a callable elsewhere. */
typedef struct {
    PyObject_HEAD
    Petsc *petsc;
    int many;
} PetscRun;

static PyTypeObject PetscRunType;

static PyObject *
petscrun_call(PetscRun *r, PyObject *args, PyObject *kw)
{
    PyObject *argss;
    if (!no_keywords("PetscRun", kw) || !PyArg_ParseTuple(args, "O!:PetscRun", &PyList_Type, &argss)) {
        return NULL;
    }
    return petsc_run(r->petsc, argss, r->many);
}

static void
petscrun_dealloc(PetscRun *r)
{
    Py_XDECREF(r->petsc);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyTypeObject PetscRunType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "collective_gc._speedups.PetscRun",
    .tp_basicsize = sizeof(PetscRun),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The runner of a run of managed PETSc destroys (Petsc.runner).",
    .tp_call = (ternaryfunc)petscrun_call,
    .tp_dealloc = (destructor)petscrun_dealloc,
};

static PyObject *
petsc_runner(Petsc *p, PyObject *arg)
{
    int many = PyObject_IsTrue(arg);
    if (many < 0) {
        return NULL;
    }
    PetscRun *r = PyObject_New(PetscRun, &PetscRunType);
    if (r != NULL) {
        r->petsc = (Petsc *)Py_NewRef(p);
        r->many = many;
    }
    return (PyObject *)r;
}

static PyObject *
petsc_run_any(PyObject *runner, PyObject *argss)
{
    return petsc_run(((PetscRun *)runner)->petsc, argss, ((PetscRun *)runner)->many);
}

static PyMethodDef petsc_methods[] = {
    {"garbage", (PyCFunction)petsc_garbage, METH_O, NULL},
    {"sort", (PyCFunction)(void (*)(void))petsc_sort, METH_FASTCALL, NULL},
    {"runner", (PyCFunction)petsc_runner, METH_O, NULL},
    {"comm_state", (PyCFunction)petsc_comm_state, METH_O, NULL},
    {NULL},
};

static PyTypeObject PetscType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "collective_gc._speedups.Petsc",
    .tp_basicsize = sizeof(Petsc),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "What collective_gc.petsc reads and runs of PETSc, in C.",
    /* No tp_clear: fast and failed are set once, at construction, and read
     * unchecked (is_fast, a failed destroy's report). A cycle through a Petsc
     * (failed's globals back to it) is broken at the function or its module. */
    .tp_traverse = (traverseproc)petsc_traverse,
    .tp_dealloc = (destructor)petsc_dealloc,
    .tp_methods = petsc_methods,
    .tp_new = petsc_new,
};

/* ======================================================================== */
/* the module                                                                */

static PyMethodDef methods[] = {
    {"new_registration", (PyCFunction)(void (*)(void))new_registration, METH_FASTCALL,
     "collective_gc._state.new_registration, in C."},
    {"note_queued", (PyCFunction)(void (*)(void))note_queued, METH_FASTCALL,
     "collective_gc._state.note_queued, in C."},
    {"take_call", (PyCFunction)(void (*)(void))take_call, METH_FASTCALL,
     "collective_gc._state.take_call, in C."},
    {NULL, NULL, 0, NULL},
};

/* The MPI library this module was built against must be mpi4py's, else its
 * handles would be another MPI's: the import fails, and the Python twins run. */
static int
same_mpi(void)
{
    char mine[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    if (MPI_Get_library_version(mine, &len) != MPI_SUCCESS) {
        return 0;
    }
    PyObject *mod = PyImport_ImportModule("mpi4py.MPI");
    PyObject *theirs = mod == NULL ? NULL : PyObject_CallMethod(mod, "Get_library_version", NULL);
    Py_XDECREF(mod);
    if (theirs == NULL) {
        return -1;
    }
    PyObject *ours = PyUnicode_DecodeLatin1(mine, len, NULL);
    int same = ours != NULL && PyUnicode_Compare(ours, theirs) == 0;
    Py_XDECREF(ours);
    Py_DECREF(theirs);
    if (PyErr_Occurred()) {
        return -1;
    }
    return same;
}

static int
exec_module(PyObject *m)
{
    if (import_mpi4py() < 0) {
        return -1;
    }
    int same = same_mpi();
    if (same <= 0) {
        if (same == 0) {
            PyErr_SetString(PyExc_ImportError,
                            "collective_gc._speedups was built against another MPI library than "
                            "mpi4py's (rebuild it)");
        }
        return -1;
    }
    PyObject *functools = PyImport_ImportModule("functools");
    if (functools == NULL) {
        return -1;
    }
    Py_XSETREF(partial_type, PyObject_GetAttrString(functools, "partial"));
    Py_DECREF(functools);
    if (partial_type == NULL || !PyType_Check(partial_type)) {
        return -1;
    }
    PyObject *wrapper = PyObject_GetAttrString(Py_None, "__str__");
    if (wrapper == NULL) {
        return -1;
    }
    method_wrapper_type = Py_TYPE(wrapper); /* a static type: never freed */
    Py_DECREF(wrapper);
    RegType.tp_base = &_PyWeakref_RefType;
    PyTypeObject *types[] = {&GcStateType, &RegType, &RegionType, &FamilyStateType, &PetscType,
                             &PetscRunType, &CommStateType};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        /* Each is exported under its tp_name's last part. */
        const char *name = strrchr(types[i]->tp_name, '.') + 1;
        if (PyType_Ready(types[i]) < 0 || PyModule_AddObjectRef(m, name, (PyObject *)types[i]) < 0) {
            return -1;
        }
    }
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "collective_gc._speedups",
    .m_doc = "collective_gc's typed state in C (see the source's header).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModuleDef_Init(&module_def);
}
