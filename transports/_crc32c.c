/* tierkv.transports._crc32c: CRC-32C (Castagnoli) for the tcp transport (built by setup.py).

   crc32c(data, crc=0) -> int    CRC-32C of a buffer, continuing from `crc`
   crc32c_rows(...), check_slots(...), pack_slots(...)   many buffers in one call (GIL released)
   init(fold) -> int              0: unusable here; 1: crc32 lanes; 2: crc32 lanes + folded lane

Three independent lanes of the SSE4.2 `crc32` instruction hide its 3-cycle latency (~8 bytes a
cycle at best). The lanes are joined by "shifting" a CRC over the length of the lanes after it
(appending L zero bytes is a linear map of the register, applied with four 256-entry tables):

    block of 3 x L bytes:  | lane 0 (crc = c) | lane 1 (crc = 0) | lane 2 (crc = 0) |
    c' = shift_L(shift_L(c0) ^ c1) ^ c2

Where the CPU has AVX2 and VPCLMULQDQ, each 28 KB block also gets a fourth lane folded with
carry-less multiplies in the same loop (another execution unit): its 16-byte blocks are moved
forward by multiplying with x^k mod P, the last one's crc is the lane's, and it is shifted in like
the others. The instruction sets are picked at run time (target attributes), so a module built on
any x86-64 machine runs on any other. x86-64 with GCC or Clang only; elsewhere init() returns 0
and the Python side uses its fallbacks. TIERKV_NO_FOLD (setup.py retries with it when the
compiler lacks VPCLMULQDQ) builds the three lanes only.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* buffers from this size on are checksummed with the GIL released */
#define RELEASE_GIL_BYTES (64 << 10)

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define TIERKV_X86 1
#include <immintrin.h>

#define LANE_LONG 8192
#define LANE_MID 2048
#define LANE_SHORT 256
/* hybrid block: three crc32 lanes and one lane folded with carry-less multiplies, in one loop
   (the two kinds of instruction run on different units) */
#define HY_ITERS 256
#define HY_LANE (16 * HY_ITERS)
#define HY_FOLD (64 * (HY_ITERS + 1))
#define HY_BLOCK (3 * HY_LANE + HY_FOLD)
#define SSE42 __attribute__((target("sse4.2")))
#define FOLD __attribute__((target("sse4.2,pclmul,avx2,vpclmulqdq")))

static uint32_t shift_long[4][256], shift_mid[4][256], shift_short[4][256];
static uint32_t shift_lane[4][256], shift_fold[4][256];
static uint64_t k_fold64[4], k_fold16[4][2];
static int use_fold;

SSE42 static uint32_t over_zeros(uint32_t c, size_t n) {
    for (size_t i = 0; i < n; i += 8) c = (uint32_t)_mm_crc32_u64(c, 0);
    return c;
}

/* x^e mod P, as a register (bit i <-> x^(31-i)) */
SSE42 static uint32_t x_pow(size_t e) {
    uint32_t c = 1u << (31 - e % 8);
    for (size_t i = 0; i < e / 8; i++) c = _mm_crc32_u8(c, 0);
    return c;
}

/* multipliers moving a 16-byte block d bytes on: its first 8 bytes by x^(8d+64), its last 8 by
   x^(8d), each less one power because the carry-less product of two reflected values is one
   bit short */
SSE42 static void fold_key(uint64_t k[2], size_t d) {
    k[0] = (uint64_t)x_pow(8 * d + 63) << 32;
    k[1] = (uint64_t)x_pow(8 * d - 1) << 32;
}

/* t[k][v]: the register v << 8k advanced over n zero bytes (linear in the register). */
SSE42 static void build(uint32_t t[4][256], size_t n) {
    uint32_t bit[32];
    for (int b = 0; b < 32; b++) bit[b] = over_zeros(1u << b, n);
    for (int k = 0; k < 4; k++)
        for (int v = 0; v < 256; v++) {
            uint32_t r = 0;
            for (int b = 0; b < 8; b++)
                if (v >> b & 1) r ^= bit[8 * k + b];
            t[k][v] = r;
        }
}

static inline uint32_t shift(uint32_t t[4][256], uint32_t c) {
    return t[0][c & 255] ^ t[1][c >> 8 & 255] ^ t[2][c >> 16 & 255] ^ t[3][c >> 24];
}

