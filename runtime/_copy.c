/* tierkv.runtime._copy: the cpu backend's batch copy, one call per batch (built by setup.py).

   copy_rows(dst, src, dst_ids, src_ids, row, stream_min) -> number of runs
   check_ids(ids, limit) -> 0 (in range, distinct), 1 (out of range), 2 (a duplicate)

   Copies row src_ids[i] of `src` to row dst_ids[i] of `dst` (buffers of whole rows of `row`
   bytes; ids int64). Pairs adjacent on both sides are merged into one run:

       src ids  4 5 6 | 9 | 1 2      dst ids  10 11 12 | 3 | 7 8     ->  3 runs

   Every id is checked before anything is copied (IndexError). The copy runs with the GIL
   released. A batch of at least `stream_min` bytes is written with non-temporal stores (x86-64:
   AVX2 where the CPU has it, else SSE2), a smaller one with ordinary vector stores (it stays in
   cache for whoever reads it next): the rows of a large batch would only evict the cache on
   their way to memory, and a store that misses the cache first reads the line it overwrites
   (three bytes of memory traffic per byte copied instead of two). glibc's memcpy makes the same
   switch, but per call and only above its `x86_non_temporal_threshold` (240 MB on the
   development VM), so a loop of row-sized memcpys never makes it.

   Each run of 1 KB or more:  | memcpy up to a 64-byte line of dst | 128-byte blocks | memcpy |
   and four runs are copied at once, a block of each in turn (see LANE_BATCH). Shorter runs, and
   every run where there is no x86-64 vector path (other CPUs, other compilers): one memcpy each.
   A run that overlaps itself (same buffer): one memmove.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define TIERKV_X86 1
#include <immintrin.h>
#endif

/* runs shorter than this are copied with one memcpy each, not in a lane */
#define LANE_MIN_RUN 1024
/* runs copied at once, 128 bytes of each in turn */
#define LANES 4

typedef struct {
    char *dst;
    const char *src;
    const int64_t *d, *s;
    int64_t n, row, i, runs;
    int lanes; /* 0: every run with memcpy (no vector path here) */
} batch_t;

typedef struct {
    char *d;
    const char *s;
    size_t left; /* a multiple of 128; 0: idle */
} lane_t;

/* Move on to the next run of the batch. A run for the lanes leaves its 64-byte-aligned body
   (a multiple of 128 bytes) in *lane and returns 1; its unaligned head and its tail are copied
   at once, as is every other run on the way. Returns 0 when the batch is done. */
static int next_run(batch_t *b, lane_t *lane) {
    const int64_t *d = b->d, *s = b->s;
    while (b->i < b->n) {
        int64_t i = b->i, j = i + 1;
        while (j < b->n && s[j] == s[j - 1] + 1 && d[j] == d[j - 1] + 1) j++;
        b->i = j;
        b->runs++;
        char *dp = b->dst + d[i] * b->row;
        const char *sp = b->src + s[i] * b->row;
        size_t len = (size_t)((j - i) * b->row);
        if (dp < sp + len && sp < dp + len) {
            memmove(dp, sp, len);
            continue;
        }
        if (!b->lanes || len < LANE_MIN_RUN) {
            memcpy(dp, sp, len);
            continue;
        }
        size_t head = (size_t)(-(uintptr_t)dp & 63);
        size_t body = (len - head) & ~(size_t)127; /* > 0: len >= LANE_MIN_RUN */
        memcpy(dp, sp, head);
        memcpy(dp + head + body, sp + head + body, len - head - body);
        lane->d = dp + head;
        lane->s = sp + head;
        lane->left = body;
        return 1;
    }
    return 0;
}

#ifdef TIERKV_X86
static int have_avx2;

__attribute__((target("avx2"))) static inline void block_avx2(char *d, const char *s) {
    __m256i a = _mm256_loadu_si256((const __m256i *)s);
    __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
    __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64));
    __m256i e = _mm256_loadu_si256((const __m256i *)(s + 96));
    _mm256_stream_si256((__m256i *)d, a);
    _mm256_stream_si256((__m256i *)(d + 32), b);
    _mm256_stream_si256((__m256i *)(d + 64), c);
    _mm256_stream_si256((__m256i *)(d + 96), e);
}

__attribute__((target("avx2"))) static inline void cached_avx2(char *d, const char *s) {
    __m256i a = _mm256_loadu_si256((const __m256i *)s);
    __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
    __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64));
    __m256i e = _mm256_loadu_si256((const __m256i *)(s + 96));
    _mm256_store_si256((__m256i *)d, a);
    _mm256_store_si256((__m256i *)(d + 32), b);
    _mm256_store_si256((__m256i *)(d + 64), c);
    _mm256_store_si256((__m256i *)(d + 96), e);
}

