/* The per-step half of cache observation, in C: every live transformers cache (an `Entry`, a weak reference with the
 * cache's owner and what it held when last read) and, where the high-water mark is followed, each owner's storage
 * now and the most since the last sample.
 *
 * Why C: the engine's step runs these hooks ~40 times (a cache made, updated, released); written in Python the
 * same accounting cost the decode benchmark 2-3% (docs/benchmarks.md, section 9), here a small fraction of that.
 * What stays in Python (registry.py) is everything off the step path: which methods are wrapped, the model's map
 * of code to owners, a cache made before the model is known, a declaring ancestor's geometry check. The tracker
 * calls those through its `delegate` (the registry), only where the fast path cannot decide.
 *
 * The accounting (peaks.py says why it is exact): an update only marks its cache; the marked caches are read
 * (`catch_up`) just before anything can fall (a release, a reshaping method) and at each sample; a catch-up first
 * gives up what every marked cache dropped and only then takes what they hold now, so an address freed by one and
 * reused by another is never mistaken for the old storage. Each storage is kept once, by data pointer, with the
 * number of caches holding it, charged to the owner of the first.
 *
 * Threads: everything runs under the GIL. Where the tracker calls Python (torch's storage getters, the delegate)
 * another thread may run; the accounts are then held by a lock (the sampler's thread waits without the GIL), and a
 * release arriving in the same thread meanwhile (a cache freed by a collection) is deferred until the work in
 * progress ends. Marks and creations touch no state a catch-up holds across a Python call. Never raises into the
 * model: the weak-reference callback reports failures to the delegate. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <structmember.h>
#include <pythread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* -- interned names ---------------------------------------------------------------------------------------------- */

static PyObject *s_layers, *s_keys, *s_values, *s_untyped_storage, *s_nbytes, *s_data_ptr, *s_dict;
static PyObject *s_owner_of_shared, *s_modules_on_stack, *s_charge, *s_class_seen, *s_failed, *s_settle;

/* -- a storage a cache holds: data pointer and bytes; an entry keeps its own sorted by pointer --------------------- */

typedef struct {
    uintptr_t ptr;
    int64_t nbytes;
} Storage;

/* A growable array (`items`, `cap` slots, `len` used) with room for one more: the same or a moved block, `cap`
 * updated; NULL with MemoryError set (the old block is kept). */
static void *room_for_one(void *items, Py_ssize_t len, Py_ssize_t *cap, size_t item_size) {
    if (len < *cap)
        return items;
    Py_ssize_t grown = *cap ? *cap * 2 : 16;
    void *moved = PyMem_Realloc(items, (size_t)grown * item_size);
    if (moved == NULL)
        return PyErr_NoMemory();
    *cap = grown;
    return moved;
}

typedef struct {
    Storage *items;
    Py_ssize_t len, cap;
} Storages;

static int storages_push(Storages *s, uintptr_t ptr, int64_t nbytes) {
    Storage *items = room_for_one(s->items, s->len, &s->cap, sizeof(Storage));
    if (items == NULL)
        return -1;
    s->items = items;
    s->items[s->len].ptr = ptr;
    s->items[s->len].nbytes = nbytes;
    s->len++;
    return 0;
}

static void storages_free(Storages *s) {
    PyMem_Free(s->items);
    s->items = NULL;
    s->len = s->cap = 0;
}

static int by_pointer(const void *a, const void *b) {
    uintptr_t x = ((const Storage *)a)->ptr, y = ((const Storage *)b)->ptr;
    return (x > y) - (x < y);
}

static void storages_sort_unique(Storages *s) {
    if (s->len < 2)
        return;
    qsort(s->items, (size_t)s->len, sizeof(Storage), by_pointer);
    Py_ssize_t kept = 1;
    for (Py_ssize_t i = 1; i < s->len; i++)
        if (s->items[i].ptr != s->items[kept - 1].ptr)
            s->items[kept++] = s->items[i];
    s->len = kept;
}