static inline uint64_t load(const unsigned char *p) { uint64_t x; memcpy(&x, p, 8); return x; }

/* 0: no SSE4.2; 1: crc32 lanes; 2: crc32 lanes and the folded lane (when `fold` and the CPU
   has AVX2 and VPCLMULQDQ). Call before crc32c_impl, again to switch. */
static int crc32c_init(int fold) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("sse4.2")) return 0;
    build(shift_long, LANE_LONG);
    build(shift_mid, LANE_MID);
    build(shift_short, LANE_SHORT);
#ifdef TIERKV_NO_FOLD
    fold = 0;
#endif
    use_fold = fold && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("pclmul")
               && __builtin_cpu_supports("vpclmulqdq");
    if (!use_fold) return 1;
    build(shift_lane, HY_LANE);
    build(shift_fold, HY_FOLD);
    fold_key(k_fold64, 64);
    k_fold64[2] = k_fold64[0], k_fold64[3] = k_fold64[1];
    for (int j = 1; j < 4; j++) fold_key(k_fold16[j], 16 * j);
    return 2;
}

#ifndef TIERKV_NO_FOLD
FOLD static inline __m256i fold32(__m256i x, __m256i k) {
    return _mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00),
                            _mm256_clmulepi64_epi128(x, k, 0x11));
}

FOLD static inline __m128i fold16(__m128i x, const uint64_t k[2]) {
    __m128i kk = _mm_loadu_si128((const void *)k);
    return _mm_xor_si128(_mm_clmulepi64_si128(x, kk, 0x00), _mm_clmulepi64_si128(x, kk, 0x11));
}

