/* tierkv.codecs._dequant: int8 pages back to fp32 / fp16 / bf16 in one pass (built by setup.py).

   dequant(out, out_stride, q, q_stride, s, s_stride, pages, groups, t, d, g, dtype) -> None
   bad_scales(s, s_stride, pages, count, mask) -> pages whose scales are negative or not finite

   Pointers are addresses (ints) of N pages, `*_stride` bytes apart; within a page everything is
   contiguous. A page holds `groups` blocks (2 * H) of t tokens of d channels:

       g == 0 (int8):        out[b, i, c] = q[b, i, c] * s[b, c]           s: [groups][d] fp32
       g >  0 (int8-group):  out[b, i, c] = q[b, i, c] * s[b, i, c / g]    s: [groups][t][d/g]

   The product is one fp32 multiply (as torch's q.float() * s), then rounded to nearest even to
   the page dtype (dtype 0 fp32, clamped to the finite range as the torch path clamps it; 1 fp16;
   2 bf16), so the result is bit-identical to the torch path it replaces. The caller (tierkv.codecs.fast) checks every extent first. The GIL is
   released.

   Paths, picked at run time: AVX-512 (F + BW + VL; 16 channels per instruction: vpmovsxbd,
   vcvtdq2ps, vmulps, then vcvtps2ph for fp16 or an integer round-to-nearest-even and vpmovdw
   for bf16) where the CPU has it, else portable C (which the compiler vectorizes with what the
   build targets, SSE2 on x86-64); TIERKV_DEQUANT_PORTABLE=1 in the environment at import picks
   the portable path anyway (the tests compare both). ISA names the path.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define TIERKV_X86 1
#include <immintrin.h>
#endif

typedef struct {
    char *out;
    const int8_t *q;
    const float *s;
    Py_ssize_t out_stride, q_stride, s_stride, pages, groups, t, d, g;
    int dtype;
} job_t;

static inline uint16_t bf16_rne(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline uint16_t fp16_rne(float x) {
    /* IEEE binary16, round to nearest even, subnormals and overflow to inf included */
    uint32_t f;
    memcpy(&f, &x, 4);
    uint32_t sign = (f >> 16) & 0x8000u;
    uint32_t a = f & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) return (uint16_t)(sign | 0x7C00u | (a > 0x7F800000u ? 0x200u : 0));
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds past 65504 */
    if (a < 0x38800000u) {                                     /* a binary16 subnormal or 0 */
        if (a < 0x33000000u) return (uint16_t)sign;             /* below half the smallest */
        uint32_t e = a >> 23, m = (a & 0x7FFFFFu) | 0x800000u;
        uint32_t shift = 126 - e; /* 14 .. 24 */
        uint32_t r = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = a - 0x38000000u; /* rebias 127 -> 15 */
    uint32_t m = r & 0x1FFFu;
    r >>= 13;
    if (m > 0x1000u || (m == 0x1000u && (r & 1u))) r++;
    return (uint16_t)(sign | r);
}

static inline float scale_of(const job_t *j, const float *s, Py_ssize_t gi, Py_ssize_t i,
                             Py_ssize_t c) {
    if (j->g == 0) return s[gi * j->d + c];
    return s[(gi * j->t + i) * (j->d / j->g) + c / j->g];
}

/* q, s and o: page p's int8 values, scales and output */
#define PAGE_POINTERS(j, p)                                                      \
    const int8_t *q = (const int8_t *)((const char *)(j)->q + (p) * (j)->q_stride); \
    const float *s = (const float *)((const char *)(j)->s + (p) * (j)->s_stride);   \
    char *o = (j)->out + (p) * (j)->out_stride

/* one element, rounded to the page dtype (fp32 clamped to its finite range) */
static inline void store1(char *o, Py_ssize_t e, float v, int dtype) {
    if (dtype == 0)
        ((float *)o)[e] = v > FLT_MAX ? FLT_MAX : v < -FLT_MAX ? -FLT_MAX : v;
    else if (dtype == 1)
        ((uint16_t *)o)[e] = fp16_rne(v);
    else
        ((uint16_t *)o)[e] = bf16_rne(v);
}

static void run_scalar(const job_t *j) {
    for (Py_ssize_t p = 0; p < j->pages; p++) {
        PAGE_POINTERS(j, p);
        Py_ssize_t e = 0;
        for (Py_ssize_t gi = 0; gi < j->groups; gi++)
            for (Py_ssize_t i = 0; i < j->t; i++)
                for (Py_ssize_t c = 0; c < j->d; c++, e++)
                    store1(o, e, (float)q[e] * scale_of(j, s, gi, i, c), j->dtype);
    }
}

#ifdef TIERKV_X86
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c")))

static int has_bf16 = 0; /* AVX512_BF16: vcvtneps2bf16 */

/* bf16 round to nearest even with integer ops (exact for subnormals too) */
AVX512_TARGET static inline void store16_bf16_int(char *o, Py_ssize_t e, __m512 v) {
    __m512i b = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)o + e), _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
}

