/* The tracker's data structures (_tracker.c includes this file; tests/c/test_tables.c tests it alone): an entry's
 * storages, a sorted array; the open-addressing tables keyed by an address; and the ledger of held storages, one slot
 * per data pointer, charged to an owner's tally. Nothing here calls Python: every function may run inside a commit
 * (_tracker.c says why that matters). Memory comes from PyMem_*, where tracemalloc and the interpreter's debug hooks
 * see it; a slot's object is a strong reference only where its table's owner says so (`table_clear`). */

#ifndef KV_EXPORTER_TABLES_H
#define KV_EXPORTER_TABLES_H

#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* -- storages: data pointer and bytes; an entry keeps its own sorted by pointer ---------------------------------- */

typedef struct {
    uintptr_t ptr;
    int64_t nbytes;
} Storage;

typedef struct {
    Storage *items;
    Py_ssize_t len, cap;
} Storages;

/* A growable array (`items`, `cap` slots, `len` used) with room for one more: the same or a moved block, `cap`
 * updated; NULL when out of memory (the old block is kept; no exception is set). */
static void *room_for_one(void *items, Py_ssize_t len, Py_ssize_t *cap, size_t item_size) {
    if (len < *cap)
        return items;
    Py_ssize_t grown = *cap ? *cap * 2 : 4;
    void *moved = PyMem_Realloc(items, (size_t)grown * item_size);
    if (moved == NULL)
        return NULL;
    *cap = grown;
    return moved;
}

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

static int storages_contain(const Storages *s, Storage item) {
    Py_ssize_t lo = 0, hi = s->len;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (s->items[mid].ptr < item.ptr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < s->len && s->items[lo].ptr == item.ptr && s->items[lo].nbytes == item.nbytes;
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
    union {
        PyObject *object;
        int64_t nbytes;
    };
    int32_t holders;
    int32_t tally;
} Slot;

typedef struct {
    Slot *slots;
    size_t mask, used;
} Table;

#define TABLE_MIN 64

static size_t table_size(const Table *t) { return t->slots ? t->mask + 1 : 0; }

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

/* Moves every slot into a new array of `size` slots; -1 when out of memory (the table is unchanged). */
static int table_resize(Table *t, size_t size) {
    Slot *slots = PyMem_Calloc(size, sizeof(Slot));
    if (slots == NULL)
        return -1;
    for (size_t j = 0; j < table_size(t); j++) {
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
    return 0;
}

/* Room for `count` keys (at most half full); -1 when out of memory. */
static int table_reserve(Table *t, size_t count) {
    size_t size = table_size(t) ? table_size(t) : TABLE_MIN;
    while (count * 2 > size)
        size *= 2;
    return size == table_size(t) ? 0 : table_resize(t, size);
}

/* Gives memory back once the table is at most 1/8 full (a burst of caches freed): to a quarter full. */
static void table_shrink(Table *t) {
    size_t size = table_size(t);
    if (size <= TABLE_MIN || t->used * 8 > size)
        return;
    while (size > TABLE_MIN && t->used * 4 < size / 2)
        size /= 2;
    (void)table_resize(t, size); /* out of memory: it stays as large as it was */
}

/* The slot of `key`, made (zeroed) if absent; the table must have room (table_reserve). */
static Slot *table_slot(Table *t, uintptr_t key) {
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

/* Empties the table; `objects`: its slots hold references, released here. */
static void table_clear(Table *t, int objects) {
    Slot *slots = t->slots;
    size_t size = table_size(t);
    t->slots = NULL;
    t->mask = t->used = 0;
    for (size_t j = 0; objects && j < size; j++)
        if (slots[j].key != 0)
            Py_DECREF(slots[j].object);
    PyMem_Free(slots);
}

static PyObject *objmap_get(const Table *t, uintptr_t key) {
    Slot *slot = table_find(t, key);
    return slot == NULL ? NULL : slot->object;
}

/* -- the ledger: each storage held once, by data pointer and size, charged to the tally of its first holder -------- */

typedef struct {
    int64_t current, peak;
} Tally;

/* A holder of `s` lets it go: the last one takes its bytes off its tally. */
static void ledger_give_up(Table *held, Tally *totals, Storage s) {
    Slot *slot = table_find(held, s.ptr);
    if (slot == NULL || slot->nbytes != s.nbytes) /* not this storage: it was replaced at a reused address */
        return;
    if (--slot->holders <= 0) {
        totals[slot->tally].current -= slot->nbytes;
        table_remove(held, slot);
    }
}

/* One more holder of `s`, charged to `tally` if it is the first; the table has room (table_reserve). */
static void ledger_take(Table *held, Tally *totals, Py_ssize_t tally, Storage s) {
    Slot *slot = table_find(held, s.ptr);
    if (slot != NULL && slot->nbytes == s.nbytes) {
        slot->holders++;
        return;
    }
    if (slot != NULL) /* another storage at a reused address, whose holders changed unannounced: it is gone */
        totals[slot->tally].current -= slot->nbytes;
    else
        slot = table_slot(held, s.ptr);
    slot->nbytes = s.nbytes;
    slot->holders = 1;
    slot->tally = (int32_t)tally;
    totals[tally].current += s.nbytes;
}

#endif
