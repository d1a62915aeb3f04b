/* Keyed BLAKE3 digests of many equal-width rows in one native call (sgl_embeds_protocol._row_digests).
 *
 * keys.row_digests hashes every row of a span on its own (a placeholder id is a row's key). The
 * Python bindings of BLAKE3 take one input per call, so a span of 4096 narrow rows costs 4096
 * calls and hashes each row with at most its own chunks side by side. Here the rows are the SIMD
 * lanes: LANES rows of equal width walk the same BLAKE3 tree in lockstep (same chunk counters,
 * block lengths and flags), so every compression runs on LANES rows at once, whatever the row
 * width. Written from the BLAKE3 specification (docs/performance.md); tests/test_keys.py checks
 * every width class against the blake3 package, row by row.
 *
 * checked_digests also finds the first row holding a NaN or Inf (an element whose exponent bits
 * are all set), each group of LANES rows checked right after it is hashed, while its bytes are
 * still in cache: a span's keys and its values check in one read of its bytes.
 *
 * Built by setup.py (optional: without a compiler keys.py keeps its Python loop, same digests).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "row_digests.c reads message words as little-endian"
#endif

#define LANES 16
typedef uint32_t vec __attribute__((vector_size(LANES * 4)));

enum { CHUNK_START = 1, CHUNK_END = 2, PARENT = 4, ROOT = 8, KEYED_HASH = 16 };
enum { BLOCK_LEN = 64, CHUNK_LEN = 1024, OUT_LEN = 32 };
enum { MAX_THREADS = 64 };

static const uint32_t IV[8] = {0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A,
                               0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19};
static const uint8_t PERMUTATION[16] = {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8};
static uint8_t SCHEDULE[7][16]; /* the message word each round reads at each position */

static void init_schedule(void) {
    for (int i = 0; i < 16; i++) SCHEDULE[0][i] = (uint8_t)i;
    for (int r = 1; r < 7; r++)
        for (int i = 0; i < 16; i++) SCHEDULE[r][i] = SCHEDULE[r - 1][PERMUTATION[i]];
}

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))
#define G(a, b, c, d, mx, my)                                                                  \
    do {                                                                                       \
        v[a] += v[b] + (mx); v[d] = ROTR(v[d] ^ v[a], 16);                                     \
        v[c] += v[d];        v[b] = ROTR(v[b] ^ v[c], 12);                                     \
        v[a] += v[b] + (my); v[d] = ROTR(v[d] ^ v[a], 8);                                      \
        v[c] += v[d];        v[b] = ROTR(v[b] ^ v[c], 7);                                      \
    } while (0)

/* One compression on every lane: the chaining value out = compress(cv, m, ...)[0:8]. The
 * counter, block length and flags are the same on every lane (the rows walk the same tree). */
static inline __attribute__((always_inline)) void compress(vec out[8], const vec cv[8], const vec m[16], uint64_t counter,
                            uint32_t block_len, uint32_t flags) {
    vec v[16];
    for (int i = 0; i < 8; i++) v[i] = cv[i];
    for (int i = 0; i < 4; i++) v[8 + i] = (vec){} + IV[i];
    v[12] = (vec){} + (uint32_t)counter;
    v[13] = (vec){} + (uint32_t)(counter >> 32);
    v[14] = (vec){} + block_len;
    v[15] = (vec){} + flags;
    for (int r = 0; r < 7; r++) {
        const uint8_t *s = SCHEDULE[r];
        G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) out[i] = v[i] ^ v[i + 8];
}

typedef struct {
    const uint8_t *row[LANES]; /* each lane's row (a tail group repeats its last row) */
    size_t width;              /* bytes per row, > 0 */
    vec key[8];
} Lanes;

/* Message words of one block of every lane, transposed: m[w][lane]. Each lane's block is one
 * vector load; four rounds of interleaving the first half of the vectors with the second half
 * transpose the 16 x 16 words. */
static const vec INTERLEAVE_LOW = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
static const vec INTERLEAVE_HIGH = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

static inline __attribute__((always_inline)) void load_block(vec m[16], const Lanes *L, size_t offset,
                                                             size_t len) {
    vec a[16], b[16];
    for (int j = 0; j < LANES; j++) {
        if (len == BLOCK_LEN) {
            memcpy(&a[j], L->row[j] + offset, BLOCK_LEN);
        } else {
            a[j] = (vec){};
            memcpy(&a[j], L->row[j] + offset, len);
        }
    }
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < 8; i++) {
            b[2 * i] = __builtin_shuffle(a[i], a[i + 8], INTERLEAVE_LOW);
            b[2 * i + 1] = __builtin_shuffle(a[i], a[i + 8], INTERLEAVE_HIGH);
        }
        for (int i = 0; i < 8; i++) {
            a[2 * i] = __builtin_shuffle(b[i], b[i + 8], INTERLEAVE_LOW);
            a[2 * i + 1] = __builtin_shuffle(b[i], b[i + 8], INTERLEAVE_HIGH);
        }
    }
    memcpy(m, a, sizeof a);
}