AVX512_TARGET static inline void store16(char *o, Py_ssize_t e, __m512 v, int dtype) {
    if (dtype == 0) { /* clamped: 127 * s may round past FLT_MAX */
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-FLT_MAX)), _mm512_set1_ps(FLT_MAX));
        _mm512_storeu_ps((float *)o + e, v);
    } else if (dtype == 1) {
        _mm256_storeu_si256((__m256i *)((uint16_t *)o + e),
                            _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else if (has_bf16) { /* vcvtneps2bf16, unless a lane is an fp32 subnormal (it flushes) */
        __mmask16 sub = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(FLT_MIN), _CMP_LT_OQ) &
                        _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_UQ);
        if (!sub) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)o + e), (__m256i)_mm512_cvtneps_pbh(v));
            return;
        }
        store16_bf16_int(o, e, v);
    } else {
        store16_bf16_int(o, e, v);
    }
}

AVX512_TARGET static void run_avx512(const job_t *j) {
    Py_ssize_t d = j->d, g = j->g;
    for (Py_ssize_t p = 0; p < j->pages; p++) {
        PAGE_POINTERS(j, p);
        Py_ssize_t e = 0;
        for (Py_ssize_t gi = 0; gi < j->groups; gi++)
            for (Py_ssize_t i = 0; i < j->t; i++) {
                Py_ssize_t c = 0;
                for (; c + 16 <= d; c += 16, e += 16) {
                    __m512 sv;
                    if (g == 0)
                        sv = _mm512_loadu_ps(s + gi * d + c);
                    else if (g % 16 == 0)
                        sv = _mm512_set1_ps(s[(gi * j->t + i) * (d / g) + c / g]);
                    else
                        break; /* groups narrower than a vector: the scalar loop below */
                    __m512i qi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + e)));
                    store16(o, e, _mm512_mul_ps(_mm512_cvtepi32_ps(qi), sv), j->dtype);
                }
                for (; c < d; c++, e++)
                    store1(o, e, (float)q[e] * scale_of(j, s, gi, i, c), j->dtype);
            }
    }
}

static int has_avx512(void) {
    __builtin_cpu_init();
    has_bf16 = __builtin_cpu_supports("avx512bf16");
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
}
#else
static int has_avx512(void) { return 0; }
#endif

static int use_avx512 = 0;

static PyObject *dequant(PyObject *self, PyObject *args) {
    job_t j;
    unsigned long long out, q, s;
    if (!PyArg_ParseTuple(args, "KnKnKnnnnnni", &out, &j.out_stride, &q, &j.q_stride, &s,
                          &j.s_stride, &j.pages, &j.groups, &j.t, &j.d, &j.g, &j.dtype))
        return NULL;
    if (j.pages < 0 || j.groups < 0 || j.t < 0 || j.d < 0 || j.g < 0 || j.dtype < 0 ||
        j.dtype > 2 || (j.g && j.d % j.g)) {
        PyErr_SetString(PyExc_ValueError, "dequant: bad sizes");
        return NULL;
    }
    j.out = (char *)(uintptr_t)out;
    j.q = (const int8_t *)(uintptr_t)q;
    j.s = (const float *)(uintptr_t)s;
    Py_BEGIN_ALLOW_THREADS
#ifdef TIERKV_X86
    if (use_avx512)
        run_avx512(&j);
    else
#endif
        run_scalar(&j);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* bad_scales(s, s_stride, pages, count, mask) -> pages with a bad scale: mask[p] = 1 where page
   p's `count` fp32 scales hold a negative one, NaN or inf (-0.0 passes, as `x >= 0` does). */
static PyObject *bad_scales(PyObject *self, PyObject *args) {
    unsigned long long s, mask;
    Py_ssize_t stride, pages, count, bad = 0;
    if (!PyArg_ParseTuple(args, "KnnnK", &s, &stride, &pages, &count, &mask)) return NULL;
    if (pages < 0 || count < 0) {
        PyErr_SetString(PyExc_ValueError, "bad_scales: bad sizes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t p = 0; p < pages; p++) {
        const uint32_t *b = (const uint32_t *)((const char *)(uintptr_t)s + p * stride);
        uint32_t any = 0;
        for (Py_ssize_t i = 0; i < count; i++) any |= (b[i] >= 0x7F800000u) & (b[i] != 0x80000000u);
        ((uint8_t *)(uintptr_t)mask)[p] = (uint8_t)any;
        bad += any;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(bad);
}

static PyMethodDef methods[] = {
    {"bad_scales", bad_scales, METH_VARARGS, "pages with negative or non-finite fp32 scales"},
    {"dequant", dequant, METH_VARARGS, "int8 pages to fp32/fp16/bf16 (see the module source)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dequant", NULL, -1, methods};

PyMODINIT_FUNC PyInit__dequant(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    const char *force = getenv("TIERKV_DEQUANT_PORTABLE"); /* "1": the portable C path */
    use_avx512 = has_avx512() && !(force && strcmp(force, "1") == 0);
    if (PyModule_AddStringConstant(m, "ISA", use_avx512 ? "avx512" : "c") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
