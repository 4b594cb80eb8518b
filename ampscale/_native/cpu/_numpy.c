/*
 * Fused overflow check + unscale for the NumPy backend.
 *
 * One pass over memory: every element is read once, multiplied by the inverse scale in float32
 * (float64 for double arrays), rounded to nearest-even in its own dtype and written back once;
 * the exponent bits of the value *stored* are tested for inf/nan (exact: no sum or norm that a
 * finite input could overflow). The product is torch's `_amp_foreach_non_finite_check_and_unscale_`
 * arithmetic (float32 "opmath"; a multiply by exactly 1 is skipped). Testing the stored value
 * rather than the input is exact in every case and costs nothing, the value being in a register:
 * an inf or nan input stays inf or nan for every inverse scale > 0; a finite input whose unscaled
 * value overflows (a scale below 1, float16 results rounding to inf included) is caught; and an
 * inverse scale of inf turns 0 into nan. So "finite" means every value written is finite. Calls
 * that only check (no multiply, or an inverse scale of exactly 1) test the inputs.
 *
 * The Python side (`ampscale/backends/numpy.py`) groups arrays by dtype and passes only
 * contiguous buffers; it calls `check_and_unscale(arrays, kind, inv_scale, multiply, threads)`.
 * The torch backend (`ampscale/backends/torch.py`) runs the same kernels on CPU tensors through
 * `check_and_unscale_tensors` (memory read through the DLPack C exchange API) or, without that
 * API, `check_and_unscale_at` (addresses and element counts).
 * The GIL is released while the kernel runs; trees larger than a threshold are split by element
 * count across `threads` POSIX threads.
 *
 * The kernels and the split live in `kernels.h`, shared with the JAX backend's XLA FFI handler
 * (`jax_ffi.cc`); this file is their Python entry point.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fp8_kernels.h"

/* ---------------------------------------------------------------- aliasing */

static PyObject *OverlapError; /* _native.OverlapError(first, second): buffers share memory in part */

typedef struct {
    uintptr_t lo, hi; /* bytes [lo, hi) */
    Py_ssize_t index;
} Extent;

static int extent_order(const void *a, const void *b) {
    const Extent *x = a, *y = b;
    if (x->lo != y->lo) return x->lo < y->lo ? -1 : 1;
    if (x->hi != y->hi) return x->hi < y->hi ? -1 : 1;
    return x->index < y->index ? -1 : (x->index > y->index);
}

/* Sort extents by address in about linear time: heap blocks are spread over an address range,
 * so a bucket per extent (by its start's place in that range) leaves only a few out of order,
 * which an insertion sort then fixes. qsort's comparison calls cost more than the kernel's own
 * bookkeeping for thousands of small buffers. */
static int sort_extents(Extent *extents, Py_ssize_t count) {
    uintptr_t low = extents[0].lo, high = extents[0].lo;
    for (Py_ssize_t i = 1; i < count; i++) {
        if (extents[i].lo < low) low = extents[i].lo;
        if (extents[i].lo > high) high = extents[i].lo;
    }
    Py_ssize_t *starts = PyMem_Calloc((size_t)count + 1, sizeof(Py_ssize_t));
    Extent *sorted = PyMem_Malloc((size_t)count * sizeof(Extent));
    if (starts == NULL || sorted == NULL) {
        PyMem_Free(starts);
        PyMem_Free(sorted);
        return -1;
    }
    const double per_byte = (double)count / ((double)(high - low) + 1.0);
#define AMPSCALE_BUCKET(e) ((Py_ssize_t)((double)((e).lo - low) * per_byte) < count ? (Py_ssize_t)((double)((e).lo - low) * per_byte) : count - 1)
    for (Py_ssize_t i = 0; i < count; i++) starts[AMPSCALE_BUCKET(extents[i]) + 1]++;
    for (Py_ssize_t b = 0; b < count; b++) starts[b + 1] += starts[b];
    for (Py_ssize_t i = 0; i < count; i++) sorted[starts[AMPSCALE_BUCKET(extents[i])]++] = extents[i];
#undef AMPSCALE_BUCKET
    /* Buckets are in order: only their insides are not. Clustered addresses (a far outlier
     * stretches the range, and most extents share a bucket) would make this quadratic: past a
     * linear budget of moves, qsort finishes the job. */
    Py_ssize_t budget = 8 * count;
    for (Py_ssize_t i = 1; i < count && budget >= 0; i++) {
        Extent e = sorted[i];
        Py_ssize_t j = i;
        while (j > 0 && extent_order(&sorted[j - 1], &e) > 0) {
            sorted[j] = sorted[j - 1];
            j--;
            budget--;
        }
        sorted[j] = e;
    }
    if (budget < 0) qsort(sorted, (size_t)count, sizeof(Extent), extent_order);
    memcpy(extents, sorted, (size_t)count * sizeof(Extent));
    PyMem_Free(starts);
    PyMem_Free(sorted);
    return 0;
}

/* Each memory location is unscaled once. Buffers that are the same bytes as an earlier one are
 * marked in `duplicate` (processed once; they are views of one array, so both show the result);
 * buffers that share only some bytes cannot be unscaled once each: -1 with OverlapError set,
 * before any element changes. One sort of the extents (none when already in address order). */
