/* The ledger of model-local KV held in transformers caches: every live cache (an `Entry`: a weak reference with the
 * cache's owner and the storages it held when last read) and each owner's storage now and the most since the last
 * sample. The per-step half of observation, in C.
 *
 * Why C: the engine's step runs these hooks ~40 times (a cache made, updated, released); written in Python the same
 * accounting cost the decode benchmark 2-3% (docs/decisions/0011-peak-lazy-marks.md), here a small fraction of that.
 * What stays in Python (registry.py) is everything off the step path: which methods are wrapped, the model's map of
 * code to owners, a cache made before the model is known, a declaring ancestor's geometry check. The tracker calls
 * those through its `delegate` (the registry), only where the fast path cannot decide.
 *
 * The accounting (peaks.py says why it is exact): an update only marks its cache; the marked caches are read
 * (`catch_up`) just before anything can fall (a release, a reshaping method) and when a sample asks; a catch-up first
 * gives up what every marked cache dropped and only then takes what they hold now, so an address freed by one and
 * reused by another is never mistaken for the old storage. Each storage is kept once, by data pointer and size, with
 * the number of caches holding it, charged to the owner of the first. A sample reads the owners' totals: its cost
 * does not grow with the caches that did not change.
 *
 * What the engine is promised (docs/observation.md):
 * - Nothing keeps a cache or anything it holds alive: an entry holds a weak reference, never the cache's state. A
 *   cache's last contents are read in its finalizer (`release`, from the `__del__` the registry gives the cache
 *   classes), where it is still whole; the weak reference's callback only forgets a cache whose finalizer never came.
 * - No lock, so nothing for a model thread or a forked child to wait on. Reading a cache goes through instance
 *   dictionaries and torch's own getters, never a property or anything else of the model's code; the ledger is
 *   changed only in commits that call no Python, allocate no Python object and never release the GIL, so each is
 *   atomic for every other thread. A reading is committed only if its cache was not marked again meanwhile (its
 *   `version`), else it stays marked for the next catch-up. A fork happens between two commits, so a child inherits
 *   a consistent ledger.
 * - Never raises into the model: failures are counted (`failures()`), and the sampler reports them. */

#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030A0000 /* one abi3 build serves 3.10 and later (docs/decisions/0027) */
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_tables.h"

/* Why a cache is left out of its owner's figures (observation.UnreadableReason, in this order from 1). */
enum { READABLE = 0, NO_LAYERS, LAYERS_RAISED, NOT_A_TENSOR, NO_STORAGE, NOT_FOLLOWED, REASONS };

/* What an entry follows: a transformers cache, or a tensor another form holds (holders.py): one a known cache
 * class stored, or one in a declaring owner's state. A tensor is read as itself, and released by its weak reference's
 * callback (no finalizer of ours comes for it). */
enum { KIND_CACHE, KIND_STORED, KIND_STATE, KINDS };

/* What reading a cache found. */
enum { READ_OK, READ_UNREADABLE, READ_UNINITIALISED, READ_GONE, READ_FAILED };

static PyObject *s_untyped_storage, *s_nbytes, *s_data_ptr;

/* The attributes a reading looks at, by index. */
enum { A_LAYERS, A_KEYS, A_VALUES, A_SELF_ATTENTION, A_CROSS_ATTENTION, ATTRIBUTES };
static PyObject *s_attribute[ATTRIBUTES];
static PyObject *s_owner_of_shared, *s_modules_on_stack, *s_decide, *s_class_seen, *s_settle;

/* -- Entry: one cache, weakly ------------------------------------------------------------------------------------- */

struct Tracker;

typedef struct {
    PyObject_HEAD
    struct Tracker *tracker;
    PyObject *ref;          /* weak reference to the cache, its callback this entry; NULL once forgotten */
    Py_ssize_t cache_id;
    unsigned long long seq; /* creation order */
    PyObject *owner;        /* str, or None until the model is known */
    PyObject *candidate;    /* a declaring ancestor whose declared memory this may be, until its first storage */
    PyObject *pending;      /* the modules on the creating stack, for a cache made before the model was known */
    Storages held;          /* what it held when last committed, sorted by pointer */
    Py_ssize_t tally;       /* its owner's tally, from its first storage on; -1 before */
    uint64_t version;       /* bumped by every mark: a reading of an older version is not committed */
    char dirty;             /* in the tracker's marked list */
    char live;              /* in the tracker's live table */
    char half;              /* one of an encoder-decoder cache's two halves: counted with that cache */
    char reason;            /* why it cannot be read (READABLE when it can) */
    char kind;              /* KIND_* */
} Entry;

typedef struct {
    Entry **items;
    Py_ssize_t len, cap;
} EntryList; /* strong references */

typedef struct Tracker {
    PyObject_HEAD
    PyObject *delegate;      /* the registry: owner_of_shared, modules_on_stack, decide, class_seen, settle */
    PyObject *unattributed;  /* the owner of a cache made outside the model's modules */
    PyObject *known_classes; /* set: cache and layer classes the delegate has seen (their methods are wrapped) */
    PyObject *unfollowed;    /* set: cache classes whose changes cannot be followed (their caches: NOT_FOLLOWED) */
    PyObject *tensor_type;   /* torch.Tensor */
    Table live;              /* id(cache) -> Entry */
    Table sites;             /* code object address -> Attribution (a tuple) or a shared site (asked of the delegate) */
    Table held;              /* data pointer -> nbytes, holders, tally */
    Table types;             /* a cache's or layer's type -> which attributes it keeps plain (plain_attribute) */
    int model_known;         /* sites describe the model: owners are named at creation */
    char follows_peaks;      /* updates and falls are followed (a T_BOOL member) */
    unsigned long long next_seq;
    EntryList marked;        /* caches that may hold other storages than when last read */
    EntryList gone;          /* caches whose weak reference died since the last sample, finalizer pending */
    EntryList gone_before;   /* those of the sample before: a finalizer still missing will not come */
    Tally *totals;           /* per owner, by tally index */
    Py_ssize_t tallies, tallies_cap;
    PyObject *tally_names;   /* list: tally -> owner */
    PyObject *tally_index;   /* dict: owner -> tally */
    uint64_t requested, served; /* catch-ups a sample asked of whichever thread marks next, and those done */
    uint64_t marks;          /* cache updates seen: a sample waits for the model's thread only while they come */
    int reading;             /* catch-ups in progress in this process (nested ones included) */
    size_t audit_cursor;     /* where the next audit resumes in the live table */
    unsigned long long failures; /* out of memory, or a reading that raised what no rule expects */
    char failure[160];       /* the last one, for the sampler's warning */
} Tracker;

static PyTypeObject *EntryType, *TrackerType, *UpdateHookType; /* heap types, made once at import */

static int entrylist_push(EntryList *l, Entry *e) {
    Entry **items = room_for_one(l->items, l->len, &l->cap, sizeof(Entry *));
    if (items == NULL)
        return -1;
    l->items = items;
    Py_INCREF(e);
    l->items[l->len++] = e;
    return 0;
}

static void entrylist_release(EntryList *l) {
    EntryList taken = *l;
    l->items = NULL;
    l->len = l->cap = 0;
    for (Py_ssize_t i = 0; i < taken.len; i++)
        Py_DECREF(taken.items[i]);
    PyMem_Free(taken.items);
}

/* Counts a failure and keeps its description; clears any exception set. */
static void fail(Tracker *t, const char *where) {
    t->failures++;
    if (PyErr_Occurred()) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyObject *text = value ? PyObject_Repr(value) : NULL;
        const char *utf8 = text ? PyUnicode_AsUTF8AndSize(text, NULL) : NULL;
        snprintf(t->failure, sizeof(t->failure), "%s: %s", where, utf8 ? utf8 : "an error");
        PyErr_Clear();
        Py_XDECREF(text);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
    } else {
        snprintf(t->failure, sizeof(t->failure), "%s: out of memory", where);
    }
}

/* The cache, as a new reference; NULL when it is gone (no exception set). Calls the weak reference (a plain
 * `weakref.ref`, whose call runs no Python): PyWeakref_GetRef is not in 3.10's limited API, and PyWeakref_GetObject is
 * deprecated from 3.13. */
