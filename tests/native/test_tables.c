/* The tracker's tables alone (kv_exporter/plugin/observe/_tables.h), against a plain model of what they should hold:
 * inserts, lookups, removals (backward shift: no tombstones), growth, shrinking, collisions and wrap-around, the
 * sorted storages and the ledger's per-tally counts. Built and run by tests/native/test_tables.py, with an embedded
 * interpreter only for PyMem_* and the reference counts of objects a table holds. Prints one line per check that
 * fails and exits 1 if any did. */

#define PY_SSIZE_T_CLEAN
#include "_tables.h"

#include <stdio.h>

static int failures;

#define CHECK(cond)                                                                                                    \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            printf("FAILED %s:%d: %s\n", __func__, __LINE__, #cond);                                                   \
            failures++;                                                                                                \
        }                                                                                                              \
    } while (0)

/* Addresses as the tracker meets them: 16-byte aligned, never 0. */
static uintptr_t key_of(size_t i) { return (uintptr_t)(i + 1) * 16; }

static Slot *insert(Table *t, uintptr_t key) {
    if (table_reserve(t, t->used + 1) < 0)
        return NULL;
    return table_slot(t, key);
}

static int removed(Table *t, uintptr_t key) {
    Slot *slot = table_find(t, key);
    if (slot == NULL)
        return 0;
    table_remove(t, slot);
    return 1;
}

/* Every key lies in the run of occupied slots starting at its home (what lookups rely on), and `used` counts them. */
static int probe_runs_hold(const Table *t) {
    size_t occupied = 0;
    for (size_t j = 0; j < table_size(t); j++) {
        if (t->slots[j].key == 0)
            continue;
        occupied++;
        for (size_t i = slot_of(t->slots[j].key, t->mask); i != j; i = (i + 1) & t->mask)
            if (t->slots[i].key == 0)
                return 0;
    }
    return occupied == t->used;
}

/* `count` keys whose home slot in a table of `size` slots is `home`. */
static void colliding(uintptr_t *keys, size_t count, size_t size, size_t home) {
    size_t found = 0;
    for (size_t i = 0; found < count; i++)
        if (slot_of(key_of(i), size - 1) == home)
            keys[found++] = key_of(i);
}

static void test_insert_lookup_grow(void) {
    Table t = {0};
    CHECK(table_find(&t, key_of(0)) == NULL); /* an empty table has no slots at all */
    size_t sizes_seen = 0, last = 0;
    for (size_t i = 0; i < 5000; i++) {
        Slot *slot = insert(&t, key_of(i));
        CHECK(slot != NULL && slot->key == key_of(i));
        slot->nbytes = (int64_t)i;
        CHECK(t.used * 2 <= table_size(&t)); /* at most half full */
        if (table_size(&t) != last)
            sizes_seen++, last = table_size(&t);
    }
    CHECK(t.used == 5000);
    CHECK(table_size(&t) == 16384); /* 64 doubled up to the first size at least twice 5000 */
    CHECK(sizes_seen == 9);
    CHECK(probe_runs_hold(&t));
    for (size_t i = 0; i < 5000; i++) {
        Slot *slot = table_find(&t, key_of(i));
        CHECK(slot != NULL && slot->nbytes == (int64_t)i); /* a rehash moves each value with its key */
    }
    CHECK(table_find(&t, key_of(5000)) == NULL);
    CHECK(table_slot(&t, key_of(7)) == table_find(&t, key_of(7))); /* inserting a present key finds it */
    CHECK(t.used == 5000);
    table_clear(&t, 0);
    CHECK(t.slots == NULL && t.used == 0 && table_size(&t) == 0);
}