static int find_aliases(const Span *spans, Py_ssize_t count, Py_ssize_t itemsize, char *duplicate) {
    if (count < 2) return 0;
    Extent *extents = PyMem_Malloc((size_t)count * sizeof(Extent));
    if (extents == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t used = 0;
    int sorted = 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (spans[i].n == 0) continue;
        uintptr_t lo = (uintptr_t)spans[i].data;
        extents[used].lo = lo;
        extents[used].hi = lo + (uintptr_t)(spans[i].n * itemsize);
        extents[used].index = i;
        if (used > 0 && extent_order(&extents[used - 1], &extents[used]) > 0) sorted = 0;
        used++;
    }
    if (!sorted && sort_extents(extents, used) != 0) {
        PyMem_Free(extents);
        PyErr_NoMemory();
        return -1;
    }
    int status = 0;
    uintptr_t reach = 0; /* the highest end so far, and whose it is */
    Py_ssize_t reach_index = -1;
    for (Py_ssize_t k = 0; k < used; k++) {
        const Extent *e = &extents[k];
        if (k > 0 && e->lo == extents[k - 1].lo && e->hi == extents[k - 1].hi) {
            duplicate[e->index] = 1;
            continue;
        }
        if (reach_index >= 0 && e->lo < reach) {
            Py_ssize_t first = reach_index < e->index ? reach_index : e->index;
            Py_ssize_t second = reach_index < e->index ? e->index : reach_index;
            PyObject *args = Py_BuildValue("(nn)", first, second);
            if (args != NULL) {
                PyErr_SetObject(OverlapError, args);
                Py_DECREF(args);
            }
            status = -1;
            break;
        }
        if (e->hi > reach) {
            reach = e->hi;
            reach_index = e->index;
        }
    }
    PyMem_Free(extents);
    return status;
}

/* ---------------------------------------------------------------- Python entry point */

PyDoc_STRVAR(check_and_unscale_doc,
             "check_and_unscale(arrays, kind, inv_scale, multiply, threads, count_tiny=False)\n\n"
             "Check every element of the contiguous buffers in `arrays` for inf/nan and, when\n"
             "`multiply` is true, multiply them in place by `inv_scale` (float32 arithmetic).\n"
             "`kind` is 0 float16, 1 bfloat16, 2 float32, 3 float64. Returns True when all\n"
             "elements were finite; with `count_tiny`, returns (all_finite, n) where n counts\n"
             "the input elements that were zero or subnormal (in the same pass).\n\n"
             "With `multiply`, buffers that are the same bytes as an earlier one are unscaled\n"
             "once; buffers that share only some bytes raise OverlapError(first, second) before\n"
             "any element changes.");

static PyObject *check_and_unscale(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *arrays;
    int kind, multiply, threads, count_tiny = 0;
    float inv;
    if (!PyArg_ParseTuple(args, "Oifpi|p", &arrays, &kind, &inv, &multiply, &threads, &count_tiny)) {
        return NULL;
    }
    if (kind < 0 || kind >= KIND_COUNT) {
        PyErr_Format(PyExc_ValueError, "kind must be in [0, %d); got %d", KIND_COUNT, kind);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(arrays, "arrays must be a sequence of buffers");
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer *views = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(Py_buffer));
    Span *spans = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(Span));
    if (views == NULL || spans == NULL) {
        PyMem_Free(views);
        PyMem_Free(spans);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    const Py_ssize_t itemsize = kind_size[kind];
    const int flags = multiply ? (PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS) : PyBUF_ANY_CONTIGUOUS;
    Py_ssize_t acquired = 0, total = 0;
    int failed = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyObject_GetBuffer(items[i], &views[i], flags) != 0) {
            failed = 1;
            break;
        }
        acquired++;
        if (views[i].len % itemsize != 0) {
            PyErr_Format(PyExc_ValueError, "buffer %zd has %zd bytes, not a multiple of %zd", i,
                         views[i].len, itemsize);
            failed = 1;
            break;
        }
        spans[i].data = (char *)views[i].buf;
        spans[i].n = views[i].len / itemsize;
    }
    if (!failed && multiply) {
        /* only writes can change a location twice: a check-only call reads what it is given */
        char *duplicate = PyMem_Calloc(count > 0 ? (size_t)count : 1, 1);
        if (duplicate == NULL) {
            PyErr_NoMemory();
            failed = 1;
        } else {
            if (find_aliases(spans, count, itemsize, duplicate) != 0) failed = 1;
            for (Py_ssize_t i = 0; i < count; i++) {
                if (duplicate[i]) spans[i].n = 0;
            }
            PyMem_Free(duplicate);
        }
    }
    for (Py_ssize_t i = 0; i < count && !failed; i++) {
        spans[i].offset = total;
        total += spans[i].n;
    }
    int bad = 0;
    long long tiny = 0;
    if (!failed) {
        /* A multiply by exactly one changes no value: skip the write, as torch does. */
        int do_multiply = multiply && inv != 1.0f;
        count_kernel_fn counter = count_tiny ? count_kernels[kind] : NULL;
        Py_BEGIN_ALLOW_THREADS
        bad = run_all(spans, count, total, itemsize, kernels[kind], counter, inv, do_multiply, threads, &tiny);
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t i = 0; i < acquired; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(spans);
    Py_DECREF(seq);
    if (failed) return NULL;
    if (count_tiny) return Py_BuildValue("(NL)", PyBool_FromLong(!bad), tiny);
    return PyBool_FromLong(!bad);
}

/* ---------------------------------------------------------------- memory given by address */