static PyObject *entry_cache(Entry *e) {
    if (e->ref == NULL)
        return NULL;
    PyObject *cache = PyObject_CallNoArgs(e->ref);
    if (cache == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (cache == Py_None) {
        Py_DECREF(cache);
        return NULL;
    }
    return cache;
}

static void mark_entry(Tracker *t, Entry *e) {
    e->version++;
    if (e->dirty || !e->live || e->reason == NOT_FOLLOWED)
        return;
    if (entrylist_push(&t->marked, e) < 0) {
        fail(t, "mark");
        return;
    }
    e->dirty = 1;
}

/* Drops `e` from the live table and breaks its cycle with its weak reference. Calls no Python (a weak reference's
 * deallocation runs none) and allocates nothing. */
static void forget(Tracker *t, Entry *e) {
    e->live = 0;
    Slot *slot = table_find(&t->live, (uintptr_t)e->cache_id);
    if (slot != NULL && slot->object == (PyObject *)e) {
        table_remove(&t->live, slot);
        Py_DECREF(e); /* the table's reference: the caller holds another */
    }
    Py_CLEAR(e->ref);
}

/* -- the ledger: commits call no Python ------------------------------------------------------------------------------ */

static void give_up(Tracker *t, Storage s) { ledger_give_up(&t->held, t->totals, s); }

/* `e` holds `s` from now on; the table has room (table_reserve). */
static void take(Tracker *t, Entry *e, Storage s) { ledger_take(&t->held, t->totals, e->tally, s); }

static void give_up_all(Tracker *t, Entry *e) {
    for (Py_ssize_t k = 0; k < e->held.len; k++)
        give_up(t, e->held.items[k]);
    e->held.len = 0;
}

static void raise_peaks(Tracker *t) {
    for (Py_ssize_t k = 0; k < t->tallies; k++)
        if (t->totals[k].current > t->totals[k].peak)
            t->totals[k].peak = t->totals[k].current;
}

/* `e`'s cache is gone: what it held last goes with it. */
static void commit_release(Tracker *t, Entry *e) {
    give_up_all(t, e);
    storages_free(&e->held);
    forget(t, e);
}

/* Keeps in the marked list only the entries still marked and live; drops the others' references (an entry's
 * deallocation calls no Python). */
static void compact_marked(Tracker *t) {
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; i < t->marked.len; i++) {
        Entry *e = t->marked.items[i];
        if (e->dirty && e->live) {
            t->marked.items[kept++] = e;
        } else {
            e->dirty = 0;
            Py_DECREF(e);
        }
    }
    t->marked.len = kept;
}

/* At a sample: releases, without a last reading, the caches whose weak reference died before the previous sample
 * and whose finalizer has not come since (a class whose `__del__` someone replaced after it was seen). Under a
 * collection the callbacks all run before the finalizers, which may run Python: a whole interval is left to them. */
static void settle_gone(Tracker *t) {
    EntryList gone = t->gone_before;
    t->gone_before = t->gone;
    t->gone.items = NULL;
    t->gone.len = t->gone.cap = 0;
    for (Py_ssize_t i = 0; i < gone.len; i++) {
        if (gone.items[i]->live)
            commit_release(t, gone.items[i]);
    }
    for (Py_ssize_t i = 0; i < gone.len; i++)
        Py_DECREF(gone.items[i]);
    PyMem_Free(gone.items);
}

/* -- reading a cache: Python runs here, and nothing of the ledger is changed -------------------------------------- */

/* A method of the last type it was called on, looked up once (a tensor's storage getters are called ~120 times a
 * step). Where the type's method is a builtin taking no arguments (torch's getters are), its C function is kept and
 * called directly: what the interpreter's call would run once it has checked the instance's type and the argument
 * count, both settled here (the instance is of the very type the method was found on): a tensor's three calls took
 * ~110 ns less, a third, in a decode step (docs/decisions/0028). Another kind of method is called through Python;
 * none: by name. */
typedef struct {
    PyObject *name;
    PyTypeObject *type; /* strong: a freed type's address must not pass for a new one */
    PyObject *method;
    PyCFunction function; /* the method's C function, when it is a builtin's METH_NOARGS one */
} MethodCache;

static MethodCache m_untyped_storage, m_nbytes, m_data_ptr;
static PyTypeObject *function_type; /* types.FunctionType (PyFunction_Check is not in the limited API) */
static PyTypeObject *frame_type;    /* types.FrameType */

/* The C function behind `method` (found on `type`) bound to `self`, when it is a builtin one taking no arguments. */
static PyCFunction noargs_function(PyObject *method, PyObject *self, PyTypeObject *type) {
    descrgetfunc get = (descrgetfunc)PyType_GetSlot(Py_TYPE(method), Py_tp_descr_get);
    PyObject *bound = get ? get(method, self, (PyObject *)type) : NULL;
    PyCFunction function = NULL;
    if (bound != NULL && PyCFunction_Check(bound) && PyCFunction_GetFlags(bound) == METH_NOARGS)
        function = PyCFunction_GetFunction(bound);
    if (bound == NULL)
        PyErr_Clear();
    Py_XDECREF(bound);
    return function;
}

static PyObject *call_method(MethodCache *cache, PyObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    if (type != cache->type) {
        PyObject *method = PyObject_GetAttr((PyObject *)type, cache->name);
        int builtin = method != NULL && PyObject_TypeCheck(method, &PyMethodDescr_Type);
        if (method == NULL)
            PyErr_Clear();
        else if (!builtin && Py_TYPE(method) != function_type)
            Py_CLEAR(method);
        PyObject *old_method = cache->method;
        PyTypeObject *old_type = cache->type;
        cache->method = method;
        cache->type = (PyTypeObject *)Py_NewRef(type);
        cache->function = builtin ? noargs_function(method, self, type) : NULL;
        Py_XDECREF(old_method);
        Py_XDECREF(old_type);
    }
    if (cache->function != NULL)
        return cache->function(self, NULL);
    if (cache->method == NULL)
        return PyObject_CallMethodObjArgs(self, cache->name, NULL);
    return PyObject_CallFunctionObjArgs(cache->method, self, NULL); /* a vectorcall inside: no tuple is made */
}

typedef struct {
    Entry *e;
    uint64_t version; /* the entry's when the reading began */
    int status;       /* READ_* */
    char reason;      /* for READ_UNREADABLE */
    Storages now;     /* for READ_OK */
} Reading;

/* `type`'s own descriptors of a class's MRO and dictionary (`vars(type)['__mro__']` and `['__dict__']`), and their
 * `__get__`s: what a lookup along an MRO reads without `_PyType_Lookup`, which the limited API lacks. */
static PyObject *mro_getter, *dict_getter;
static descrgetfunc mro_get, dict_get;

/* What `_PyType_Lookup(type, name)` finds: the first class along `type`'s MRO whose own dictionary has `name`, its
 * value (a new reference) in `*found`, or NULL; -1 on error (left set). Runs no Python: the MRO and each class's
 * dictionary are read by `type`'s own getters (never a metaclass's), a dictionary keyed by an interned str. */
static int type_lookup(PyTypeObject *type, PyObject *name, PyObject **found) {
    *found = NULL;
    PyObject *mro = mro_get(mro_getter, (PyObject *)type, (PyObject *)&PyType_Type);
    if (mro == NULL)
        return -1;
    Py_ssize_t n = PyTuple_Check(mro) ? PyTuple_Size(mro) : 0; /* None: the type is not ready, nothing is found */
    int status = 0;
    for (Py_ssize_t i = 0; i < n && *found == NULL && status == 0; i++) {
        PyObject *dict = dict_get(dict_getter, PyTuple_GetItem(mro, i), (PyObject *)&PyType_Type); /* a proxy */
        if (dict == NULL) {
            status = -1;
            break;
        }
        *found = PyObject_GetItem(dict, name);
        if (*found == NULL && PyErr_ExceptionMatches(PyExc_KeyError))
            PyErr_Clear();
        else if (*found == NULL)
            status = -1;
        Py_DECREF(dict);
    }
    Py_DECREF(mro);
    return status;
}

/* Whether `type` keeps attribute `which` as a plain instance attribute: the generic attribute lookup, and nothing of
 * that name in its MRO that computes a value (a property, any descriptor with `__get__`). Reading a cache goes
 * through such attributes only: no code of the model's own runs, so a reading in the model's thread (at a release,
 * with whatever locks it holds) cannot wait on anything. The verdict is kept per type (the `types` table: each
 * type's slot holds two bits per attribute, known and plain); a lookup that failed is not kept, and reads nothing. */
