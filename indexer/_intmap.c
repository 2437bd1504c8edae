/* indexer._intmap: IntMap, an int64-keyed open-addressing hash map for the prefix index.
 *
 * Why: the index's two big dicts (block key -> table value, engine hash -> block key) cost a dict
 * slot plus a 32-byte int object per key; here an entry is one 16-byte slot and a lookup touches
 * one cache line. Semantics are those of indexer.int_map.PyIntMap (a dict subclass), plus type
 * checks: keys are int or bytes, values int (int64 when packed).
 *
 * Layout: a power-of-two array of {uint64 tag; int64-or-PyObject* value}. The tag is ~key, so a
 * zeroed slot (PyMem_Calloc) is empty and the key -1 is the one int64 that cannot live in the
 * array (CPython's hash() never returns -1, so block keys never need the overflow). Linear
 * probing from fmix64(key) (sequential engine hashes must not cluster), backward-shift deletion
 * (no tombstones), doubling past a load of 3/4 (7/8 made absent-key probes 50% slower for 14%
 * less memory), shrinking to a load <= 3/8 when a deletion leaves it at 1/8. Every other key
 * (bytes, ints outside int64, -1) lives in an internal overflow dict.
 *
 * Keys and values are normalised to exact int/bytes, so the map's own operations run no user code
 * (__hash__, __eq__, __del__ of keys or values), and holding only ints it needs no GC support.
 * User code can still run while a caller's iterable is iterated, and (3.11) from a finalizer
 * when allocating a GC-tracked object triggers a collection: loops re-read the array after
 * either, and array walks allocate nothing GC-tracked.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MIN_CAP 8
#ifndef LOAD_NUM
#define LOAD_NUM 3 /* grow when used + 1 > cap * LOAD_NUM / LOAD_DEN */
#define LOAD_DEN 4
#endif
#ifndef BATCH
#define BATCH 16 /* keys hashed and prefetched ahead of their probes (measured: 16-32 best) */
#endif

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((p), 0, 3)
#define PREFETCH_W(p) __builtin_prefetch((p), 1, 3)
#else
#define PREFETCH(p) ((void)(p))
#define PREFETCH_W(p) ((void)(p))
#endif

typedef struct {
    uint64_t tag; /* ~key; 0 means empty */
    union {
        int64_t i;   /* packed=True */
        PyObject *o; /* packed=False: a strong reference to an exact int (or bool) */
    } v;
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;        /* NULL while cap == 0 */
    Py_ssize_t cap;     /* 0 or a power of two >= MIN_CAP */
    Py_ssize_t used;    /* occupied slots */
    PyObject *overflow; /* dict of keys the array cannot hold, created on demand */
    int packed;
} IntMapObject;

static PyTypeObject IntMap_Type;

enum { KEY_ERROR = -1, KEY_ARRAY = 0, KEY_OVERFLOW = 1 };

/* A random per-process key for the slot mix, set at import. Block keys are CPython tuple hashes
 * of prompt tokens, which a client chooses: with a fixed mix anyone could search offline for
 * prompts whose keys pile into one linear-probe run and slow every lookup down. Slot positions
 * (and so iteration order) differ between processes; nothing persists them. */
static uint64_t mix_key;

/* murmur3's fmix64 of the keyed value: full avalanche, so consecutive keys land on unrelated
 * slots, and unpredictable ones without mix_key. */