/* Check aliasing (when writing), then run the kernel over `spans` with the GIL released.
 * Returns 1 (all finite), 0 (an inf or nan) or -1 with an exception set (OverlapError). */
static int run_spans(Span *spans, Py_ssize_t count, int kind, float inv, int multiply, int threads) {
    const Py_ssize_t itemsize = kind_size[kind];
    if (multiply && count > 1) {
        char *duplicate = PyMem_Calloc((size_t)count, 1);
        if (duplicate == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        int status = find_aliases(spans, count, itemsize, duplicate);
        for (Py_ssize_t i = 0; i < count; i++) {
            if (duplicate[i]) spans[i].n = 0;
        }
        PyMem_Free(duplicate);
        if (status != 0) return -1;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        spans[i].offset = total;
        total += spans[i].n;
    }
    int do_multiply = multiply && inv != 1.0f; /* a multiply by exactly one changes no value */
    long long tiny = 0;
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = run_all(spans, count, total, itemsize, kernels[kind], NULL, inv, do_multiply, threads, &tiny);
    Py_END_ALLOW_THREADS
    return !bad;
}

static PyObject *finish(Span *spans, int status) {
    PyMem_Free(spans);
    if (status < 0) return NULL;
    return PyBool_FromLong(status);
}

PyDoc_STRVAR(check_and_unscale_at_doc,
             "check_and_unscale_at(addresses, counts, kind, inv_scale, multiply, threads)\n\n"
             "check_and_unscale() over memory given by address: `addresses[i]` is the first of\n"
             "`counts[i]` contiguous elements of `kind` (lists of ints), for arrays that export\n"
             "no buffer. The caller guarantees that each range is memory of its own, writable\n"
             "when `multiply`, alive and not resized during the call. Same result, aliasing\n"
             "rule and OverlapError as check_and_unscale().");

static PyObject *check_and_unscale_at(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *addresses, *counts;
    int kind, multiply, threads;
    float inv;
    if (!PyArg_ParseTuple(args, "OOifpi", &addresses, &counts, &kind, &inv, &multiply, &threads)) {
        return NULL;
    }
    if (kind < 0 || kind >= KIND_COUNT) {
        PyErr_Format(PyExc_ValueError, "kind must be in [0, %d); got %d", KIND_COUNT, kind);
        return NULL;
    }
    if (!PyList_CheckExact(addresses) || !PyList_CheckExact(counts) ||
        PyList_GET_SIZE(addresses) != PyList_GET_SIZE(counts)) {
        PyErr_SetString(PyExc_TypeError, "addresses and counts must be lists of ints of one length");
        return NULL;
    }
    const Py_ssize_t count = PyList_GET_SIZE(addresses);
    Span *spans = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(Span));
    if (spans == NULL) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < count; i++) {
        void *address = PyLong_AsVoidPtr(PyList_GET_ITEM(addresses, i));
        Py_ssize_t n = PyLong_AsSsize_t(PyList_GET_ITEM(counts, i));
        if (PyErr_Occurred()) return finish(spans, -1);
        if (n < 0 || (n > 0 && address == NULL)) {
            PyErr_Format(PyExc_ValueError, "range %zd: %zd elements at address %p", i, n, address);
            return finish(spans, -1);
        }
        spans[i].data = (char *)address;
        spans[i].n = n;
    }
    return finish(spans, run_spans(spans, count, kind, inv, multiply, threads));
}

/* ---------------------------------------------------------------- tensors, through DLPack
 *
 * A framework's tensors are read through the DLPack C exchange API (DLPack 1.3: the type's
 * `__dlpack_c_exchange_api__` capsule, "dlpack_exchange_api"), whose
 * `dltensor_from_py_object_no_sync` describes a tensor's memory in a caller-provided struct:
 * no Python call, object or allocation per tensor. The declarations below are the parts of
 * the DLPack ABI used here (field order and types as the standard fixes them). */

typedef struct {
    int32_t device_type; /* 1: CPU */
    int32_t device_id;
} AmpDLDevice;

typedef struct {
    uint8_t code; /* 2: IEEE float, 4: bfloat */
    uint8_t bits;
    uint16_t lanes;
} AmpDLDataType;

typedef struct {
    void *data;
    AmpDLDevice device;
    int32_t ndim;
    AmpDLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements */
    uint64_t byte_offset;
} AmpDLTensor;

typedef struct {
    uint32_t major, minor;
    void *prev_api;
} AmpDLExchangeHeader;

typedef struct {
    AmpDLExchangeHeader header;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    int (*dltensor_from_py_object_no_sync)(void *py_object, AmpDLTensor *out);
    void *current_work_stream;
} AmpDLExchangeAPI;

enum { AMP_DL_CPU = 1, AMP_DL_FLOAT = 2, AMP_DL_BFLOAT = 4 };

static int dl_kind(AmpDLDataType t) {
    if (t.lanes != 1) return -1;
    if (t.code == AMP_DL_FLOAT) return t.bits == 16 ? KIND_F16 : t.bits == 32 ? KIND_F32 : t.bits == 64 ? KIND_F64 : -1;
    if (t.code == AMP_DL_BFLOAT && t.bits == 16) return KIND_BF16;
    return -1;
}