static inline __attribute__((always_inline)) void chunk_cv(vec out[8], const Lanes *L, uint64_t chunk, int is_root) {
    size_t start = (size_t)chunk * CHUNK_LEN;
    size_t len = L->width - start < CHUNK_LEN ? L->width - start : CHUNK_LEN;
    size_t blocks = (len + BLOCK_LEN - 1) / BLOCK_LEN;
    vec cv[8], m[16];
    memcpy(cv, L->key, sizeof cv);
    for (size_t b = 0; b < blocks; b++) {
        int last = b + 1 == blocks;
        size_t block_len = last ? len - b * BLOCK_LEN : BLOCK_LEN;
        uint32_t flags = KEYED_HASH | (b == 0 ? CHUNK_START : 0) | (last ? CHUNK_END : 0) |
                         (last && is_root ? ROOT : 0);
        load_block(m, L, start + b * BLOCK_LEN, block_len);
        compress(cv, cv, m, chunk, (uint32_t)block_len, flags);
    }
    memcpy(out, cv, sizeof cv);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DISPATCH __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DISPATCH
#endif

static inline __attribute__((always_inline)) void parent_cv(vec out[8], const Lanes *L, const vec left[8],
                                                            const vec right[8], int is_root) {
    vec m[16];
    memcpy(m, left, 8 * sizeof(vec));
    memcpy(m + 8, right, 8 * sizeof(vec));
    compress(out, L->key, m, 0, BLOCK_LEN, KEYED_HASH | PARENT | (is_root ? ROOT : 0));
}

/* The root chaining value (the digest) of every lane: the chunks' values merged as BLAKE3's
 * incremental hasher merges them, a subtree as soon as it is complete, the rest at the end. One
 * compiled copy per instruction set; the helpers above are inlined into each. */
DISPATCH static void hash_lanes(vec out[8], const Lanes *L) {
    uint64_t chunks = (L->width + CHUNK_LEN - 1) / CHUNK_LEN;
    vec stack[64][8], cv[8];
    int depth = 0;
    for (uint64_t c = 0; c + 1 < chunks; c++) {
        chunk_cv(cv, L, c, 0);
        for (uint64_t total = c + 1; (total & 1) == 0; total >>= 1) parent_cv(cv, L, stack[--depth], cv, 0);
        memcpy(stack[depth++], cv, sizeof cv);
    }
    chunk_cv(cv, L, chunks - 1, chunks == 1);
    while (depth > 0) {
        depth--;
        parent_cv(cv, L, stack[depth], cv, depth == 0);
    }
    memcpy(out, cv, sizeof cv);
}

/* Whether a row holds an element whose exponent bits (mask, in elements of elem_size bytes: 2 or
 * 4) are all set: a NaN or an Inf of float16, bfloat16 or float32. (v & mask) ^ mask is zero
 * exactly there, so the row's minimum of it is zero: a min reduction in the element's own width
 * (no widening, no early exit), which vectorizes to one load, and, xor and min per vector. */
DISPATCH static int non_finite(const uint8_t *row, size_t width, int elem_size, uint32_t mask) {
    if (elem_size == 4) {
        uint32_t low = UINT32_MAX;
        for (size_t i = 0; i + 4 <= width; i += 4) {
            uint32_t v;
            memcpy(&v, row + i, 4);
            uint32_t t = (v & mask) ^ mask;
            low = t < low ? t : low;
        }
        return low == 0;
    }
    uint16_t m16 = (uint16_t)mask, low = UINT16_MAX;
    for (size_t i = 0; i + 2 <= width; i += 2) {
        uint16_t v;
        memcpy(&v, row + i, 2);
        uint16_t t = (uint16_t)((v & m16) ^ m16);
        low = t < low ? t : low;
    }
    return low == 0;
}

typedef struct {
    const uint8_t *rows;
    size_t width, first, end; /* rows [first, end) */
    const uint32_t *key;
    uint8_t *out;
    int elem_size;       /* > 0: check values (checked_digests) */
    uint32_t mask;
    size_t first_bad;    /* out: the first non-finite row of [first, end), or end */
} Job;

static void *run_job(void *arg) {
    Job *job = arg;
    Lanes L;
    L.width = job->width;
    for (int i = 0; i < 8; i++) L.key[i] = (vec){} + job->key[i];
    for (size_t base = job->first; base < job->end; base += LANES) {
        size_t n = job->end - base < LANES ? job->end - base : LANES;
        for (size_t j = 0; j < LANES; j++) L.row[j] = job->rows + (base + (j < n ? j : n - 1)) * job->width;
        vec cv[8];
        hash_lanes(cv, &L);
        for (size_t j = 0; j < n; j++)
            for (int i = 0; i < 8; i++) memcpy(job->out + (base + j) * OUT_LEN + 4 * i, &cv[i][j], 4);
        if (job->elem_size && job->first_bad == job->end)
            for (size_t j = 0; j < n; j++)
                if (non_finite(L.row[j], job->width, job->elem_size, job->mask)) {
                    job->first_bad = base + j;
                    break;
                }
    }
    return NULL;
}

/* The digests of every width-byte row of data (a new bytes object, or NULL with an exception
 * set); with elem_size > 0 also *first_bad: the first row holding a NaN or Inf, or the count. */
static PyObject *hash_rows(Py_buffer *data, Py_ssize_t width, Py_buffer *key, Py_ssize_t threads,
                           int elem_size, uint32_t mask, size_t *first_bad) {
    if (width <= 0 || data->len % width != 0 || key->len != 32 ||
        (elem_size && (elem_size != 2 && elem_size != 4))) {
        PyErr_SetString(PyExc_ValueError,
                        "row_digests: width must be > 0 and divide the buffer, key 32 bytes, elem_size 2 or 4");
        return NULL;
    }
    size_t n = (size_t)(data->len / width);
    *first_bad = n;
    PyObject *result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * OUT_LEN));
    if (!result || n == 0) return result;
    uint32_t key_words[8];
    memcpy(key_words, key->buf, 32);
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    size_t groups = (n + LANES - 1) / LANES;
    if ((size_t)threads > groups) threads = (Py_ssize_t)groups;
    Job jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (Py_ssize_t t = 0; t < threads; t++) {
        jobs[t] = (Job){data->buf, (size_t)width, groups * t / threads * LANES, groups * (t + 1) / threads * LANES,
                        key_words, (uint8_t *)PyBytes_AS_STRING(result), elem_size, mask, 0};
        if (jobs[t].end > n) jobs[t].end = n;
        jobs[t].first_bad = jobs[t].end;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 1; t < threads; t++) started[t] = pthread_create(&tids[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (Py_ssize_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tids[t], NULL);
        else run_job(&jobs[t]); /* no thread to be had: this one does that share too */
    }
    Py_END_ALLOW_THREADS
    for (Py_ssize_t t = threads - 1; t >= 0; t--)
        if (jobs[t].first_bad < jobs[t].end) *first_bad = jobs[t].first_bad;
    return result;
}

