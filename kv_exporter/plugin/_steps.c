/* The step record's writer: how many sequences each step of a model runner runs, written into the worker's mapped
 * record (kv_exporter/steprecord.py describes the layout and the protocol; this file writes exactly that).
 *
 * Why C: it runs on every step of the engine. A `StepWrapper` is put on the runner instance in place of its bound
 * `execute_model`; a call reads `len(scheduler_output.num_scheduled_tokens)`, the coarse monotonic clock (the vDSO:
 * no system call) and writes a few words into shared memory, then calls the method with the same arguments (the
 * call's own tuple and dict, passed on as they came) and writes a few more when it returns. No allocation of its own,
 * no system call, no lock: the GIL makes every writer of one record the only one while it writes.
 *
 * Written against CPython's limited API of 3.10 (one abi3 build serves 3.10 and later): heap types from specs, and
 * tp_call rather than vectorcall (not limited before 3.12), which costs the interpreter a tuple for the arguments
 * (tens of nanoseconds; bench/micro_step_record.py). The buffer protocol is not limited before 3.11 either: the
 * record's memory is reached once, when a Record is made, through ctypes (`c_char.from_buffer`, which holds the
 * buffer exported until the Record is closed, as a Py_buffer held it), and each step writes through the address.
 *
 * What the engine is promised: the wrapper never raises (a count it cannot read is written as unknown and counted),
 * returns what the method returns and raises what it raises, untouched. A call with `dummy_run=True` (Model Runner
 * V2's warm-up and data-parallel padding) runs no request: it passes straight through. */

#define Py_LIMITED_API 0x030A0000
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

/* -- Record: the mapped file, held exported through ctypes ------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *keeper; /* a ctypes array over the buffer, which holds it exported; NULL once closed */
    Layout *layout;   /* NULL once closed */
} Record;

static PyObject *RecordType, *StepWrapperType;
static PyObject *record_array, *addressof; /* ctypes.c_char * sizeof(Layout), ctypes.addressof: on first use */

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

/* ctypes, once per process: what the record's address is read through (the buffer protocol is not limited in 3.10). */
static int load_ctypes(void) {
    if (record_array != NULL)
        return 0;
    PyObject *ctypes = PyImport_ImportModule("ctypes");
    if (ctypes == NULL)
        return -1;
    PyObject *c_char = PyObject_GetAttrString(ctypes, "c_char");
    PyObject *size = PyLong_FromSize_t(sizeof(Layout));
    PyObject *array = c_char != NULL && size != NULL ? PyNumber_Multiply(c_char, size) : NULL;
    PyObject *address = array != NULL ? PyObject_GetAttrString(ctypes, "addressof") : NULL;
    Py_XDECREF(size);
    Py_XDECREF(c_char);
    Py_DECREF(ctypes);
    if (address == NULL) {
        Py_XDECREF(array);
        return -1;
    }
    record_array = array;
    addressof = address;
    return 0;
}

/* What the buffer protocol's PyBUF_WRITABLE | PyBUF_SIMPLE request refused, refused here before ctypes is asked, with
 * the same errors (TypeError: no buffer; BufferError: read-only or not contiguous); its length, or -1. */
