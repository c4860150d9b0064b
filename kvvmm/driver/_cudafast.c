/* kvvmm.driver._cudafast: CudaDriver's hot calls without Python in the way.
 *
 * CudaDriver's create / map / set access / unmap / release cost, in pure Python, 0.4-0.6 us
 * of bookkeeping on top of cuda-python's own wrapper (1.3-1.6x the raw call for a 2 MiB map
 * on an H200 host). This module does the same checks and the same bookkeeping in C, on the
 * same dicts, and calls the driver through function pointers that Python looked up in the
 * libcuda the process already loaded: no CUDA header, no link to libcuda, nothing compiled
 * at run time (it is built once, with the package, like any extension; CPython's limited
 * API, so one build serves 3.11 and later).
 *
 * It only takes the common, valid case. Anything else (a check that fails, an argument that
 * is not a plain int, a capture underway, another context current, a handle released while
 * mapped) goes to the Python implementation, which gives the typed error or does the rare
 * work. A CUDA error is handed to the driver's _fast_failed, which raises the DriverError.
 *
 * Threads: the GIL is the lock of the C path. cuMemMap runs with the GIL held, so its check,
 * call and record are one step; release and unmap take the handle or mapping out of the
 * dicts *before* they release the GIL for the driver call (and the synchronize, which may
 * wait long), and put it back if CUDA refuses, so no two threads act on the same one.
 * Handle ids must be exact ints (True == 1 and 1.0 == 1 as dict keys: they go to Python).
 */
#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030B0000
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>

typedef unsigned long long u64;
typedef int cu_result;
typedef cu_result (*map_fn)(u64 va, size_t size, size_t offset, u64 handle, u64 flags);
typedef cu_result (*unmap_fn)(u64 va, size_t size);
typedef cu_result (*create_fn)(u64 *handle, size_t size, const void *prop, u64 flags);
typedef cu_result (*release_fn)(u64 handle);
typedef cu_result (*access_fn)(u64 va, size_t size, const void *desc, size_t count);
typedef cu_result (*getcur_fn)(void **ctx);
typedef cu_result (*sync_fn)(void);
typedef cu_result (*iscap_fn)(void *stream, int *status);

#define CU_STREAM_LEGACY ((void *)0x1)

/* ---------------------------------------------------------------- Handle */

typedef struct {
    PyObject_HEAD
    u64 raw;         /* CUmemGenericAllocationHandle */
    long long size;  /* bytes */
    long long maps;  /* live mappings of it */
    char live;       /* not yet released */
    char imported;   /* from another process: its memory is not ours to count */
} Handle;

static PyMemberDef handle_members[] = {
    {"raw", T_ULONGLONG, offsetof(Handle, raw), READONLY, "the CUDA handle"},
    {"size", T_LONGLONG, offsetof(Handle, size), READONLY, "bytes"},
    {"maps", T_LONGLONG, offsetof(Handle, maps), 0, "live mappings of it"},
    {"live", T_BOOL, offsetof(Handle, live), 0, "not yet released"},
    {"imported", T_BOOL, offsetof(Handle, imported), READONLY, "from another process"},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *handle_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    static char *names[] = {"raw", "size", "imported", NULL};
    unsigned long long raw;
    long long size;
    int imported = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KL|p", names, &raw, &size, &imported))
        return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(tp, Py_tp_alloc);
    Handle *h = (Handle *)alloc(tp, 0);
    if (h == NULL)
        return NULL;
    h->raw = raw;
    h->size = size;
    h->maps = 0;
    h->live = 1;
    h->imported = (char)imported;
    return (PyObject *)h;
}

static void handle_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    freefunc free_ = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    free_(self);
    Py_DECREF(tp);
}

static PyType_Slot handle_slots[] = {
    {Py_tp_new, (void *)handle_new},
    {Py_tp_dealloc, (void *)handle_dealloc},
    {Py_tp_members, handle_members},
    {Py_tp_doc, "Handle(raw, size, imported=False): one CUDA allocation as CudaDriver tracks it."},
    {0, NULL},
};