static int storages_contain(const Storages *s, uintptr_t ptr) {
    Py_ssize_t lo = 0, hi = s->len;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (s->items[mid].ptr < ptr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < s->len && s->items[lo].ptr == ptr;
}

/* -- open-addressing tables keyed by an address (never 0), linear probing, backward-shift deletion ---------------- */

static size_t slot_of(uintptr_t key, size_t mask) {
    uint64_t h = (uint64_t)key * 0x9E3779B97F4A7C15ull; /* Fibonacci hashing: addresses are 16-byte aligned */
    return (size_t)(h >> 17) & mask;
}

/* One slot of either table: the live caches and code sites map an address to an object (a strong reference); the
 * held storages map a data pointer to its bytes, the caches holding it and the owner's tally it is charged to. */
typedef struct {
    uintptr_t key;
    PyObject *object;
    int64_t nbytes;
    Py_ssize_t holders;
    Py_ssize_t tally;
} Slot;

typedef struct {
    Slot *slots;
    size_t mask, used;
} Table;

static Slot *table_find(const Table *t, uintptr_t key) {
    if (t->slots == NULL)
        return NULL;
    for (size_t i = slot_of(key, t->mask);; i = (i + 1) & t->mask) {
        if (t->slots[i].key == key)
            return &t->slots[i];
        if (t->slots[i].key == 0)
            return NULL;
    }
}

/* The slot of `key`, made (zeroed) if absent; NULL with MemoryError set. Moves every slot when the table grows. */
static Slot *table_slot(Table *t, uintptr_t key) {
    if ((t->used + 1) * 2 > (t->slots ? t->mask + 1 : 0)) {
        size_t size = t->slots ? (t->mask + 1) * 2 : 64;
        Slot *slots = PyMem_Calloc(size, sizeof(Slot));
        if (slots == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        for (size_t j = 0; t->slots != NULL && j <= t->mask; j++) {
            if (t->slots[j].key == 0)
                continue;
            size_t i = slot_of(t->slots[j].key, size - 1);
            while (slots[i].key != 0)
                i = (i + 1) & (size - 1);
            slots[i] = t->slots[j];
        }
        PyMem_Free(t->slots);
        t->slots = slots;
        t->mask = size - 1;
    }
    size_t i = slot_of(key, t->mask);
    while (t->slots[i].key != 0 && t->slots[i].key != key)
        i = (i + 1) & t->mask;
    if (t->slots[i].key == 0) {
        t->slots[i].key = key;
        t->used++;
    }
    return &t->slots[i];
}

/* Empties `slot` (its object, if any, is the caller's to release), keeping every other key findable. */
static void table_remove(Table *t, Slot *slot) {
    size_t i = (size_t)(slot - t->slots);
    for (size_t j = (i + 1) & t->mask; t->slots[j].key != 0; j = (j + 1) & t->mask) {
        size_t home = slot_of(t->slots[j].key, t->mask);
        /* move j back into the hole at i unless its home lies cyclically in (i, j] */
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            t->slots[i] = t->slots[j];
            i = j;
        }
    }
    memset(&t->slots[i], 0, sizeof(Slot));
    t->used--;
}

static void table_clear(Table *t) {
    Slot *slots = t->slots;
    size_t size = slots ? t->mask + 1 : 0;
    t->slots = NULL;
    t->mask = t->used = 0;
    for (size_t j = 0; j < size; j++)
        Py_XDECREF(slots[j].object);
    PyMem_Free(slots);
}

static PyObject *objmap_get(const Table *t, uintptr_t key) {
    Slot *slot = table_find(t, key);
    return slot == NULL ? NULL : slot->object;
}

/* Stores a new reference to `value`; `replaced` gets the reference it replaced (the caller's to release), or NULL. */
static int objmap_put(Table *t, uintptr_t key, PyObject *value, PyObject **replaced) {
    Slot *slot = table_slot(t, key);
    if (slot == NULL) {
        *replaced = NULL;
        return -1;
    }
    *replaced = slot->object;
    slot->object = Py_NewRef(value);
    return 0;
}

/* Removes `key`; returns its reference (the caller's to release), or NULL. */
static PyObject *objmap_pop(Table *t, uintptr_t key) {
    Slot *slot = table_find(t, key);
    if (slot == NULL)
        return NULL;
    PyObject *value = slot->object;
    table_remove(t, slot);
    return value;
}

/* -- Entry: a weak reference to one cache ------------------------------------------------------------------------ */

typedef struct {
    PyWeakReference ref;
    Py_ssize_t cache_id;
    unsigned long long seq; /* creation order: the sampler charges a shared storage to the first cache */
    PyObject *owner;        /* str, or NULL until the model is known */
    PyObject *candidate;    /* a declaring ancestor whose declared memory this may be, until its first storage */
    PyObject *pending;      /* the modules on the creating stack, for a cache made before the model was known */
    PyObject *state;        /* the cache's instance dictionary: still readable when the cache is released */
    Storages held;          /* what it held when last read, sorted by pointer */
    Py_ssize_t tally;       /* its owner's tally, from its first storage on; -1 before */
    char dirty;             /* in the tracker's marked list */
    char live;              /* in the tracker's live table */
} Entry;

static PyTypeObject EntryType;

static int entry_traverse(Entry *self, visitproc visit, void *arg) {
    Py_VISIT(self->owner);
    Py_VISIT(self->candidate);
    Py_VISIT(self->pending);
    Py_VISIT(self->state);
    return _PyWeakref_RefType.tp_traverse((PyObject *)self, visit, arg);
}

static int entry_clear(Entry *self) {
    Py_CLEAR(self->owner);
    Py_CLEAR(self->candidate);
    Py_CLEAR(self->pending);
    Py_CLEAR(self->state);
    return _PyWeakref_RefType.tp_clear((PyObject *)self);
}

static void entry_dealloc(Entry *self) {
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->candidate);
    Py_CLEAR(self->pending);
    Py_CLEAR(self->state);
    storages_free(&self->held);
    _PyWeakref_RefType.tp_dealloc((PyObject *)self); /* unlinks it from its referent and frees it */
}