/* The exchange API in `capsule`, if it is one this file understands; else NULL (no error). */
static const AmpDLExchangeAPI *exchange_api(PyObject *capsule) {
    if (!PyCapsule_IsValid(capsule, "dlpack_exchange_api")) return NULL;
    const AmpDLExchangeAPI *api = PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
    if (api == NULL || api->header.major != 1 || api->header.minor < 3 || api->dltensor_from_py_object_no_sync == NULL) {
        PyErr_Clear();
        return NULL;
    }
    return api;
}

/* Fill `spans` from `items`: 1 if every one is a CPU tensor of the exact types `types`, all of
 * one float kind (`*kind_out`), C-contiguous, with memory; 0 if not (no error set); -1 on error. */
static int gather_tensors(PyObject **items, Py_ssize_t count, PyObject *types, const AmpDLExchangeAPI *api,
                          Span *spans, int *kind_out) {
    const Py_ssize_t type_count = PyTuple_GET_SIZE(types);
    int kind = -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = items[i];
        int allowed = 0;
        for (Py_ssize_t k = 0; k < type_count; k++) allowed |= (PyObject *)Py_TYPE(item) == PyTuple_GET_ITEM(types, k);
        if (!allowed) return 0;
        AmpDLTensor t;
        if (api->dltensor_from_py_object_no_sync(item, &t) != 0) {
            PyErr_Clear(); /* sparse, batched, meta, ... tensors: the framework's own kernel */
            return 0;
        }
        int this_kind = dl_kind(t.dtype);
        if (t.device.device_type != AMP_DL_CPU || this_kind < 0 || (kind >= 0 && this_kind != kind)) return 0;
        kind = this_kind;
        int64_t n = 1, expected = 1;
        int contiguous = 1;
        for (int32_t d = t.ndim - 1; d >= 0; d--) {
            int64_t size = t.shape[d];
            if (size != 1 && t.strides[d] != expected) contiguous = 0;
            expected *= size;
            n *= size;
        }
        if (n == 0) contiguous = 1;
        if (!contiguous || n < 0 || (n > 0 && t.data == NULL)) return 0;
        spans[i].data = (char *)t.data + t.byte_offset;
        spans[i].n = (ptrdiff_t)n;
    }
    *kind_out = kind;
    return kind >= 0;
}

PyDoc_STRVAR(check_and_unscale_tensors_doc,
             "check_and_unscale_tensors(tensors, types, api, inv_scale, multiply, threads)\n\n"
             "check_and_unscale() over a framework's tensors (a list), read through the DLPack C\n"
             "exchange API capsule `api`. `inv_scale`: a float, or a one-element float32 CPU\n"
             "tensor (read in place). Returns True/False (all values finite) when every\n"
             "tensor is of one of the exact `types` (a tuple), on the CPU, of one float dtype,\n"
             "C-contiguous and backed by memory; otherwise None, and nothing is touched.\n"
             "Aliasing as check_and_unscale() (OverlapError before any change). The tensors must\n"
             "not be resized or freed by another thread during the call.");

/* The inverse scale: a Python float, or a one-element float32 CPU tensor read in place (host
 * memory: nothing to wait for). 1 if read, 0 if `value` is neither (no error set), -1 on error. */
static int read_inverse(PyObject *value, PyObject *types, const AmpDLExchangeAPI *api, float *out) {
    if (PyFloat_Check(value)) {
        *out = (float)PyFloat_AS_DOUBLE(value);
        return 1;
    }
    Span span;
    int kind;
    int found = gather_tensors(&value, 1, types, api, &span, &kind);
    if (found <= 0) return found;
    if (kind != KIND_F32 || span.n != 1) return 0;
    memcpy(out, span.data, sizeof *out);
    return 1;
}

static PyObject *check_and_unscale_tensors(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tensors, *types, *capsule, *inverse;
    int multiply, threads;
    if (!PyArg_ParseTuple(args, "O!O!OOpi", &PyList_Type, &tensors, &PyTuple_Type, &types, &capsule, &inverse,
                          &multiply, &threads)) {
        return NULL;
    }
    const AmpDLExchangeAPI *api = exchange_api(capsule);
    const Py_ssize_t count = PyList_GET_SIZE(tensors);
    if (api == NULL || count == 0) Py_RETURN_NONE;
    float inv;
    int readable = read_inverse(inverse, types, api, &inv);
    if (readable < 0) return NULL;
    if (readable == 0) Py_RETURN_NONE;
    if (!multiply) inv = 1.0f;
    Span *spans = PyMem_Calloc((size_t)count, sizeof(Span));
    if (spans == NULL) return PyErr_NoMemory();
    int kind;
    int found = gather_tensors(PySequence_Fast_ITEMS(tensors), count, types, api, spans, &kind);
    if (found <= 0) {
        PyMem_Free(spans);
        if (found < 0) return NULL;
        Py_RETURN_NONE;
    }
    return finish(spans, run_spans(spans, count, kind, inv, multiply, threads));
}

PyDoc_STRVAR(tensor_kind_doc,
             "tensor_kind(tensors, types, api) -> int | None\n\n"
             "The kind check_and_unscale_tensors() would run `tensors` with, or None where it\n"
             "would not run them (the same conditions); reads the tensors, changes nothing.");

