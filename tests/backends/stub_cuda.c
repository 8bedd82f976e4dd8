// A stand-in libcuda.so.1 for CPU tests of kernel launchers: the entry points a launcher calls record what they
// are given (the launch configuration, each parameter's bytes at the sizes the test sets) and launch nothing.
#include <stdint.h>
#include <string.h>
#include "cuda.h"

static int sizes[128];
static int count = 0;
static unsigned char parameters[128 * 8];
static unsigned int config[8];
static long launches = 0;
static CUresult next_result = CUDA_SUCCESS;
static int contexts[2];
static int current = 0;

void stub_set_sizes(int n, const int *s) { count = n; memcpy(sizes, s, n * sizeof(int)); }
void stub_set_context(int which) { current = which; }
void stub_fail_next(int code) { next_result = (CUresult)code; }
long stub_launches(void) { return launches; }
const unsigned char *stub_parameters(void) { return parameters; }
const unsigned int *stub_config(void) { return config; }

CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
  if (next_result != CUDA_SUCCESS) {
    CUresult r = next_result;
    next_result = CUDA_SUCCESS;
    return r;
  }
  launches++;
  config[0] = c->gridDimX; config[1] = c->gridDimY; config[2] = c->gridDimZ; config[3] = c->blockDimX;
  config[4] = c->sharedMemBytes; config[5] = (unsigned int)(uintptr_t)c->hStream; config[6] = c->numAttrs;
  config[7] = (unsigned int)(uintptr_t)f;
  int offset = 0;
  for (int i = 0; i < count; i++) {
    memcpy(parameters + offset, params[i], sizes[i]);
    offset += sizes[i];
  }
  return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext *pctx) { *pctx = (CUcontext)&contexts[current]; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext ctx) { return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *d, int i) { *d = i; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice d) { *pctx = (CUcontext)&contexts[0]; return CUDA_SUCCESS; }
CUresult cuGetErrorString(CUresult e, const char **s) { *s = "stand-in error"; return CUDA_SUCCESS; }
CUresult cuPointerGetAttribute(void *data, CUpointer_attribute a, CUdeviceptr p) { *(uint64_t *)data = p; return CUDA_SUCCESS; }
CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) { return CUDA_SUCCESS; }