static int plain_attribute(Tracker *t, PyTypeObject *type, int which) {
    Slot *slot = table_find(&t->types, (uintptr_t)type);
    int known = 1 << (2 * which), plain = 1 << (2 * which + 1);
    if (slot != NULL && (slot->holders & known))
        return (slot->holders & plain) != 0;
    int verdict = PyType_GetSlot(type, Py_tp_getattro) == (void *)PyObject_GenericGetAttr;
    if (verdict) {
        PyObject *found;
        if (type_lookup(type, s_attribute[which], &found) < 0) {
            fail(t, "a type's attributes");
            return 0;
        }
        verdict = found == NULL || PyType_GetSlot(Py_TYPE(found), Py_tp_descr_get) == NULL;
        Py_XDECREF(found);
    }
    if (slot == NULL && table_reserve(&t->types, t->types.used + 1) == 0) {
        slot = table_slot(&t->types, (uintptr_t)type);
        slot->object = Py_NewRef((PyObject *)type); /* a type's address must not pass for another's */
        slot->holders = 0;
    }
    if (slot != NULL)
        slot->holders |= known | (verdict ? plain : 0);
    return verdict;
}

/* `object`'s plain attribute `which` (a new reference), or NULL (no exception) where it has none it can read. */
static PyObject *plain(Tracker *t, PyObject *object, int which) {
    if (!plain_attribute(t, Py_TYPE(object), which))
        return NULL;
    PyObject *value = PyObject_GenericGetAttr(object, s_attribute[which]);
    if (value == NULL)
        PyErr_Clear();
    return value;
}

/* Adds the storage of one K or V tensor to `r`; -1 with `r` set unreadable or failed. */
static int read_tensor(Tracker *t, PyObject *tensor, Reading *r, PyObject **first) {
    if (tensor == NULL || tensor == Py_None)
        return 0;
    if (!PyObject_TypeCheck(tensor, (PyTypeObject *)t->tensor_type)) {
        r->status = READ_UNREADABLE;
        r->reason = NOT_A_TENSOR;
        return -1;
    }
    PyObject *storage = call_method(&m_untyped_storage, tensor);
    if (storage == NULL) { /* torch's answer for sparse, nested and wrapper tensors */
        int expected = PyErr_ExceptionMatches(PyExc_NotImplementedError) || PyErr_ExceptionMatches(PyExc_RuntimeError);
        r->status = expected ? READ_UNREADABLE : READ_FAILED;
        r->reason = NO_STORAGE;
        if (expected)
            PyErr_Clear();
        return -1;
    }
    PyObject *nbytes = call_method(&m_nbytes, storage);
    long long size = nbytes ? PyLong_AsLongLong(nbytes) : -1;
    Py_XDECREF(nbytes);
    PyObject *pointer = size > 0 ? call_method(&m_data_ptr, storage) : NULL;
    void *address = pointer ? PyLong_AsVoidPtr(pointer) : NULL;
    Py_XDECREF(pointer);
    Py_DECREF(storage);
    if (PyErr_Occurred()) {
        r->status = READ_FAILED;
        return -1;
    }
    if (size <= 0 || address == NULL) /* empty storages all report pointer 0 and hold nothing */
        return 0;
    if (storages_push(&r->now, (uintptr_t)address, (int64_t)size) < 0) {
        r->status = READ_FAILED;
        return -1;
    }
    if (*first == NULL)
        *first = Py_NewRef(tensor);
    return 0;
}

static int see_class(Tracker *t, PyTypeObject *type, int layer);

/* Reads one layer list into `r`. */
static void read_layers(Tracker *t, PyObject *layers, Reading *r, PyObject **first) {
    PyObject *copy = PySequence_Tuple(layers); /* another thread may append a layer while this one reads */
    if (copy == NULL) {
        r->status = READ_FAILED;
        return;
    }
    for (Py_ssize_t i = 0; i < PyTuple_Size(copy) && r->status == READ_OK; i++) {
        PyObject *layer = PyTuple_GetItem(copy, i);
        if (see_class(t, Py_TYPE(layer), 1) < 0)
            fail(t, "a layer class");
        if (layer != Py_None && (!plain_attribute(t, Py_TYPE(layer), A_KEYS) ||
                                 !plain_attribute(t, Py_TYPE(layer), A_VALUES))) {
            r->status = READ_UNREADABLE; /* its K or V is computed by code of its class */
            r->reason = LAYERS_RAISED;
        }
        for (int which = A_KEYS; which <= A_VALUES && r->status == READ_OK; which++) {
            PyObject *tensor = layer == Py_None ? NULL : plain(t, layer, which);
            read_tensor(t, tensor, r, first);
            Py_XDECREF(tensor);
        }
    }
    Py_DECREF(copy);
}

/* An encoder-decoder cache holds no layers of its own: its two halves are caches of their own, counted with it. */
static int read_halves(Tracker *t, PyObject *cache) {
    int found = 0;
    for (int which = A_SELF_ATTENTION; which <= A_CROSS_ATTENTION; which++) {
        PyObject *half = plain(t, cache, which);
        if (half != NULL && half != Py_None) {
            found = 1;
            PyObject *entry = objmap_get(&t->live, (uintptr_t)half);
            if (entry != NULL)
                ((Entry *)entry)->half = 1;
        }
        Py_XDECREF(half);
    }
    return found;
}

/* A cache whose instance dictionary is still empty has not run its `__init__` yet (nor been filled by a copy). */
static int uninitialised(PyObject *cache) {
    PyObject *dict = PyObject_GenericGetDict(cache, NULL);
    int empty = dict != NULL && PyDict_Check(dict) && PyDict_Size(dict) == 0;
    if (dict == NULL)
        PyErr_Clear();
    Py_XDECREF(dict);
    return empty;
}

/* Reads what `cache` (`r->e`'s) holds into `r`, and settles a candidate owner by its first K/V tensor. A cache not
 * initialised yet stays marked, read again at the next catch-up. */
static void read_cache(Tracker *t, PyObject *cache, Reading *r) {
    r->status = READ_OK;
    PyObject *first = NULL;
    PyObject *layers = plain(t, cache, A_LAYERS);
    if (layers != NULL && (PyList_Check(layers) || PyTuple_Check(layers))) {
        read_layers(t, layers, r, &first);
    } else if (!read_halves(t, cache)) {
        r->status = uninitialised(cache) ? READ_UNINITIALISED : READ_UNREADABLE;
        r->reason = NO_LAYERS;
    }
    Py_XDECREF(layers);
    if (r->status == READ_FAILED) {
        fail(t, "reading a cache");
        r->status = READ_UNREADABLE;
        r->reason = LAYERS_RAISED;
    }
    Entry *e = r->e;
    if (r->status == READ_OK && first != NULL && e->candidate != NULL && e->candidate != Py_None) {
        PyObject *decided = PyObject_CallMethodObjArgs(t->delegate, s_decide, (PyObject *)e, cache, first, NULL);
        if (decided == NULL)
            fail(t, "an owner's geometry");
        Py_XDECREF(decided);
    }
    Py_XDECREF(first);
    storages_sort_unique(&r->now);
}