static Py_ssize_t writable_length(PyObject *target) {
    PyObject *view = PyMemoryView_FromObject(target);
    if (view == NULL)
        return -1;
    PyObject *readonly = PyObject_GetAttrString(view, "readonly");
    PyObject *contiguous = readonly != NULL ? PyObject_GetAttrString(view, "c_contiguous") : NULL;
    PyObject *nbytes = contiguous != NULL ? PyObject_GetAttrString(view, "nbytes") : NULL;
    PyObject *released = nbytes != NULL ? PyObject_CallMethod(view, "release", NULL) : NULL;
    Py_DECREF(view);
    Py_ssize_t length = -1;
    if (released == NULL)
        ;
    else if (readonly != Py_True && contiguous == Py_True)
        length = PyLong_AsSsize_t(nbytes);
    else
        PyErr_SetString(PyExc_BufferError,
                        readonly == Py_True ? "Object is not writable." : "a step record is one contiguous buffer");
    Py_XDECREF(released);
    Py_XDECREF(nbytes);
    Py_XDECREF(contiguous);
    Py_XDECREF(readonly);
    return length;
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
    Py_ssize_t length = writable_length(target);
    if (length < 0)
        return -1;
    if (length != (Py_ssize_t)sizeof(Layout)) {
        PyErr_SetString(PyExc_ValueError, "not a version 1 step record (kv_exporter/steprecord.py)");
        return -1;
    }
    if (load_ctypes() < 0)
        return -1;
    /* (c_char * size).from_buffer(target): the array holds target's buffer exported (an mmap cannot be closed nor a
     * bytearray resized under it) until it goes, when this Record is closed or goes. */
    PyObject *keeper = PyObject_CallMethod(record_array, "from_buffer", "O", target);
    if (keeper == NULL)
        return -1;
    PyObject *address = PyObject_CallFunctionObjArgs(addressof, keeper, NULL);
    Layout *r = address != NULL ? (Layout *)PyLong_AsVoidPtr(address) : NULL;
    Py_XDECREF(address);
    if (r == NULL) {
        Py_DECREF(keeper);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a step record at address 0");
        return -1;
    }
    if (((uintptr_t)r & 7) != 0 || memcmp(r->header.magic, "KVXSTEPS", 8) != 0 ||
        r->header.version != RECORD_VERSION || r->header.header_bytes != sizeof(Header) ||
        r->header.bucket_count != BUCKET_COUNT || r->header.bucket_ns != (uint64_t)BUCKET_NS) {
        Py_DECREF(keeper);
        PyErr_SetString(PyExc_ValueError, "not a version 1 step record (kv_exporter/steprecord.py)");
        return -1;
    }
    self->keeper = keeper;
    self->layout = r;
    return 0;
}

static PyObject *Record_close(Record *self, PyObject *unused) {
    self->layout = NULL;
    Py_CLEAR(self->keeper); /* releases the buffer */
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
    PyTypeObject *type = Py_TYPE(self);
    self->layout = NULL;
    Py_CLEAR(self->keeper);
    freefunc free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free(self);
    Py_DECREF(type); /* a heap type's instance holds its type */
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

static PyType_Slot Record_slots[] = {
    {Py_tp_doc, (void *)"A step record mapped writable: Record(buffer)."},
    {Py_tp_new, (void *)PyType_GenericNew},
    {Py_tp_init, (void *)Record_init},
    {Py_tp_dealloc, (void *)Record_dealloc},
    {Py_tp_methods, Record_methods},
    {Py_tp_getset, Record_getset},
    {0, NULL},
};

static PyType_Spec Record_spec = {
    .name = "kv_exporter.plugin._steps.Record",
    .basicsize = sizeof(Record),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Record_slots,
};

/* -- StepWrapper: a runner's bound execute_model, recording each step ---------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *wrapped; /* the bound method */
    Record *record;
} StepWrapper;

/* The step's sequences: len(scheduler_output.num_scheduled_tokens); UNKNOWN where that cannot be read. */
static uint64_t sequences(PyObject *scheduler_output) {
    PyObject *scheduled = PyObject_GetAttr(scheduler_output, s_num_scheduled_tokens);
    if (scheduled == NULL) {
        PyErr_Clear();
        return UNKNOWN;
    }
    Py_ssize_t n = PyDict_CheckExact(scheduled) ? PyDict_Size(scheduled) : PyObject_Size(scheduled);
    Py_DECREF(scheduled);
    if (n < 0) {
        PyErr_Clear();
        return UNKNOWN;
    }
    return (uint64_t)n;
}

/* A keyword's value (borrowed), or NULL; never an error (a key that cannot be compared is not the keyword). */
static PyObject *keyword(PyObject *kwargs, PyObject *name) {
    PyObject *value = PyDict_GetItemWithError(kwargs, name);
    if (value == NULL)
        PyErr_Clear();
    return value;
}

/* tp_call, not vectorcall (limited only from 3.12): the interpreter has made the call's arguments a tuple (and its
 * keywords a dict), and they are passed on as they came. */