static PyMemberDef entry_members[] = {
    {"cache_id", T_PYSSIZET, offsetof(Entry, cache_id), READONLY, "id() of the cache"},
    {"owner", T_OBJECT, offsetof(Entry, owner), 0, "the owner's module path, None until known"},
    {"candidate", T_OBJECT, offsetof(Entry, candidate), 0, "a declaring ancestor it may belong to, or None"},
    {"pending", T_OBJECT, offsetof(Entry, pending), 0, "modules on the creating stack before the model was known"},
    {"state", T_OBJECT, offsetof(Entry, state), 0, "the cache's instance dictionary, None once released"},
    {NULL},
};

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kv_exporter.plugin.observe._tracker.Entry",
    .tp_basicsize = sizeof(Entry),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A weak reference to one tracked cache, with its owner.",
    .tp_traverse = (traverseproc)entry_traverse,
    .tp_clear = (inquiry)entry_clear,
    .tp_dealloc = (destructor)entry_dealloc,
    .tp_members = entry_members,
};

/* -- Tracker ----------------------------------------------------------------------------------------------------- */

typedef struct {
    Entry **items;
    Py_ssize_t len, cap;
} EntryList; /* strong references */

static int entrylist_push(EntryList *l, Entry *e) {
    Entry **items = room_for_one(l->items, l->len, &l->cap, sizeof(Entry *));
    if (items == NULL)
        return -1;
    l->items = items;
    Py_INCREF(e);
    l->items[l->len++] = e;
    return 0;
}

static EntryList entrylist_take(EntryList *l) {
    EntryList taken = *l;
    l->items = NULL;
    l->len = l->cap = 0;
    return taken;
}

static void entrylist_release(EntryList *l) {
    EntryList taken = entrylist_take(l);
    for (Py_ssize_t i = 0; i < taken.len; i++)
        Py_DECREF(taken.items[i]);
    PyMem_Free(taken.items);
}

/* One owner's storage: what its caches hold now, and the most since the last sample. */
typedef struct {
    int64_t current, peak;
} Tally;

typedef struct {
    PyObject_HEAD
    PyObject *delegate;       /* the registry: owner_of_shared, modules_on_stack, charge, class_seen, failed, settle */
    PyObject *unattributed;   /* the owner of a cache made outside the model's modules */
    PyObject *on_release;     /* this tracker's release method: every entry's weak-reference callback */
    PyObject *known_classes;  /* set: cache and layer classes the delegate has seen (their methods are wrapped) */
    PyObject *copying;        /* tuple: code objects that make an instance whose contents arrive after `__new__` */
    Table live;              /* id(cache) -> Entry */
    Table sites;             /* code object address -> Attribution (a tuple) or a shared site (asked of the delegate) */
    int model_known;          /* sites describe the model: owners are named at creation */
    char follows_peaks;       /* updates and falls are counted (a T_BOOL member) */
    unsigned long long next_seq;
    EntryList marked;         /* caches that may hold more than when last read */
    EntryList deferred;       /* releases that arrived while this thread was in the accounts */
    Table held;
    Tally *totals;            /* per owner, by tally index */
    Py_ssize_t tallies, tallies_cap;
    PyObject *tally_names;    /* list: tally -> owner */
    PyObject *tally_index;    /* dict: owner -> tally */
    PyThread_type_lock lock;
    unsigned long holder;     /* the thread in the accounts, 0 when none */
} Tracker;

static void report(Tracker *t, const char *where) {
    /* Hands the pending exception to the delegate's `failed(where, exc)`; leaves no exception set. */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    PyObject *name = PyUnicode_FromString(where);
    PyObject *result = NULL;
    if (name != NULL && value != NULL)
        result = PyObject_CallMethodObjArgs(t->delegate, s_failed, name, value, NULL);
    if (result == NULL)
        PyErr_WriteUnraisable(t->delegate); /* the reporter itself failed: say so once on stderr, never raise */
    Py_XDECREF(result);
    Py_XDECREF(name);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
}