static Py_ssize_t tally_of(Tracker *t, PyObject *owner) {
    PyObject *index = PyDict_GetItemWithError(t->tally_index, owner);
    if (index != NULL)
        return PyLong_AsSsize_t(index);
    if (PyErr_Occurred())
        return -1;
    Tally *totals = room_for_one(t->totals, t->tallies, &t->tallies_cap, sizeof(Tally));
    if (totals == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->totals = totals;
    PyObject *number = PyLong_FromSsize_t(t->tallies);
    if (number == NULL || PyDict_SetItem(t->tally_index, owner, number) < 0 || PyList_Append(t->tally_names, owner) < 0) {
        Py_XDECREF(number);
        return -1;
    }
    Py_DECREF(number);
    t->totals[t->tallies].current = t->totals[t->tallies].peak = 0;
    return t->tallies++;
}

static PyObject *owner_of(Tracker *t, Entry *e) {
    return (e->owner != NULL && PyUnicode_Check(e->owner)) ? e->owner : t->unattributed;
}

/* -- catching up --------------------------------------------------------------------------------------------------- */

static double seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* Reads what `object` (`r->e`'s cache or tensor) holds into `r`; the owner's tally is known from its first storage. */
static void read_entry(Tracker *t, PyObject *object, Reading *r) {
    Entry *e = r->e;
    if (e->kind == KIND_CACHE) {
        read_cache(t, object, r);
    } else {
        PyObject *first = NULL;
        r->status = READ_OK;
        read_tensor(t, object, r, &first);
        Py_XDECREF(first);
        if (r->status == READ_FAILED) {
            fail(t, "reading a tensor");
            r->status = READ_GONE;
        }
    }
    if (r->status == READ_OK && r->now.len && e->tally < 0 && (e->tally = tally_of(t, owner_of(t, e))) < 0) {
        fail(t, "an owner's tally");
        r->status = READ_GONE;
    }
}

/* Applies the readings whose caches did not change meanwhile: what each dropped first, then what each holds. */
static void commit(Tracker *t, Reading *readings, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        Reading *r = &readings[i];
        Entry *e = r->e;
        r->status = (e->live && e->version == r->version) ? r->status : READ_GONE;
        if (r->status == READ_OK) {
            Py_ssize_t kept = 0;
            for (Py_ssize_t k = 0; k < e->held.len; k++) {
                if (storages_contain(&r->now, e->held.items[k]))
                    e->held.items[kept++] = e->held.items[k];
                else
                    give_up(t, e->held.items[k]);
            }
            e->held.len = kept;
        } else if (r->status == READ_UNREADABLE) {
            give_up_all(t, e);
            e->reason = r->reason;
            e->dirty = 0;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Reading *r = &readings[i];
        if (r->status != READ_OK)
            continue;
        Entry *e = r->e;
        for (Py_ssize_t k = 0; k < r->now.len; k++)
            if (!storages_contain(&e->held, r->now.items[k]))
                take(t, e, r->now.items[k]);
        Storages previous = e->held;
        e->held = r->now;
        r->now = previous;
        e->reason = READABLE;
        e->dirty = 0;
    }
    raise_peaks(t);
    compact_marked(t);
}

/* Reads the marked caches and commits what they hold (`final`, a cache being finalized, is read from `final_cache`:
 * its weak reference may be dead already). `pause`, if given, is called about every `slice_s` of reading. Never
 * raises: failures are counted. */
static void catch_up(Tracker *t, Entry *final, PyObject *final_cache, PyObject *pause, double slice_s) {
    Py_ssize_t n = t->marked.len;
    if (n == 0)
        return;
    Reading *readings = PyMem_Calloc((size_t)n, sizeof(Reading));
    if (readings == NULL) {
        fail(t, "catching up");
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        readings[i].e = (Entry *)Py_NewRef(t->marked.items[i]);
        readings[i].version = readings[i].e->version;
    }
    t->reading++;
    double since = pause ? seconds() : 0;
    size_t storages = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Reading *r = &readings[i];
        Entry *e = r->e;
        PyObject *cache = e == final ? Py_NewRef(final_cache) : entry_cache(e);
        if (cache == NULL || !e->live)
            r->status = READ_GONE;
        else
            read_entry(t, cache, r);
        storages += (size_t)r->now.len;
        Py_XDECREF(cache); /* may release a cache: its finalizer catches up on its own, nested */
        if (pause != NULL && seconds() - since >= slice_s) {
            PyObject *paused = PyObject_CallNoArgs(pause);
            if (paused == NULL)
                fail(t, "pausing");
            Py_XDECREF(paused);
            since = seconds();
        }
    }
    t->reading--;
    if (table_reserve(&t->held, t->held.used + storages) < 0) { /* nothing committed: every entry stays marked */
        fail(t, "catching up");
    } else {
        commit(t, readings, n);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        storages_free(&readings[i].now);
        Py_DECREF(readings[i].e);
    }
    PyMem_Free(readings);
}

/* Gives back what a crowd of caches, gone, left the tables and the marked list (at a sample). */
static void shrink(Tracker *t) {
    table_shrink(&t->held);
    table_shrink(&t->live);
    if (t->marked.cap > 64 && t->marked.len * 8 < t->marked.cap) {
        Py_ssize_t cap = t->marked.len * 2 > 16 ? t->marked.len * 2 : 16;
        Entry **items = PyMem_Realloc(t->marked.items, (size_t)cap * sizeof(Entry *));
        if (items != NULL) {
            t->marked.items = items;
            t->marked.cap = cap;
        }
    }
}

/* -- attributing a new cache ------------------------------------------------------------------------------------- */

/* A cache class first met (defined after the install), or where updates are followed a layer class, is handed to
 * the delegate, which wraps its methods; -1 on error (left set). */
static int see_class(Tracker *t, PyTypeObject *type, int layer) {
    if (layer && !t->follows_peaks)
        return 0;
    int known = PySet_Contains(t->known_classes, (PyObject *)type);
    if (known != 0)
        return known < 0 ? -1 : 0;
    PyObject *seen = PyObject_CallMethodObjArgs(t->delegate, s_class_seen, (PyObject *)type, NULL);
    if (seen == NULL)
        return -1;
    Py_DECREF(seen);
    return 0;
}

/* The frame type's `f_back` descriptor and its `__get__` (PyFrame_GetBack is not in the limited API). */
static PyObject *f_back_getter;
static descrgetfunc f_back_get;

/* `frame`'s caller, a new reference, or NULL (at the bottom, or on error: left set). Read by the frame type's own
 * getter, called directly (a lookup by name cost ~10 ns a frame more: 0.3 us a cache made under a worker's
 * ~30 frames, bench_observe's `outside` case): no Python runs. */
static PyFrameObject *frame_back(PyFrameObject *frame) {
    PyObject *back = f_back_get(f_back_getter, (PyObject *)frame, (PyObject *)Py_TYPE(frame));
    if (back == Py_None)
        Py_CLEAR(back);
    return (PyFrameObject *)back;
}

/* Names the owner of a cache made by `frame` (the caller of the cache class's `__new__`): the first frame running a
 * module's code names it. Sets owner and candidate (new references); -1 on error. */
static int attribute_frame(Tracker *t, PyFrameObject *frame, PyObject **owner, PyObject **candidate) {
    Py_XINCREF(frame);
    while (frame != NULL) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        PyObject *site = objmap_get(&t->sites, (uintptr_t)code);
        Py_DECREF(code);
        PyObject *found = NULL;
        if (site != NULL && PyTuple_Check(site)) {
            found = Py_NewRef(site);
        } else if (site != NULL) { /* several modules share this code: the delegate reads the frame's `self` */
            found = PyObject_CallMethodObjArgs(t->delegate, s_owner_of_shared, site, (PyObject *)frame, NULL);
            if (found == NULL) {
                Py_DECREF(frame);
                return -1;
            }
        }
        if (found != NULL && PyTuple_Check(found) && PyTuple_Size(found) == 2) {
            *owner = Py_NewRef(PyTuple_GetItem(found, 0));
            *candidate = Py_NewRef(PyTuple_GetItem(found, 1));
            Py_DECREF(found);
            Py_DECREF(frame);
            return 0;
        }
        Py_XDECREF(found);
        PyFrameObject *back = frame_back(frame);
        Py_DECREF(frame);
        if (back == NULL && PyErr_Occurred())
            return -1;
        frame = back;
    }
    *owner = Py_NewRef(t->unattributed);
    *candidate = Py_NewRef(Py_None);
    return 0;
}

static Entry *new_entry(Tracker *t, PyObject *cache) {
    Entry *e = PyObject_GC_New(Entry, EntryType);
    if (e == NULL)
        return NULL;
    e->tracker = (Tracker *)Py_NewRef((PyObject *)t);
    e->ref = NULL;
    e->cache_id = (Py_ssize_t)(uintptr_t)cache;
    e->seq = t->next_seq++;
    e->owner = Py_NewRef(Py_None);
    e->candidate = Py_NewRef(Py_None);
    e->pending = NULL;
    e->held.items = NULL;
    e->held.len = e->held.cap = 0;
    e->tally = -1;
    e->version = 0;
    e->dirty = e->live = e->half = e->reason = 0;
    e->kind = KIND_CACHE;
    PyObject_GC_Track(e);
    e->ref = PyWeakref_NewRef(cache, (PyObject *)e); /* TypeError for a cache that cannot be weakly referenced */
    if (e->ref == NULL) {
        Py_DECREF(e);
        return NULL;
    }
    return e;
}

/* -- Entry's type ---------------------------------------------------------------------------------------------------- */

/* The weak reference's callback: the object is gone. A cache's finalizer (`release`) normally came first and forgot
 * it; under a garbage collection the callback comes first, and the finalizer after it reads the cache: until then
 * the entry waits in `gone`, released without a last reading if no finalizer ever comes. A tensor has no finalizer
 * of ours: its storage, read when it was held, goes now, after the instant before is counted. */
static PyObject *entry_call(Entry *e, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwargs)) {
    Tracker *t = e->tracker;
    if (t == NULL || !e->live)
        Py_RETURN_NONE;
    Py_INCREF(e);
    if (e->kind != KIND_CACHE || entrylist_push(&t->gone, e) < 0) {
        if (e->kind != KIND_CACHE && t->follows_peaks && t->marked.len)
            catch_up(t, NULL, NULL, NULL, 0);
        if (e->live)
            commit_release(t, e);
    }
    Py_DECREF(e);
    Py_RETURN_NONE;
}

static PyObject *entry_get_cache(Entry *e, PyObject *Py_UNUSED(ignored)) {
    PyObject *cache = entry_cache(e);
    return cache ? cache : Py_NewRef(Py_None);
}