/*  | lane 0 (crc = c) | lane 1 (0) | lane 2 (0) | folded lane: 2 x 32-byte accumulators | */
FOLD static uint32_t hybrid(uint32_t c, const unsigned char **pp, size_t *pn) {
    const unsigned char *p = *pp;
    size_t n = *pn;
    const __m256i k = _mm256_loadu_si256((const void *)k_fold64);
    for (; n >= HY_BLOCK; n -= HY_BLOCK, p += HY_BLOCK) {
        const unsigned char *f = p + 3 * HY_LANE;
        uint64_t c0 = c, c1 = 0, c2 = 0;
        __m256i a0 = _mm256_loadu_si256((const void *)f);
        __m256i a1 = _mm256_loadu_si256((const void *)(f + 32));
        for (size_t i = 0; i < HY_ITERS; i++) {
            const unsigned char *q = p + 16 * i, *g = f + 64 * (i + 1);
            c0 = _mm_crc32_u64(c0, load(q));
            c1 = _mm_crc32_u64(c1, load(q + HY_LANE));
            c2 = _mm_crc32_u64(c2, load(q + 2 * HY_LANE));
            c0 = _mm_crc32_u64(c0, load(q + 8));
            c1 = _mm_crc32_u64(c1, load(q + HY_LANE + 8));
            c2 = _mm_crc32_u64(c2, load(q + 2 * HY_LANE + 8));
            a0 = _mm256_xor_si256(fold32(a0, k), _mm256_loadu_si256((const void *)g));
            a1 = _mm256_xor_si256(fold32(a1, k), _mm256_loadu_si256((const void *)(g + 32)));
        }
        /* the four 16-byte blocks left, moved onto the last one; its crc is the lane's */
        __m128i r = _mm256_extracti128_si256(a1, 1);
        r = _mm_xor_si128(r, fold16(_mm256_castsi256_si128(a0), k_fold16[3]));
        r = _mm_xor_si128(r, fold16(_mm256_extracti128_si256(a0, 1), k_fold16[2]));
        r = _mm_xor_si128(r, fold16(_mm256_castsi256_si128(a1), k_fold16[1]));
        uint64_t cf = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(r));
        cf = _mm_crc32_u64(cf, (uint64_t)_mm_extract_epi64(r, 1));
        c = shift(shift_lane, shift(shift_lane, (uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
        c = shift(shift_fold, c) ^ (uint32_t)cf;
    }
    *pp = p;
    *pn = n;
    return c;
}
#endif

#define LANES(L, TABLE)                                                              \
    while (n >= 3 * (L)) {                                                           \
        uint64_t c0 = c, c1 = 0, c2 = 0;                                             \
        for (size_t i = 0; i < (L); i += 8) {                                        \
            c0 = _mm_crc32_u64(c0, load(p + i));                                     \
            c1 = _mm_crc32_u64(c1, load(p + (L) + i));                               \
            c2 = _mm_crc32_u64(c2, load(p + 2 * (L) + i));                           \
        }                                                                            \
        c = shift(TABLE, shift(TABLE, (uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;  \
        p += 3 * (L);                                                                \
        n -= 3 * (L);                                                                \
    }

/* CRC32C of n bytes at buf, continuing from crc (0 to start). */
SSE42 static uint32_t crc32c_impl(uint32_t crc, const unsigned char *p, size_t n) {
    uint32_t c = ~crc;
    for (; n && ((uintptr_t)p & 7); n--) c = _mm_crc32_u8(c, *p++);
#ifndef TIERKV_NO_FOLD
    if (use_fold) c = hybrid(c, &p, &n);
#endif
    LANES(LANE_LONG, shift_long)
    LANES(LANE_MID, shift_mid)
    LANES(LANE_SHORT, shift_short)
    for (; n >= 8; n -= 8, p += 8) c = (uint32_t)_mm_crc32_u64(c, load(p));
    for (; n; n--) c = _mm_crc32_u8(c, *p++);
    return ~c;
}
#endif /* TIERKV_X86 */

static int level; /* what init() returned last */

PyDoc_STRVAR(init_doc,
             "init(fold) -> level\n\n"
             "Select the code path: 0 where this CPU (or platform) cannot run it, 1 for the\n"
             "crc32 lanes, 2 with the folded lane as well (when `fold` and the CPU has AVX2\n"
             "and VPCLMULQDQ). Not thread-safe against running checksums: call it at import.");

static PyObject *init(PyObject *self, PyObject *arg) {
    (void)self;
    int fold = PyObject_IsTrue(arg);
    if (fold < 0) return NULL;
#ifdef TIERKV_X86
    level = crc32c_init(fold);
#else
    level = 0;
#endif
    return PyLong_FromLong(level);
}

PyDoc_STRVAR(crc32c_doc,
             "crc32c(data, crc=0) -> int\n\n"
             "CRC-32C of a contiguous buffer, continuing from `crc` (0 to start). Raises\n"
             "RuntimeError when init() found no usable code path, BufferError for a\n"
             "non-contiguous buffer.");

static PyObject *crc32c(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "crc32c takes a buffer and an optional crc");
        return NULL;
    }
    unsigned long crc = 0;
    if (nargs == 2) {
        crc = PyLong_AsUnsignedLong(args[1]);
        if (crc == (unsigned long)-1 && PyErr_Occurred()) return NULL;
        if (crc > 0xFFFFFFFFul) {
            PyErr_SetString(PyExc_ValueError, "crc must fit in 32 bits");
            return NULL;
        }
    }
    if (level == 0) {
        PyErr_SetString(PyExc_RuntimeError, "crc32c: no usable code path on this CPU");
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
    uint32_t out = (uint32_t)crc;
#ifdef TIERKV_X86
    if (b.len >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        out = crc32c_impl(out, b.buf, (size_t)b.len);
        Py_END_ALLOW_THREADS
    } else if (b.len) {
        out = crc32c_impl(out, b.buf, (size_t)b.len);
    }
#endif
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(out);
}

PyDoc_STRVAR(crc32c_rows_doc,
             "crc32c_rows(data, row_bytes, rows) -> bytes\n\n"
             "The CRC-32C of each of several rows of a contiguous buffer, in one call: row i\n"
             "is data[rows[i] * row_bytes : (rows[i] + 1) * row_bytes]; `rows` is a buffer of\n"
             "int64. Returns len(rows) little-endian uint32 values (4 bytes each). Raises\n"
             "IndexError for a row outside the buffer (before anything is computed),\n"
             "RuntimeError when init() found no usable code path. Releases the GIL.");

static PyObject *crc32c_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "crc32c_rows takes a buffer, a row size and rows");
        return NULL;
    }
    Py_ssize_t row_bytes = PyLong_AsSsize_t(args[1]);
    if (row_bytes == -1 && PyErr_Occurred()) return NULL;
    if (row_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "crc32c_rows: row_bytes must be > 0");
        return NULL;
    }
    if (level == 0) {
        PyErr_SetString(PyExc_RuntimeError, "crc32c: no usable code path on this CPU");
        return NULL;
    }
    Py_buffer b, r;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &r, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&b);
        return NULL;
    }
    PyObject *out = NULL;
    if (r.len % 8) {
        PyErr_SetString(PyExc_ValueError, "crc32c_rows: rows must be a buffer of int64");
        goto done;
    }
    Py_ssize_t n = r.len / 8, nrows = b.len / row_bytes;
    const int64_t *rows = (const int64_t *)r.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= nrows) {
            PyErr_Format(PyExc_IndexError, "crc32c_rows: row %lld outside [0, %zd)",
                         (long long)rows[i], nrows);
            goto done;
        }
    }
    out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) goto done;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    const unsigned char *base = (const unsigned char *)b.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t c = 0;
