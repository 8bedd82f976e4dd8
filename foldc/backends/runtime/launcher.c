// foldc's launcher of a bound kernel launch: everything but the leading addresses (and at most one 32-bit integer)
// is packed once, when the launch is bound; a call stores the addresses and the integer into the packed parameters
// and calls cuLaunchKernelEx, as triton's generated launcher does, without parsing a format string per argument,
// without the per-call context and scratch handling (a bound launch has no scratch) and without releasing the GIL.
// Built by fast_c.py with triton's compiler helper and its copy of cuda.h; libcuda is opened when the module is
// loaded (`load`), so building needs no driver.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include "cuda.h"

typedef CUresult (*launch_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*context_fn)(CUcontext *);
typedef CUresult (*error_fn)(CUresult, const char **);

static launch_fn launch_kernel = NULL;
static context_fn current_context = NULL;
static error_fn error_string = NULL;

#define MOST_PARAMETERS 128

typedef struct {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  CUlaunchConfig config;
  CUlaunchAttribute attributes[2];
  CUfunction function;
  CUcontext context;        // the context current at the bind: a call under another one launches nothing
  int ready;                // __init__ succeeded
  int addresses;            // the first `addresses` parameters are given per call
  int slot;                 // the parameter given per call as a 32-bit integer after them, or -1
  int count;                // parameters in all (the kernel's, then triton's two scratch pointers)
  uint64_t values[MOST_PARAMETERS];   // one 8-byte cell per parameter, its value packed at its start
  void *parameters[MOST_PARAMETERS];
} Launch;

// Launch(function, grid_x, grid_y, grid_z, threads, shared_memory, cooperative, pdl, packed, addresses, slot)
// packed: bytes, 8 per parameter (each value at the start of its cell, little-endian as the GPU reads it).
static int Launch_init(Launch *self, PyObject *args, PyObject *kwargs) {
  unsigned long long function;
  unsigned int gx, gy, gz, threads, shared;
  int cooperative, pdl, addresses, slot;
  Py_buffer packed;
  if (!PyArg_ParseTuple(args, "KIIIIIppy*ii", &function, &gx, &gy, &gz, &threads, &shared, &cooperative, &pdl,
                        &packed, &addresses, &slot))
    return -1;
  Py_ssize_t count = packed.len / 8;
  if (packed.len % 8 || count > MOST_PARAMETERS || addresses < 0 || addresses > count || slot >= count
      || (slot >= 0 && slot < addresses)) {
    PyBuffer_Release(&packed);
    PyErr_SetString(PyExc_ValueError, "packed parameters must be 8 bytes each, at most 128, the addresses first "
                                      "and the per-call integer after them");
    return -1;
  }
  if (current_context == NULL) {
    PyBuffer_Release(&packed);
    PyErr_SetString(PyExc_RuntimeError, "libcuda is not loaded (call load first)");
    return -1;
  }
  self->ready = 0;
  memcpy(self->values, packed.buf, packed.len);
  PyBuffer_Release(&packed);
  self->count = (int)count;
  for (int i = 0; i < self->count; i++) self->parameters[i] = &self->values[i];
  self->addresses = addresses;
  self->slot = slot;
  self->function = (CUfunction)(uintptr_t)function;
  memset(&self->config, 0, sizeof(self->config));
  self->config.gridDimX = gx;
  self->config.gridDimY = gy;
  self->config.gridDimZ = gz;
  self->config.blockDimX = threads;
  self->config.blockDimY = 1;
  self->config.blockDimZ = 1;
  self->config.sharedMemBytes = shared;
  int n = 0;
  if (pdl) {
    self->attributes[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    self->attributes[n].value.programmaticStreamSerializationAllowed = 1;
    n++;
  }
  if (cooperative) {
    self->attributes[n].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    self->attributes[n].value.cooperative = 1;
    n++;
  }
  self->config.attrs = self->attributes;
  self->config.numAttrs = n;
  if (current_context(&self->context) != CUDA_SUCCESS || self->context == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "no CUDA context is current: bind a launch after one ran");
    return -1;
  }
  self->ready = 1;
  return 0;
}

