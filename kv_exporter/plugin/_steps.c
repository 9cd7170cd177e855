/* The step record's writer: how many sequences each step of a model runner runs, written into the worker's mapped
 * record (kv_exporter/steprecord.py describes the layout and the protocol; this file writes exactly that).
 *
 * Why C: it runs on every step of the engine. A `StepWrapper` is put on the runner instance in place of its bound
 * `execute_model`; a call reads `len(scheduler_output.num_scheduled_tokens)`, the coarse monotonic clock (the vDSO:
 * no system call) and writes a few words into shared memory, then calls the method with the same arguments
 * (vectorcall: no tuple, no dict) and writes a few more when it returns. No allocation, no system call, no lock: the
 * GIL makes every writer of one record the only one while it writes.
 *
 * What the engine is promised: the wrapper never raises (a count it cannot read is written as unknown and counted),
 * returns what the method returns and raises what it raises, untouched. A call with `dummy_run=True` (Model Runner
 * V2's warm-up and data-parallel padding) runs no request: it passes straight through. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the step record is little-endian (kv_exporter/steprecord.py)"
#endif

#define RECORD_VERSION 1
#define BUCKET_COUNT 128
#define BUCKET_NS 1000000000LL
#define UNKNOWN UINT64_MAX

typedef struct {
    char magic[8];
    uint32_t version, header_bytes, bucket_count, zero;
    uint64_t bucket_ns;
    int64_t pid, start_time_ticks;
    uint64_t seq, steps, finished, latest;
    int64_t latest_started_ns, latest_finished_ns;
    uint64_t unreadable;
    char reserved[24];
} Header;

typedef struct {
    int64_t index;
    uint64_t most;
} Bucket;

typedef struct {
    Header header;
    Bucket buckets[BUCKET_COUNT];
} Layout;

_Static_assert(sizeof(Header) == 128, "the header is 128 bytes");
_Static_assert(sizeof(Layout) == 128 + 16 * BUCKET_COUNT, "the record's size");

#define STORE(field, value) __atomic_store_n(&(field), (value), __ATOMIC_RELAXED)

static PyObject *s_num_scheduled_tokens, *s_scheduler_output, *s_dummy_run;

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* -- Record: the mapped file, held through the buffer protocol ---------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    Layout *layout; /* NULL once closed */
} Record;

