/* indexer._keychain: the router's block-key chain (see indexer/namespace.py) in C.
 *
 * key_i = hash((key_{i-1}, tuple(block_i_tokens))) with CPython's own `hash`, so the keys are
 * identical to the pure-Python chain: this file re-derives, from the documented scheme, the
 * two hashes involved (an int's hash modulo 2**61 - 1 and the xxHash-style tuple mix used by
 * CPython >= 3.8) and never builds the tuples. Anything that is not a small exact int goes
 * through PyObject_Hash, exactly as the tuple hash would. Module init compares a few keys with
 * real tuple hashes and refuses to import on a mismatch, so a different scheme (a 32-bit build,
 * a future CPython) falls back to Python instead of producing different keys.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#if SIZEOF_PY_HASH_T != 8
#error "indexer._keychain needs a 64-bit Py_hash_t (the pure-Python chain covers other builds)"
#endif

/* The tuple mix's primes and rotation, and the int hash's Mersenne modulus (61 bits on
 * 64-bit builds); facts of CPython's hashing, checked against real hashes at import. */
#define XX_PRIME_1 11400714785074694791ULL
#define XX_PRIME_2 14029467366897019727ULL
#define XX_PRIME_5 2870177450012600261ULL
#define LEN_MANGLE (XX_PRIME_5 ^ 3527539ULL) /* keeps hash(()) at its historical value */
#define MINUS_ONE_TUPLE 1546275796ULL      /* what a tuple hashing to -1 hashes to instead */
#define MODULUS ((UINT64_C(1) << 61) - 1)

#if (-1 >> 1) != -1
#error "int64_lane relies on an arithmetic right shift of negative values (as CPython does)"
#endif

/* Keys of up to this many blocks live on the stack; longer prompts take one heap buffer. */
#define STACK_KEYS 64

static inline uint64_t
mix(uint64_t acc, uint64_t lane)
{
    acc += lane * XX_PRIME_2;
    acc = (acc << 31) | (acc >> 33);
    return acc * XX_PRIME_1;
}

static inline uint64_t
finish(uint64_t acc, Py_ssize_t len)
{
    acc += (uint64_t)len ^ LEN_MANGLE;
    return acc == UINT64_MAX ? MINUS_ONE_TUPLE : acc;
}

/* hash(v) for an int64: sign(v) * (|v| mod 2**61-1), with -1 (the C API's error value) as -2.
 * Computed as the representative of v mod 2**61-1 that has v's sign, which is the same number
 * without the negations (this sits on the chain's serial path). */
static inline uint64_t
int64_lane(int64_t v)
{
    /* v = (v >> 61) * 2**61 + (v & MODULUS) and 2**61 = 1 (mod MODULUS): t = v, in [-4, P+3] */
    int64_t t = (int64_t)((uint64_t)v & MODULUS) + (v >> 61);
    if (t >= (v < 0 ? 1 : (int64_t)MODULUS))
        t -= (int64_t)MODULUS;
    return t == -1 ? (uint64_t)-2 : (uint64_t)t;
}

/* 1 and the lane if `o` is an exact int in [0, 2**30) (every token id), else 0. Reads int
 * internals, whose layout changed in 3.12, hence the guard. Negative ints take the general
 * path: they never occur as tokens, and excluding them spares the -1 -> -2 rule here. */
static inline int
small_lane(PyObject *o, uint64_t *lane)
{
    Py_ssize_t v;
    if (!PyLong_CheckExact(o))
        return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)o))
        return 0;
    v = PyUnstable_Long_CompactValue((PyLongObject *)o);
    if (v < 0)
        return 0;
#else
    {
        Py_ssize_t size = Py_SIZE(o);
        if ((size_t)size > 1)
            return 0;
        /* size is 0 or 1; a zero still owns one digit, so the read is in bounds */
        v = size * (Py_ssize_t)((PyLongObject *)o)->ob_digit[0];
    }
#endif
    *lane = (uint64_t)v;
    return 1;
}