// launch(stream, address, ..., [integer]) -> True when launched; False, launching nothing, where an address is not
// 16-byte aligned, the integer is outside 32 bits or another context is current.
static PyObject *Launch_call(Launch *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
  if (!self->ready) {
    PyErr_SetString(PyExc_RuntimeError, "this Launch was not made (its __init__ failed or was not called)");
    return NULL;
  }
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  Py_ssize_t want = 1 + self->addresses + (self->slot >= 0);
  if (nargs != want || kwnames != NULL) {
    PyErr_Format(PyExc_TypeError, "a bound launch takes %zd positional arguments (%zd given)", want, nargs);
    return NULL;
  }
  unsigned long long stream = PyLong_AsUnsignedLongLong(args[0]);
  if (stream == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
  uint64_t misaligned = 0;
  for (int i = 0; i < self->addresses; i++) {
    unsigned long long a = PyLong_AsUnsignedLongLong(args[1 + i]);
    if (a == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    misaligned |= a;
    self->values[i] = a;
  }
  if (misaligned & 15) Py_RETURN_FALSE;
  if (self->slot >= 0) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(args[1 + self->addresses], &overflow);
    if (v == -1 && PyErr_Occurred()) return NULL;
    if (overflow || v < INT32_MIN || v > INT32_MAX) Py_RETURN_FALSE;
    int32_t v32 = (int32_t)v;
    memcpy(&self->values[self->slot], &v32, 4);
  }
  CUcontext context;
  if (current_context(&context) != CUDA_SUCCESS || context != self->context) Py_RETURN_FALSE;
  if (self->config.gridDimX == 0 || self->config.gridDimY == 0 || self->config.gridDimZ == 0)
    Py_RETURN_TRUE;   // an empty grid launches nothing, as triton's launcher skips it
  self->config.hStream = (CUstream)(uintptr_t)stream;
  CUresult status = launch_kernel(&self->config, self->function, self->parameters, NULL);
  if (status != CUDA_SUCCESS) {
    const char *text = "unknown error";
    error_string(status, &text);
    PyErr_Format(PyExc_RuntimeError, "foldc launch [CUDA]: %s", text);
    return NULL;
  }
  Py_RETURN_TRUE;
}

static PyObject *Launch_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
  return Launch_call((Launch *)self, args, nargsf, kwnames);
}

static PyObject *Launch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  Launch *self = (Launch *)type->tp_alloc(type, 0);
  if (self != NULL) self->vectorcall = Launch_vectorcall;
  return (PyObject *)self;
}

static PyTypeObject LaunchType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "foldc_launcher.Launch",
  .tp_basicsize = sizeof(Launch),
  .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
  .tp_new = Launch_new,
  .tp_init = (initproc)Launch_init,
  .tp_call = PyVectorcall_Call,
  .tp_vectorcall_offset = offsetof(Launch, vectorcall),
  .tp_doc = "One bound kernel launch (foldc.backends.runtime.fast_c)",
};

// load(path): open libcuda (a path, or the name "libcuda.so.1") and find the three entry points a launch uses.
static PyObject *load(PyObject *module, PyObject *args) {
  const char *path;
  if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
  void *handle = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  if (handle == NULL) {
    PyErr_Format(PyExc_OSError, "cannot open %s: %s", path, dlerror());
    return NULL;
  }
  launch_fn l = (launch_fn)dlsym(handle, "cuLaunchKernelEx");
  context_fn c = (context_fn)dlsym(handle, "cuCtxGetCurrent");
  error_fn e = (error_fn)dlsym(handle, "cuGetErrorString");
  if (l == NULL || c == NULL || e == NULL) {
    PyErr_Format(PyExc_OSError, "%s lacks cuLaunchKernelEx, cuCtxGetCurrent or cuGetErrorString", path);
    return NULL;
  }
  launch_kernel = l;
  current_context = c;
  error_string = e;
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
  {"load", load, METH_VARARGS, "load(path): open libcuda and find the entry points a launch uses"},
  {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "foldc_launcher", NULL, -1, methods};

PyMODINIT_FUNC PyInit_foldc_launcher(void) {
  if (PyType_Ready(&LaunchType) < 0) return NULL;
  PyObject *m = PyModule_Create(&module_def);
  if (m == NULL) return NULL;
  Py_INCREF(&LaunchType);
  if (PyModule_AddObject(m, "Launch", (PyObject *)&LaunchType) < 0) {
    Py_DECREF(&LaunchType);
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