static inline void cached_sse2(char *d, const char *s) { memcpy(d, s, 128); }

static inline void block_sse2(char *d, const char *s) {
    for (int o = 0; o < 128; o += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + o));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + o + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + o + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + o + 48));
        _mm_stream_si128((__m128i *)(d + o), a);
        _mm_stream_si128((__m128i *)(d + o + 16), b);
        _mm_stream_si128((__m128i *)(d + o + 32), c);
        _mm_stream_si128((__m128i *)(d + o + 48), e);
    }
}

/* The bodies of LANES runs at a time, 128 bytes of each in turn: one run at a time over
   scattered 16 KB rows keeps too few cache misses in flight (the hardware prefetcher starts
   over at every row); four interleaved ones measured 1.3-1.7x faster here with streaming stores
   and 1.1-1.5x faster than a memcpy per run with ordinary ones. */
#define LANE_BATCH(NAME, TARGET, BLOCK, FENCE)                           \
    TARGET static void NAME(batch_t *b) {                               \
        lane_t lane[LANES];                                              \
        int active = 0;                                                  \
        for (int k = 0; k < LANES; k++) {                                \
            lane[k].left = 0;                                            \
            active += next_run(b, &lane[k]);                             \
        }                                                                \
        while (active) {                                                 \
            for (int k = 0; k < LANES; k++) {                            \
                lane_t *l = &lane[k];                                    \
                if (!l->left) continue;                                  \
                BLOCK(l->d, l->s);                                       \
                l->d += 128, l->s += 128, l->left -= 128;                \
                if (!l->left && !next_run(b, l)) active--;               \
            }                                                            \
        }                                                                \
        FENCE;                                                           \
    }

/* streamed lines are in memory before the batch counts as done */
#define SFENCE _mm_sfence()
LANE_BATCH(stream_avx2, __attribute__((target("avx2"))), block_avx2, SFENCE)
LANE_BATCH(stream_sse2, , block_sse2, SFENCE)
LANE_BATCH(cached_lanes_avx2, __attribute__((target("avx2"))), cached_avx2, (void)0)
LANE_BATCH(cached_lanes_sse2, , cached_sse2, (void)0)
#endif

static const char *streaming_name(void) {
#ifdef TIERKV_X86
    return have_avx2 ? "avx2" : "sse2";
#else
    return "";
#endif
}

/* Returns the number of runs; -1 when an id is out of range (nothing copied). */
static int64_t copy_rows_impl(char *dst, const char *src, const int64_t *d, const int64_t *s,
                              int64_t n, int64_t row, int64_t dst_rows, int64_t src_rows,
                              int stream) {
    for (int64_t i = 0; i < n; i++)
        if (s[i] < 0 || s[i] >= src_rows || d[i] < 0 || d[i] >= dst_rows) return -1;
#ifdef TIERKV_X86
    batch_t b = {dst, src, d, s, n, row, 0, 0, 1};
    if (stream && have_avx2)
        stream_avx2(&b);
    else if (stream)
        stream_sse2(&b);
    else if (have_avx2)
        cached_lanes_avx2(&b);
    else
        cached_lanes_sse2(&b);
#else
    batch_t b = {dst, src, d, s, n, row, 0, 0, 0};
    lane_t unused;
    (void)stream;
    while (next_run(&b, &unused)) { /* next_run copies every run itself */
    }
#endif
    return b.runs;
}