/* Enters the accounts; 0 when this thread is already in them (the caller defers or skips its work). */
static int enter(Tracker *t) {
    unsigned long me = PyThread_get_thread_ident();
    if (t->holder == me)
        return 0;
    if (!PyThread_acquire_lock(t->lock, NOWAIT_LOCK)) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(t->lock, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
    t->holder = me;
    return 1;
}

static void leave(Tracker *t) {
    t->holder = 0;
    PyThread_release_lock(t->lock);
}

static int mark(Tracker *t, Entry *e) {
    if (e->dirty || !e->live)
        return 0;
    if (entrylist_push(&t->marked, e) < 0)
        return -1;
    e->dirty = 1;
    return 0;
}

/* -- reading what a cache holds ---------------------------------------------------------------------------------- */

/* Where updates are followed, a cache or layer class first met (defined after the install) is handed to the
 * delegate, which wraps its methods; -1 on error (left set). */
static int see_class(Tracker *t, PyTypeObject *type) {
    if (!t->follows_peaks)
        return 0;
    int known = PySet_Contains(t->known_classes, (PyObject *)type);
    if (known != 0)
        return known < 0 ? -1 : 0;
    PyObject *seen = PyObject_CallMethodOneArg(t->delegate, s_class_seen, (PyObject *)type);
    if (seen == NULL)
        return -1;
    Py_DECREF(seen);
    return 0;
}

static int no_storage_error(void) {
    /* what a K/V slot that holds no plain tensor raises: None, a sparse or nested tensor, a wrapper subclass */
    return PyErr_ExceptionMatches(PyExc_AttributeError) || PyErr_ExceptionMatches(PyExc_TypeError) ||
           PyErr_ExceptionMatches(PyExc_RuntimeError);
}

/* A method of the last type it was called on, looked up once (a tensor's storage getters are called ~60 times a step;
 * the lookup by name was a third of each call). Only a plain method is kept: anything else is called by name. */
typedef struct {
    PyObject *name;
    PyTypeObject *type; /* strong: a freed type's address must not pass for a new one */
    PyObject *method;
} MethodCache;

static MethodCache m_untyped_storage, m_nbytes, m_data_ptr;

static PyObject *call_method(MethodCache *cache, PyObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    if (type != cache->type) {
        PyObject *method = PyObject_GetAttr((PyObject *)type, cache->name);
        if (method == NULL)
            PyErr_Clear();
        else if (!PyObject_TypeCheck(method, &PyMethodDescr_Type) && !PyFunction_Check(method))
            Py_CLEAR(method);
        Py_XSETREF(cache->method, method);
        Py_XSETREF(cache->type, (PyTypeObject *)Py_NewRef(type));
    }
    if (cache->method == NULL)
        return PyObject_CallMethodNoArgs(self, cache->name);
    return PyObject_Vectorcall(cache->method, &self, 1, NULL);
}

/* Adds the storage of `layer.<name>` to `out`; 0 where it has none, -1 on another error (left set). */
static int read_slot(PyObject *layer, PyObject *name, Storages *out) {
    PyObject *tensor = PyObject_GetAttr(layer, name);
    PyObject *storage = tensor ? call_method(&m_untyped_storage, tensor) : NULL;
    PyObject *nbytes = storage ? call_method(&m_nbytes, storage) : NULL;
    int result = 0;
    if (nbytes == NULL) {
        if (no_storage_error())
            PyErr_Clear();
        else
            result = -1;
    } else {
        long long size = PyLong_AsLongLong(nbytes);
        if (size == -1 && PyErr_Occurred()) {
            result = -1;
        } else if (size > 0) {
            PyObject *pointer = call_method(&m_data_ptr, storage);
            void *address = pointer ? PyLong_AsVoidPtr(pointer) : NULL;
            Py_XDECREF(pointer);
            if (address == NULL)
                result = PyErr_Occurred() ? -1 : 0;
            else
                result = storages_push(out, (uintptr_t)address, (int64_t)size);
        }
    }
    Py_XDECREF(nbytes);
    Py_XDECREF(storage);
    Py_XDECREF(tensor);
    return result;
}

/* What a cache's layers hold as K or V, sorted by pointer, each once (nothing for what cannot be read: the
 * sampler's walk says why). An unexpected error is reported and that slot left out. */
static int read_cache(Tracker *t, PyObject *state, Storages *out) {
    if (state == NULL || !PyDict_Check(state))
        return 0;
    PyObject *layers = PyDict_GetItemWithError(state, s_layers);
    if (layers == NULL) {
        if (PyErr_Occurred())
            report(t, "peak");
        return 0;
    }
    if (!PyList_CheckExact(layers))
        return 0;
    Py_INCREF(layers);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(layers); i++) { /* re-read: Python code may run in between */
        PyObject *layer = Py_NewRef(PyList_GET_ITEM(layers, i));
        if (see_class(t, Py_TYPE(layer)) < 0)
            report(t, "peak");
        if (read_slot(layer, s_keys, out) < 0 || read_slot(layer, s_values, out) < 0) {
            if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
                Py_DECREF(layer);
                Py_DECREF(layers);
                return -1;
            }
            report(t, "peak");
        }
        Py_DECREF(layer);
    }
    Py_DECREF(layers);
    storages_sort_unique(out);
    return 0;
}

/* -- the accounts ------------------------------------------------------------------------------------------------ */