static PyObject *StepWrapper_call(StepWrapper *self, PyObject *args, PyObject *kwargs) {
    Layout *r = self->record->layout;
    if (r == NULL)
        return PyObject_Call(self->wrapped, args, kwargs);
    PyObject *scheduler_output = PyTuple_Size(args) > 0 ? PyTuple_GetItem(args, 0) : NULL;
    if (kwargs != NULL) {
        if (scheduler_output == NULL)
            scheduler_output = keyword(kwargs, s_scheduler_output);
        PyObject *dummy_run = keyword(kwargs, s_dummy_run);
        if (dummy_run != NULL) {
            int dummy = PyObject_IsTrue(dummy_run);
            if (dummy != 0) {
                if (dummy < 0)
                    PyErr_Clear();
                return PyObject_Call(self->wrapped, args, kwargs); /* no request runs in it */
            }
        }
    }
    uint64_t count = UNKNOWN;
    if (scheduler_output != NULL) {
        Py_INCREF(scheduler_output); /* borrowed from kwargs, which the attribute's code could change */
        count = sequences(scheduler_output);
        Py_DECREF(scheduler_output);
    }
    if (self->record->layout != r) /* closed by the attribute's code (a fork's child closes its copies) */
        return PyObject_Call(self->wrapped, args, kwargs);
    step_begins(r, count);
    PyObject *result = PyObject_Call(self->wrapped, args, kwargs);
    if (self->record->layout == r) /* not closed meanwhile (a fork's child closes its copies) */
        step_ends(r);
    return result;
}

static PyObject *StepWrapper_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *wrapped;
    Record *record;
    static char *keywords[] = {"method", "record", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!:StepWrapper", keywords, &wrapped, (PyTypeObject *)RecordType,
                                     &record))
        return NULL;
    if (!PyCallable_Check(wrapped)) {
        PyErr_SetString(PyExc_TypeError, "StepWrapper wraps a callable");
        return NULL;
    }
    StepWrapper *self = (StepWrapper *)PyType_GenericAlloc(type, 0);
    if (self == NULL)
        return NULL;
    self->wrapped = Py_NewRef(wrapped);
    self->record = (Record *)Py_NewRef(record);
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
    Py_VISIT(Py_TYPE(self)); /* a heap type's instance holds its type */
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
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    StepWrapper_clear(self);
    freefunc free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free(self);
    Py_DECREF(type);
}

static PyMemberDef StepWrapper_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(StepWrapper, wrapped), READONLY, "The bound method it calls."},
    {"record", T_OBJECT, offsetof(StepWrapper, record), READONLY, "The record it writes."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot StepWrapper_slots[] = {
    {Py_tp_doc, (void *)"StepWrapper(method, record): calls method, writing each step's sequences into record."},
    {Py_tp_new, (void *)StepWrapper_new},
    {Py_tp_dealloc, (void *)StepWrapper_dealloc},
    {Py_tp_traverse, (void *)StepWrapper_traverse},
    {Py_tp_clear, (void *)StepWrapper_clear},
    {Py_tp_call, (void *)StepWrapper_call},
    {Py_tp_getattro, (void *)StepWrapper_getattro},
    {Py_tp_repr, (void *)StepWrapper_repr},
    {Py_tp_members, StepWrapper_members},
    {0, NULL},
};

static PyType_Spec StepWrapper_spec = {
    .name = "kv_exporter.plugin._steps.StepWrapper",
    .basicsize = sizeof(StepWrapper),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = StepWrapper_slots,
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
    if (RecordType == NULL && (RecordType = PyType_FromSpec(&Record_spec)) == NULL)
        return NULL;
    if (StepWrapperType == NULL && (StepWrapperType = PyType_FromSpec(&StepWrapper_spec)) == NULL)
        return NULL;
    PyObject *module = PyModule_Create(&steps_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddIntConstant(module, "VERSION", RECORD_VERSION) < 0 ||
        PyModule_AddIntConstant(module, "BUCKET_COUNT", BUCKET_COUNT) < 0 ||
        PyModule_AddObjectRef(module, "Record", RecordType) < 0 ||
        PyModule_AddObjectRef(module, "StepWrapper", StepWrapperType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
