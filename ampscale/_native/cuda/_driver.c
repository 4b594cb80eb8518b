/* The CUDA driver API, found at run time: load a module, launch a kernel, with no CUDA toolkit.
 *
 * libcuda.so.1 (the driver, present wherever a GPU is) is opened with dlopen on the first call
 * of init(); its entry points are looked up with dlsym. Nothing from CUDA is needed to build
 * this file, and importing it on a machine without a GPU costs nothing.
 *
 * launch() is METH_FASTCALL: a call with a handful of integer arguments costs well under a
 * microsecond of Python overhead, against several through ctypes. Every kernel parameter is
 * passed as one 64-bit value (the kernels take only pointers and long long).
 *
 * Other extensions (an XLA FFI CUDA handler) reach the same entry points through the capsule
 * ampscale._native.cuda._driver._C_API: a struct AmpscaleDriverApi (see below), filled by init().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifndef _WIN32
#include <dlfcn.h>
#endif
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef void* CUmodule;
typedef void* CUfunction;
typedef void* CUstream;

#define AMPSCALE_MAX_PARAMS 16
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76

/* The table other extensions get through the _C_API capsule (version 1). */
typedef struct {
    int version;
    CUresult (*cuCtxGetCurrent)(CUcontext*);
    CUresult (*cuCtxPushCurrent)(CUcontext);
    CUresult (*cuCtxPopCurrent)(CUcontext*);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
    CUresult (*cuModuleLoadData)(CUmodule*, const void*);
    CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
    CUresult (*cuLaunchKernel)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                               unsigned int, unsigned int, CUstream, void**, void**);
    CUresult (*cuGetErrorString)(CUresult, const char**);
} AmpscaleDriverApi;

static AmpscaleDriverApi api;
static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDriverGetVersion)(int*);
static CUresult (*p_cuDeviceGet)(CUdevice*, int);
static CUresult (*p_cuDeviceGetAttribute)(int*, int, CUdevice);
static void* driver_handle = NULL;
static int driver_version = 0;

static PyObject* driver_error(const char* what, CUresult result) {
    const char* text = NULL;
    if (api.cuGetErrorString == NULL || api.cuGetErrorString(result, &text) != 0 || text == NULL) text = "unknown error";
    PyErr_Format(PyExc_RuntimeError, "CUDA driver: %s failed: %s (CUresult %d)", what, text, result);
    return NULL;
}

#define CHECK(call, what)                                 \
    do {                                                  \
        CUresult result_ = (call);                        \
        if (result_ != 0) return driver_error(what, result_); \
    } while (0)

static int ready(void) {
    if (driver_handle != NULL) return 1;
    PyErr_SetString(PyExc_RuntimeError, "ampscale._native.cuda._driver.init() has not succeeded");
    return 0;
}