static PyType_Spec handle_spec = {
    "kvvmm.driver._cudafast.Handle", sizeof(Handle), 0, Py_TPFLAGS_DEFAULT, handle_slots,
};

/* ---------------------------------------------------------------- Fast */

typedef struct {
    PyObject_HEAD
    map_fn map;
    unmap_fn unmap;
    create_fn create;
    release_fn release;
    access_fn access;
    getcur_fn getcur;
    sync_fn sync;
    iscap_fn iscap;
    void *ctx;          /* the primary context this driver works in */
    const void *prop;   /* CUmemAllocationProp, owned by the driver */
    const void *acc;    /* one CUmemAccessDesc (own device, read/write), owned by the driver */
    u64 gran;
    u64 hot_lo, hot_hi; /* the reservation the last map landed in, [lo, hi) */
    long long next_handle;
    long long physical_bytes;
    PyObject *handles;       /* dict: handle id -> Handle (live ones) */
    PyObject *maps;          /* dict: mapping start -> Handle */
    PyObject *capture_check; /* torch's "is the current stream capturing?", or None */
    PyObject *driver_ref;    /* weakref to the CudaDriver (slow paths, errors) */
    PyObject *handle_type;
} Fast;

static PyMemberDef fast_members[] = {
    {"hot_lo", T_ULONGLONG, offsetof(Fast, hot_lo), 0, "start of the last map's reservation"},
    {"hot_hi", T_ULONGLONG, offsetof(Fast, hot_hi), 0, "end of the last map's reservation"},
    {"next_handle", T_LONGLONG, offsetof(Fast, next_handle), 0, "the next handle id"},
    {"physical_bytes", T_LONGLONG, offsetof(Fast, physical_bytes), 0, "bytes held"},
    {"capture_check", T_OBJECT_EX, offsetof(Fast, capture_check), 0,
     "a no-argument callable: torch's current stream on this device (an int), or whether "
     "a capture is underway (a bool); None: not known yet"},
    {NULL, 0, 0, 0, NULL},
};

static int get_u64(PyObject *o, u64 *out) {
    /* A plain int in [0, 2**64): anything else (bool included) is the slow path's to judge. */
    if (!PyLong_CheckExact(o))
        return 0;
    u64 v = PyLong_AsUnsignedLongLong(o);
    if (v == (u64)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 1;
}

static void *get_ptr(PyObject *o, const char *what) {
    u64 v;
    if (!get_u64(o, &v) || v == 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a non-null address (an int)", what);
        return NULL;
    }
    return (void *)(uintptr_t)v;
}

static PyObject *fast_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    /* Fast(fns, ctx, prop, acc, gran, handles, maps, driver, handle_type):
     * fns: 8 addresses (cuMemMap, cuMemUnmap, cuMemCreate, cuMemRelease, cuMemSetAccess,
     * cuCtxGetCurrent, cuCtxSynchronize, cuStreamIsCapturing). */
    static char *names[] = {"fns", "ctx", "prop", "acc", "gran", "handles", "maps", "driver",
                            "handle_type", NULL};
    PyObject *fns, *ctx, *prop, *acc, *handles, *maps, *driver, *htype;
    unsigned long long gran;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOKO!O!OO", names, &fns, &ctx, &prop, &acc,
                                     &gran, &PyDict_Type, &handles, &PyDict_Type, &maps,
                                     &driver, &htype))
        return NULL;
    if (!PyTuple_Check(fns) || PyTuple_Size(fns) != 8) {
        PyErr_SetString(PyExc_ValueError, "fns must be a tuple of 8 function addresses");
        return NULL;
    }
    if (gran == 0) {
        PyErr_SetString(PyExc_ValueError, "gran must be > 0");
        return NULL;
    }
    void *p[8];
    for (Py_ssize_t i = 0; i < 8; i++) {
        p[i] = get_ptr(PyTuple_GetItem(fns, i), "each function address");
        if (p[i] == NULL)
            return NULL;
    }
    void *ctxp = get_ptr(ctx, "ctx"), *propp = get_ptr(prop, "prop"), *accp = get_ptr(acc, "acc");
    if (ctxp == NULL || propp == NULL || accp == NULL)
        return NULL;
    PyObject *ref = PyWeakref_NewRef(driver, NULL);
    if (ref == NULL)
        return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(tp, Py_tp_alloc);
    Fast *f = (Fast *)alloc(tp, 0);
    if (f == NULL) {
        Py_DECREF(ref);
        return NULL;
    }
    f->map = (map_fn)p[0];
    f->unmap = (unmap_fn)p[1];
    f->create = (create_fn)p[2];
    f->release = (release_fn)p[3];
    f->access = (access_fn)p[4];
    f->getcur = (getcur_fn)p[5];
    f->sync = (sync_fn)p[6];
    f->iscap = (iscap_fn)p[7];
    f->ctx = ctxp;
    f->prop = propp;
    f->acc = accp;
    f->gran = gran;
    f->hot_lo = f->hot_hi = 0;
    f->next_handle = 1;
    f->physical_bytes = 0;
    Py_INCREF(handles);
    f->handles = handles;
    Py_INCREF(maps);
    f->maps = maps;
    Py_INCREF(Py_None);
    f->capture_check = Py_None;
    f->driver_ref = ref;
    Py_INCREF(htype);
    f->handle_type = htype;
    return (PyObject *)f;
}