static PyObject *tensor_kind(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tensors, *types, *capsule;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyList_Type, &tensors, &PyTuple_Type, &types, &capsule)) return NULL;
    const AmpDLExchangeAPI *api = exchange_api(capsule);
    const Py_ssize_t count = PyList_GET_SIZE(tensors);
    if (api == NULL || count == 0) Py_RETURN_NONE;
    Span *spans = PyMem_Calloc((size_t)count, sizeof(Span));
    if (spans == NULL) return PyErr_NoMemory();
    int kind;
    int found = gather_tensors(PySequence_Fast_ITEMS(tensors), count, types, api, spans, &kind);
    PyMem_Free(spans);
    if (found < 0) return NULL;
    if (found == 0) Py_RETURN_NONE;
    return PyLong_FromLong(kind);
}

/* ---------------------------------------------------------------- FP8: amax and cast
 *
 * One pass over many buffers (of mixed float kinds) giving each one's amax and, with a format,
 * its saturated FP8 payload and clipped count (fp8_kernels.h). Python allocates every output; the
 * inputs are only read, so buffers may repeat or overlap. */

/* `kinds`: an int (every buffer's kind) or a bytes object with one kind per buffer. */
static int read_kind(PyObject *kinds, Py_ssize_t i, Py_ssize_t count, int *kind) {
    long k;
    if (PyLong_Check(kinds)) {
        k = PyLong_AsLong(kinds);
        if (k == -1 && PyErr_Occurred()) return -1;
    } else if (PyBytes_Check(kinds) && PyBytes_GET_SIZE(kinds) == count) {
        k = (unsigned char)PyBytes_AS_STRING(kinds)[i];
    } else {
        PyErr_Format(PyExc_TypeError, "kinds must be an int or bytes of one kind per buffer (%zd); got %R", count,
                     kinds);
        return -1;
    }
    if (k < 0 || k >= KIND_COUNT) {
        PyErr_Format(PyExc_ValueError, "kind of buffer %zd must be in [0, %d); got %ld", i, KIND_COUNT, k);
        return -1;
    }
    *kind = (int)k;
    return 0;
}

/* A writable, contiguous buffer of `count` items of `itemsize` bytes whose struct format is one
 * of the characters of `format` ("f": float32; "ql": int64, which NumPy spells 'l' on LP64). */
static int output_buffer(PyObject *object, const char *name, const char *format, Py_ssize_t itemsize, Py_ssize_t count,
                         Py_buffer *view) {
    if (PyObject_GetBuffer(object, view, PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT) != 0) return -1;
    const char *got = view->format ? view->format : "B";
    if (got[0] == '<' || got[0] == '=' || got[0] == '@') got++;
    if (strlen(got) != 1 || strchr(format, got[0]) == NULL || view->itemsize != itemsize || view->len != count * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s must be a writable contiguous buffer of %zd items of format '%c'; got %zd bytes of '%s'",
                     name, count, format[0], view->len, view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The pass over `spans` (data, n, kind, and out/scale for a cast, filled), the GIL released; the
 * amaxes written to `amaxes` as float32 and the clipped counts to `clipped` (with a cast).
 * Returns 1 when every amax is finite, 0 otherwise, -1 with an exception set. */
static int fp8_pass(Fp8Span *spans, Py_ssize_t count, int format, int divide, uint32_t nan_byte, float *amaxes,
                    long long *clipped, int threads) {
    uint64_t *top = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(uint64_t));
    if (top == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ptrdiff_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        spans[i].start = total;
        total += spans[i].n * kind_size[spans[i].kind];
    }
    if (clipped != NULL) memset(clipped, 0, (size_t)count * sizeof(long long));
    Py_BEGIN_ALLOW_THREADS
    fp8_run_all(spans, count, total, format, divide, nan_byte, top, clipped, threads);
    Py_END_ALLOW_THREADS
    int finite = 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        amaxes[i] = fp8_top_to_f32(spans[i].kind, top[i]);
        finite &= (f32_bits(amaxes[i]) & 0x7f800000u) != 0x7f800000u;
    }
    PyMem_Free(top);
    return finite;
}

/* The format code and NaN byte of a cast, checked. */
static int read_format(int format, unsigned int nan_byte) {
    if (format < 0 || format >= FP8_FORMAT_COUNT) {
        PyErr_Format(PyExc_ValueError, "format must be in [0, %d); got %d", FP8_FORMAT_COUNT, format);
        return -1;
    }
    if (nan_byte > 0xffu) {
        PyErr_Format(PyExc_ValueError, "nan_byte must be in [0, 255]; got %u", nan_byte);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(fp8_amax_doc,
             "fp8_amax(arrays, kinds, amaxes, threads) -> bool\n\n"
             "max(|x|) of every contiguous buffer in `arrays` (their kinds: an int, or bytes with\n"
             "one KIND_* code per buffer), written to `amaxes` (a writable float32 buffer, one item\n"
             "per array): NaN if the buffer holds a NaN, else inf if it holds an inf; 0 for an empty\n"
             "buffer. Returns True when every amax is finite. Reads only.");

static PyObject *fp8_amax(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *arrays, *kinds, *out;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOi", &arrays, &kinds, &out, &threads)) return NULL;
    PyObject *seq = PySequence_Fast(arrays, "arrays must be a sequence of buffers");
    if (seq == NULL) return NULL;
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer *views = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(Py_buffer));
    Fp8Span *spans = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(Fp8Span));
    Py_buffer amax_view = {0};
    int have_amax = 0, result = -1;
    Py_ssize_t acquired = 0;
    if (views == NULL || spans == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (output_buffer(out, "amaxes", "f", 4, count, &amax_view) != 0) goto done;
    have_amax = 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        int kind;
        if (read_kind(kinds, i, count, &kind) != 0) goto done;
        if (PyObject_GetBuffer(items[i], &views[i], PyBUF_ANY_CONTIGUOUS) != 0) goto done;
        acquired++;
        if (views[i].len % kind_size[kind] != 0) {
            PyErr_Format(PyExc_ValueError, "buffer %zd has %zd bytes, not a multiple of %zd", i, views[i].len,
                         (Py_ssize_t)kind_size[kind]);
            goto done;
        }
        spans[i] = (Fp8Span){(const char *)views[i].buf, NULL, views[i].len / kind_size[kind], 0, kind, 1.0f};
    }
    result = fp8_pass(spans, count, -1, 0, 0, (float *)amax_view.buf, NULL, threads);
done:
    for (Py_ssize_t i = 0; i < acquired; i++) PyBuffer_Release(&views[i]);
    if (have_amax) PyBuffer_Release(&amax_view);
    PyMem_Free(views);
    PyMem_Free(spans);
    Py_DECREF(seq);
    if (result < 0) return NULL;
    return PyBool_FromLong(result);
}