static void test_collisions_and_wraparound(void) {
    Table t = {0};
    CHECK(table_reserve(&t, 1) == 0 && table_size(&t) == TABLE_MIN);
    uintptr_t keys[5];
    colliding(keys, 5, TABLE_MIN, TABLE_MIN - 2); /* a run from the second last slot wraps to slots 0 .. 2 */
    for (int i = 0; i < 5; i++)
        insert(&t, keys[i]);
    for (int i = 0; i < 5; i++)
        CHECK(table_find(&t, keys[i]) == &t.slots[(TABLE_MIN - 2 + (size_t)i) & t.mask]);
    CHECK(removed(&t, keys[1])); /* a hole in the middle of the run: the keys after it shift back, across the wrap */
    CHECK(table_find(&t, keys[1]) == NULL);
    for (int i = 2; i < 5; i++)
        CHECK(table_find(&t, keys[i]) == &t.slots[(TABLE_MIN - 3 + (size_t)i) & t.mask]);
    CHECK(t.slots[2].key == 0); /* the run is 4 long again: nothing left behind where it ended */
    CHECK(probe_runs_hold(&t));
    table_clear(&t, 0);
    /* a key at home in slot 0, after a run ending in the last slot, never moves back across the wrap */
    uintptr_t zero;
    colliding(&zero, 1, TABLE_MIN, 0);
    insert(&t, keys[0]);
    insert(&t, keys[1]);
    CHECK(insert(&t, zero) == &t.slots[0]);
    CHECK(removed(&t, keys[1]));
    CHECK(table_find(&t, zero) == &t.slots[0] && t.slots[TABLE_MIN - 1].key == 0);
    CHECK(probe_runs_hold(&t) && t.used == 2);
    table_clear(&t, 0);
}

/* No tombstones: a table that only ever holds a few keys at once stays at its first size however many come and go,
 * and a lookup of an absent key ends at the first empty slot. */
static void test_churn_leaves_nothing_behind(void) {
    Table t = {0};
    for (size_t i = 0; i < 200000; i++) {
        insert(&t, key_of(i));
        if (i >= 8)
            CHECK(removed(&t, key_of(i - 8)));
    }
    CHECK(t.used == 8 && table_size(&t) == TABLE_MIN);
    size_t empty = 0;
    for (size_t j = 0; j < table_size(&t); j++)
        empty += t.slots[j].key == 0;
    CHECK(empty == TABLE_MIN - 8);
    CHECK(probe_runs_hold(&t));
    table_clear(&t, 0);
}