/* The lane of any object: what the tuple hash would take for it. 0, or -1 with an error. */
static int
any_lane(PyObject *o, uint64_t *lane)
{
    Py_hash_t h;
    if (small_lane(o, lane))
        return 0;
    if (PyLong_CheckExact(o)) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow); /* no Python code runs */
        if (!overflow) {
            if (v == -1 && PyErr_Occurred())
                return -1;
            *lane = int64_lane((int64_t)v);
            return 0;
        }
    }
    /* the item may run Python code that drops the container's last reference to it */
    Py_INCREF(o);
    h = PyObject_Hash(o);
    Py_DECREF(o);
    if (h == -1)
        return -1;
    *lane = (uint64_t)h;
    return 0;
}

/* The lane of a chain's `prev`, which must be an int (subclasses keep their own __hash__). */
static int
prev_lane(PyObject *prev, uint64_t *lane)
{
    if (!PyLong_Check(prev)) {
        PyErr_Format(PyExc_TypeError, "prev must be int, not %.100s", Py_TYPE(prev)->tp_name);
        return -1;
    }
    return any_lane(prev, lane);
}

/* Tuple hash of `bs` small-int items; 0 as soon as one item needs the general path. */
static inline int
block_fast(PyObject *const *items, Py_ssize_t bs, uint64_t *out)
{
    uint64_t acc = XX_PRIME_5, lane;
    for (Py_ssize_t j = 0; j < bs; j++) {
        if (!small_lane(items[j], &lane))
            return 0;
        acc = mix(acc, lane);
    }
    *out = finish(acc, bs);
    return 1;
}

/* key = hash((previous key, block)): a 2-tuple whose lanes are the previous key's hash and the
 * block's tuple hash. */
static inline uint64_t
pair_key(uint64_t prev_lane, uint64_t block_hash)
{
    return finish(mix(mix(XX_PRIME_5, prev_lane), block_hash), 2);
}

/* Tuple hash of any `n` items, in item order (so the first failing item's error wins). */
static int
items_hash(PyObject *const *items, Py_ssize_t n, uint64_t *out)
{
    uint64_t acc = XX_PRIME_5, lane;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (any_lane(items[j], &lane) < 0)
            return -1;
        acc = mix(acc, lane);
    }
    *out = finish(acc, n);
    return 0;
}

/* Clamp an index-like argument to long long (a huge count means "all", a huge start "none"). */
static int
clamped_index(PyObject *o, const char *name, long long *out)
{
    int overflow;
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be int, not %.100s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow)
        *out = overflow > 0 ? LLONG_MAX : LLONG_MIN;
    else if (*out == -1 && PyErr_Occurred())
        return -1;
    return 0;
}

/* list[lo:hi] as a new tuple, allocated before any item is read: a collection inside the
 * allocation may run a finalizer that shrinks the list, and CPython's own slice and tuple() copy
 * from the item array they saw before allocating (a read of freed memory). NULL, with
 * RuntimeError when the list no longer holds the range. */
static PyObject *
list_range_copy(PyObject *list, Py_ssize_t lo, Py_ssize_t hi)
{
    PyObject *copy = PyTuple_New(hi - lo);
    if (copy == NULL)
        return NULL;
    if (PyList_GET_SIZE(list) < hi) {
        Py_DECREF(copy); /* unfilled items are NULL, which tuple dealloc skips */
        PyErr_SetString(PyExc_RuntimeError, "tokens changed size while being keyed");
        return NULL;
    }
    for (Py_ssize_t i = lo; i < hi; i++)
        PyTuple_SET_ITEM(copy, i - lo, Py_NewRef(PyList_GET_ITEM(list, i)));
    return copy;
}

/* The keys of `nblocks` blocks of `bs` items after `lane` (the hash of prev), into `keys`.
 * `owner` holds the items; when it is the caller's list and an item needs PyObject_Hash (which
 * may run Python code that mutates that list), the rest is read from a private copy, which is
 * what the Python chain (it slices first) effectively hashes too. 0, or -1 with an error.
 *
 * Only the key steps depend on each other (~25 cycles each); each block's hash is independent
 * work the CPU overlaps with them on its own (hand-interleaving 2-4 blocks measured no faster:
 * the loop is bound by instruction count, not by the multiplies' latency). */