static PyObject* init(PyObject* self, PyObject* args) {
    (void)self;
    (void)args;
    if (driver_handle != NULL) return PyLong_FromLong(driver_version);
#ifdef _WIN32
    PyErr_SetString(PyExc_OSError, "the CUDA driver launcher is built for Linux only");
    return NULL;
#else
    void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        const char* reason = dlerror();
        PyErr_Format(PyExc_OSError, "the CUDA driver libcuda.so.1 could not be loaded: %s", reason ? reason : "?");
        return NULL;
    }
    struct {
        const char* name;
        void** slot;
    } symbols[] = {
        {"cuInit", (void**)&p_cuInit},
        {"cuDriverGetVersion", (void**)&p_cuDriverGetVersion},
        {"cuDeviceGet", (void**)&p_cuDeviceGet},
        {"cuDeviceGetAttribute", (void**)&p_cuDeviceGetAttribute},
        {"cuCtxGetCurrent", (void**)&api.cuCtxGetCurrent},
        {"cuCtxPushCurrent_v2", (void**)&api.cuCtxPushCurrent},
        {"cuCtxPopCurrent_v2", (void**)&api.cuCtxPopCurrent},
        {"cuDevicePrimaryCtxRetain", (void**)&api.cuDevicePrimaryCtxRetain},
        {"cuModuleLoadData", (void**)&api.cuModuleLoadData},
        {"cuModuleGetFunction", (void**)&api.cuModuleGetFunction},
        {"cuLaunchKernel", (void**)&api.cuLaunchKernel},
        {"cuGetErrorString", (void**)&api.cuGetErrorString},
    };
    for (size_t i = 0; i < sizeof(symbols) / sizeof(symbols[0]); i++) {
        *symbols[i].slot = dlsym(handle, symbols[i].name);
        if (*symbols[i].slot == NULL) {
            PyErr_Format(PyExc_OSError, "the CUDA driver libcuda.so.1 has no %s", symbols[i].name);
            memset(&api, 0, sizeof(api));
            dlclose(handle);
            return NULL;
        }
    }
    CUresult result = p_cuInit(0);
    if (result != 0) {
        driver_error("cuInit", result);
        memset(&api, 0, sizeof(api));
        dlclose(handle);
        return NULL;
    }
    int version = 0;
    result = p_cuDriverGetVersion(&version);
    if (result != 0) {
        driver_error("cuDriverGetVersion", result);
        memset(&api, 0, sizeof(api));
        dlclose(handle);
        return NULL;
    }
    api.version = 1;
    driver_version = version;
    driver_handle = handle;
    return PyLong_FromLong(version);
#endif
}

static PyObject* compute_capability(PyObject* self, PyObject* arg) {
    (void)self;
    if (!ready()) return NULL;
    int ordinal = (int)PyLong_AsLong(arg);
    if (ordinal == -1 && PyErr_Occurred()) return NULL;
    CUdevice device;
    int major = 0, minor = 0;
    CHECK(p_cuDeviceGet(&device, ordinal), "cuDeviceGet");
    CHECK(p_cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device), "cuDeviceGetAttribute");
    CHECK(p_cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device), "cuDeviceGetAttribute");
    return Py_BuildValue("(ii)", major, minor);
}

/* load_module(ordinal, image) -> (module, context): the image (cubin or NUL-terminated PTX) loaded
   into the device's primary context (the one torch, CuPy and JAX use). */
static PyObject* load_module(PyObject* self, PyObject* args) {
    (void)self;
    int ordinal;
    Py_buffer image;
    if (!PyArg_ParseTuple(args, "iy*", &ordinal, &image)) return NULL;
    if (!ready()) {
        PyBuffer_Release(&image);
        return NULL;
    }
    CUdevice device;
    CUcontext context = NULL, popped = NULL;
    CUmodule module = NULL;
    CUresult result = p_cuDeviceGet(&device, ordinal);
    if (result == 0) result = api.cuDevicePrimaryCtxRetain(&context, device);
    if (result == 0) result = api.cuCtxPushCurrent(context);
    const char* what = "loading the module (cuDeviceGet, cuDevicePrimaryCtxRetain, cuCtxPushCurrent)";
    if (result == 0) {
        result = api.cuModuleLoadData(&module, image.buf);
        what = "loading the module (cuModuleLoadData)";
        const CUresult pop = api.cuCtxPopCurrent(&popped);
        if (result == 0 && pop != 0) {
            result = pop;
            what = "cuCtxPopCurrent after loading the module";
        }
    }
    PyBuffer_Release(&image);
    if (result != 0) return driver_error(what, result);
    return Py_BuildValue("(KK)", (unsigned long long)(uintptr_t)module, (unsigned long long)(uintptr_t)context);
}