#ifdef TIERKV_X86
        c = crc32c_impl(0, base + rows[i] * row_bytes, (size_t)row_bytes);
#endif
        dst[4 * i] = (unsigned char)c;
        dst[4 * i + 1] = (unsigned char)(c >> 8);
        dst[4 * i + 2] = (unsigned char)(c >> 16);
        dst[4 * i + 3] = (unsigned char)(c >> 24);
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&r);
    PyBuffer_Release(&b);
    return out;
}

/* ---- the disk medium's slot headers (tierkv/disk/layout.py), a run of pages per call ----------

   header, little-endian, in the first SH_BYTES of each slot's ALIGN-byte header block:
      0 magic 8s | 8 version u16 | 10 flags u16 | 12 key_len u16 | 14 zero u16 | 16 key 32s
     48 generation u64 | 56 length u32 | 60 payload_crc u32 | 64 slot u64 | 72 header_crc u32
   tierkv/disk/io.py keeps the same checks in Python (the fallback, and the source of a failed
   page's message); the tests hold the two to the same verdicts. */
#define SH_BYTES 76
#define SH_KEY 32
static const unsigned char SH_MAGIC[8] = {'T', 'K', 'V', 'D', 'I', 'S', 'K', 1};

typedef struct {
    Py_buffer payload;
    unsigned char key[SH_KEY];
    size_t key_len;
    uint64_t generation, slot;
    unsigned flags;
} sh_page;

static inline uint16_t get16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t get32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t get64(const unsigned char *p) {
    return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}
static inline void put16(unsigned char *p, unsigned v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
}
static inline void put32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> 8 * i);
}
static inline void put64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> 8 * i);
}

static uint32_t crc_of(const void *p, size_t n) {
#ifdef TIERKV_X86
    return crc32c_impl(0, p, n);
#else
    (void)p, (void)n;
    return 0; /* unreachable: at level 0 every call is refused first */
#endif
}

static void sh_release(sh_page *pages, Py_ssize_t held) {
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&pages[i].payload);
    PyMem_Free(pages);
}

static int sh_uint(PyObject *seq, Py_ssize_t i, uint64_t *out, uint64_t limit, const char *what) {
    unsigned long long v = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (v > limit) {
        PyErr_Format(PyExc_ValueError, "slot headers: %s %llu out of range", what, v);
        return -1;
    }
    *out = v;
    return 0;
}

/* The pages of one call, gathered under the GIL: each payload's buffer held (sh_release lets
   go), each key copied. NULL with an exception set on bad arguments (nothing held then). */