static int entry_traverse(Entry *e, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(e)); /* a heap type: its instances hold it */
    Py_VISIT(e->tracker);
    Py_VISIT(e->ref);
    Py_VISIT(e->owner);
    Py_VISIT(e->candidate);
    Py_VISIT(e->pending);
    return 0;
}

static int entry_clear(Entry *e) {
    Py_CLEAR(e->tracker);
    Py_CLEAR(e->ref);
    Py_CLEAR(e->owner);
    Py_CLEAR(e->candidate);
    Py_CLEAR(e->pending);
    return 0;
}

static void entry_dealloc(Entry *e) {
    PyTypeObject *type = Py_TYPE(e);
    PyObject_GC_UnTrack(e);
    entry_clear(e);
    storages_free(&e->held);
    PyObject_GC_Del(e);
    Py_DECREF(type);
}

static PyMemberDef entry_members[] = {
    {"cache_id", T_PYSSIZET, offsetof(Entry, cache_id), READONLY, "id() of the cache"},
    {"owner", T_OBJECT, offsetof(Entry, owner), 0, "the owner's module path, None until known"},
    {"candidate", T_OBJECT, offsetof(Entry, candidate), 0, "a declaring ancestor it may belong to, or None"},
    {"pending", T_OBJECT, offsetof(Entry, pending), 0, "modules on the creating stack before the model was known"},
    {"reason", T_BYTE, offsetof(Entry, reason), READONLY, "why it cannot be read (0: it can)"},
    {NULL},
};

static PyMethodDef entry_methods[] = {
    {"cache", (PyCFunction)entry_get_cache, METH_NOARGS, "cache()\n--\n\nThe cache, or None once it is gone."},
    {NULL},
};

static PyType_Slot entry_slots[] = {
    {Py_tp_doc, "One tracked cache, weakly, with its owner and what it held when last read."},
    {Py_tp_call, entry_call},
    {Py_tp_traverse, entry_traverse},
    {Py_tp_clear, entry_clear},
    {Py_tp_dealloc, entry_dealloc},
    {Py_tp_members, entry_members},
    {Py_tp_methods, entry_methods},
    {0, NULL},
};

static PyType_Spec entry_spec = {
    .name = "kv_exporter.plugin.observe._tracker.Entry",
    .basicsize = sizeof(Entry),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = entry_slots,
};

/* -- Tracker's methods ----------------------------------------------------------------------------------------------- */

PyDoc_STRVAR(track_doc, "track(cache, maker)\n--\n\nTrack a cache just made: called from the cache class's `__new__` "
                        "with its caller's frame, the code that made it (its owner; None: unknown). Raises TypeError "
                        "for a cache that cannot be weakly referenced.");

/* The maker's frame comes from the `__new__` (`sys._getframe(1)`): read here, it would take that `__new__`'s own frame
 * first, and each call's frame made into an object and dropped was ~0.5 us of a cache made between forwards. */
static PyObject *tracker_track(Tracker *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || (args[1] != Py_None && Py_TYPE(args[1]) != frame_type)) {
        PyErr_SetString(PyExc_TypeError, "track takes a cache and the frame that made it (or None)");
        return NULL;
    }
    PyObject *cache = args[0];
    if (see_class(t, Py_TYPE(cache), 0) < 0)
        return NULL;
    int unfollowed = PySet_Contains(t->unfollowed, (PyObject *)Py_TYPE(cache));
    if (unfollowed < 0)
        return NULL;
    Entry *e = new_entry(t, cache);
    if (e == NULL)
        return NULL;
    PyFrameObject *maker = args[1] == Py_None ? NULL : (PyFrameObject *)Py_NewRef(args[1]);
    int failed = 0;
    if (t->model_known) {
        Py_CLEAR(e->owner);
        Py_CLEAR(e->candidate);
        failed = attribute_frame(t, maker, &e->owner, &e->candidate) < 0;
        e->pending = PyTuple_New(0);
    } else {
        e->pending = PyObject_CallMethodObjArgs(t->delegate, s_modules_on_stack, maker ? (PyObject *)maker : Py_None,
                                               NULL);
    }
    failed = failed || e->pending == NULL || table_reserve(&t->live, t->live.used + 1) < 0;
    if (failed) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
    } else {
        /* commit: a cache at this address whose release is still waiting is gone first */
        Slot *slot = table_find(&t->live, (uintptr_t)cache);
        if (slot != NULL) {
            Entry *stale = (Entry *)Py_NewRef(slot->object);
            commit_release(t, stale);
            Py_DECREF(stale);
        }
        slot = table_slot(&t->live, (uintptr_t)cache);
        slot->object = Py_NewRef((PyObject *)e);
        e->live = 1;
        e->reason = unfollowed ? NOT_FOLLOWED : READABLE;
        if (t->follows_peaks) /* what `__init__` or a copy fills in is read at the next catch-up */
            mark_entry(t, e);
    }
    if (!failed && e->owner == Py_None && t->model_known) { /* the model came meanwhile */
        PyObject *settled = PyObject_CallMethodObjArgs(t->delegate, s_settle, (PyObject *)e, NULL);
        failed = settled == NULL;
        Py_XDECREF(settled);
    }
    Py_XDECREF(maker);
    Py_DECREF(e);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(mark_doc, "mark(cache)\n--\n\nWhat `cache` holds may have grown: read it at the next catch-up. Catches "
                       "up first if a sample asked (`request`). Never raises.");