static void fast_dealloc(PyObject *self) {
    Fast *f = (Fast *)self;
    Py_XDECREF(f->handles);
    Py_XDECREF(f->maps);
    Py_XDECREF(f->capture_check);
    Py_XDECREF(f->driver_ref);
    Py_XDECREF(f->handle_type);
    PyTypeObject *tp = Py_TYPE(self);
    freefunc free_ = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    free_(self);
    Py_DECREF(tp);
}

/* Call the driver's method `name` with `args` (a new tuple, stolen; NULL passes an error on)
 * and `kw` (a new dict or NULL, stolen). */
static PyObject *to_driver(Fast *f, const char *name, PyObject *args, PyObject *kw) {
    PyObject *out = NULL;
    PyObject *drv = args == NULL ? NULL : PyObject_CallNoArgs(f->driver_ref);
    if (drv == Py_None)
        PyErr_SetString(PyExc_RuntimeError, "the CudaDriver behind this fast path is gone");
    else if (drv != NULL) {
        PyObject *meth = PyObject_GetAttrString(drv, name);
        if (meth != NULL) {
            out = PyObject_Call(meth, args, kw);
            Py_DECREF(meth);
        }
    }
    Py_XDECREF(drv);
    Py_XDECREF(args);
    Py_XDECREF(kw);
    return out;
}

/* The n arguments as a new tuple, or NULL. */
static PyObject *as_tuple(PyObject *const *args, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t i = 0; t != NULL && i < n; i++) {
        Py_INCREF(args[i]);
        PyTuple_SetItem(t, i, args[i]);
    }
    return t;
}

/* The slow path: the driver's Python method, with the call's arguments exactly as they came. */
static PyObject *slow(Fast *f, const char *name, PyObject *const *args, Py_ssize_t n,
                     PyObject *kwnames) {
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_Size(kwnames);
    PyObject *kw = NULL;
    if (nkw) {
        kw = PyDict_New();
        for (Py_ssize_t i = 0; kw != NULL && i < nkw; i++) {
            if (PyDict_SetItem(kw, PyTuple_GetItem(kwnames, i), args[n + i]) < 0)
                Py_CLEAR(kw);
        }
        if (kw == NULL)
            return NULL;
    }
    return to_driver(f, name, as_tuple(args, n), kw);
}

#define HAS_KW(kwnames) ((kwnames) != NULL && PyTuple_Size(kwnames) > 0)