static inline uint64_t
mix(uint64_t x)
{
    x ^= mix_key;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* Classify a key: KEY_ARRAY sets *out; KEY_OVERFLOW sets *okey to a new reference to an exact
 * int or bytes equal to the key; KEY_ERROR raises TypeError. */
static int
key_of(PyObject *key, int64_t *out, PyObject **okey)
{
    if (PyLong_Check(key)) {
        int ovf = 0;
        long long v = PyLong_AsLongLongAndOverflow(key, &ovf);
        if (ovf == 0 && v != -1) {
            *out = (int64_t)v;
            return KEY_ARRAY;
        }
        if (v == -1 && ovf == 0 && PyErr_Occurred()) {
            return KEY_ERROR;
        }
        *okey = PyNumber_Index(key); /* exact int, even for subclasses */
        return *okey == NULL ? KEY_ERROR : KEY_OVERFLOW;
    }
    if (PyBytes_CheckExact(key)) {
        Py_INCREF(key);
        *okey = key;
        return KEY_OVERFLOW;
    }
    if (PyBytes_Check(key)) {
        *okey = PyBytes_FromStringAndSize(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
        return *okey == NULL ? KEY_ERROR : KEY_OVERFLOW;
    }
    PyErr_Format(PyExc_TypeError, "IntMap keys must be int or bytes, not %.200s",
                 Py_TYPE(key)->tp_name);
    return KEY_ERROR;
}

/* A value to store. Packed: *iv is set and *ov is NULL. Object mode: *ov is a new reference to
 * an exact int or a bool. Returns -1 with TypeError/OverflowError. */
static int
value_of(const IntMapObject *m, PyObject *value, int64_t *iv, PyObject **ov)
{
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "IntMap values must be int, not %.200s",
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    *ov = NULL;
    if (m->packed) {
        int ovf = 0;
        long long v = PyLong_AsLongLongAndOverflow(value, &ovf);
        if (ovf != 0) {
            PyErr_SetString(PyExc_OverflowError,
                            "IntMap(packed=True) values must fit in a signed 64-bit int");
            return -1;
        }
        if (v == -1 && PyErr_Occurred()) {
            return -1;
        }
        *iv = (int64_t)v;
        return 0;
    }
    if (PyLong_CheckExact(value) || PyBool_Check(value)) {
        Py_INCREF(value);
        *ov = value;
        return 0;
    }
    *ov = PyNumber_Index(value); /* an int subclass could carry a __dict__ and make cycles */
    return *ov == NULL ? -1 : 0;
}

/* The Python object for a stored value (new reference). */
static inline PyObject *
slot_value(const IntMapObject *m, const Slot *s)
{
    if (m->packed) {
        return PyLong_FromLongLong(s->v.i);
    }
    Py_INCREF(s->v.o);
    return s->v.o;
}

/* The slot holding key, or NULL. */
static inline Slot *
find(const IntMapObject *m, int64_t key)
{
    if (m->used == 0) {
        return NULL;
    }
    const uint64_t tag = ~(uint64_t)key;
    const size_t mask = (size_t)m->cap - 1;
    size_t i = (size_t)mix((uint64_t)key) & mask;
    for (;;) {
        Slot *s = &m->slots[i];
        if (s->tag == tag) {
            return s;
        }
        if (s->tag == 0) {
            return NULL;
        }
        i = (i + 1) & mask;
    }
}

/* Move every entry into a fresh zeroed array of new_cap slots (a power of two, > used). */
static int
resize(IntMapObject *m, Py_ssize_t new_cap)
{
    Slot *fresh = PyMem_Calloc((size_t)new_cap, sizeof(Slot));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    const size_t mask = (size_t)new_cap - 1;
    for (Py_ssize_t j = 0; j < m->cap; j++) {
        const Slot *s = &m->slots[j];
        if (s->tag == 0) {
            continue;
        }
        size_t i = (size_t)mix(~s->tag) & mask;
        while (fresh[i].tag != 0) {
            i = (i + 1) & mask;
        }
        fresh[i] = *s;
    }
    PyMem_Free(m->slots);
    m->slots = fresh;
    m->cap = new_cap;
    return 0;
}

/* The slot for key: the existing one (*found = 1) or an empty one to fill (*found = 0), growing
 * first when one more entry would pass the load limit. NULL with MemoryError. */
static Slot *
slot_for_insert(IntMapObject *m, int64_t key, int *found)
{
    if (m->cap == 0 && resize(m, MIN_CAP) < 0) {
        return NULL;
    }
    const uint64_t tag = ~(uint64_t)key;
    size_t mask = (size_t)m->cap - 1;
    size_t i = (size_t)mix((uint64_t)key) & mask;
    while (m->slots[i].tag != 0) {
        if (m->slots[i].tag == tag) {
            *found = 1;
            return &m->slots[i];
        }
        i = (i + 1) & mask;
    }
    *found = 0;
    if ((m->used + 1) * LOAD_DEN > m->cap * LOAD_NUM) {
        if (resize(m, m->cap * 2) < 0) {
            return NULL;
        }
        mask = (size_t)m->cap - 1;
        i = (size_t)mix((uint64_t)key) & mask;
        while (m->slots[i].tag != 0) {
            i = (i + 1) & mask;
        }
    }
    return &m->slots[i];
}

/* Empty slot s (its value already taken) and close the gap so probes stay unbroken. */
static void
remove_slot(IntMapObject *m, Slot *s)
{
    const size_t mask = (size_t)m->cap - 1;
    size_t hole = (size_t)(s - m->slots);
    size_t j = hole;
    for (;;) {
        j = (j + 1) & mask;
        Slot *t = &m->slots[j];
        if (t->tag == 0) {
            break;
        }
        size_t home = (size_t)mix(~t->tag) & mask;
        /* t may move back to the hole unless its home lies in (hole, j] */
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            m->slots[hole] = *t;
            hole = j;
        }
    }
    m->slots[hole].tag = 0;
    m->slots[hole].v.i = 0;
    m->used--;
    if (m->used == 0) {
        PyMem_Free(m->slots);
        m->slots = NULL;
        m->cap = 0;
    }
    else if (m->cap > MIN_CAP && m->used * 8 <= m->cap) {
        Py_ssize_t target = MIN_CAP;
        while (m->used * LOAD_DEN * 2 > target * LOAD_NUM) {
            target *= 2;
        }
        if (resize(m, target) < 0) {
            PyErr_Clear(); /* shrinking is optional: keep the bigger array */
        }
    }
}

static Py_ssize_t
intmap_length(IntMapObject *m)
{
    return m->used + (m->overflow != NULL ? PyDict_Size(m->overflow) : 0);
}

/* 1 and *out (new reference) when present, 0 when absent, -1 on error. */
static int
lookup(IntMapObject *m, PyObject *key, PyObject **out)
{
    int64_t k;
    PyObject *okey;
    switch (key_of(key, &k, &okey)) {
    case KEY_ARRAY: {
        Slot *s = find(m, k);
        if (s == NULL) {
            return 0;
        }
        *out = slot_value(m, s);
        return *out == NULL ? -1 : 1;
    }
    case KEY_OVERFLOW: {
        PyObject *v = m->overflow != NULL ? PyDict_GetItemWithError(m->overflow, okey) : NULL;
        Py_DECREF(okey);
        if (v == NULL) {
            return PyErr_Occurred() ? -1 : 0;
        }
        Py_INCREF(v);
        *out = v;
        return 1;
    }
    default:
        return -1;
    }
}

/* Store an already converted value under an array key. */
static int
store_array(IntMapObject *m, int64_t k, int64_t iv, PyObject *ov)
{
    int found;
    Slot *s = slot_for_insert(m, k, &found);
    if (s == NULL) {
        Py_XDECREF(ov);
        return -1;
    }
    if (!found) {
        s->tag = ~(uint64_t)k;
        m->used++;
        s->v.o = NULL;
    }
    if (m->packed) {
        s->v.i = iv;
        return 0;
    }
    PyObject *old = s->v.o;
    s->v.o = ov; /* steals */
    Py_XDECREF(old);
    return 0;
}

/* Store an already converted value under an overflow key (okey borrowed). */
static int
store_overflow(IntMapObject *m, PyObject *okey, int64_t iv, PyObject *ov)
{
    if (m->overflow == NULL) {
        PyObject *fresh = PyDict_New();
        if (fresh == NULL) {
            Py_XDECREF(ov);
            return -1;
        }
        if (m->overflow == NULL) { /* a finalizer run by a collection in PyDict_New may have */
            m->overflow = fresh;
        }
        else {
            Py_DECREF(fresh);
        }
    }
    if (ov == NULL) {
        ov = PyLong_FromLongLong(iv);
        if (ov == NULL) {
            return -1;
        }
    }
    int rc = PyDict_SetItem(m->overflow, okey, ov);
    Py_DECREF(ov);
    return rc;
}

static int
set_item(IntMapObject *m, PyObject *key, PyObject *value)
{
    int64_t k, iv = 0;
    PyObject *okey, *ov;
    int kind = key_of(key, &k, &okey);
    if (kind == KEY_ERROR) {
        return -1;
    }
    if (value_of(m, value, &iv, &ov) < 0) {
        if (kind == KEY_OVERFLOW) {
            Py_DECREF(okey);
        }
        return -1;
    }
    if (kind == KEY_ARRAY) {
        return store_array(m, k, iv, ov);
    }
    int rc = store_overflow(m, okey, iv, ov);
    Py_DECREF(okey);
    return rc;
}

/* 1 and *out (new reference to the value) when removed, 0 when absent, -1 on error. */
static int
pop_item(IntMapObject *m, PyObject *key, PyObject **out)
{
    int64_t k;
    PyObject *okey;
    int kind = key_of(key, &k, &okey);
    if (kind == KEY_ARRAY) {
        Slot *s = find(m, k);
        if (s == NULL) {
            return 0;
        }
        if (m->packed) {
            *out = PyLong_FromLongLong(s->v.i);
            if (*out == NULL) {
                return -1; /* map unchanged */
            }
        }
        else {
            *out = s->v.o; /* the map's reference moves to the caller */
        }
        remove_slot(m, s);
        return 1;
    }
    if (kind == KEY_ERROR) {
        return -1;
    }
    PyObject *v = m->overflow != NULL ? PyDict_GetItemWithError(m->overflow, okey) : NULL;
    if (v == NULL) {
        Py_DECREF(okey);
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_INCREF(v);
    int rc = PyDict_DelItem(m->overflow, okey);
    Py_DECREF(okey);
    if (rc < 0) {
        Py_DECREF(v);
        return -1;
    }
    *out = v;
    return 1;
}

/* ------------------------------------------------------------------------------ type slots */

static PyObject *
intmap_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"packed", NULL};
    int packed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p:IntMap", kwlist, &packed)) {
        return NULL;
    }
    IntMapObject *m = (IntMapObject *)type->tp_alloc(type, 0);
    if (m == NULL) {
        return NULL;
    }
    m->slots = NULL;
    m->cap = 0;
    m->used = 0;
    m->overflow = NULL;
    m->packed = packed;
    return (PyObject *)m;
}