static uint64_t next_random(uint64_t *state) { /* xorshift64: the same sequence on every run */
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

/* Random inserts and removals over a small key space, against a plain array of which keys are in. */
static void test_against_a_model(void) {
    enum { KEYS = 700 };
    static char in[KEYS];
    Table t = {0};
    uint64_t state = 0x2545F4914F6CDD1Dull;
    size_t count = 0;
    for (int step = 0; step < 300000; step++) {
        size_t i = (size_t)(next_random(&state) % KEYS);
        if (next_random(&state) % 3) {
            Slot *slot = insert(&t, key_of(i));
            count += !in[i];
            in[i] = 1;
            slot->nbytes = (int64_t)i;
        } else {
            CHECK(removed(&t, key_of(i)) == in[i]);
            count -= in[i];
            in[i] = 0;
        }
        if (step % 1000 == 0) {
            table_shrink(&t); /* as a sample does */
            CHECK(probe_runs_hold(&t));
        }
        if (failures > 20)
            return;
    }
    CHECK(t.used == count);
    for (size_t i = 0; i < KEYS; i++) {
        Slot *slot = table_find(&t, key_of(i));
        CHECK((slot != NULL) == in[i]);
        CHECK(slot == NULL || slot->nbytes == (int64_t)i);
    }
    table_clear(&t, 0);
}

static void test_shrink(void) {
    Table t = {0};
    for (size_t i = 0; i < 1000; i++)
        insert(&t, key_of(i));
    CHECK(table_size(&t) == 2048);
    table_shrink(&t); /* half full: kept */
    CHECK(table_size(&t) == 2048);
    for (size_t i = 0; i < 990; i++)
        removed(&t, key_of(i));
    table_shrink(&t); /* 10 of 2048: down to a quarter full at most, not under TABLE_MIN */
    CHECK(table_size(&t) == TABLE_MIN);
    for (size_t i = 990; i < 1000; i++)
        CHECK(table_find(&t, key_of(i)) != NULL);
    CHECK(probe_runs_hold(&t));
    table_clear(&t, 0);
}

/* A table of objects holds one reference each, given back by table_clear. */
static void test_objects_released(void) {
    enum { COUNT = 100 };
    PyObject *objects[COUNT];
    Table t = {0};
    for (int i = 0; i < COUNT; i++) {
        objects[i] = PyLong_FromLong(1000000 + i); /* not a cached small int */
        insert(&t, (uintptr_t)objects[i])->object = Py_NewRef(objects[i]);
        CHECK(Py_REFCNT(objects[i]) == 2);
    }
    PyObject *found = objmap_get(&t, (uintptr_t)objects[5]);
    CHECK(found == objects[5]);
    CHECK(objmap_get(&t, key_of(0)) == NULL);
    table_clear(&t, 1);
    for (int i = 0; i < COUNT; i++) {
        CHECK(Py_REFCNT(objects[i]) == 1);
        Py_DECREF(objects[i]);
    }
}

static void test_storages(void) {
    Storages s = {0};
    uintptr_t pointers[] = {0x500, 0x100, 0x300, 0x100, 0x200, 0x500, 0x400};
    for (size_t i = 0; i < sizeof(pointers) / sizeof(pointers[0]); i++)
        CHECK(storages_push(&s, pointers[i], (int64_t)pointers[i] / 16) == 0);
    CHECK(s.len == 7 && s.cap == 8);
    storages_sort_unique(&s);
    CHECK(s.len == 5);
    for (Py_ssize_t i = 0; i < s.len; i++)
        CHECK(s.items[i].ptr == (uintptr_t)(i + 1) * 0x100);
    CHECK(storages_contain(&s, (Storage){0x300, 0x30}));
    CHECK(!storages_contain(&s, (Storage){0x300, 0x31})); /* the same address, another storage */
    CHECK(!storages_contain(&s, (Storage){0x350, 0x35}));
    CHECK(!storages_contain(&s, (Storage){0x600, 0x60}));
    storages_free(&s);
    CHECK(s.items == NULL && s.len == 0 && s.cap == 0);
    CHECK(!storages_contain(&s, (Storage){0x100, 0x10}));
}

/* The ledger: a storage held by several caches is counted once, on the tally of its first holder, until the last
 * lets it go; a different storage at a reused address replaces it. */
static void test_ledger_counts(void) {
    Table held = {0};
    Tally totals[2] = {{0, 0}, {0, 0}};
    Storage a = {0x1000, 4096}, b = {0x2000, 1024};
    table_reserve(&held, 4);
    ledger_take(&held, totals, 0, a);
    ledger_take(&held, totals, 1, a); /* a second holder, of another owner: still charged to the first */
    ledger_take(&held, totals, 1, b);
    CHECK(totals[0].current == 4096 && totals[1].current == 1024);
    CHECK(held.used == 2 && table_find(&held, a.ptr)->holders == 2);
    ledger_give_up(&held, totals, a);
    CHECK(totals[0].current == 4096 && table_find(&held, a.ptr)->holders == 1);
    ledger_give_up(&held, totals, (Storage){a.ptr, 8192}); /* not the storage held there: nothing changes */
    CHECK(totals[0].current == 4096 && table_find(&held, a.ptr)->holders == 1);
    ledger_give_up(&held, totals, a);
    CHECK(totals[0].current == 0 && table_find(&held, a.ptr) == NULL && held.used == 1);
    /* b's address reused by a larger storage whose release never came: the new one replaces it */
    ledger_take(&held, totals, 0, (Storage){b.ptr, 2048});
    CHECK(totals[1].current == 0 && totals[0].current == 2048);
    CHECK(table_find(&held, b.ptr)->holders == 1 && table_find(&held, b.ptr)->tally == 0);
    ledger_give_up(&held, totals, b); /* the old size: not what is held there now */
    CHECK(totals[0].current == 2048);
    ledger_give_up(&held, totals, (Storage){b.ptr, 2048});
    CHECK(totals[0].current == 0 && held.used == 0);
    table_clear(&held, 0);
}

int main(void) {
    Py_Initialize();
    test_insert_lookup_grow();
    test_collisions_and_wraparound();
    test_churn_leaves_nothing_behind();
    test_against_a_model();
    test_shrink();
    test_objects_released();
    test_storages();
    test_ledger_counts();
    if (Py_FinalizeEx() < 0)
        failures++;
    printf("%s\n", failures ? "tables: FAILED" : "tables: ok");
    return failures != 0;
}