static Py_ssize_t tally_of(Tracker *t, PyObject *owner) {
    PyObject *index = PyDict_GetItemWithError(t->tally_index, owner);
    if (index != NULL)
        return PyLong_AsSsize_t(index);
    if (PyErr_Occurred())
        return -1;
    Tally *totals = room_for_one(t->totals, t->tallies, &t->tallies_cap, sizeof(Tally));
    if (totals == NULL)
        return -1;
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

/* The tally a new storage of `e` is charged to; its first storage settles a candidate (the delegate's geometry
 * check). A failure charges it to its owner as it stands. */
static Py_ssize_t charge(Tracker *t, Entry *e, uintptr_t ptr) {
    if (e->tally >= 0)
        return e->tally;
    if (e->candidate != NULL && e->candidate != Py_None && e->owner != NULL && e->owner != Py_None) {
        PyObject *pointer = PyLong_FromVoidPtr((void *)ptr);
        PyObject *result = pointer ? PyObject_CallMethodObjArgs(t->delegate, s_charge, (PyObject *)e, pointer, NULL)
                                   : NULL;
        Py_XDECREF(pointer);
        if (result == NULL)
            report(t, "peak");
        Py_XDECREF(result);
    }
    PyObject *owner = (e->owner != NULL && PyUnicode_Check(e->owner)) ? e->owner : t->unattributed;
    Py_INCREF(owner);
    Py_ssize_t tally = tally_of(t, owner);
    Py_DECREF(owner);
    if (tally >= 0)
        e->tally = tally;
    return tally;
}

static void give_up(Tracker *t, uintptr_t ptr) {
    Slot *slot = table_find(&t->held, ptr);
    if (slot == NULL)
        return;
    if (--slot->holders <= 0) {
        t->totals[slot->tally].current -= slot->nbytes;
        table_remove(&t->held, slot);
    }
}

/* Reads every marked cache: the totals then are at least what they were at any instant since the last read. */
static int catch_up_held(Tracker *t) {
    EntryList marked = entrylist_take(&t->marked);
    if (marked.len == 0)
        return 0;
    int result = 0;
    Storages *now = PyMem_Calloc((size_t)marked.len, sizeof(Storages));
    if (now == NULL) {
        PyErr_NoMemory();
        result = -1;
    }
    /* first what each dropped: its address may hold another's storage now */
    for (Py_ssize_t i = 0; result == 0 && i < marked.len; i++) {
        Entry *e = marked.items[i];
        e->dirty = 0;
        if (!e->live)
            continue;
        if (read_cache(t, e->state, &now[i]) < 0) {
            result = -1;
            break;
        }
        Py_ssize_t kept = 0;
        for (Py_ssize_t k = 0; k < e->held.len; k++) {
            if (storages_contain(&now[i], e->held.items[k].ptr))
                e->held.items[kept++] = e->held.items[k];
            else
                give_up(t, e->held.items[k].ptr);
        }
        e->held.len = kept; /* what it still holds: a release in between gives up exactly that */
    }
    /* then what each holds now */
    Py_ssize_t settled = 0; /* entries whose reading is complete */
    for (Py_ssize_t i = 0; result == 0 && i < marked.len; i++, settled = i) {
        Entry *e = marked.items[i];
        if (!e->live)
            continue;
        Storages *read = &now[i];
        for (Py_ssize_t k = 0; k < read->len; k++) {
            uintptr_t ptr = read->items[k].ptr;
            if (storages_contain(&e->held, ptr))
                continue;
            Slot *slot = table_find(&t->held, ptr);
            if (slot != NULL) {
                slot->holders++;
                continue;
            }
            Py_ssize_t tally = charge(t, e, ptr);
            Slot *held = tally < 0 ? NULL : table_slot(&t->held, ptr);
            if (held == NULL) {
                result = -1;
                break;
            }
            held->nbytes = read->items[k].nbytes;
            held->holders = 1;
            held->tally = tally;
            t->totals[tally].current += read->items[k].nbytes;
        }
        if (result < 0)
            break;
        storages_free(&e->held);
        e->held = *read;
        read->items = NULL;
        read->len = read->cap = 0;
    }
    for (Py_ssize_t k = 0; k < t->tallies; k++)
        if (t->totals[k].current > t->totals[k].peak)
            t->totals[k].peak = t->totals[k].current;
    for (Py_ssize_t i = 0; i < marked.len; i++) {
        Entry *e = marked.items[i];
        if (i >= settled) { /* a failure left it half read: read again at the next catch-up */
            e->dirty = 0;
            if (mark(t, e) < 0)
                PyErr_Clear();
        }
        if (now != NULL)
            storages_free(&now[i]);
        Py_DECREF(e);
    }
    PyMem_Free(now);
    PyMem_Free(marked.items);
    return result;
}

/* Drops `e` from the live table (its last reference may go with it). */
static void forget(Tracker *t, Entry *e) {
    e->live = 0;
    Py_CLEAR(e->state);
    PyObject *held = objmap_pop(&t->live, (uintptr_t)e->cache_id);
    if (held != NULL && held != (PyObject *)e) { /* another cache at that address took its slot: put it back */
        PyObject *replaced;
        if (objmap_put(&t->live, (uintptr_t)e->cache_id, held, &replaced) < 0)
            PyErr_Clear();
        Py_XDECREF(replaced);
    }
    Py_XDECREF(held);
}

/* `e`'s cache is gone: count the instant before, then its storage goes. Inside the accounts. */
static void release_held(Tracker *t, Entry *e) {
    if (t->marked.len && catch_up_held(t) < 0)
        report(t, "peak");
    for (Py_ssize_t k = 0; k < e->held.len; k++)
        give_up(t, e->held.items[k].ptr);
    storages_free(&e->held);
    forget(t, e);
}

static void settle_deferred(Tracker *t) {
    while (t->deferred.len) {
        EntryList deferred = entrylist_take(&t->deferred);
        for (Py_ssize_t i = 0; i < deferred.len; i++) {
            if (deferred.items[i]->live)
                release_held(t, deferred.items[i]);
            Py_DECREF(deferred.items[i]);
        }
        PyMem_Free(deferred.items);
    }
}

/* Releases what arrived meanwhile and leaves the accounts; an exception pending on entry is kept for the caller. */
static void settle_and_leave(Tracker *t) {
    PyObject *error_type, *error, *traceback;
    PyErr_Fetch(&error_type, &error, &traceback);
    settle_deferred(t);
    leave(t);
    PyErr_Restore(error_type, error, traceback);
}

/* -- Python-facing methods ----------------------------------------------------------------------------------------- */

/* The weak-reference callback of every entry: never raises. */
static PyObject *tracker_released(Tracker *t, PyObject *ref) {
    if (!PyObject_TypeCheck(ref, &EntryType))
        Py_RETURN_NONE;
    Entry *e = (Entry *)Py_NewRef(ref);
    if (e->live) {
        if (!t->follows_peaks || (e->held.len == 0 && !e->dirty)) { /* nothing it holds is counted: nothing falls */
            forget(t, e);
        } else if (!enter(t)) {
            if (entrylist_push(&t->deferred, e) < 0)
                report(t, "peak");
        } else {
            release_held(t, e);
            settle_and_leave(t);
        }
    }
    Py_DECREF(e);
    if (PyErr_Occurred())
        report(t, "peak");
    Py_RETURN_NONE;
}

static PyMethodDef released_def = {"released", (PyCFunction)tracker_released, METH_O, NULL};

/* Names the owner of a cache made by `frame` (the caller of the cache class's `__new__`): the first frame running a
 * module's code names it. Sets owner and candidate (new references); -1 on error. */
static int attribute(Tracker *t, PyFrameObject *frame, PyObject **owner, PyObject **candidate) {
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
        if (found != NULL && PyTuple_Check(found) && PyTuple_GET_SIZE(found) == 2) {
            *owner = Py_NewRef(PyTuple_GET_ITEM(found, 0));
            *candidate = Py_NewRef(PyTuple_GET_ITEM(found, 1));
            Py_DECREF(found);
            Py_DECREF(frame);
            return 0;
        }
        Py_XDECREF(found);
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    *owner = Py_NewRef(t->unattributed);
    *candidate = Py_NewRef(Py_None);
    return 0;
}

static int is_copying(Tracker *t, PyFrameObject *frame) {
    if (frame == NULL)
        return 0;
    PyCodeObject *code = PyFrame_GetCode(frame);
    int found = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t->copying); i++)
        found |= PyTuple_GET_ITEM(t->copying, i) == (PyObject *)code;
    Py_DECREF(code);
    return found;
}