static sh_page *sh_gather(PyObject *payloads, PyObject *keys, PyObject *gens, PyObject *slots,
                          PyObject *flags, Py_ssize_t page_bytes, Py_ssize_t *count) {
    PyObject *seq[5] = {payloads, keys, gens, slots, flags};
    PyObject *fast[5] = {NULL, NULL, NULL, NULL, NULL};
    sh_page *pages = NULL;
    Py_ssize_t n = 0, held = 0;
    for (int k = 0; k < 5; k++) {
        if (seq[k] == NULL) continue;
        fast[k] = PySequence_Fast(seq[k], "slot headers: expected sequences");
        if (fast[k] == NULL) goto fail;
        if (k == 0) {
            n = PySequence_Fast_GET_SIZE(fast[k]);
        } else if (PySequence_Fast_GET_SIZE(fast[k]) != n) {
            PyErr_SetString(PyExc_ValueError, "slot headers: sequences of different lengths");
            goto fail;
        }
    }
    pages = PyMem_Calloc(n ? (size_t)n : 1, sizeof(sh_page));
    if (pages == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        sh_page *p = &pages[i];
        char *kb;
        Py_ssize_t kl;
        uint64_t f = 0;
        if (PyBytes_AsStringAndSize(PySequence_Fast_GET_ITEM(fast[1], i), &kb, &kl) < 0) goto fail;
        if (kl != 16 && kl != 32) {
            PyErr_Format(PyExc_ValueError, "slot headers: a key of %zd bytes (16 or 32)", kl);
            goto fail;
        }
        memcpy(p->key, kb, (size_t)kl);
        p->key_len = (size_t)kl;
        if (sh_uint(fast[2], i, &p->generation, UINT64_MAX, "generation") < 0
            || sh_uint(fast[3], i, &p->slot, UINT64_MAX, "slot") < 0
            || (fast[4] && sh_uint(fast[4], i, &f, 0xFFFF, "flags") < 0))
            goto fail;
        p->flags = (unsigned)f;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast[0], i), &p->payload, PyBUF_SIMPLE) < 0)
            goto fail;
        held = i + 1;
        if (p->payload.len < page_bytes) {
            PyErr_Format(PyExc_ValueError, "slot headers: a payload of %zd bytes, the page is %zd",
                         p->payload.len, page_bytes);
            goto fail;
        }
    }
    for (int k = 0; k < 5; k++) Py_XDECREF(fast[k]);
    *count = n;
    return pages;
fail:
    if (pages) sh_release(pages, held);
    for (int k = 0; k < 5; k++) Py_XDECREF(fast[k]);
    return NULL;
}

/* the buffer of the headers, `stride` bytes apart; 0, or -1 with an exception set */
static int sh_headers(PyObject *obj, Py_buffer *b, Py_ssize_t stride, Py_ssize_t page_bytes,
                      int writable) {
    if (level == 0) {
        PyErr_SetString(PyExc_RuntimeError, "crc32c: no usable code path on this CPU");
        return -1;
    }
    if (stride < SH_BYTES || page_bytes <= 0 || page_bytes > 0xFFFFFFFF) {
        PyErr_SetString(PyExc_ValueError, "slot headers: stride or page size out of range");
        return -1;
    }
    return PyObject_GetBuffer(obj, b, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE);
}

/* 0 when header h is page p's: intact, its key, generation, slot and size, its payload's CRC */
static int sh_check(const unsigned char *h, const sh_page *p, size_t page_bytes) {
    unsigned kl = get16(h + 12);
    if (memcmp(h, SH_MAGIC, 8) || get16(h + 8) != 1 || get16(h + 14) != 0 || (kl != 16 && kl != 32))
        return 1;
    if (crc_of(h, 72) != get32(h + 72)) return 1;
    for (unsigned i = kl; i < SH_KEY; i++)
        if (h[16 + i]) return 1;
    if (kl != p->key_len || memcmp(h + 16, p->key, kl)) return 2;
    if (get64(h + 48) != p->generation) return 3;
    if (get64(h + 64) != p->slot || get32(h + 56) != page_bytes) return 4;
    if (crc_of(p->payload.buf, page_bytes) != get32(h + 60)) return 5;
    return 0;
}

/* header of page p into h (the whole stride: zero past the header) */
static void sh_pack(unsigned char *h, size_t stride, const sh_page *p, size_t page_bytes) {
    memset(h, 0, stride);
    memcpy(h, SH_MAGIC, 8);
    put16(h + 8, 1);
    put16(h + 10, p->flags);
    put16(h + 12, (unsigned)p->key_len);
    memcpy(h + 16, p->key, p->key_len);
    put64(h + 48, p->generation);
    put32(h + 56, (uint32_t)page_bytes);
    put32(h + 60, crc_of(p->payload.buf, page_bytes));
    put64(h + 64, p->slot);
    put32(h + 72, crc_of(h, 72));
}

/* the arguments of check_slots / pack_slots, held while the GIL is released */
typedef struct {
    Py_buffer hb;
    sh_page *pages;
    Py_ssize_t n, stride, page_bytes;
} sh_args;

static void sh_close(sh_args *a) {
    sh_release(a->pages, a->n);
    PyBuffer_Release(&a->hb);
}