PyDoc_STRVAR(fp8_amax_cast_doc,
             "fp8_amax_cast(arrays, kinds, outs, scales, format, divide, nan_byte, amaxes, clipped,\n"
             "              threads) -> bool\n\n"
             "fp8_amax(), and in the same pass saturate(x * scales[i]) (x / scales[i] with `divide`)\n"
             "of every element of buffer i written as FP8 `format` (FP8_* code) to `outs[i]` (a\n"
             "writable byte buffer of as many elements), NaN as `nan_byte` (with the sign where the\n"
             "format has one); `clipped[i]` (int64) the elements whose product exceeded fp8_max.\n"
             "`scales`: a float32 buffer, one item per array.");

static PyObject *fp8_amax_cast(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *arrays, *kinds, *outs, *scales, *amax_out, *clipped_out;
    int format, divide, threads;
    unsigned int nan_byte;
    if (!PyArg_ParseTuple(args, "OOOOipIOOi", &arrays, &kinds, &outs, &scales, &format, &divide, &nan_byte, &amax_out,
                          &clipped_out, &threads)) {
        return NULL;
    }
    if (read_format(format, nan_byte) != 0) return NULL;
    PyObject *seq = PySequence_Fast(arrays, "arrays must be a sequence of buffers");
    if (seq == NULL) return NULL;
    PyObject *out_seq = PySequence_Fast(outs, "outs must be a sequence of buffers");
    if (out_seq == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject **out_items = PySequence_Fast_ITEMS(out_seq);
    Py_buffer *views = PyMem_Calloc(count > 0 ? 2 * (size_t)count : 1, sizeof(Py_buffer));
    Fp8Span *spans = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(Fp8Span));
    Py_buffer amax_view = {0}, clipped_view = {0}, scale_view = {0};
    int outputs = 0, result = -1;
    Py_ssize_t acquired = 0;
    if (views == NULL || spans == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PySequence_Fast_GET_SIZE(out_seq) != count) {
        PyErr_Format(PyExc_ValueError, "outs must hold one buffer per array (%zd); got %zd", count,
                     PySequence_Fast_GET_SIZE(out_seq));
        goto done;
    }
    if (output_buffer(amax_out, "amaxes", "f", 4, count, &amax_view) != 0) goto done;
    outputs = 1;
    if (output_buffer(clipped_out, "clipped", "ql", 8, count, &clipped_view) != 0) goto done;
    outputs = 2;
    if (PyObject_GetBuffer(scales, &scale_view, PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT) != 0) goto done;
    outputs = 3;
    if (scale_view.itemsize != 4 || scale_view.len != count * 4 || scale_view.format == NULL ||
        strchr(scale_view.format, 'f') == NULL) {
        PyErr_Format(PyExc_ValueError, "scales must be a contiguous float32 buffer of %zd items", count);
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        int kind;
        if (read_kind(kinds, i, count, &kind) != 0) goto done;
        if (PyObject_GetBuffer(items[i], &views[2 * i], PyBUF_ANY_CONTIGUOUS) != 0) goto done;
        acquired++;
        if (PyObject_GetBuffer(out_items[i], &views[2 * i + 1], PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS) != 0) goto done;
        acquired++;
        const Py_ssize_t n = views[2 * i].len / kind_size[kind];
        if (views[2 * i].len % kind_size[kind] != 0 || views[2 * i + 1].len != n) {
            PyErr_Format(PyExc_ValueError, "buffer %zd: %zd bytes of kind %d need an output of %zd bytes; got %zd", i,
                         views[2 * i].len, kind, n, views[2 * i + 1].len);
            goto done;
        }
        spans[i] = (Fp8Span){(const char *)views[2 * i].buf, (uint8_t *)views[2 * i + 1].buf, n, 0, kind,
                             ((const float *)scale_view.buf)[i]};
    }
    result = fp8_pass(spans, count, format, divide, nan_byte, (float *)amax_view.buf, (long long *)clipped_view.buf,
                      threads);
done:
    for (Py_ssize_t i = 0; i < acquired; i++) PyBuffer_Release(&views[i]);
    if (outputs >= 1) PyBuffer_Release(&amax_view);
    if (outputs >= 2) PyBuffer_Release(&clipped_view);
    if (outputs >= 3) PyBuffer_Release(&scale_view);
    PyMem_Free(views);
    PyMem_Free(spans);
    Py_DECREF(seq);
    Py_DECREF(out_seq);
    if (result < 0) return NULL;
    return PyBool_FromLong(result);
}