/* Detach all storage first, then release it, so the map is consistent at every step. */
static void
release_all(IntMapObject *m)
{
    Slot *slots = m->slots;
    Py_ssize_t cap = m->cap;
    PyObject *overflow = m->overflow;
    m->slots = NULL;
    m->cap = 0;
    m->used = 0;
    m->overflow = NULL;
    if (slots != NULL && !m->packed) {
        for (Py_ssize_t j = 0; j < cap; j++) {
            if (slots[j].tag != 0) {
                Py_DECREF(slots[j].v.o);
            }
        }
    }
    PyMem_Free(slots);
    Py_XDECREF(overflow);
}

static void
intmap_dealloc(IntMapObject *m)
{
    release_all(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyObject *
intmap_repr(IntMapObject *m)
{
    return PyUnicode_FromFormat("IntMap(n=%zd, packed=%s)", intmap_length(m),
                                m->packed ? "True" : "False");
}

static PyObject *
intmap_subscript(IntMapObject *m, PyObject *key)
{
    PyObject *v;
    int rc = lookup(m, key, &v);
    if (rc == 0) {
        PyErr_SetObject(PyExc_KeyError, key);
    }
    return rc == 1 ? v : NULL;
}

static int
intmap_ass_subscript(IntMapObject *m, PyObject *key, PyObject *value)
{
    if (value != NULL) {
        return set_item(m, key, value);
    }
    PyObject *old;
    int rc = pop_item(m, key, &old);
    if (rc == 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    if (rc < 0) {
        return -1;
    }
    Py_DECREF(old);
    return 0;
}

static int
intmap_contains(IntMapObject *m, PyObject *key)
{
    int64_t k;
    PyObject *okey;
    switch (key_of(key, &k, &okey)) {
    case KEY_ARRAY:
        return find(m, k) != NULL;
    case KEY_OVERFLOW: {
        int rc = m->overflow != NULL ? PyDict_Contains(m->overflow, okey) : 0;
        Py_DECREF(okey);
        return rc;
    }
    default:
        return -1;
    }
}

/* New lists of the keys and/or the values (either out pointer may be NULL), in one order.
 * Only int objects (never GC-tracked) are allocated once the walk starts, so no collection, and
 * no finalizer that could change the map, can run in the middle of it. */
static int
collect(IntMapObject *m, PyObject **keys_out, PyObject **values_out)
{
    PyObject *keys = NULL, *values = NULL;
    Py_ssize_t n;
    do { /* allocating the lists may collect garbage and so change the map: size them again */
        Py_CLEAR(keys);
        Py_CLEAR(values);
        n = intmap_length(m);
        if ((keys_out != NULL && (keys = PyList_New(n)) == NULL) ||
            (values_out != NULL && (values = PyList_New(n)) == NULL)) {
            goto error;
        }
    } while (n != intmap_length(m));
    Py_ssize_t i = 0;
    for (Py_ssize_t j = 0; j < m->cap; j++) {
        const Slot *s = &m->slots[j];
        if (s->tag == 0) {
            continue;
        }
        if (keys != NULL) {
            PyObject *k = PyLong_FromLongLong((long long)~s->tag);
            if (k == NULL) {
                goto error;
            }
            PyList_SET_ITEM(keys, i, k);
        }
        if (values != NULL) {
            PyObject *v = slot_value(m, s);
            if (v == NULL) {
                goto error;
            }
            PyList_SET_ITEM(values, i, v);
        }
        i++;
    }
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (m->overflow != NULL && PyDict_Next(m->overflow, &pos, &k, &v)) {
        if (keys != NULL) {
            PyList_SET_ITEM(keys, i, Py_NewRef(k));
        }
        if (values != NULL) {
            PyList_SET_ITEM(values, i, Py_NewRef(v));
        }
        i++;
    }
    if (keys_out != NULL) {
        *keys_out = keys;
    }
    if (values_out != NULL) {
        *values_out = values;
    }
    return 0;
error: /* unfilled items are NULL, which list dealloc skips */
    Py_XDECREF(keys);
    Py_XDECREF(values);
    return -1;
}

static PyObject *
intmap_iter(IntMapObject *m)
{
    PyObject *keys;
    if (collect(m, &keys, NULL) < 0) {
        return NULL;
    }
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

/* --------------------------------------------------------------------------------- methods */

static PyObject *
intmap_get(IntMapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "get expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *v;
    int rc = lookup(m, args[0], &v);
    if (rc != 0) {
        return rc == 1 ? v : NULL;
    }
    v = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(v);
    return v;
}

static PyObject *
intmap_pop(IntMapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "pop expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *v;
    int rc = pop_item(m, args[0], &v);
    if (rc != 0) {
        return rc == 1 ? v : NULL;
    }
    if (nargs == 1) {
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    Py_INCREF(args[1]);
    return args[1];
}

static PyObject *
intmap_setdefault(IntMapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "setdefault expected 2 arguments, got %zd", nargs);
        return NULL;
    }
    int64_t k, iv = 0;
    PyObject *okey, *ov;
    int kind = key_of(args[0], &k, &okey);
    if (kind == KEY_ERROR) {
        return NULL;
    }
    /* the default is checked even when the key is present: a bad default is a caller bug */
    if (value_of(m, args[1], &iv, &ov) < 0) {
        if (kind == KEY_OVERFLOW) {
            Py_DECREF(okey);
        }
        return NULL;
    }
    if (kind == KEY_OVERFLOW) {
        PyObject *v = m->overflow != NULL ? PyDict_GetItemWithError(m->overflow, okey) : NULL;
        if (v != NULL || PyErr_Occurred()) {
            Py_XINCREF(v);
            Py_XDECREF(ov);
            Py_DECREF(okey);
            return v;
        }
        int rc = store_overflow(m, okey, iv, ov == NULL ? NULL : Py_NewRef(ov));
        Py_DECREF(okey);
        if (rc < 0) {
            Py_XDECREF(ov);
            return NULL;
        }
        return ov != NULL ? ov : Py_NewRef(args[1]);
    }
    int found;
    Slot *s = slot_for_insert(m, k, &found);
    if (s == NULL) {
        Py_XDECREF(ov);
        return NULL;
    }
    if (found) {
        Py_XDECREF(ov);
        return slot_value(m, s);
    }
    s->tag = ~(uint64_t)k;
    m->used++;
    if (m->packed) {
        s->v.i = iv;
        return Py_NewRef(args[1]);
    }
    s->v.o = ov;
    return Py_NewRef(ov);
}

/* Copy a dict's items. A collection inside set_item (the overflow dict's creation) could run a
 * finalizer that changes the dict: PyDict_Next tolerates that, and the references held here keep
 * the dict and the current item alive. */
static int
update_from_dict(IntMapObject *m, PyObject *dict)
{
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    int rc = 0;
    Py_INCREF(dict);
    while (rc == 0 && PyDict_Next(dict, &pos, &k, &v)) {
        Py_INCREF(k);
        Py_INCREF(v);
        rc = set_item(m, k, v);
        Py_DECREF(k);
        Py_DECREF(v);
    }
    Py_DECREF(dict);
    return rc;
}

/* Copy another IntMap's entries (never self); the array walk allocates nothing GC-tracked. */
static int
update_from_intmap(IntMapObject *m, IntMapObject *other)
{
    for (Py_ssize_t j = 0; j < other->cap; j++) {
        const Slot *s = &other->slots[j];
        if (s->tag == 0) {
            continue;
        }
        int64_t iv = 0;
        PyObject *ov = NULL;
        if (other->packed && m->packed) {
            iv = s->v.i;
        }
        else {
            PyObject *v = slot_value(other, s);
            if (v == NULL) {
                return -1;
            }
            int rc = value_of(m, v, &iv, &ov);
            Py_DECREF(v);
            if (rc < 0) {
                return -1;
            }
        }
        if (store_array(m, (int64_t)~s->tag, iv, ov) < 0) {
            return -1;
        }
    }
    return other->overflow != NULL ? update_from_dict(m, other->overflow) : 0;
}

static int
update_from_pairs(IntMapObject *m, PyObject *other)
{
    PyObject *it = PyObject_GetIter(other);
    if (it == NULL) {
        return -1;
    }
    PyObject *item;
    for (Py_ssize_t i = 0; (item = PyIter_Next(it)) != NULL; i++) {
        PyObject *pair = PySequence_Fast(item, "");
        Py_DECREF(item);
        if (pair == NULL) {
            if (PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Format(PyExc_TypeError,
                             "cannot convert IntMap update sequence element #%zd to a sequence",
                             i);
            }
            goto error;
        }
        if (PySequence_Fast_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_ValueError,
                         "IntMap update sequence element #%zd has length %zd; 2 is required", i,
                         PySequence_Fast_GET_SIZE(pair));
            Py_DECREF(pair);
            goto error;
        }
        int rc = set_item(m, PySequence_Fast_GET_ITEM(pair, 0), PySequence_Fast_GET_ITEM(pair, 1));
        Py_DECREF(pair);
        if (rc < 0) {
            goto error;
        }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
error:
    Py_DECREF(it);
    return -1;
}

static int
update_from_mapping(IntMapObject *m, PyObject *other, PyObject *keys_method)
{
    PyObject *keys = PyObject_CallNoArgs(keys_method);
    if (keys == NULL) {
        return -1;
    }
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    if (it == NULL) {
        return -1;
    }
    PyObject *k;
    while ((k = PyIter_Next(it)) != NULL) {
        PyObject *v = PyObject_GetItem(other, k);
        int rc = v == NULL ? -1 : set_item(m, k, v);
        Py_DECREF(k);
        Py_XDECREF(v);
        if (rc < 0) {
            Py_DECREF(it);
            return -1;
        }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *
intmap_update(IntMapObject *m, PyObject *other)
{
    int rc;
    if ((PyObject *)m == other) {
        Py_RETURN_NONE;
    }
    if (PyObject_TypeCheck(other, &IntMap_Type)) {
        rc = update_from_intmap(m, (IntMapObject *)other);
    }
    else if (PyDict_Check(other)) {
        rc = update_from_dict(m, other);
    }
    else {
        PyObject *keys_method = PyObject_GetAttrString(other, "keys");
        if (keys_method != NULL) {
            rc = update_from_mapping(m, other, keys_method);
            Py_DECREF(keys_method);
        }
        else if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            rc = update_from_pairs(m, other);
        }
        else {
            rc = -1;
        }
    }
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
intmap_clear(IntMapObject *m, PyObject *Py_UNUSED(ignored))
{
    release_all(m);
    Py_RETURN_NONE;
}

static PyObject *
intmap_keys(IntMapObject *m, PyObject *Py_UNUSED(ignored))
{
    PyObject *keys;
    return collect(m, &keys, NULL) < 0 ? NULL : keys;
}

static PyObject *
intmap_values(IntMapObject *m, PyObject *Py_UNUSED(ignored))
{
    PyObject *values;
    return collect(m, NULL, &values) < 0 ? NULL : values;
}

static PyObject *
intmap_items(IntMapObject *m, PyObject *Py_UNUSED(ignored))
{
    PyObject *keys, *values;
    if (collect(m, &keys, &values) < 0) {
        return NULL;
    }
    const Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *item = PyTuple_Pack(2, PyList_GET_ITEM(keys, i), PyList_GET_ITEM(values, i));
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, item);
    }
    Py_DECREF(keys);
    Py_DECREF(values);
    return out;
}

/* A run of up to BATCH keys of a list or tuple, converted and hashed up front with their home
 * slots prefetched, so the run's cache misses overlap instead of queueing one by one. Nothing
 * between batch_load and batch_release runs user code, so the map cannot change meanwhile. */
typedef struct {
    int cnt;
    int64_t keys[BATCH];
    size_t homes[BATCH];
    PyObject *okeys[BATCH]; /* new references for overflow keys, else NULL */
} Batch;

static void
batch_release(Batch *b)
{
    for (int j = 0; j < b->cnt; j++) {
        Py_CLEAR(b->okeys[j]);
    }
    b->cnt = 0;
}

static int
batch_load(const IntMapObject *m, Batch *b, PyObject *const *items, Py_ssize_t n)
{
    const size_t mask = (size_t)m->cap - 1;
    b->cnt = 0;
    for (int j = 0; j < n && j < BATCH; j++) {
        b->okeys[j] = NULL;
        int kind = key_of(items[j], &b->keys[j], &b->okeys[j]);
        if (kind == KEY_ERROR) {
            batch_release(b);
            return -1;
        }
        b->cnt = j + 1;
        if (kind == KEY_ARRAY && m->used > 0) {
            b->homes[j] = (size_t)mix((uint64_t)b->keys[j]) & mask;
            PREFETCH(&m->slots[b->homes[j]]);
        }
    }
    return 0;
}

/* Batch key j: 1 with *slot (array key) or *ovalue (borrowed, overflow key), 0 absent, -1 error. */
static int
batch_find(const IntMapObject *m, const Batch *b, int j, const Slot **slot, PyObject **ovalue)
{
    *slot = NULL;
    *ovalue = NULL;
    if (b->okeys[j] != NULL) {
        *ovalue = m->overflow != NULL ? PyDict_GetItemWithError(m->overflow, b->okeys[j]) : NULL;
        return *ovalue != NULL ? 1 : (PyErr_Occurred() ? -1 : 0);
    }
    if (m->used == 0) {
        return 0;
    }
    const uint64_t tag = ~(uint64_t)b->keys[j];
    const size_t mask = (size_t)m->cap - 1;
    for (size_t i = b->homes[j];; i = (i + 1) & mask) {
        const Slot *s = &m->slots[i];
        if (s->tag == tag) {
            *slot = s;
            return 1;
        }
        if (s->tag == 0) {
            return 0;
        }
    }
}

static PyObject *
intmap_isdisjoint(IntMapObject *m, PyObject *iterable)
{
    if (PyList_CheckExact(iterable) || PyTuple_CheckExact(iterable)) {
        PyObject *const *items = PySequence_Fast_ITEMS(iterable);
        const Py_ssize_t n = PySequence_Fast_GET_SIZE(iterable);
        Batch b;
        for (Py_ssize_t base = 0; base < n; base += BATCH) {
            if (batch_load(m, &b, items + base, n - base) < 0) {
                return NULL;
            }
            int rc = 0;
            for (int j = 0; j < b.cnt && rc == 0; j++) {
                const Slot *slot;
                PyObject *ovalue;
                rc = batch_find(m, &b, j, &slot, &ovalue);
            }
            batch_release(&b);
            if (rc != 0) {
                return rc < 0 ? NULL : Py_NewRef(Py_False);
            }
        }
        Py_RETURN_TRUE;
    }
    PyObject *it = PyObject_GetIter(iterable);
    if (it == NULL) {
        return NULL;
    }
    PyObject *key;
    while ((key = PyIter_Next(it)) != NULL) {
        int rc = intmap_contains(m, key);
        Py_DECREF(key);
        if (rc != 0) {
            Py_DECREF(it);
            return rc < 0 ? NULL : Py_NewRef(Py_False);
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_TRUE;
}

/* get_many over a list's or tuple's items, a batch at a time. The result is allocated before
 * the items are read: a collection inside that allocation may run a finalizer that resizes or
 * clears a list argument, so its size is checked again and its item array read only after. */
static PyObject *
get_many_items(IntMapObject *m, PyObject *seq, PyObject *dflt)
{
    PyObject *out = NULL;
    Py_ssize_t n;
    do {
        Py_XDECREF(out); /* unfilled items are NULL, which list dealloc skips */
        n = PySequence_Fast_GET_SIZE(seq);
        out = PyList_New(n);
        if (out == NULL) {
            return NULL;
        }
    } while (n != PySequence_Fast_GET_SIZE(seq));
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    Batch b;
    for (Py_ssize_t base = 0; base < n; base += BATCH) {
        if (batch_load(m, &b, items + base, n - base) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        for (int j = 0; j < b.cnt; j++) {
            const Slot *slot;
            PyObject *v;
            int rc = batch_find(m, &b, j, &slot, &v);
            if (rc == 1) {
                v = slot != NULL ? slot_value(m, slot) : Py_NewRef(v);
            }
            else if (rc == 0) {
                v = Py_NewRef(dflt);
            }
            if (v == NULL) {
                batch_release(&b);
                Py_DECREF(out); /* unfilled items are NULL, which list dealloc skips */
                return NULL;
            }
            PyList_SET_ITEM(out, base + j, v);
        }
        batch_release(&b);
    }
    return out;
}

static PyObject *
intmap_get_many(IntMapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "get_many expected 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *keys = args[0], *dflt = args[1];
    if (PyList_CheckExact(keys) || PyTuple_CheckExact(keys)) {
        return get_many_items(m, keys, dflt);
    }
    PyObject *it = PyObject_GetIter(keys);
    if (it == NULL) {
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        Py_DECREF(it);
        return NULL;
    }
    PyObject *key;
    while ((key = PyIter_Next(it)) != NULL) {
        PyObject *v;
        int rc = lookup(m, key, &v);
        Py_DECREF(key);
        if (rc == 0) {
            v = Py_NewRef(dflt);
        }
        if (rc < 0 || PyList_Append(out, v) < 0) {
            Py_XDECREF(rc < 0 ? NULL : v);
            goto error;
        }
        Py_DECREF(v);
    }
    if (PyErr_Occurred()) {
        goto error;
    }
    Py_DECREF(it);
    return out;
error:
    Py_DECREF(it);
    Py_DECREF(out);
    return NULL;
}

/* ------------------------------------------------------------------- bulk event methods
 * The index's store and remove paths handle an event's ~8 hashes at once; these save it the
 * zip tuples and the per-key method calls of doing the same through map(). Each works on a
 * tuple copy of its arguments, so nothing a finalizer does to the caller's lists matters. */

/* Prefetch, for writing, the home slots of the array keys among items[0:n] (at most BATCH): a
 * store loop over a long key list then overlaps its cache misses as batch_load does for reads.
 * Only a hint: a store that grows the array in between just misses the cache as before. */
static void
prefetch_stores(const IntMapObject *m, PyObject *const *items, Py_ssize_t n)
{
    if (m->cap == 0) {
        return;
    }
    const size_t mask = (size_t)m->cap - 1;
    for (Py_ssize_t j = 0; j < n && j < BATCH; j++) {
        if (PyLong_CheckExact(items[j])) {
            int ovf = 0;
            long long v = PyLong_AsLongLongAndOverflow(items[j], &ovf);
            if (ovf == 0) {
                PREFETCH_W(&m->slots[(size_t)mix((uint64_t)v) & mask]);
            }
        }
    }
}

static PyObject *
intmap_assign(IntMapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "assign expected 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *keys = PySequence_Tuple(args[0]);
    if (keys == NULL) {
        return NULL;
    }
    PyObject *const *items = &PyTuple_GET_ITEM(keys, 0);
    const Py_ssize_t n = PyTuple_GET_SIZE(keys);
    prefetch_stores(m, items, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i % BATCH == 0 && i + BATCH < n) {
            prefetch_stores(m, items + i + BATCH, n - i - BATCH);
        }
        if (set_item(m, items[i], args[1]) < 0) {
            Py_DECREF(keys);
            return NULL; /* keys before i stay assigned, as with update */
        }
    }
    Py_DECREF(keys);
    Py_RETURN_NONE;
}

static PyObject *
intmap_pop_many(IntMapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "pop_many expected 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *keys = PySequence_Tuple(args[0]);
    if (keys == NULL) {
        return NULL;
    }
    const Py_ssize_t n = PyTuple_GET_SIZE(keys);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *v;
        int rc = pop_item(m, PyTuple_GET_ITEM(keys, i), &v);
        if (rc < 0) {
            Py_CLEAR(out); /* keys before i stay popped, as with a loop of pop */
            break;
        }
        PyList_SET_ITEM(out, i, rc == 1 ? v : Py_NewRef(args[1]));
    }
    Py_DECREF(keys);
    return out;
}

/* or_many(keys, mask): m[k] = m.get(k, 0) | mask for every key (object maps: holder bit sets;
 * a routed prompt's pending marks join the bits other streams already have on its keys). */
static PyObject *
intmap_or_many(IntMapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "or_many expected 2 arguments, got %zd", nargs);
        return NULL;
    }
    if (m->packed) {
        PyErr_SetString(PyExc_TypeError, "or_many needs an object IntMap (packed=False)");
        return NULL;
    }
    if (!PyLong_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "or_many mask must be int, not %.200s",
                     Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    int64_t unused;
    PyObject *mask;
    if (value_of(m, args[1], &unused, &mask) < 0) { /* an exact int: ORs below run no user code */
        return NULL;
    }
    PyObject *keys = PySequence_Tuple(args[0]);
    if (keys == NULL) {
        Py_DECREF(mask);
        return NULL;
    }
    PyObject *const *items = &PyTuple_GET_ITEM(keys, 0);
    const Py_ssize_t n = PyTuple_GET_SIZE(keys);
    /* Keys marked together share one value object (assign stores one for all), so the last
     * old value and its merge are kept: a run of such keys costs one OR and no allocation. Both
     * are strong references, so a freed old value's address cannot be mistaken for it. */
    PyObject *memo_old = NULL, *memo_merged = NULL, *result = NULL;
    prefetch_stores(m, items, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i % BATCH == 0 && i + BATCH < n) {
            prefetch_stores(m, items + i + BATCH, n - i - BATCH);
        }
        int64_t k;
        PyObject *okey;
        int kind = key_of(items[i], &k, &okey);
        if (kind == KEY_ERROR) {
            goto done; /* keys before i stay updated, as with a loop of assignments */
        }
        if (kind == KEY_OVERFLOW) {
            Py_DECREF(okey);
            PyObject *old = NULL;
            int rc = lookup(m, items[i], &old);
            PyObject *merged = rc == 1 ? PyNumber_Or(old, mask) : rc == 0 ? Py_NewRef(mask) : NULL;
            Py_XDECREF(old);
            rc = merged == NULL ? -1 : set_item(m, items[i], merged);
            Py_XDECREF(merged);
            if (rc < 0) {
                goto done;
            }
            continue;
        }
        /* one probe: the slot is found (or made) and updated in place. Nothing between the
         * probe and the store allocates a GC-tracked object (exact ints only), so no finalizer
         * can move the array under the pointer. */
        int found;
        Slot *s = slot_for_insert(m, k, &found);
        if (s == NULL) {
            goto done;
        }
        if (!found) {
            s->tag = ~(uint64_t)k;
            s->v.o = Py_NewRef(mask);
            m->used++;
            continue;
        }
        PyObject *old = s->v.o;
        if (old != memo_old) {
            PyObject *merged = PyNumber_Or(old, mask);
            if (merged == NULL) {
                goto done;
            }
            Py_XSETREF(memo_merged, merged);
            Py_INCREF(old);
            Py_XSETREF(memo_old, old);
        }
        s->v.o = Py_NewRef(memo_merged);
        Py_DECREF(old); /* memo_old still holds it */
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(memo_old);
    Py_XDECREF(memo_merged);
    Py_DECREF(keys);
    Py_DECREF(mask);
    return result;
}

/* Pop keys[0:n] again (they were absent before this call inserted them). */
static int
take_back(IntMapObject *m, PyObject *keys, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = NULL;
        if (pop_item(m, PyTuple_GET_ITEM(keys, i), &v) < 0) {
            return -1;
        }
        Py_XDECREF(v);
    }
    return 0;
}

static PyObject *
intmap_insert_new(IntMapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "insert_new expected 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *keys = PySequence_Tuple(args[0]);
    if (keys == NULL) {
        return NULL;
    }
    PyObject *values = PySequence_Tuple(args[1]);
    if (values == NULL) {
        Py_DECREF(keys);
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = PyTuple_GET_SIZE(keys);
    if (PyTuple_GET_SIZE(values) != n) {
        PyErr_Format(PyExc_ValueError, "insert_new got %zd keys and %zd values", n,
                     PyTuple_GET_SIZE(values));
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int rc = intmap_contains(m, PyTuple_GET_ITEM(keys, i));
        if (rc != 0) {
            result = rc < 0 ? NULL : Py_NewRef(Py_False);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const Py_ssize_t before = intmap_length(m);
        if (set_item(m, PyTuple_GET_ITEM(keys, i), PyTuple_GET_ITEM(values, i)) < 0) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            (void)take_back(m, keys, i);
            PyErr_Restore(type, value, tb);
            goto done;
        }
        if (intmap_length(m) == before) {
            /* a key repeated within the call: the map is as before once keys[0:i] are gone
             * (keys[i] is one of them) */
            result = take_back(m, keys, i) < 0 ? NULL : Py_NewRef(Py_False);
            goto done;
        }
    }
    result = Py_NewRef(Py_True);
done:
    Py_DECREF(keys);
    Py_DECREF(values);
    return result;
}

/* A packed copy of m's entries: what pop_by_value(m) decides against, as the Python twin does
 * (it reads every value's membership before deleting anything). */
static IntMapObject *
packed_copy(IntMapObject *m)
{
    IntMapObject *copy = PyObject_New(IntMapObject, &IntMap_Type);
    if (copy == NULL) {
        return NULL;
    }
    copy->slots = NULL;
    copy->cap = 0;
    copy->used = 0;
    copy->overflow = NULL;
    copy->packed = 1;
    if (update_from_intmap(copy, m) < 0) {
        Py_DECREF(copy);
        return NULL;
    }
    return copy;
}

/* Remove the overflow entries whose value is a key of other; append them to out. 0 or -1. */
static int
pop_overflow_by_value(IntMapObject *m, IntMapObject *other, PyObject *out)
{
    /* A collection inside PyDict_Items may run a finalizer that clears the map (freeing the
     * dict) or replaces its overflow dict: hold the dict, and delete only while it is still the
     * map's. The loop itself allocates nothing GC-tracked, so the snapshot stays current. */
    PyObject *overflow = Py_NewRef(m->overflow);
    PyObject *items = PyDict_Items(overflow);
    int rc = items == NULL ? -1 : 0;
    for (Py_ssize_t i = 0; rc == 0 && m->overflow == overflow && i < PyList_GET_SIZE(items); i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        PyObject *key = PyTuple_GET_ITEM(item, 0), *value = PyTuple_GET_ITEM(item, 1);
        rc = intmap_contains(other, value);
        if (rc > 0) {
            PyObject *now = PyDict_GetItemWithError(overflow, key);
            rc = now != value ? (PyErr_Occurred() ? -1 : 0) : PyDict_DelItem(overflow, key);
            if (rc == 0 && now == value) {
                rc = PyList_Append(out, item);
            }
        }
    }
    Py_XDECREF(items);
    Py_DECREF(overflow);
    return rc < 0 ? -1 : 0;
}

/* pop_by_value(other): remove every entry whose value is a key of `other` (an IntMap); a list of
 * the removed (key, value) pairs. Evicting a namespace drops a stream's entries of a set of
 * block keys this way in one pass over the slots instead of a Python step per entry. The array
 * part is found and removed before any Python object is allocated, so nothing can run and change
 * the map in between. */
static PyObject *
intmap_pop_by_value(IntMapObject *m, PyObject *other_obj)
{
    if (!m->packed || !PyObject_TypeCheck(other_obj, &IntMap_Type)) {
        PyErr_SetString(PyExc_TypeError, "pop_by_value needs a packed IntMap and an IntMap");
        return NULL;
    }
    IntMapObject *other = (IntMapObject *)other_obj;
    if (other != m) {
        Py_INCREF(other); /* one reference to release on every path, copy or not */
    }
    else if ((other = packed_copy(m)) == NULL) {
        return NULL;
    }
    PyObject *out = NULL;
    int64_t *pairs = NULL;
    Py_ssize_t n = 0;
    int minus_one_in_other = 0; /* -1 is never an array key: ask the overflow once */
    if (other->overflow != NULL) {
        PyObject *minus_one = PyLong_FromLong(-1);
        if (minus_one == NULL) {
            goto done;
        }
        minus_one_in_other = PyDict_Contains(other->overflow, minus_one);
        Py_DECREF(minus_one);
        if (minus_one_in_other < 0) {
            goto done;
        }
    }
    if (m->used > 0) {
        pairs = PyMem_Malloc(sizeof(int64_t) * 2 * (size_t)m->used);
        if (pairs == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t j = 0; j < m->cap; j++) {
            const Slot *s = &m->slots[j];
            if (s->tag == 0) {
                continue;
            }
            const int64_t v = s->v.i;
            if (v == -1 ? minus_one_in_other : find(other, v) != NULL) {
                pairs[2 * n] = (int64_t)~s->tag;
                pairs[2 * n + 1] = v;
                n++;
            }
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            remove_slot(m, find(m, pairs[2 * i]));
        }
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *item = Py_BuildValue("(LL)", (long long)pairs[2 * i], (long long)pairs[2 * i + 1]);
        if (item == NULL) {
            Py_CLEAR(out); /* the entries are gone either way: the caller sees the error */
            break;
        }
        PyList_SET_ITEM(out, i, item);
    }
    /* the tuples above may have run a finalizer: m->overflow is read only now */
    if (out != NULL && m->overflow != NULL && pop_overflow_by_value(m, other, out) < 0) {
        Py_CLEAR(out);
    }
done:
    PyMem_Free(pairs);
    Py_DECREF(other);
    return out;
}

static PyObject *
intmap_sizeof(IntMapObject *m, PyObject *Py_UNUSED(ignored))
{
    Py_ssize_t size = (Py_ssize_t)sizeof(IntMapObject) + m->cap * (Py_ssize_t)sizeof(Slot);
    if (m->overflow != NULL) {
        PyObject *r = PyObject_CallMethod(m->overflow, "__sizeof__", NULL);
        if (r == NULL) {
            return NULL;
        }
        Py_ssize_t extra = PyLong_AsSsize_t(r);
        Py_DECREF(r);
        if (extra == -1 && PyErr_Occurred()) {
            return NULL;
        }
        size += extra;
    }
    return PyLong_FromSsize_t(size);
}

static PyObject *
intmap_contains_method(IntMapObject *m, PyObject *key)
{
    int rc = intmap_contains(m, key);
    return rc < 0 ? NULL : PyBool_FromLong(rc);
}

static PyMethodDef intmap_methods[] = {
    /* explicit twins of the slots: map(m.__contains__, keys) then skips the slot wrapper */
    {"__contains__", (PyCFunction)intmap_contains_method, METH_O | METH_COEXIST,
     "True when key is in the map."},
    {"__getitem__", (PyCFunction)intmap_subscript, METH_O | METH_COEXIST,
     "The value of key (KeyError when absent)."},
    {"get", (PyCFunction)(void (*)(void))intmap_get, METH_FASTCALL,
     "get($self, key, default=None, /)\n--\n\n"
     "The value of key, or default."},
    {"pop", (PyCFunction)(void (*)(void))intmap_pop, METH_FASTCALL,
     "pop(key[, default], /): remove key and return its value (KeyError without default)."},
    {"setdefault", (PyCFunction)(void (*)(void))intmap_setdefault, METH_FASTCALL,
     "setdefault($self, key, default, /)\n--\n\n"
     "The value of key, inserting default first if absent."},
    {"update", (PyCFunction)intmap_update, METH_O,
     "update($self, other, /)\n--\n\n"
     "Set every item of a dict, IntMap, mapping or iterable of pairs."},
    {"clear", (PyCFunction)intmap_clear, METH_NOARGS, "Remove every entry and free the arrays."},
    {"keys", (PyCFunction)intmap_keys, METH_NOARGS, "A new list of the keys."},
    {"values", (PyCFunction)intmap_values, METH_NOARGS, "A new list of the values."},
    {"items", (PyCFunction)intmap_items, METH_NOARGS, "A new list of (key, value) tuples."},
    {"isdisjoint", (PyCFunction)intmap_isdisjoint, METH_O,
     "isdisjoint($self, iterable, /)\n--\n\n"
     "True when no element is a key."},
    {"get_many", (PyCFunction)(void (*)(void))intmap_get_many, METH_FASTCALL,
     "get_many($self, keys, default, /)\n--\n\n"
     "A list with the value (or default) of each key, in order."},
    {"assign", (PyCFunction)(void (*)(void))intmap_assign, METH_FASTCALL,
     "assign($self, keys, value, /)\n--\n\n"
     "Set every key of keys to value."},
    {"or_many", (PyCFunction)(void (*)(void))intmap_or_many, METH_FASTCALL,
     "or_many($self, keys, mask, /)\n--\n\n"
     "Set every key to its value (0 when absent) ORed with mask (object maps only)."},
    {"pop_many", (PyCFunction)(void (*)(void))intmap_pop_many, METH_FASTCALL,
     "pop_many($self, keys, default, /)\n--\n\n"
     "Remove each key; a list of the values (default for absent keys), in order."},
    {"insert_new", (PyCFunction)(void (*)(void))intmap_insert_new, METH_FASTCALL,
     "insert_new($self, keys, values, /)\n--\n\n"
     "Insert every pair and return True when no key is present and none repeats;\n"
     "otherwise change nothing and return False."},
    {"pop_by_value", (PyCFunction)intmap_pop_by_value, METH_O,
     "pop_by_value($self, other, /)\n--\n\n"
     "Remove every entry whose value is a key of other (an IntMap; self must be packed);\n"
     "a list of the removed (key, value) pairs."},
    {"__sizeof__", (PyCFunction)intmap_sizeof, METH_NOARGS,
     "Bytes of the object, its array and its overflow dict."},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods intmap_as_mapping = {
    .mp_length = (lenfunc)intmap_length,
    .mp_subscript = (binaryfunc)intmap_subscript,
    .mp_ass_subscript = (objobjargproc)intmap_ass_subscript,
};

static PySequenceMethods intmap_as_sequence = {
    .sq_contains = (objobjproc)intmap_contains,
};

PyDoc_STRVAR(intmap_doc, "IntMap(packed=False)\n--\n\n"
                         "A hash map from int or bytes keys to int values, compact for int64 "
                         "keys.\npacked=True stores values inline as int64.");

static PyTypeObject IntMap_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "indexer._intmap.IntMap",
    .tp_basicsize = sizeof(IntMapObject),
    .tp_itemsize = 0,
    .tp_dealloc = (destructor)intmap_dealloc,
    .tp_repr = (reprfunc)intmap_repr,
    .tp_as_sequence = &intmap_as_sequence,
    .tp_as_mapping = &intmap_as_mapping,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = intmap_doc,
    .tp_iter = (getiterfunc)intmap_iter,
    .tp_methods = intmap_methods,
    .tp_new = intmap_new,
};

static struct PyModuleDef intmap_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "indexer._intmap",
    .m_doc = "IntMap: a compiled int64-keyed hash map for the prefix index.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__intmap(void)
{
    PyObject *os = PyImport_ImportModule("os");
    PyObject *random = os != NULL ? PyObject_CallMethod(os, "urandom", "i", 8) : NULL;
    Py_XDECREF(os);
    if (random == NULL) {
        return NULL;
    }
    if (!PyBytes_Check(random) || PyBytes_GET_SIZE(random) != 8) {
        Py_DECREF(random);
        PyErr_SetString(PyExc_RuntimeError, "os.urandom(8) did not return 8 bytes");
        return NULL;
    }
    memcpy(&mix_key, PyBytes_AS_STRING(random), sizeof(mix_key));
    Py_DECREF(random);
    if (PyType_Ready(&IntMap_Type) < 0) {
        return NULL;
    }
    PyObject *mod = PyModule_Create(&intmap_module);
    if (mod == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(mod, "IntMap", (PyObject *)&IntMap_Type) < 0 ||
        PyModule_AddIntConstant(mod, "MAX_LOAD_PERCENT", 100 * LOAD_NUM / LOAD_DEN) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