/* A CUDA call failed: the driver raises the DriverError (CUDA's name, the arguments). */
static PyObject *failed(Fast *f, const char *call, const char *fn, PyObject *const *args,
                        Py_ssize_t n, cu_result err) {
    PyObject *a = as_tuple(args, n);
    if (a == NULL)
        return NULL;
    PyObject *out =
        to_driver(f, "_fast_failed", Py_BuildValue("(ssNi)", call, fn, a, (int)err), NULL);
    if (out != NULL) {
        Py_DECREF(out);
        PyErr_Format(PyExc_RuntimeError, "%s failed with CUDA error %d", fn, (int)err);
    }
    return NULL;
}

static Handle *as_handle(Fast *f, PyObject *o) {
    if (o == NULL || (PyObject *)Py_TYPE(o) != f->handle_type)
        return NULL;
    return (Handle *)o;
}

/* map(va, size, handle) */
static PyObject *fast_map(PyObject *self, PyObject *const *args, Py_ssize_t n,
                          PyObject *kwnames) {
    Fast *f = (Fast *)self;
    u64 va, size;
    if (n != 3 || HAS_KW(kwnames) || !get_u64(args[0], &va) || !get_u64(args[1], &size) ||
        !PyLong_CheckExact(args[2]))
        return slow(f, "_py_map", args, n, kwnames);
    Handle *h = as_handle(f, PyDict_GetItemWithError(f->handles, args[2]));
    if (h == NULL) {
        PyErr_Clear();
        return slow(f, "_py_map", args, n, kwnames);
    }
    if ((u64)h->size != size || va < f->hot_lo || va + size > f->hot_hi || va + size < va ||
        va % f->gran)
        return slow(f, "_py_map", args, n, kwnames);
    Py_INCREF((PyObject *)h);
    /* The GIL stays held (a few us): no other thread can release the handle or map over
     * this VA between the checks above and the record below. */
    cu_result err = f->map(va, (size_t)size, 0, h->raw, 0);
    if (err) {
        Py_DECREF((PyObject *)h);
        return failed(f, "map", "cuMemMap", args, n, err);
    }
    if (PyDict_SetItem(f->maps, args[0], (PyObject *)h) < 0) {
        /* Out of memory for the record: undo the map so nothing is left unaccounted. */
        f->unmap(va, (size_t)size);
        Py_DECREF((PyObject *)h);
        return NULL;
    }
    h->maps++;
    Py_DECREF((PyObject *)h);
    Py_RETURN_NONE;
}