static void write_begin(Layout *r) {
    uint64_t seq = r->header.seq;
    STORE(r->header.seq, seq + 1);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static void write_end(Layout *r) {
    __atomic_store_n(&r->header.seq, r->header.seq + 1, __ATOMIC_RELEASE);
}

static void bucket(Layout *r, int64_t now, uint64_t count) {
    int64_t index = now / BUCKET_NS;
    Bucket *b = &r->buckets[index % BUCKET_COUNT];
    if (b->index != index) {
        STORE(b->index, index);
        STORE(b->most, count);
    } else if (count > b->most) {
        STORE(b->most, count);
    }
}

static void step_begins(Layout *r, uint64_t count) {
    int64_t now = now_ns();
    write_begin(r);
    STORE(r->header.steps, r->header.steps + 1);
    STORE(r->header.latest, count);
    STORE(r->header.latest_started_ns, now);
    if (count == UNKNOWN)
        STORE(r->header.unreadable, r->header.unreadable + 1);
    else
        bucket(r, now, count);
    write_end(r);
}

static void step_ends(Layout *r) {
    int64_t now = now_ns();
    write_begin(r);
    STORE(r->header.finished, r->header.finished + 1);
    STORE(r->header.latest_finished_ns, now);
    if (r->header.latest != UNKNOWN)
        bucket(r, now, r->header.latest);
    write_end(r);
}

static int Record_init(Record *self, PyObject *args, PyObject *kwds) {
    PyObject *target;
    static char *keywords[] = {"buffer", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Record", keywords, &target))
        return -1;
    if (self->layout != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Record is initialised once");
        return -1;
    }
    if (PyObject_GetBuffer(target, &self->view, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0)
        return -1;
    Layout *r = (Layout *)self->view.buf;
    if (self->view.len != (Py_ssize_t)sizeof(Layout) || ((uintptr_t)r & 7) != 0 ||
        memcmp(r->header.magic, "KVXSTEPS", 8) != 0 || r->header.version != RECORD_VERSION ||
        r->header.header_bytes != sizeof(Header) || r->header.bucket_count != BUCKET_COUNT ||
        r->header.bucket_ns != (uint64_t)BUCKET_NS) {
        PyBuffer_Release(&self->view);
        PyErr_SetString(PyExc_ValueError, "not a version 1 step record (kv_exporter/steprecord.py)");
        return -1;
    }
    self->layout = r;
    return 0;
}

static PyObject *Record_close(Record *self, PyObject *unused) {
    if (self->layout != NULL) {
        self->layout = NULL;
        PyBuffer_Release(&self->view);
    }
    Py_RETURN_NONE;
}

static PyObject *Record_begin(Record *self, PyObject *count) {
    if (self->layout == NULL)
        Py_RETURN_NONE;
    uint64_t value = UNKNOWN;
    if (count != Py_None) {
        value = PyLong_AsUnsignedLongLong(count);
        if (value == (uint64_t)-1 && PyErr_Occurred())
            return NULL;
    }
    step_begins(self->layout, value);
    Py_RETURN_NONE;
}

static PyObject *Record_end(Record *self, PyObject *unused) {
    if (self->layout != NULL)
        step_ends(self->layout);
    Py_RETURN_NONE;
}

static PyObject *Record_closed(Record *self, void *unused) { return PyBool_FromLong(self->layout == NULL); }

static void Record_dealloc(Record *self) {
    if (self->layout != NULL)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Record_methods[] = {
    {"begin", (PyCFunction)Record_begin, METH_O, "Write a step beginning with `count` sequences (None: unknown)."},
    {"end", (PyCFunction)Record_end, METH_NOARGS, "Write the latest step's end."},
    {"close", (PyCFunction)Record_close, METH_NOARGS, "Stop writing and release the buffer (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Record_getset[] = {
    {"closed", (getter)Record_closed, NULL, "Whether writes go nowhere.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RecordType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kv_exporter.plugin._steps.Record",
    .tp_basicsize = sizeof(Record),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A step record mapped writable: Record(buffer).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Record_init,
    .tp_dealloc = (destructor)Record_dealloc,
    .tp_methods = Record_methods,
    .tp_getset = Record_getset,
};

/* -- StepWrapper: a runner's bound execute_model, recording each step ---------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *wrapped; /* the bound method */
    Record *record;
    vectorcallfunc vectorcall;
} StepWrapper;

static int keyword(PyObject *kwnames, PyObject *name, Py_ssize_t *at) {
    Py_ssize_t n = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *given = PyTuple_GET_ITEM(kwnames, i);
        if (given == name || PyUnicode_Compare(given, name) == 0) {
            *at = i;
            return 1;
        }
    }
    return 0;
}

/* The step's sequences: len(scheduler_output.num_scheduled_tokens); UNKNOWN where that cannot be read. */
static uint64_t sequences(PyObject *scheduler_output) {
    PyObject *scheduled = PyObject_GetAttr(scheduler_output, s_num_scheduled_tokens);
    if (scheduled == NULL) {
        PyErr_Clear();
        return UNKNOWN;
    }
    Py_ssize_t n = PyDict_CheckExact(scheduled) ? PyDict_GET_SIZE(scheduled) : PyObject_Size(scheduled);
    Py_DECREF(scheduled);
    if (n < 0) {
        PyErr_Clear();
        return UNKNOWN;
    }
    return (uint64_t)n;
}

static PyObject *StepWrapper_vectorcall(StepWrapper *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Layout *r = self->record->layout;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *scheduler_output = nargs > 0 ? args[0] : NULL;
    if (r != NULL && kwnames != NULL) {
        Py_ssize_t at;
        if (scheduler_output == NULL && keyword(kwnames, s_scheduler_output, &at))
            scheduler_output = args[nargs + at];
        if (keyword(kwnames, s_dummy_run, &at)) {
            int dummy = PyObject_IsTrue(args[nargs + at]);
            if (dummy != 0) {
                if (dummy < 0)
                    PyErr_Clear();
                r = NULL; /* no request runs in it */
            }
        }
    }
    if (r == NULL)
        return PyObject_Vectorcall(self->wrapped, args, nargsf, kwnames);
    step_begins(r, scheduler_output == NULL ? UNKNOWN : sequences(scheduler_output));
    PyObject *result = PyObject_Vectorcall(self->wrapped, args, nargsf, kwnames);
    if (self->record->layout == r) /* not closed meanwhile (a fork's child closes its copies) */
        step_ends(r);
    return result;
}

static PyObject *StepWrapper_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *wrapped;
    Record *record;
    static char *keywords[] = {"method", "record", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!:StepWrapper", keywords, &wrapped, &RecordType, &record))
        return NULL;
    if (!PyCallable_Check(wrapped)) {
        PyErr_SetString(PyExc_TypeError, "StepWrapper wraps a callable");
        return NULL;
    }
    StepWrapper *self = (StepWrapper *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->wrapped = Py_NewRef(wrapped);
    self->record = (Record *)Py_NewRef(record);
    self->vectorcall = (vectorcallfunc)StepWrapper_vectorcall;
    return (PyObject *)self;
}

/* Anything else is the wrapped method's: __name__, __self__, __func__, __doc__, ... */
static PyObject *StepWrapper_getattro(StepWrapper *self, PyObject *name) {
    PyObject *found = PyObject_GenericGetAttr((PyObject *)self, name);
    if (found != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return found;
    PyErr_Clear();
    return PyObject_GetAttr(self->wrapped, name);
}

static PyObject *StepWrapper_repr(StepWrapper *self) {
    return PyUnicode_FromFormat("<kv-exporter step record around %R>", self->wrapped);
}

static int StepWrapper_traverse(StepWrapper *self, visitproc visit, void *arg) {
    Py_VISIT(self->wrapped);
    Py_VISIT(self->record);
    return 0;
}

static int StepWrapper_clear(StepWrapper *self) {
    Py_CLEAR(self->wrapped);
    Py_CLEAR(self->record);
    return 0;
}

static void StepWrapper_dealloc(StepWrapper *self) {
    PyObject_GC_UnTrack(self);
    StepWrapper_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef StepWrapper_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(StepWrapper, wrapped), READONLY, "The bound method it calls."},
    {"record", T_OBJECT, offsetof(StepWrapper, record), READONLY, "The record it writes."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject StepWrapperType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kv_exporter.plugin._steps.StepWrapper",
    .tp_basicsize = sizeof(StepWrapper),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "StepWrapper(method, record): calls method, writing each step's sequences into record.",
    .tp_new = StepWrapper_new,
    .tp_dealloc = (destructor)StepWrapper_dealloc,
    .tp_traverse = (traverseproc)StepWrapper_traverse,
    .tp_clear = (inquiry)StepWrapper_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(StepWrapper, vectorcall),
    .tp_getattro = (getattrofunc)StepWrapper_getattro,
    .tp_repr = (reprfunc)StepWrapper_repr,
    .tp_members = StepWrapper_members,
};

static struct PyModuleDef steps_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kv_exporter.plugin._steps",
    .m_doc = "The step record's writer (kv_exporter/steprecord.py).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__steps(void) {
    s_num_scheduled_tokens = PyUnicode_InternFromString("num_scheduled_tokens");
    s_scheduler_output = PyUnicode_InternFromString("scheduler_output");
    s_dummy_run = PyUnicode_InternFromString("dummy_run");
    if (s_num_scheduled_tokens == NULL || s_scheduler_output == NULL || s_dummy_run == NULL)
        return NULL;
    if (PyType_Ready(&RecordType) < 0 || PyType_Ready(&StepWrapperType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&steps_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddIntConstant(module, "VERSION", RECORD_VERSION) < 0 ||
        PyModule_AddIntConstant(module, "BUCKET_COUNT", BUCKET_COUNT) < 0 ||
        PyModule_AddObjectRef(module, "Record", (PyObject *)&RecordType) < 0 ||
        PyModule_AddObjectRef(module, "StepWrapper", (PyObject *)&StepWrapperType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