static PyObject *tracker_mark(Tracker *t, PyObject *cache) {
    t->marks++;
    Slot *slot = table_find(&t->live, (uintptr_t)cache);
    if (slot != NULL)
        mark_entry(t, (Entry *)slot->object);
    if (t->requested != t->served && t->reading == 0) {
        uint64_t asked = t->requested;
        catch_up(t, NULL, NULL, NULL, 0);
        t->served = asked;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(catch_up_doc, "catch_up(pause=None, slice_s=0.0004)\n--\n\nRead every marked cache now and commit what "
                           "they hold (just before something may fall, or for a sample: then `pause` is called about "
                           "every `slice_s` seconds of reading). Serves the requests made so far. Never raises.");

static PyObject *tracker_catch_up(Tracker *t, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"pause", "slice_s", NULL};
    PyObject *pause = Py_None;
    double slice_s = 0.0004;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|Od:catch_up", names, &pause, &slice_s))
        return NULL;
    uint64_t asked = t->requested;
    catch_up(t, NULL, NULL, pause == Py_None ? NULL : pause, slice_s);
    t->served = asked;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(release_doc, "release(cache)\n--\n\nA tracked cache's finalizer: count the instant before it goes (its "
                          "last contents read), then give up what it holds. Never raises.");

static PyObject *tracker_release(Tracker *t, PyObject *cache) {
    Slot *slot = table_find(&t->live, (uintptr_t)cache);
    if (slot == NULL)
        Py_RETURN_NONE;
    Entry *e = (Entry *)Py_NewRef(slot->object);
    PyObject *referent = entry_cache(e); /* NULL under a collection, which cleared the weak reference first */
    if (referent == NULL || referent == cache) {
        if (t->follows_peaks && t->marked.len)
            catch_up(t, e, cache, NULL, 0);
        if (e->live)
            commit_release(t, e);
    }
    Py_XDECREF(referent);
    Py_DECREF(e);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(request_doc, "request()\n--\n\nAsk the next thread that marks a cache to catch up first (a sample's "
                          "figures, read in the model's own thread); returns the request's number (see `served`).");

static PyObject *tracker_request(Tracker *t, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromUnsignedLongLong(++t->requested);
}

PyDoc_STRVAR(take_doc, "take()\n--\n\n({owner: (bytes, peak, caches, stored, state)}, {(owner, reason): count}): "
                       "what each owner holds now in every form and the most since the last take, with its readable "
                       "caches, stored tensors and state tensors; and what is left out, by reason. The next "
                       "interval's peak starts at what they hold now.");

static PyObject *tracker_take(Tracker *t, PyObject *Py_UNUSED(ignored)) {
    settle_gone(t);
    for (size_t j = 0; j < table_size(&t->live); j++) { /* every owner with a live cache has a tally */
        Entry *e = (Entry *)t->live.slots[j].object;
        if (e != NULL && e->tally < 0 && tally_of(t, owner_of(t, e)) < 0)
            return NULL;
    }
    /* per tally: entries left out by reason (caches read as READABLE), then readable stored and state tensors */
    const int width = REASONS + KINDS - 1;
    Py_ssize_t *counts = PyMem_Calloc((size_t)(t->tallies ? t->tallies : 1) * (size_t)width, sizeof(Py_ssize_t));
    if (counts == NULL)
        return PyErr_NoMemory();
    for (size_t j = 0; j < table_size(&t->live); j++) {
        Entry *e = (Entry *)t->live.slots[j].object;
        if (e == NULL || e->half)
            continue;
        Py_ssize_t tally = e->tally;
        if (tally < 0) {
            PyObject *index = PyDict_GetItemWithError(t->tally_index, owner_of(t, e));
            tally = index ? PyLong_AsSsize_t(index) : -1;
        }
        if (tally >= 0)
            counts[tally * width + (e->reason != READABLE ? e->reason : e->kind ? REASONS + e->kind - 1 : 0)]++;
    }
    PyObject *owners = PyDict_New(), *unreadable = PyDict_New(), *result = NULL;
    for (Py_ssize_t k = 0; owners != NULL && unreadable != NULL && k < t->tallies; k++) {
        PyObject *name = PyList_GetItem(t->tally_names, k);
        Tally *tally = &t->totals[k];
        Py_ssize_t *count = &counts[k * width];
        Py_ssize_t stored = count[REASONS + KIND_STORED - 1], state = count[REASONS + KIND_STATE - 1];
        if (tally->peak > 0 || count[READABLE] > 0 || stored > 0 || state > 0) {
            PyObject *figures = Py_BuildValue("(LLnnn)", (long long)tally->current, (long long)tally->peak,
                                              count[READABLE], stored, state);
            if (figures == NULL || PyDict_SetItem(owners, name, figures) < 0)
                Py_CLEAR(owners);
            Py_XDECREF(figures);
        }
        for (int reason = 1; owners != NULL && reason < REASONS; reason++) {
            if (count[reason] == 0)
                continue;
            PyObject *key = Py_BuildValue("(Oi)", name, reason), *value = PyLong_FromSsize_t(count[reason]);
            if (key == NULL || value == NULL || PyDict_SetItem(unreadable, key, value) < 0)
                Py_CLEAR(owners);
            Py_XDECREF(key);
            Py_XDECREF(value);
        }
    }
    PyMem_Free(counts);
    if (owners != NULL && unreadable != NULL) {
        result = PyTuple_Pack(2, owners, unreadable);
        if (result != NULL)
            for (Py_ssize_t k = 0; k < t->tallies; k++)
                t->totals[k].peak = t->totals[k].current;
    }
    shrink(t);
    Py_XDECREF(owners);
    Py_XDECREF(unreadable);
    return result;
}

PyDoc_STRVAR(audit_doc, "audit(count)\n--\n\nMark up to `count` live caches (all of them when negative) for the next "
                        "catch-up, round robin: what changed without a hooked method is read within a few samples.");

static PyObject *tracker_audit(Tracker *t, PyObject *arg) {
    Py_ssize_t count = PyLong_AsSsize_t(arg);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    size_t size = table_size(&t->live);
    if (count < 0 || (size_t)count > t->live.used)
        count = (Py_ssize_t)t->live.used;
    for (size_t visited = 0; count > 0 && visited < size; visited++) {
        t->audit_cursor = (t->audit_cursor + 1) % size;
        Entry *e = (Entry *)t->live.slots[t->audit_cursor].object;
        if (e != NULL) {
            mark_entry(t, e);
            count--;
        }
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(rebuild_doc, "rebuild()\n--\n\nForget the ledger and mark every live cache (once their owners are "
                          "known): the next catch-up counts them again, and what they hold then is the new peak.");

static PyObject *tracker_rebuild(Tracker *t, PyObject *Py_UNUSED(ignored)) {
    table_clear(&t->held, 0);
    t->tallies = 0;
    PyDict_Clear(t->tally_index);
    if (PyList_SetSlice(t->tally_names, 0, PyList_Size(t->tally_names), NULL) < 0)
        return NULL;
    for (size_t j = 0; j < table_size(&t->live); j++) {
        Entry *e = (Entry *)t->live.slots[j].object;
        if (e == NULL)
            continue;
        e->held.len = 0;
        e->tally = -1;
        mark_entry(t, e);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(after_fork_doc, "after_fork()\n--\n\nIn a forked child: the catch-ups the parent's other threads had in "
                             "progress never end there (what they were reading stays marked: it is read again).");

static PyObject *tracker_after_fork(Tracker *t, PyObject *Py_UNUSED(ignored)) {
    t->reading = 0;
    t->served = t->requested;
    Py_RETURN_NONE;
}

/* The live entry of `object`, a new reference, or NULL (no exception). */
static Entry *entry_of(Tracker *t, PyObject *object) {
    Slot *slot = table_find(&t->live, (uintptr_t)object);
    if (slot == NULL)
        return NULL;
    Entry *e = (Entry *)Py_NewRef(slot->object);
    PyObject *referent = entry_cache(e);
    Py_XDECREF(referent);
    if (referent != object) {
        Py_DECREF(e);
        return NULL;
    }
    return e;
}

PyDoc_STRVAR(hold_doc, "hold(tensor, owner, stored)\n--\n\nFollow a tensor another form holds for `owner`: one a known "
                       "cache class stored (`stored`: read at once where peaks are followed, with what it replaced "
                       "still alive, that instant being the peak), or one in a declaring owner's state (read at the "
                       "sample's catch-up). It counts until it is released or let go. Already held: nothing changes.");

static PyObject *tracker_hold(Tracker *t, PyObject *args) {
    PyObject *tensor, *owner;
    int stored;
    if (!PyArg_ParseTuple(args, "OUp:hold", &tensor, &owner, &stored))
        return NULL;
    Entry *held = entry_of(t, tensor);
    if (held != NULL) {
        Py_DECREF(held);
        Py_RETURN_NONE;
    }
    Entry *e = new_entry(t, tensor);
    if (e == NULL)
        return NULL;
    PyObject *old_owner = e->owner;
    e->owner = Py_NewRef(owner);
    Py_XDECREF(old_owner);
    e->pending = PyTuple_New(0);
    e->kind = stored ? KIND_STORED : KIND_STATE;
    if (e->pending == NULL || table_reserve(&t->live, t->live.used + 1) < 0) {
        Py_DECREF(e);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    Slot *slot = table_find(&t->live, (uintptr_t)tensor);
    if (slot != NULL) { /* a dead object's entry at this address: gone first */
        Entry *stale = (Entry *)Py_NewRef(slot->object);
        commit_release(t, stale);
        Py_DECREF(stale);
    }
    slot = table_slot(&t->live, (uintptr_t)tensor);
    slot->object = Py_NewRef((PyObject *)e);
    e->live = 1;
    mark_entry(t, e);
    if (t->follows_peaks && stored) /* in the model's thread, as the class stores it; a state's at the sample */
        catch_up(t, NULL, NULL, NULL, 0);
    Py_DECREF(e);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(let_go_doc, "let_go(tensor)\n--\n\nStop counting a held tensor (no longer in its owner's state).");

static PyObject *tracker_let_go(Tracker *t, PyObject *tensor) {
    Entry *e = entry_of(t, tensor);
    if (e != NULL && e->kind != KIND_CACHE)
        commit_release(t, e);
    Py_XDECREF(e);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(reown_doc, "reown(tensor, owner)\n--\n\nCharge a held tensor to `owner` from now on (its storage is read "
                        "again for it).");

static PyObject *tracker_reown(Tracker *t, PyObject *args) {
    PyObject *tensor, *owner;
    if (!PyArg_ParseTuple(args, "OU:reown", &tensor, &owner))
        return NULL;
    Entry *e = entry_of(t, tensor);
    if (e == NULL || e->kind == KIND_CACHE) {
        Py_XDECREF(e);
        Py_RETURN_NONE;
    }
    give_up_all(t, e);
    PyObject *old_owner = e->owner;
    e->owner = Py_NewRef(owner);
    Py_XDECREF(old_owner);
    e->tally = -1;
    mark_entry(t, e);
    Py_DECREF(e);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(failures_doc, "failures()\n--\n\n(count, last): failures since the last call, and the last one's "
                           "description.");

static PyObject *tracker_failures(Tracker *t, PyObject *Py_UNUSED(ignored)) {
    PyObject *result = Py_BuildValue("(Ks)", t->failures, t->failure);
    t->failures = 0;
    return result;
}

static int by_creation(const void *a, const void *b) {
    unsigned long long x = (*(Entry *const *)a)->seq, y = (*(Entry *const *)b)->seq;
    return (x > y) - (x < y);
}

PyDoc_STRVAR(entries_doc, "entries()\n--\n\nThe live entries, in creation order (a snapshot).");

static PyObject *tracker_entries(Tracker *t, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t count = (Py_ssize_t)t->live.used, n = 0;
    Entry **found = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(Entry *));
    if (found == NULL)
        return PyErr_NoMemory();
    for (size_t j = 0; j < table_size(&t->live); j++)
        if (t->live.slots[j].object != NULL)
            found[n++] = (Entry *)t->live.slots[j].object;
    qsort(found, (size_t)n, sizeof(Entry *), by_creation);
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list != NULL && i < n; i++)
        PyList_SetItem(list, i, Py_NewRef((PyObject *)found[i])); /* a new list's item: cannot fail */
    PyMem_Free(found);
    return list;
}

PyDoc_STRVAR(set_sites_doc, "set_sites(sites)\n--\n\nThe model's map, id(code) -> Attribution, or a shared site the "
                            "delegate's owner_of_shared(site, frame) names; None: the model is not known.");

static PyObject *tracker_set_sites(Tracker *t, PyObject *sites) {
    table_clear(&t->sites, 1);
    t->model_known = 0;
    if (sites == Py_None)
        Py_RETURN_NONE;
    if (!PyDict_Check(sites)) {
        PyErr_SetString(PyExc_TypeError, "sites must be a dict or None");
        return NULL;
    }
    if (table_reserve(&t->sites, (size_t)PyDict_Size(sites)) < 0)
        return PyErr_NoMemory();
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(sites, &pos, &key, &value)) {
        void *code = PyLong_AsVoidPtr(key);
        if (code == NULL) {
            table_clear(&t->sites, 1);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "a site's key is 0");
            return NULL;
        }
        Slot *slot = table_slot(&t->sites, (uintptr_t)code);
        PyObject *old = slot->object;
        slot->object = Py_NewRef(value);
        Py_XDECREF(old);
    }
    t->model_known = 1;
    Py_RETURN_NONE;
}

static PyObject *tracker_sizes(Tracker *t, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("{s:n,s:n,s:n,s:n}", "live", (Py_ssize_t)table_size(&t->live), "held",
                         (Py_ssize_t)table_size(&t->held), "marked", t->marked.cap, "storages",
                         (Py_ssize_t)t->held.used);
}

static PyMethodDef tracker_methods[] = {
    {"track", (PyCFunction)(void (*)(void))tracker_track, METH_FASTCALL, track_doc},
    {"mark", (PyCFunction)tracker_mark, METH_O, mark_doc},
    {"catch_up", (PyCFunction)(void (*)(void))tracker_catch_up, METH_VARARGS | METH_KEYWORDS, catch_up_doc},
    {"release", (PyCFunction)tracker_release, METH_O, release_doc},
    {"request", (PyCFunction)tracker_request, METH_NOARGS, request_doc},
    {"take", (PyCFunction)tracker_take, METH_NOARGS, take_doc},
    {"audit", (PyCFunction)tracker_audit, METH_O, audit_doc},
    {"rebuild", (PyCFunction)tracker_rebuild, METH_NOARGS, rebuild_doc},
    {"after_fork", (PyCFunction)tracker_after_fork, METH_NOARGS, after_fork_doc},
    {"hold", (PyCFunction)tracker_hold, METH_VARARGS, hold_doc},
    {"let_go", (PyCFunction)tracker_let_go, METH_O, let_go_doc},
    {"reown", (PyCFunction)tracker_reown, METH_VARARGS, reown_doc},
    {"failures", (PyCFunction)tracker_failures, METH_NOARGS, failures_doc},
    {"entries", (PyCFunction)tracker_entries, METH_NOARGS, entries_doc},
    {"set_sites", (PyCFunction)tracker_set_sites, METH_O, set_sites_doc},
    {"sizes", (PyCFunction)tracker_sizes, METH_NOARGS, "sizes()\n--\n\nThe tables' slots (tests, benchmarks)."},
    {NULL},
};

static PyMemberDef tracker_members[] = {
    {"follows_peaks", T_BOOL, offsetof(Tracker, follows_peaks), 0, "updates and falls are followed (the peak)"},
    {"served", T_ULONGLONG, offsetof(Tracker, served), READONLY, "the last request a catch-up served"},
    {"marks", T_ULONGLONG, offsetof(Tracker, marks), READONLY, "cache updates seen so far"},
    {NULL},
};

static int tracker_init(Tracker *t, PyObject *args, PyObject *kwds) {
    static char *names[] = {"delegate", "unattributed", "known_classes", "unfollowed", "tensor_type", NULL};
    PyObject *delegate, *unattributed, *known, *unfollowed, *tensor_type;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OUO!O!O:Tracker", names, &delegate, &unattributed, &PySet_Type,
                                     &known, &PySet_Type, &unfollowed, &tensor_type))
        return -1;
    if (t->delegate != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Tracker is initialised once");
        return -1;
    }
    t->delegate = Py_NewRef(delegate);
    t->unattributed = Py_NewRef(unattributed);
    t->known_classes = Py_NewRef(known);
    t->unfollowed = Py_NewRef(unfollowed);
    t->tensor_type = Py_NewRef(tensor_type);
    t->tally_names = PyList_New(0);
    t->tally_index = PyDict_New();
    return t->tally_names == NULL || t->tally_index == NULL ? -1 : 0;
}

static int tracker_traverse(Tracker *t, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(t)); /* a heap type: its instances hold it */
    Py_VISIT(t->delegate);
    Py_VISIT(t->unattributed);
    Py_VISIT(t->known_classes);
    Py_VISIT(t->unfollowed);
    Py_VISIT(t->tensor_type);
    Py_VISIT(t->tally_names);
    Py_VISIT(t->tally_index);
    for (size_t j = 0; j < table_size(&t->live); j++)
        Py_VISIT(t->live.slots[j].object);
    for (size_t j = 0; j < table_size(&t->sites); j++)
        Py_VISIT(t->sites.slots[j].object);
    for (size_t j = 0; j < table_size(&t->types); j++)
        Py_VISIT(t->types.slots[j].object);
    for (Py_ssize_t i = 0; i < t->marked.len; i++)
        Py_VISIT(t->marked.items[i]);
    for (Py_ssize_t i = 0; i < t->gone.len; i++)
        Py_VISIT(t->gone.items[i]);
    for (Py_ssize_t i = 0; i < t->gone_before.len; i++)
        Py_VISIT(t->gone_before.items[i]);
    return 0;
}

static int tracker_clear(Tracker *t) {
    Py_CLEAR(t->delegate);
    Py_CLEAR(t->unattributed);
    Py_CLEAR(t->known_classes);
    Py_CLEAR(t->unfollowed);
    Py_CLEAR(t->tensor_type);
    Py_CLEAR(t->tally_names);
    Py_CLEAR(t->tally_index);
    table_clear(&t->live, 1);
    table_clear(&t->sites, 1);
    table_clear(&t->types, 1);
    entrylist_release(&t->marked);
    entrylist_release(&t->gone);
    entrylist_release(&t->gone_before);
    return 0;
}

static void tracker_dealloc(Tracker *t) {
    PyTypeObject *type = Py_TYPE(t);
    PyObject_GC_UnTrack(t);
    tracker_clear(t);
    table_clear(&t->held, 0);
    PyMem_Free(t->totals);
    ((freefunc)PyType_GetSlot(type, Py_tp_free))(t);
    Py_DECREF(type);
}

static PyType_Slot tracker_slots[] = {
    {Py_tp_doc, "Tracker(delegate, unattributed, known_classes, unfollowed, tensor_type): the live caches and their "
                "owners' storage ledger."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, tracker_init},
    {Py_tp_traverse, tracker_traverse},
    {Py_tp_clear, tracker_clear},
    {Py_tp_dealloc, tracker_dealloc},
    {Py_tp_methods, tracker_methods},
    {Py_tp_members, tracker_members},
    {0, NULL},
};

static PyType_Spec tracker_spec = {
    .name = "kv_exporter.plugin.observe._tracker.Tracker",
    .basicsize = sizeof(Tracker),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = tracker_slots,
};

/* -- the update hook: a cache class's `update`, then its cache marked ---------------------------------------- */
/* Why C: between a forward's kernels a Python wrapper's frame cost ~2 us an update, about half of what the hooks added
 * to a decode step (docs/decisions/0023-update-hook-in-c.md). An `UpdateHook` is what the interpreter calls for
 * `cache.update(...)`: a method descriptor (Py_TPFLAGS_METHOD_DESCRIPTOR), so the call's method load hands it the
 * instance unbound, and it calls the original with the same arguments, untouched, then marks the cache. Every other
 * access binds through the `__get__` wrappers.py sets on this type, in Python, which gives the Python wrapper: what
 * introspection, `super()`, a bound method kept for later and dynamo see is exactly that wrapper.
 * Under the limited API (docs/decisions/0027-tracker-on-the-limited-api.md): the call is `tp_call`, its arguments a
 * tuple (a type of ours has no vectorcall there); and the type is mutable, `__get__` set on it after it is made:
 * flags cannot be written there, and no Python subclass carries the method-descriptor flag (so none is allowed). */

typedef struct {
    PyObject_HEAD
    PyObject *original; /* the class's own `update` */
    PyObject *wrapper;  /* the Python wrapper every other access gets */
} UpdateHook;

static Tracker *hook_tracker; /* where update hooks mark; NULL: nowhere */

static PyObject *update_hook_call(UpdateHook *h, PyObject *args, PyObject *kwargs) {
    PyObject *result = PyObject_Call(h->original, args, kwargs);
    Tracker *t = hook_tracker;
    if (result != NULL && t != NULL && PyTuple_Size(args) > 0) {
        Py_INCREF(t); /* a catch-up runs Python: the hooks may be retargeted meanwhile */
        Py_DECREF(tracker_mark(t, PyTuple_GetItem(args, 0))); /* returns None, never fails */
        Py_DECREF(t);
    }
    return result;
}

static int update_hook_init(UpdateHook *h, PyObject *args, PyObject *kwds) {
    static char *names[] = {"original", "wrapper", NULL};
    PyObject *original, *wrapper;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:UpdateHook", names, &original, &wrapper))
        return -1;
    if (!PyCallable_Check(original) || !PyCallable_Check(wrapper)) {
        PyErr_SetString(PyExc_TypeError, "UpdateHook takes two callables");
        return -1;
    }
    PyObject *old_original = h->original, *old_wrapper = h->wrapper;
    h->original = Py_NewRef(original);
    h->wrapper = Py_NewRef(wrapper);
    Py_XDECREF(old_original);
    Py_XDECREF(old_wrapper);
    return 0;
}

static int update_hook_traverse(UpdateHook *h, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(h)); /* a heap type: its instances hold it */
    Py_VISIT(h->original);
    Py_VISIT(h->wrapper);
    return 0;
}

static int update_hook_clear(UpdateHook *h) {
    Py_CLEAR(h->original);
    Py_CLEAR(h->wrapper);
    return 0;
}

static void update_hook_dealloc(UpdateHook *h) {
    PyTypeObject *type = Py_TYPE(h);
    PyObject_GC_UnTrack(h);
    update_hook_clear(h);
    ((freefunc)PyType_GetSlot(type, Py_tp_free))(h);
    Py_DECREF(type);
}

static PyMemberDef update_hook_members[] = {
    {"original", T_OBJECT, offsetof(UpdateHook, original), READONLY, "the class's own `update`"},
    {"wrapper", T_OBJECT, offsetof(UpdateHook, wrapper), READONLY, "the Python wrapper every other access gets"},
    {NULL},
};

static PyType_Slot update_hook_slots[] = {
    {Py_tp_doc, "UpdateHook(original, wrapper): `cache.update(...)` calls `original`, then marks the cache; every "
                "other access binds by the `__get__` wrappers.py sets on this type."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, update_hook_init},
    {Py_tp_traverse, update_hook_traverse},
    {Py_tp_clear, update_hook_clear},
    {Py_tp_dealloc, update_hook_dealloc},
    {Py_tp_call, update_hook_call},
    {Py_tp_members, update_hook_members},
    {0, NULL},
};

static PyType_Spec update_hook_spec = {
    .name = "kv_exporter.plugin.observe._tracker.UpdateHook",
    .basicsize = sizeof(UpdateHook),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .slots = update_hook_slots,
};

PyDoc_STRVAR(mark_updates_into_doc, "mark_updates_into(tracker)\n--\n\nWhere update hooks mark from now on (None: "
                                    "nowhere).");

static PyObject *mark_updates_into(PyObject *Py_UNUSED(module), PyObject *tracker) {
    if (tracker != Py_None && !PyObject_TypeCheck(tracker, TrackerType)) {
        PyErr_SetString(PyExc_TypeError, "mark_updates_into takes a Tracker or None");
        return NULL;
    }
    Tracker *old = hook_tracker;
    hook_tracker = tracker == Py_None ? NULL : (Tracker *)Py_NewRef(tracker);
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

static PyMethodDef module_functions[] = {
    {"mark_updates_into", mark_updates_into, METH_O, mark_updates_into_doc},
    {NULL},
};

/* -- the module ------------------------------------------------------------------------------------------------------ */

static int intern_all(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_attribute[A_LAYERS], "layers"},
        {&s_attribute[A_KEYS], "keys"},
        {&s_attribute[A_VALUES], "values"},
        {&s_attribute[A_SELF_ATTENTION], "self_attention_cache"},
        {&s_attribute[A_CROSS_ATTENTION], "cross_attention_cache"},
        {&s_untyped_storage, "untyped_storage"},
        {&s_nbytes, "nbytes"},
        {&s_data_ptr, "data_ptr"},
        {&s_owner_of_shared, "owner_of_shared"},
        {&s_modules_on_stack, "modules_on_stack"},
        {&s_decide, "decide"},
        {&s_class_seen, "class_seen"},
        {&s_settle, "settle"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL)
            return -1;
    m_untyped_storage.name = s_untyped_storage;
    m_nbytes.name = s_nbytes;
    m_data_ptr.name = s_data_ptr;
    return 0;
}

/* What the limited API reaches only through Python's own objects: the function and frame types, `type`'s getters of
 * a class's MRO and dictionary (type_lookup), and the frame type's getter of `f_back` (frame_back). */
static int find_builtins(void) {
    PyObject *types = PyImport_ImportModule("types");
    function_type = types ? (PyTypeObject *)PyObject_GetAttrString(types, "FunctionType") : NULL;
    frame_type = types ? (PyTypeObject *)PyObject_GetAttrString(types, "FrameType") : NULL;
    Py_XDECREF(types);
    PyObject *type_dict = PyObject_GetAttrString((PyObject *)&PyType_Type, "__dict__");
    mro_getter = type_dict ? PyMapping_GetItemString(type_dict, "__mro__") : NULL;
    dict_getter = type_dict ? PyMapping_GetItemString(type_dict, "__dict__") : NULL;
    Py_XDECREF(type_dict);
    PyObject *frame_dict = frame_type ? PyObject_GetAttrString((PyObject *)frame_type, "__dict__") : NULL;
    f_back_getter = frame_dict ? PyMapping_GetItemString(frame_dict, "f_back") : NULL;
    Py_XDECREF(frame_dict);
    if (function_type == NULL || frame_type == NULL || mro_getter == NULL || dict_getter == NULL ||
        f_back_getter == NULL)
        return -1;
    mro_get = (descrgetfunc)PyType_GetSlot(Py_TYPE(mro_getter), Py_tp_descr_get);
    dict_get = (descrgetfunc)PyType_GetSlot(Py_TYPE(dict_getter), Py_tp_descr_get);
    f_back_get = (descrgetfunc)PyType_GetSlot(Py_TYPE(f_back_getter), Py_tp_descr_get);
    if (!PyType_Check(function_type) || !PyType_Check(frame_type) || mro_get == NULL || dict_get == NULL ||
        f_back_get == NULL) {
        PyErr_SetString(PyExc_ImportError, "the tracker finds no function or frame type, or no getters of a type's "
                                           "MRO or a frame's caller");
        return -1;
    }
    return 0;
}

static struct PyModuleDef tracker_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kv_exporter.plugin.observe._tracker",
    .m_doc = "The live transformers caches of this process and their owners' storage ledger (the per-step part).",
    .m_size = -1,
    .m_methods = module_functions,
};

PyMODINIT_FUNC PyInit__tracker(void) {
    if (EntryType == NULL) { /* made once: a second import (a test's) gets the same types */
        if (intern_all() < 0 || find_builtins() < 0)
            return NULL;
        EntryType = (PyTypeObject *)PyType_FromSpec(&entry_spec);
        TrackerType = (PyTypeObject *)PyType_FromSpec(&tracker_spec);
        UpdateHookType = (PyTypeObject *)PyType_FromSpec(&update_hook_spec);
        if (EntryType == NULL || TrackerType == NULL || UpdateHookType == NULL) {
            Py_CLEAR(EntryType);
            Py_CLEAR(TrackerType);
            Py_CLEAR(UpdateHookType);
            return NULL;
        }
    }
    PyObject *module = PyModule_Create(&tracker_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Entry", (PyObject *)EntryType) < 0 ||
        PyModule_AddObjectRef(module, "Tracker", (PyObject *)TrackerType) < 0 ||
        PyModule_AddObjectRef(module, "UpdateHook", (PyObject *)UpdateHookType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