/* unmap(va, size): one whole mapping of a live handle, no capture seen, our context current. */
static PyObject *fast_unmap(PyObject *self, PyObject *const *args, Py_ssize_t n,
                            PyObject *kwnames) {
    Fast *f = (Fast *)self;
    u64 va, size;
    if (n != 2 || HAS_KW(kwnames) || !get_u64(args[0], &va) || !get_u64(args[1], &size) ||
        f->capture_check == Py_None)
        return slow(f, "_py_unmap", args, n, kwnames);
    Handle *h = as_handle(f, PyDict_GetItemWithError(f->maps, args[0]));
    if (h == NULL) {
        PyErr_Clear();
        return slow(f, "_py_unmap", args, n, kwnames);
    }
    if ((u64)h->size != size || !h->live || h->imported)
        return slow(f, "_py_unmap", args, n, kwnames);
    /* A synchronize while a stream captures would invalidate the capture: look first.
     * capture_check answers torch's current stream on this device, as a raw pointer, or
     * (older torch) whether a capture is underway; anything doubtful goes to Python. */
    PyObject *check = f->capture_check;
    Py_INCREF(check); /* Python may replace it while it runs */
    PyObject *cap = PyObject_CallNoArgs(check);
    Py_DECREF(check);
    if (cap == NULL)
        return NULL;
    int capturing = 1;
    u64 stream;
    if (PyBool_Check(cap)) {
        capturing = cap == Py_True;
    } else if (get_u64(cap, &stream)) {
        int st = 0;
        capturing = f->iscap((void *)(uintptr_t)stream, &st) != 0 || st != 0;
    }
    Py_DECREF(cap);
    if (capturing)
        return slow(f, "_py_unmap", args, n, kwnames);
    int status = 0;
    void *cur = NULL;
    if (f->iscap(CU_STREAM_LEGACY, &status) != 0 || status != 0 || f->getcur(&cur) != 0 ||
        cur != f->ctx)
        return slow(f, "_py_unmap", args, n, kwnames);
    Py_INCREF((PyObject *)h);
    /* Out of the book before the GIL goes: no other thread can unmap it too. */
    if (PyDict_DelItem(f->maps, args[0]) < 0) {
        Py_DECREF((PyObject *)h);
        return NULL;
    }
    cu_result serr, err = 0;
    Py_BEGIN_ALLOW_THREADS
    serr = f->sync();
    if (!serr)
        err = f->unmap(va, (size_t)size);
    Py_END_ALLOW_THREADS
    if (serr || err) {
        /* Nothing was unmapped: the mapping goes back in the book. */
        int bad = PyDict_SetItem(f->maps, args[0], (PyObject *)h);
        Py_DECREF((PyObject *)h);
        if (bad < 0)
            return NULL;
        if (serr)
            return failed(f, "unmap", "cuCtxSynchronize", args, n, serr);
        return failed(f, "unmap", "cuMemUnmap", args, n, err);
    }
    h->maps--;
    Py_DECREF((PyObject *)h);
    Py_RETURN_NONE;
}

/* create(size) -> handle id */
static PyObject *fast_create(PyObject *self, PyObject *const *args, Py_ssize_t n,
                             PyObject *kwnames) {
    Fast *f = (Fast *)self;
    u64 size;
    if (n != 1 || HAS_KW(kwnames) || !get_u64(args[0], &size) || size == 0 || size % f->gran ||
        size > (u64)LLONG_MAX)
        return slow(f, "_py_create", args, n, kwnames);
    u64 raw = 0;
    cu_result err;
    Py_BEGIN_ALLOW_THREADS
    err = f->create(&raw, (size_t)size, f->prop, 0);
    Py_END_ALLOW_THREADS
    if (err)
        return failed(f, "create", "cuMemCreate", args, n, err);
    allocfunc alloc = (allocfunc)PyType_GetSlot((PyTypeObject *)f->handle_type, Py_tp_alloc);
    Handle *h = (Handle *)alloc((PyTypeObject *)f->handle_type, 0);
    if (h != NULL) {
        h->raw = raw;
        h->size = (long long)size;
        h->maps = 0;
        h->live = 1;
        h->imported = 0;
    }
    PyObject *key = h == NULL ? NULL : PyLong_FromLongLong(f->next_handle);
    if (key == NULL || PyDict_SetItem(f->handles, key, (PyObject *)h) < 0) {
        /* No record, no handle: give the memory back rather than leak it. */
        Py_XDECREF(key);
        Py_XDECREF((PyObject *)h);
        Py_BEGIN_ALLOW_THREADS
        f->release(raw);
        Py_END_ALLOW_THREADS
        return NULL;
    }
    Py_DECREF((PyObject *)h);
    f->next_handle++;
    f->physical_bytes += (long long)size;
    return key;
}