static int
chain_keys(uint64_t lane, PyObject *owner, Py_ssize_t lo, Py_ssize_t bs, Py_ssize_t nblocks,
           uint64_t *keys)
{
    PyObject *copy = NULL;
    PyObject *const *block = PySequence_Fast_ITEMS(owner) + lo;
    uint64_t inner;
    for (Py_ssize_t i = 0; i < nblocks; i++, block += bs) {
        if (!block_fast(block, bs, &inner)) {
            if (copy == NULL && PyList_CheckExact(owner)) {
                copy = list_range_copy(owner, lo + i * bs, lo + nblocks * bs);
                if (copy == NULL)
                    return -1;
                block = PySequence_Fast_ITEMS(copy);
            }
            if (items_hash(block, bs, &inner) < 0) {
                Py_XDECREF(copy);
                return -1;
            }
        }
        keys[i] = pair_key(lane, inner);
        lane = int64_lane((int64_t)keys[i]);
    }
    Py_XDECREF(copy);
    return 0;
}

static PyObject *
keys_to_list(const uint64_t *keys, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyLong_FromLongLong((long long)(int64_t)keys[i]);
        if (key == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, key);
    }
    return out;
}

PyDoc_STRVAR(chain_doc,
             "chain(prev, tokens, block_size, start=0, count=-1, /)\n--\n\n"
             "Keys of full blocks start, start+1, ... (at most count; -1: all) of tokens, "
             "chained after prev.");

static PyObject *
chain(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    long long bs, start = 0, count = -1, full, stop;
    uint64_t lane, stack_keys[STACK_KEYS], *keys = stack_keys;
    PyObject *tokens, *seq, *out = NULL;
    Py_ssize_t n, lo = 0, nblocks;

    if (nargs < 3 || nargs > 5)
        return PyErr_Format(PyExc_TypeError, "chain expected 3 to 5 arguments, got %zd", nargs);
    tokens = args[1];
    if (prev_lane(args[0], &lane) < 0 || clamped_index(args[2], "block_size", &bs) < 0 ||
        (nargs > 3 && clamped_index(args[3], "start", &start) < 0) ||
        (nargs > 4 && clamped_index(args[4], "count", &count) < 0))
        return NULL;
    if (bs <= 0)
        return PyErr_Format(PyExc_ValueError, "block_size must be positive, got %lld", bs);
    if (start < 0)
        return PyErr_Format(PyExc_ValueError, "start must be >= 0, got %lld", start);

    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        n = PySequence_Fast_GET_SIZE(tokens);
    }
    else {
        n = PySequence_Size(tokens);
        if (n < 0)
            return NULL;
    }
    full = n / bs;
    stop = count < 0 || count >= full - start ? full : start + count;
    if (start >= stop)
        return PyList_New(0);
    nblocks = (Py_ssize_t)(stop - start);

    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        /* no copy: the items are read in place */
        lo = (Py_ssize_t)(start * bs);
        seq = Py_NewRef(tokens);
    }
    else {
        /* like the Python chain, only the keyed range of other sequences is materialized */
        PyObject *part =
            PySequence_GetSlice(tokens, (Py_ssize_t)(start * bs), (Py_ssize_t)(stop * bs));
        if (part == NULL)
            return NULL;
        seq = PySequence_Fast(part, "tokens must be a sequence");
        Py_DECREF(part);
        if (seq == NULL)
            return NULL;
        /* a sequence whose slice disagrees with its len() gets what the Python chain gives:
         * the full blocks of the slice */
        nblocks = PySequence_Fast_GET_SIZE(seq) / (Py_ssize_t)bs;
        if (nblocks == 0) {
            Py_DECREF(seq);
            return PyList_New(0);
        }
    }

    if (nblocks > STACK_KEYS) {
        keys = PyMem_Malloc((size_t)nblocks * sizeof(uint64_t));
        if (keys == NULL) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
    }
    /* the keys are computed before any result object exists: allocating one can start a GC
     * pass whose finalizers could otherwise mutate `tokens` under our borrowed item pointers */
    if (chain_keys(lane, seq, lo, (Py_ssize_t)bs, nblocks, keys) == 0)
        out = keys_to_list(keys, nblocks);
    if (keys != stack_keys)
        PyMem_Free(keys);
    Py_DECREF(seq);
    return out;
}

PyDoc_STRVAR(partial_doc,
             "partial(prev, tokens, /)\n--\n\n"
             "Key of a trailing partial page: hash((prev, tuple(tokens), len(tokens))).");