static PyObject *digests(PyObject *self, PyObject *args) {
    Py_buffer data, key;
    Py_ssize_t width, threads = 1;
    if (!PyArg_ParseTuple(args, "y*ny*|n", &data, &width, &key, &threads)) return NULL;
    size_t first_bad;
    PyObject *result = hash_rows(&data, width, &key, threads, 0, 0, &first_bad);
    PyBuffer_Release(&data);
    PyBuffer_Release(&key);
    return result;
}

static PyObject *checked_digests(PyObject *self, PyObject *args) {
    Py_buffer data, key;
    Py_ssize_t width, threads;
    int elem_size;
    unsigned int mask;
    if (!PyArg_ParseTuple(args, "y*ny*niI", &data, &width, &key, &threads, &elem_size, &mask)) return NULL;
    size_t first_bad;
    PyObject *result = hash_rows(&data, width, &key, threads, elem_size ? elem_size : -1, mask, &first_bad);
    PyBuffer_Release(&data);
    PyBuffer_Release(&key);
    if (!result) return NULL;
    return Py_BuildValue("(Nn)", result, (Py_ssize_t)first_bad);
}

static PyMethodDef METHODS[] = {
    {"digests", digests, METH_VARARGS,
     "digests(data, width, key, threads=1) -> bytes: the 32-byte keyed BLAKE3 digest of each "
     "width-byte row of data, back to back."},
    {"checked_digests", checked_digests, METH_VARARGS,
     "checked_digests(data, width, key, threads, elem_size, exponent_mask) -> (bytes, int): the "
     "digests, and the first row holding an element (of elem_size bytes, 2 or 4) whose exponent "
     "bits are all set (a NaN or an Inf), or the row count if none does."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_row_digests",
                                    "Keyed BLAKE3 digests of many equal-width rows (csrc/row_digests.c).",
                                    -1, METHODS};

PyMODINIT_FUNC PyInit__row_digests(void) {
    init_schedule();
    return PyModule_Create(&MODULE);
}