static int check_id_buffer(Py_buffer *b, const char *what) {
    if (b->len % 8 != 0 || ((uintptr_t)b->buf & 7) != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be an aligned buffer of int64", what);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(copy_rows_doc,
             "copy_rows(dst, src, dst_ids, src_ids, row, stream_min) -> runs\n\n"
             "Copy row src_ids[i] of src to row dst_ids[i] of dst (contiguous buffers of whole\n"
             "rows of `row` bytes; ids: contiguous int64 buffers of equal length; dst_ids\n"
             "unique). Batches of at least `stream_min` bytes use non-temporal stores where the\n"
             "CPU has them. Raises IndexError (nothing copied) for an id out of range and\n"
             "ValueError for malformed arguments. Returns the number of runs copied.");

static PyObject *copy_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "copy_rows takes 6 arguments");
        return NULL;
    }
    Py_ssize_t row = PyLong_AsSsize_t(args[4]);
    if (row == -1 && PyErr_Occurred()) return NULL;
    long long stream_min = PyLong_AsLongLong(args[5]);
    if (stream_min == -1 && PyErr_Occurred()) return NULL;
    if (row <= 0) {
        PyErr_Format(PyExc_ValueError, "row size must be > 0, got %zd", row);
        return NULL;
    }
    Py_buffer bufs[4];
    int flags[4] = {PyBUF_WRITABLE, PyBUF_SIMPLE, PyBUF_SIMPLE, PyBUF_SIMPLE};
    int got = 0;
    PyObject *result = NULL;
    for (; got < 4; got++)
        if (PyObject_GetBuffer(args[got], &bufs[got], flags[got]) < 0) goto done;
    if (check_id_buffer(&bufs[2], "dst_ids") < 0 || check_id_buffer(&bufs[3], "src_ids") < 0) goto done;
    if (bufs[2].len != bufs[3].len) {
        PyErr_SetString(PyExc_ValueError, "dst_ids and src_ids differ in length");
        goto done;
    }
    if (bufs[0].len % row != 0 || bufs[1].len % row != 0) {
        PyErr_Format(PyExc_ValueError, "buffers of %zd and %zd bytes are not whole rows of %zd",
                     bufs[0].len, bufs[1].len, row);
        goto done;
    }
    int64_t n = (int64_t)(bufs[2].len / 8), runs;
    int stream = (long long)n * row >= stream_min;
    Py_BEGIN_ALLOW_THREADS
    runs = copy_rows_impl(bufs[0].buf, bufs[1].buf, bufs[2].buf, bufs[3].buf, n, row,
                          bufs[0].len / row, bufs[1].len / row, stream);
    Py_END_ALLOW_THREADS
    if (runs < 0)
        PyErr_Format(PyExc_IndexError, "slot id out of range (%zd / %zd rows)", bufs[1].len / row,
                     bufs[0].len / row);
    else
        result = PyLong_FromLongLong(runs);
done:
    while (got-- > 0) PyBuffer_Release(&bufs[got]);
    return result;
}

/* 0: every id in [0, limit) and distinct; 1: an id out of range; 2: a duplicate. Duplicates are
   found with an open-addressing hash set of at least 2n entries (O(n); sorting measured ~7x slower
   at 2048 ids, and numpy's sort releases the GIL, handing it to a stream worker mid-submit). */
#define CHECK_STACK_ENTRIES 1024
static int check_ids_impl(const int64_t *ids, int64_t n, int64_t limit) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= limit) return 1;
    if (n < 2) return 0;
    int bits = 6;
    while (((int64_t)1 << bits) < 2 * n) bits++;
    size_t size = (size_t)1 << bits, mask = size - 1;
    uint64_t stack[CHECK_STACK_ENTRIES];
    uint64_t *table = size <= CHECK_STACK_ENTRIES ? stack : malloc(size * sizeof(uint64_t));
    if (table == NULL) return -1;
    memset(table, 0, size * sizeof(uint64_t));
    int status = 0;
    for (int64_t i = 0; i < n && !status; i++) {
        uint64_t key = (uint64_t)ids[i] + 1; /* 0 marks an empty entry */
        size_t h = (size_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - bits));
        while (table[h] && table[h] != key) h = (h + 1) & mask;
        if (table[h]) status = 2;
        table[h] = key;
    }
    if (table != stack) free(table);
    return status;
}

PyDoc_STRVAR(check_ids_doc,
             "check_ids(ids, limit) -> status\n\n"
             "0 when every id of `ids` (a contiguous int64 buffer) is in [0, limit) and no id\n"
             "repeats, 1 when an id is out of range, 2 when one repeats. Raises ValueError for a\n"
             "malformed buffer and MemoryError.");

static PyObject *check_ids(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "check_ids takes 2 arguments");
        return NULL;
    }
    long long limit = PyLong_AsLongLong(args[1]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *result = NULL;
    if (check_id_buffer(&buf, "ids") == 0) {
        int status = check_ids_impl(buf.buf, (int64_t)(buf.len / 8), (int64_t)limit);
        result = status < 0 ? PyErr_NoMemory() : PyLong_FromLong(status);
    }
    PyBuffer_Release(&buf);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_rows", (PyCFunction)(void (*)(void))copy_rows, METH_FASTCALL, copy_rows_doc},
    {"check_ids", (PyCFunction)(void (*)(void))check_ids, METH_FASTCALL, check_ids_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copy", "The cpu backend's batch copy (see runtime/_copy.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__copy(void) {
#ifdef TIERKV_X86
    __builtin_cpu_init();
    const char *avx2 = getenv("TIERKV_COPY_AVX2"); /* "0": the SSE2 path (tests use it) */
    have_avx2 = __builtin_cpu_supports("avx2") && !(avx2 && avx2[0] == '0');
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* "avx2" or "sse2": the instructions of the non-temporal path; "" where there is none */
    if (PyModule_AddStringConstant(m, "STREAMING", streaming_name()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