/* Fill `spans` from framework tensors read through DLPack: 1 if every one is a CPU float
 * tensor of the exact `types`, C-contiguous, with memory (kinds may differ); 0 if not (no error
 * set); -1 on error. With `outs`, each needs a uint8 CPU tensor of as many elements, C-contiguous. */
static int gather_fp8_tensors(PyObject **items, PyObject **outs, Py_ssize_t count, PyObject *types,
                              const AmpDLExchangeAPI *api, Fp8Span *spans) {
    for (Py_ssize_t i = 0; i < count; i++) {
        Span span;
        int kind;
        if (gather_tensors(&items[i], 1, types, api, &span, &kind) <= 0) return PyErr_Occurred() ? -1 : 0;
        spans[i] = (Fp8Span){span.data, NULL, span.n, 0, kind, 1.0f};
        if (outs == NULL) continue;
        PyObject *out = outs[i];
        int allowed = 0;
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(types); k++) allowed |= (PyObject *)Py_TYPE(out) == PyTuple_GET_ITEM(types, k);
        AmpDLTensor t;
        if (!allowed || api->dltensor_from_py_object_no_sync(out, &t) != 0) {
            PyErr_Clear();
            return 0;
        }
        int64_t n = 1, expected = 1;
        int contiguous = 1;
        for (int32_t d = t.ndim - 1; d >= 0; d--) {
            if (t.shape[d] != 1 && t.strides[d] != expected) contiguous = 0;
            expected *= t.shape[d];
            n *= t.shape[d];
        }
        if (t.device.device_type != AMP_DL_CPU || t.dtype.code != 1 || t.dtype.bits != 8 || t.dtype.lanes != 1 ||
            n != span.n || (n > 0 && (!contiguous || t.data == NULL))) {
            return 0;
        }
        spans[i].out = (uint8_t *)t.data + t.byte_offset;
    }
    return 1;
}

PyDoc_STRVAR(fp8_amax_tensors_doc,
             "fp8_amax_tensors(tensors, types, api, amaxes, threads) -> bool | None\n\n"
             "fp8_amax() over a framework's tensors (a list) read through the DLPack C exchange API\n"
             "capsule `api`: None (nothing written) unless every tensor is of one of the exact\n"
             "`types`, on the CPU, a float16/bfloat16/float32/float64 tensor, C-contiguous and\n"
             "backed by memory (dtypes may differ).");

static PyObject *fp8_amax_tensors(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tensors, *types, *capsule, *out;
    int threads;
    if (!PyArg_ParseTuple(args, "O!O!OOi", &PyList_Type, &tensors, &PyTuple_Type, &types, &capsule, &out, &threads)) {
        return NULL;
    }
    const AmpDLExchangeAPI *api = exchange_api(capsule);
    const Py_ssize_t count = PyList_GET_SIZE(tensors);
    if (api == NULL) Py_RETURN_NONE;
    Fp8Span *spans = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(Fp8Span));
    if (spans == NULL) return PyErr_NoMemory();
    int found = gather_fp8_tensors(PySequence_Fast_ITEMS(tensors), NULL, count, types, api, spans);
    if (found <= 0) {
        PyMem_Free(spans);
        if (found < 0) return NULL;
        Py_RETURN_NONE;
    }
    Py_buffer amax_view;
    if (output_buffer(out, "amaxes", "f", 4, count, &amax_view) != 0) {
        PyMem_Free(spans);
        return NULL;
    }
    int result = fp8_pass(spans, count, -1, 0, 0, (float *)amax_view.buf, NULL, threads);
    PyBuffer_Release(&amax_view);
    PyMem_Free(spans);
    if (result < 0) return NULL;
    return PyBool_FromLong(result);
}

PyDoc_STRVAR(fp8_amax_cast_tensors_doc,
             "fp8_amax_cast_tensors(tensors, outs, types, api, scales, format, divide, nan_byte,\n"
             "                      amaxes, clipped, threads) -> bool | None\n\n"
             "fp8_amax_cast() over a framework's tensors, the payloads written to `outs` (uint8 CPU\n"
             "tensors, C-contiguous, one element per input element); `scales`, `amaxes` and\n"
             "`clipped` are buffers as for fp8_amax_cast(). None (nothing written) where\n"
             "fp8_amax_tensors() would return None, or an output is not such a tensor.");