static PyObject *
partial(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t lane, inner, acc;
    PyObject *seq;
    Py_ssize_t n;
    int fast;

    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "partial expected 2 arguments, got %zd", nargs);
    if (prev_lane(args[0], &lane) < 0)
        return NULL;
    if (PyTuple_CheckExact(args[1]) || PyList_CheckExact(args[1]))
        seq = Py_NewRef(args[1]);
    else if ((seq = PySequence_Tuple(args[1])) == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    fast = block_fast(PySequence_Fast_ITEMS(seq), n, &inner);
    if (!fast && PyList_CheckExact(seq)) {
        /* PyObject_Hash may run code that mutates the caller's list: hash a snapshot of the n
         * tokens seen (RuntimeError if a finalizer run by its allocation dropped some) */
        Py_SETREF(seq, list_range_copy(seq, 0, n));
        if (seq == NULL)
            return NULL;
    }
    if (!fast && items_hash(PySequence_Fast_ITEMS(seq), n, &inner) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_DECREF(seq);
    /* hash((prev, tuple(tokens), len(tokens))): a 3-tuple */
    acc = mix(mix(mix(XX_PRIME_5, lane), inner), int64_lane((int64_t)n));
    return PyLong_FromLongLong((long long)(int64_t)finish(acc, 3));
}

PyDoc_STRVAR(int_hash_doc, "int_hash(x, /)\n--\n\nCPython's hash of the int x (for tests).");

static PyObject *
int_hash(PyObject *Py_UNUSED(module), PyObject *x)
{
    uint64_t lane;
    if (!PyLong_Check(x))
        return PyErr_Format(PyExc_TypeError, "x must be int, not %.100s", Py_TYPE(x)->tp_name);
    if (any_lane(x, &lane) < 0)
        return NULL;
    return PyLong_FromLongLong((long long)(int64_t)lane);
}

/* One probe key against CPython's real tuple hash: 1 equal, 0 different, -1 error. */
static int
probe(long long prev, long first_token, Py_ssize_t bs)
{
    PyObject *block = PyTuple_New(bs), *prev_obj, *pair;
    uint64_t lane, inner, key;
    Py_hash_t want;
    if (block == NULL)
        return -1;
    for (Py_ssize_t j = 0; j < bs; j++) {
        PyObject *tok = PyLong_FromLong(first_token + (long)j);
        if (tok == NULL) {
            Py_DECREF(block);
            return -1;
        }
        PyTuple_SET_ITEM(block, j, tok);
    }
    prev_obj = PyLong_FromLongLong(prev);
    pair = prev_obj == NULL ? NULL : PyTuple_Pack(2, prev_obj, block);
    Py_XDECREF(prev_obj);
    if (pair == NULL || items_hash(PySequence_Fast_ITEMS(block), bs, &inner) < 0 ||
        any_lane(PyTuple_GET_ITEM(pair, 0), &lane) < 0 || (want = PyObject_Hash(pair)) == -1) {
        Py_XDECREF(pair);
        Py_DECREF(block);
        return -1;
    }
    Py_DECREF(pair);
    Py_DECREF(block);
    key = pair_key(lane, inner);
    return (Py_hash_t)key == want;
}

static int
exec_module(PyObject *Py_UNUSED(module))
{
    /* prevs across the int64 range (incl. the -1 and modulus cases), tokens incl. -1 */
    static const long long prevs[] = {0, -1, 1, (1LL << 61) - 1, (1LL << 61), LLONG_MIN,
                                      LLONG_MAX, -1234567890123456789LL};
    for (size_t i = 0; i < sizeof(prevs) / sizeof(prevs[0]); i++) {
        int ok = probe(prevs[i], (long)i - 3, (Py_ssize_t)i + 1);
        if (ok < 0)
            return -1;
        if (!ok) {
            PyErr_SetString(PyExc_ImportError,
                            "indexer._keychain: this interpreter's hash scheme differs");
            return -1;
        }
    }
    return 0;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL, chain_doc},
    {"partial", (PyCFunction)(void (*)(void))partial, METH_FASTCALL, partial_doc},
    {"int_hash", int_hash, METH_O, int_hash_doc},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, (void *)exec_module},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "indexer._keychain",
    .m_doc = "The block-key chain of indexer.namespace in C: identical keys, 5-7x faster.",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC
PyInit__keychain(void)
{
    return PyModuleDef_Init(&module_def);
}