static Entry *new_entry(Tracker *t, PyObject *cache) {
    PyObject *args[] = {cache, t->on_release};
    Entry *e = (Entry *)PyObject_Vectorcall((PyObject *)&EntryType, args, 2, NULL);
    if (e == NULL)
        return NULL;
    e->cache_id = (Py_ssize_t)(uintptr_t)cache;
    e->seq = t->next_seq++;
    e->tally = -1;
    e->state = PyObject_GetAttr(cache, s_dict);
    if (e->state == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            Py_DECREF(e);
            return NULL;
        }
        PyErr_Clear();
    }
    return e;
}

PyDoc_STRVAR(track_doc, "track(cache)\n--\n\nTrack a cache just made: called from the cache class's `__new__`, whose "
                        "caller is the code that made it (its owner). Raises TypeError for a cache that cannot be "
                        "weakly referenced.");

static PyObject *tracker_track(Tracker *t, PyObject *cache) {
    if (see_class(t, Py_TYPE(cache)) < 0)
        return NULL;
    Entry *e = new_entry(t, cache);
    if (e == NULL)
        return NULL;
    PyFrameObject *here = PyEval_GetFrame(); /* the `__new__` calling this */
    PyFrameObject *maker = here != NULL ? PyFrame_GetBack(here) : NULL;
    int failed = 0;
    if (t->model_known) {
        failed = attribute(t, maker, &e->owner, &e->candidate);
        e->pending = PyTuple_New(0);
    } else {
        e->pending = PyObject_CallMethodOneArg(t->delegate, s_modules_on_stack, maker ? (PyObject *)maker : Py_None);
    }
    failed = failed || e->pending == NULL;
    PyObject *stale = failed ? NULL : objmap_get(&t->live, (uintptr_t)cache);
    if (stale != NULL) { /* a cache at this address whose release is still deferred: released first */
        PyObject *done = tracker_released(t, stale);
        Py_XDECREF(done);
    }
    PyObject *replaced = NULL;
    if (!failed)
        failed = objmap_put(&t->live, (uintptr_t)cache, (PyObject *)e, &replaced) < 0;
    if (!failed) {
        e->live = 1;
        Py_XDECREF(replaced); /* its release, deferred, finds this one in its place and leaves it */
        if (t->follows_peaks && is_copying(t, maker)) /* its contents arrive after `__new__`, unannounced */
            failed = mark(t, e) < 0;
    }
    if (!failed && (e->owner == NULL || e->owner == Py_None) && t->model_known) { /* the model came meanwhile */
        PyObject *settled = PyObject_CallMethodOneArg(t->delegate, s_settle, (PyObject *)e);
        failed = settled == NULL;
        Py_XDECREF(settled);
    }
    Py_XDECREF(maker);
    Py_DECREF(e);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(mark_doc, "mark(cache)\n--\n\nWhat `cache` holds may have grown: read it at the next fall or sample.");

static PyObject *tracker_mark(Tracker *t, PyObject *cache) {
    PyObject *e = objmap_get(&t->live, (uintptr_t)cache);
    if (e != NULL && mark(t, (Entry *)e) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(catch_up_doc, "catch_up()\n--\n\nRead every marked cache now (just before something may fall); "
                           "failures are reported to the delegate, never raised.");

static PyObject *tracker_catch_up(Tracker *t, PyObject *Py_UNUSED(ignored)) {
    if (t->marked.len == 0 || !enter(t))
        Py_RETURN_NONE;
    if (catch_up_held(t) < 0)
        report(t, "peak");
    settle_and_leave(t);
    if (PyErr_Occurred())
        report(t, "peak");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(take_peaks_doc, "take_peaks()\n--\n\nowner -> the most its caches held since the last call, for the "
                             "owners that held anything; the next interval starts at what they hold now.");

static PyObject *tracker_take_peaks(Tracker *t, PyObject *Py_UNUSED(ignored)) {
    if (!enter(t)) {
        PyErr_SetString(PyExc_RuntimeError, "take_peaks() from inside the accounts");
        return NULL;
    }
    PyObject *peaks = NULL;
    if (catch_up_held(t) == 0 && (peaks = PyDict_New()) != NULL) {
        for (Py_ssize_t k = 0; k < t->tallies; k++) {
            if (t->totals[k].peak > 0) {
                PyObject *value = PyLong_FromLongLong(t->totals[k].peak);
                if (value == NULL || PyDict_SetItem(peaks, PyList_GET_ITEM(t->tally_names, k), value) < 0) {
                    Py_XDECREF(value);
                    Py_CLEAR(peaks);
                    break;
                }
                Py_DECREF(value);
            }
            t->totals[k].peak = t->totals[k].current;
        }
    }
    settle_and_leave(t);
    return peaks;
}

PyDoc_STRVAR(rebuild_doc, "rebuild()\n--\n\nCount again from the live caches (once their owners are known): what they "
                          "hold now is the new peak.");

static PyObject *tracker_rebuild(Tracker *t, PyObject *Py_UNUSED(ignored)) {
    if (!enter(t)) {
        PyErr_SetString(PyExc_RuntimeError, "rebuild() from inside the accounts");
        return NULL;
    }
    int failed = 0;
    table_clear(&t->held);
    t->tallies = 0;
    PyDict_Clear(t->tally_index);
    failed = PyList_SetSlice(t->tally_names, 0, PyList_GET_SIZE(t->tally_names), NULL) < 0;
    for (size_t j = 0; !failed && t->live.slots != NULL && j <= t->live.mask; j++) {
        Entry *e = (Entry *)t->live.slots[j].object;
        if (e == NULL)
            continue;
        storages_free(&e->held);
        e->tally = -1;
        failed = mark(t, e) < 0;
    }
    if (!failed)
        failed = catch_up_held(t) < 0;
    settle_and_leave(t);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
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
    for (size_t j = 0; t->live.slots != NULL && j <= t->live.mask; j++)
        if (t->live.slots[j].object != NULL)
            found[n++] = (Entry *)t->live.slots[j].object;
    qsort(found, (size_t)n, sizeof(Entry *), by_creation);
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list != NULL && i < n; i++)
        PyList_SET_ITEM(list, i, Py_NewRef((PyObject *)found[i]));
    PyMem_Free(found);
    return list;
}

PyDoc_STRVAR(set_sites_doc, "set_sites(sites)\n--\n\nThe model's map, id(code) -> Attribution, or a shared site the "
                            "delegate's owner_of_shared(site, frame) names; None: the model is not known.");

static PyObject *tracker_set_sites(Tracker *t, PyObject *sites) {
    table_clear(&t->sites);
    t->model_known = 0;
    if (sites == Py_None)
        Py_RETURN_NONE;
    if (!PyDict_Check(sites)) {
        PyErr_SetString(PyExc_TypeError, "sites must be a dict or None");
        return NULL;
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(sites, &pos, &key, &value)) {
        void *code = PyLong_AsVoidPtr(key);
        PyObject *replaced;
        if ((code == NULL && PyErr_Occurred()) || objmap_put(&t->sites, (uintptr_t)code, value, &replaced) < 0) {
            table_clear(&t->sites);
            return NULL;
        }
        Py_XDECREF(replaced);
    }
    t->model_known = 1;
    Py_RETURN_NONE;
}

static PyMethodDef tracker_methods[] = {
    {"track", (PyCFunction)tracker_track, METH_O, track_doc},
    {"mark", (PyCFunction)tracker_mark, METH_O, mark_doc},
    {"catch_up", (PyCFunction)tracker_catch_up, METH_NOARGS, catch_up_doc},
    {"take_peaks", (PyCFunction)tracker_take_peaks, METH_NOARGS, take_peaks_doc},
    {"rebuild", (PyCFunction)tracker_rebuild, METH_NOARGS, rebuild_doc},
    {"entries", (PyCFunction)tracker_entries, METH_NOARGS, entries_doc},
    {"set_sites", (PyCFunction)tracker_set_sites, METH_O, set_sites_doc},
    {NULL},
};

static PyMemberDef tracker_members[] = {
    {"follows_peaks", T_BOOL, offsetof(Tracker, follows_peaks), 0, "updates and falls are counted (the peak)"},
    {NULL},
};

static int tracker_init(Tracker *t, PyObject *args, PyObject *kwds) {
    static char *names[] = {"delegate", "unattributed", "known_classes", "copying", NULL};
    PyObject *delegate, *unattributed, *known, *copying;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OUO!O!:Tracker", names, &delegate, &unattributed, &PySet_Type,
                                     &known, &PyTuple_Type, &copying))
        return -1;
    if (t->delegate != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Tracker is initialised once");
        return -1;
    }
    t->delegate = Py_NewRef(delegate);
    t->unattributed = Py_NewRef(unattributed);
    t->known_classes = Py_NewRef(known);
    t->copying = Py_NewRef(copying);
    t->on_release = PyCFunction_New(&released_def, (PyObject *)t);
    t->tally_names = PyList_New(0);
    t->tally_index = PyDict_New();
    t->lock = PyThread_allocate_lock();
    if (t->on_release == NULL || t->tally_names == NULL || t->tally_index == NULL)
        return -1;
    if (t->lock == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int tracker_traverse(Tracker *t, visitproc visit, void *arg) {
    Py_VISIT(t->delegate);
    Py_VISIT(t->unattributed);
    Py_VISIT(t->on_release);
    Py_VISIT(t->known_classes);
    Py_VISIT(t->copying);
    Py_VISIT(t->tally_names);
    Py_VISIT(t->tally_index);
    for (size_t j = 0; t->live.slots != NULL && j <= t->live.mask; j++)
        Py_VISIT(t->live.slots[j].object);
    for (size_t j = 0; t->sites.slots != NULL && j <= t->sites.mask; j++)
        Py_VISIT(t->sites.slots[j].object);
    for (Py_ssize_t i = 0; i < t->marked.len; i++)
        Py_VISIT(t->marked.items[i]);
    for (Py_ssize_t i = 0; i < t->deferred.len; i++)
        Py_VISIT(t->deferred.items[i]);
    return 0;
}

static int tracker_clear(Tracker *t) {
    Py_CLEAR(t->delegate);
    Py_CLEAR(t->unattributed);
    Py_CLEAR(t->on_release);
    Py_CLEAR(t->known_classes);
    Py_CLEAR(t->copying);
    Py_CLEAR(t->tally_names);
    Py_CLEAR(t->tally_index);
    table_clear(&t->live);
    table_clear(&t->sites);
    entrylist_release(&t->marked);
    entrylist_release(&t->deferred);
    return 0;
}

static void tracker_dealloc(Tracker *t) {
    PyObject_GC_UnTrack(t);
    tracker_clear(t);
    table_clear(&t->held);
    PyMem_Free(t->totals);
    if (t->lock != NULL)
        PyThread_free_lock(t->lock);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyTypeObject TrackerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kv_exporter.plugin.observe._tracker.Tracker",
    .tp_basicsize = sizeof(Tracker),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Tracker(delegate, unattributed, known_classes, copying): the live caches and their owners' accounts.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)tracker_init,
    .tp_traverse = (traverseproc)tracker_traverse,
    .tp_clear = (inquiry)tracker_clear,
    .tp_dealloc = (destructor)tracker_dealloc,
    .tp_methods = tracker_methods,
    .tp_members = tracker_members,
};

/* -- the module ------------------------------------------------------------------------------------------------------ */

static int intern_all(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_layers, "layers"},
        {&s_keys, "keys"},
        {&s_values, "values"},
        {&s_untyped_storage, "untyped_storage"},
        {&s_nbytes, "nbytes"},
        {&s_data_ptr, "data_ptr"},
        {&s_dict, "__dict__"},
        {&s_owner_of_shared, "owner_of_shared"},
        {&s_modules_on_stack, "modules_on_stack"},
        {&s_charge, "charge"},
        {&s_class_seen, "class_seen"},
        {&s_failed, "failed"},
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

static struct PyModuleDef tracker_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kv_exporter.plugin.observe._tracker",
    .m_doc = "The live transformers caches of this process and their owners' storage accounts (the per-step part).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__tracker(void) {
    EntryType.tp_base = &_PyWeakref_RefType;
    if (intern_all() < 0 || PyType_Ready(&EntryType) < 0 || PyType_Ready(&TrackerType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&tracker_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObject(module, "Entry", Py_NewRef((PyObject *)&EntryType)) < 0 ||
        PyModule_AddObject(module, "Tracker", Py_NewRef((PyObject *)&TrackerType)) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