static PyObject* get_function(PyObject* self, PyObject* args) {
    (void)self;
    unsigned long long module, context;
    const char* name;
    if (!PyArg_ParseTuple(args, "KKs", &module, &context, &name)) return NULL;
    if (!ready()) return NULL;
    CUfunction function = NULL;
    CUcontext popped = NULL;
    CHECK(api.cuCtxPushCurrent((CUcontext)(uintptr_t)context), "cuCtxPushCurrent");
    CUresult result = api.cuModuleGetFunction(&function, (CUmodule)(uintptr_t)module, name);
    const CUresult pop = api.cuCtxPopCurrent(&popped);
    if (result != 0) return driver_error("cuModuleGetFunction", result);
    if (pop != 0) return driver_error("cuCtxPopCurrent", pop);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)function);
}

/* launch(function, context, grid, block, stream, *params): cuLaunchKernel on `stream`, in
   `context` (made current for the call if another one is). Each param is a Python int, passed
   as one 64-bit kernel parameter. Asynchronous: returns once the launch is queued. */
static PyObject* launch(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 5 || nargs > 5 + AMPSCALE_MAX_PARAMS) {
        PyErr_Format(PyExc_TypeError, "launch() takes function, context, grid, block, stream and up to %d params",
                     AMPSCALE_MAX_PARAMS);
        return NULL;
    }
    if (!ready()) return NULL;
    unsigned long long head[5];
    for (Py_ssize_t i = 0; i < 5; i++) {
        head[i] = PyLong_AsUnsignedLongLongMask(args[i]);
        if (head[i] == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    }
    unsigned long long values[AMPSCALE_MAX_PARAMS];
    void* params[AMPSCALE_MAX_PARAMS];
    for (Py_ssize_t i = 5; i < nargs; i++) {
        values[i - 5] = PyLong_AsUnsignedLongLongMask(args[i]);
        if (values[i - 5] == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
        params[i - 5] = &values[i - 5];
    }
    if (head[2] == 0 || head[2] > 0x7fffffffULL || head[3] == 0 || head[3] > 1024) {
        PyErr_Format(PyExc_ValueError, "launch(): grid must be in [1, 2**31 - 1] and block in [1, 1024]; got %llu, %llu",
                     head[2], head[3]);
        return NULL;
    }
    CUcontext context = (CUcontext)(uintptr_t)head[1], current = NULL, popped = NULL;
    CHECK(api.cuCtxGetCurrent(&current), "cuCtxGetCurrent");
    const int switched = current != context;
    if (switched) CHECK(api.cuCtxPushCurrent(context), "cuCtxPushCurrent");
    CUresult result = api.cuLaunchKernel((CUfunction)(uintptr_t)head[0], (unsigned int)head[2], 1, 1,
                                         (unsigned int)head[3], 1, 1, 0, (CUstream)(uintptr_t)head[4], params, NULL);
    /* the launch is queued even when popping fails: report that failure after the launch's own */
    const CUresult pop = switched ? api.cuCtxPopCurrent(&popped) : 0;
    if (result != 0) return driver_error("cuLaunchKernel", result);
    if (pop != 0) return driver_error("cuCtxPopCurrent (after a queued launch)", pop);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"init", init, METH_NOARGS, "Load libcuda.so.1 and initialise the driver; return its version (e.g. 13000)."},
    {"compute_capability", compute_capability, METH_O, "compute_capability(ordinal) -> (major, minor)"},
    {"load_module", load_module, METH_VARARGS,
     "load_module(ordinal, image) -> (module, context): load a cubin or PTX into the primary context."},
    {"get_function", get_function, METH_VARARGS, "get_function(module, context, name) -> function handle"},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(function, context, grid, block, stream, *params): queue a kernel (64-bit params)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "ampscale._native.cuda._driver",
    "The CUDA driver API at run time (libcuda.so.1 through dlopen): module loading and kernel launches.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__driver(void) {
    PyObject* module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    PyObject* capsule = PyCapsule_New(&api, "ampscale._native.cuda._driver._C_API", NULL);
    if (capsule == NULL || PyModule_AddObject(module, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