/* (headers, stride, payloads, keys, generations, slots[, flags], page_bytes), flags and a
   writable headers buffer holding every stride when `pack`; 0, or -1 with an exception set
   and nothing held */
static int sh_open(sh_args *a, PyObject *const *args, Py_ssize_t nargs, int pack) {
    Py_ssize_t want = pack ? 8 : 7;
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", pack ? "pack_slots" : "check_slots",
                     want);
        return -1;
    }
    a->stride = PyLong_AsSsize_t(args[1]);
    a->page_bytes = PyLong_AsSsize_t(args[want - 1]);
    if (PyErr_Occurred()) return -1;
    if (sh_headers(args[0], &a->hb, a->stride, a->page_bytes, pack) < 0) return -1;
    a->pages = sh_gather(args[2], args[3], args[4], args[5], pack ? args[6] : NULL, a->page_bytes,
                         &a->n);
    if (a->pages == NULL) {
        PyBuffer_Release(&a->hb);
        return -1;
    }
    Py_ssize_t need = pack ? a->n * a->stride : a->n ? (a->n - 1) * a->stride + SH_BYTES : 0;
    if (a->hb.len < need) {
        PyErr_SetString(PyExc_ValueError, "slot headers: the headers buffer is too short");
        sh_close(a);
        return -1;
    }
    return 0;
}

/* check_slots (pack = 0) and pack_slots (pack = 1) */
static PyObject *slots_call(PyObject *const *args, Py_ssize_t nargs, int pack) {
    sh_args a;
    if (sh_open(&a, args, nargs, pack) < 0) return NULL;
    PyObject *out = pack ? Py_NewRef(Py_None) : PyBytes_FromStringAndSize(NULL, a.n);
    if (out != NULL) {
        unsigned char *res = pack ? NULL : (unsigned char *)PyBytes_AS_STRING(out);
        unsigned char *h = a.hb.buf;
        size_t stride = (size_t)a.stride, page_bytes = (size_t)a.page_bytes;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < a.n; i++) {
            if (pack)
                sh_pack(h + i * a.stride, stride, &a.pages[i], page_bytes);
            else
                res[i] = (unsigned char)sh_check(h + i * a.stride, &a.pages[i], page_bytes);
        }
        Py_END_ALLOW_THREADS
    }
    sh_close(&a);
    return out;
}

PyDoc_STRVAR(check_slots_doc,
             "check_slots(headers, stride, payloads, keys, generations, slots, page_bytes)\n"
             "    -> bytes\n\n"
             "Verify a run of disk slots read back: header i is headers[i * stride:], page i\n"
             "payloads[i] (its first page_bytes). One byte per page: 0 when the header is\n"
             "intact and names keys[i], generations[i], slots[i] and page_bytes, and the\n"
             "payload's CRC-32C is the header's; else 1 (no intact header), 2 (another key),\n"
             "3 (another generation), 4 (another slot or page size), 5 (payload CRC).\n"
             "Releases the GIL once for the whole run. ValueError for bad arguments.");

PyDoc_STRVAR(pack_slots_doc,
             "pack_slots(headers, stride, payloads, keys, generations, slots, flags,\n"
             "           page_bytes) -> None\n\n"
             "Write the slot headers of a run of pages: header i into headers[i * stride:]\n"
             "(the whole stride, zero past the header) for keys[i], generations[i], slots[i],\n"
             "flags[i], page_bytes and the CRC-32C of payloads[i]'s first page_bytes.\n"
             "Releases the GIL once for the whole run. ValueError for bad arguments.");

static PyObject *check_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return slots_call(args, nargs, 0);
}
static PyObject *pack_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return slots_call(args, nargs, 1);
}

static PyMethodDef methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))crc32c, METH_FASTCALL, crc32c_doc},
    {"crc32c_rows", (PyCFunction)(void (*)(void))crc32c_rows, METH_FASTCALL, crc32c_rows_doc},
    {"check_slots", (PyCFunction)(void (*)(void))check_slots, METH_FASTCALL, check_slots_doc},
    {"pack_slots", (PyCFunction)(void (*)(void))pack_slots, METH_FASTCALL, pack_slots_doc},
    {"init", init, METH_O, init_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_crc32c", "CRC-32C (see transports/_crc32c.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__crc32c(void) { return PyModule_Create(&module); }