static PyObject *fp8_amax_cast_tensors(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tensors, *outs, *types, *capsule, *scales, *amax_out, *clipped_out;
    int format, divide, threads;
    unsigned int nan_byte;
    if (!PyArg_ParseTuple(args, "O!O!O!OOipIOOi", &PyList_Type, &tensors, &PyList_Type, &outs, &PyTuple_Type, &types,
                          &capsule, &scales, &format, &divide, &nan_byte, &amax_out, &clipped_out, &threads)) {
        return NULL;
    }
    if (read_format(format, nan_byte) != 0) return NULL;
    const AmpDLExchangeAPI *api = exchange_api(capsule);
    const Py_ssize_t count = PyList_GET_SIZE(tensors);
    if (api == NULL || PyList_GET_SIZE(outs) != count) Py_RETURN_NONE;
    Fp8Span *spans = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(Fp8Span));
    if (spans == NULL) return PyErr_NoMemory();
    int found = gather_fp8_tensors(PySequence_Fast_ITEMS(tensors), PySequence_Fast_ITEMS(outs), count, types, api, spans);
    if (found <= 0) {
        PyMem_Free(spans);
        if (found < 0) return NULL;
        Py_RETURN_NONE;
    }
    Py_buffer amax_view, clipped_view, scale_view;
    if (output_buffer(amax_out, "amaxes", "f", 4, count, &amax_view) != 0) {
        PyMem_Free(spans);
        return NULL;
    }
    if (output_buffer(clipped_out, "clipped", "ql", 8, count, &clipped_view) != 0) {
        PyBuffer_Release(&amax_view);
        PyMem_Free(spans);
        return NULL;
    }
    if (PyObject_GetBuffer(scales, &scale_view, PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        PyBuffer_Release(&amax_view);
        PyBuffer_Release(&clipped_view);
        PyMem_Free(spans);
        return NULL;
    }
    int result = -1;
    if (scale_view.itemsize != 4 || scale_view.len != count * 4 || scale_view.format == NULL ||
        strchr(scale_view.format, 'f') == NULL) {
        PyErr_Format(PyExc_ValueError, "scales must be a contiguous float32 buffer of %zd items", count);
    } else {
        for (Py_ssize_t i = 0; i < count; i++) spans[i].scale = ((const float *)scale_view.buf)[i];
        result = fp8_pass(spans, count, format, divide, nan_byte, (float *)amax_view.buf, (long long *)clipped_view.buf,
                          threads);
    }
    PyBuffer_Release(&scale_view);
    PyBuffer_Release(&amax_view);
    PyBuffer_Release(&clipped_view);
    PyMem_Free(spans);
    if (result < 0) return NULL;
    return PyBool_FromLong(result);
}

PyDoc_STRVAR(use_isa_doc,
             "use_isa(name) -> str\n\n"
             "Select the kernel family: 'generic' (portable C), 'avx2', or 'best' (the fastest\n"
             "this CPU supports). Returns the family now in use. Tests use it to cover both paths.");

static PyObject *use_isa(PyObject *self, PyObject *args) {
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    int ceiling = strcmp(name, "generic") == 0 ? ISA_GENERIC
                  : strcmp(name, "avx2") == 0  ? ISA_AVX2
                  : strcmp(name, "best") == 0  ? ISA_BEST
                                               : -1;
    if (ceiling < 0) {
        PyErr_Format(PyExc_ValueError, "use_isa: name must be 'generic', 'avx2' or 'best'; got %R",
                     PyTuple_GET_ITEM(args, 0));
        return NULL;
    }
    if (select_isa(ceiling) < 0) {
        PyErr_SetString(PyExc_ValueError, "use_isa: this CPU has no AVX2/FMA/F16C");
        return NULL;
    }
    return PyUnicode_FromString(kernel_isa);
}

static PyMethodDef methods[] = {
    {"check_and_unscale", check_and_unscale, METH_VARARGS, check_and_unscale_doc},
    {"check_and_unscale_at", check_and_unscale_at, METH_VARARGS, check_and_unscale_at_doc},
    {"check_and_unscale_tensors", check_and_unscale_tensors, METH_VARARGS, check_and_unscale_tensors_doc},
    {"tensor_kind", tensor_kind, METH_VARARGS, tensor_kind_doc},
    {"fp8_amax", fp8_amax, METH_VARARGS, fp8_amax_doc},
    {"fp8_amax_cast", fp8_amax_cast, METH_VARARGS, fp8_amax_cast_doc},
    {"fp8_amax_tensors", fp8_amax_tensors, METH_VARARGS, fp8_amax_tensors_doc},
    {"fp8_amax_cast_tensors", fp8_amax_cast_tensors, METH_VARARGS, fp8_amax_cast_tensors_doc},
    {"use_isa", use_isa, METH_VARARGS, use_isa_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ampscale._native.cpu._numpy",
    "Fused overflow check and unscale for contiguous NumPy buffers.", -1, methods,
};

PyMODINIT_FUNC PyInit__numpy(void) {
    select_kernels();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    OverlapError = PyErr_NewExceptionWithDoc("ampscale._native.cpu._numpy.OverlapError",
                                             "Two buffers share some, but not all, of their bytes.",
                                             PyExc_ValueError, NULL);
    if (OverlapError == NULL || PyModule_AddObjectRef(m, "OverlapError", OverlapError) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "PARALLEL_THRESHOLD", (long)(PARALLEL_THRESHOLD * 2)) < 0 ||
        PyModule_AddIntConstant(m, "KIND_FLOAT16", KIND_F16) < 0 ||
        PyModule_AddIntConstant(m, "KIND_BFLOAT16", KIND_BF16) < 0 ||
        PyModule_AddIntConstant(m, "KIND_FLOAT32", KIND_F32) < 0 ||
        PyModule_AddIntConstant(m, "KIND_FLOAT64", KIND_F64) < 0 ||
        PyModule_AddIntConstant(m, "FP8_E4M3FN", FP8_E4M3FN) < 0 || PyModule_AddIntConstant(m, "FP8_E5M2", FP8_E5M2) < 0 ||
        PyModule_AddIntConstant(m, "FP8_E4M3FNUZ", FP8_E4M3FNUZ) < 0 ||
        PyModule_AddIntConstant(m, "FP8_E5M2FNUZ", FP8_E5M2FNUZ) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