/* release(handle) */
static PyObject *fast_release(PyObject *self, PyObject *const *args, Py_ssize_t n,
                              PyObject *kwnames) {
    Fast *f = (Fast *)self;
    if (n != 1 || HAS_KW(kwnames) || !PyLong_CheckExact(args[0]))
        return slow(f, "_py_release", args, n, kwnames);
    Handle *h = as_handle(f, PyDict_GetItemWithError(f->handles, args[0]));
    if (h == NULL) {
        PyErr_Clear();
        return slow(f, "_py_release", args, n, kwnames);
    }
    Py_INCREF((PyObject *)h);
    /* Out of the book before the GIL goes: no other thread can release or map it now. */
    if (PyDict_DelItem(f->handles, args[0]) < 0) {
        Py_DECREF((PyObject *)h);
        return NULL;
    }
    cu_result err;
    u64 raw = h->raw;
    Py_BEGIN_ALLOW_THREADS
    err = f->release(raw);
    Py_END_ALLOW_THREADS
    if (err) {
        int bad = PyDict_SetItem(f->handles, args[0], (PyObject *)h); /* still live */
        Py_DECREF((PyObject *)h);
        if (bad < 0)
            return NULL;
        return failed(f, "release", "cuMemRelease", args, n, err);
    }
    h->live = 0;
    if (!h->maps && !h->imported)
        f->physical_bytes -= h->size;
    Py_DECREF((PyObject *)h);
    Py_RETURN_NONE;
}

/* set_access(va, size[, devices]): the own-device case of one whole mapping. */
static PyObject *fast_set_access(PyObject *self, PyObject *const *args, Py_ssize_t n,
                                 PyObject *kwnames) {
    Fast *f = (Fast *)self;
    u64 va, size;
    if (n != 2 || HAS_KW(kwnames) || !get_u64(args[0], &va) || !get_u64(args[1], &size))
        return slow(f, "_py_set_access", args, n, kwnames);
    Handle *h = as_handle(f, PyDict_GetItemWithError(f->maps, args[0]));
    if (h == NULL) {
        PyErr_Clear();
        return slow(f, "_py_set_access", args, n, kwnames);
    }
    if ((u64)h->size != size)
        return slow(f, "_py_set_access", args, n, kwnames);
    cu_result err;
    Py_BEGIN_ALLOW_THREADS
    err = f->access(va, (size_t)size, f->acc, 1);
    Py_END_ALLOW_THREADS
    if (err)
        return failed(f, "set_access", "cuMemSetAccess", args, n, err);
    Py_RETURN_NONE;
}

#define FAST_METHOD(name, fn, doc) \
    {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL | METH_KEYWORDS, doc}

static PyMethodDef fast_methods[] = {
    FAST_METHOD("map", fast_map, "map(va, size, handle)"),
    FAST_METHOD("unmap", fast_unmap, "unmap(va, size)"),
    FAST_METHOD("create", fast_create, "create(size) -> handle"),
    FAST_METHOD("release", fast_release, "release(handle)"),
    FAST_METHOD("set_access", fast_set_access, "set_access(va, size, devices=None)"),
    {NULL, NULL, 0, NULL},
};

static PyType_Slot fast_slots[] = {
    {Py_tp_new, (void *)fast_new},
    {Py_tp_dealloc, (void *)fast_dealloc},
    {Py_tp_members, fast_members},
    {Py_tp_methods, fast_methods},
    {Py_tp_doc, "CudaDriver's hot calls in C, over the driver's own dicts."},
    {0, NULL},
};

static PyType_Spec fast_spec = {
    "kvvmm.driver._cudafast.Fast", sizeof(Fast), 0, Py_TPFLAGS_DEFAULT, fast_slots,
};

/* ---------------------------------------------------------------- module */

static int module_exec(PyObject *m) {
    PyObject *ht = PyType_FromSpec(&handle_spec);
    if (ht == NULL || PyModule_AddObject(m, "Handle", ht) < 0) {
        Py_XDECREF(ht);
        return -1;
    }
    PyObject *ft = PyType_FromSpec(&fast_spec);
    if (ft == NULL || PyModule_AddObject(m, "Fast", ft) < 0) {
        Py_XDECREF(ft);
        return -1;
    }
    return PyModule_AddIntConstant(m, "ABI", 1);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, (void *)module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_cudafast", "CudaDriver's hot calls in C.", 0, NULL, module_slots,
    NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cudafast(void) { return PyModuleDef_Init(&module_def); }
