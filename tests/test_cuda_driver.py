"""The CUDA driver launcher (``ampscale/_native/cuda/_driver.c``) against a fake ``libcuda.so.1``.

No GPU here: a small C library with the driver's entry points (built by the host compiler)
stands in for ``libcuda.so.1``, found through ``LD_LIBRARY_PATH`` in a child process (the
launcher's ``init()`` is once per process). Each entry point can be told to fail, and every
failure must come back as an error that names the call, never be ignored.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
try:
    from ampscale._native.cuda import _driver  # noqa: F401
except ImportError as exc:
    BUILT = str(exc)
else:
    BUILT = ""

pytestmark = [
    pytest.mark.skipif(CC is None, reason="no C compiler"),
    pytest.mark.skipif(bool(BUILT), reason=f"the launcher is not built: {BUILT}"),
    pytest.mark.skipif(sys.platform != "linux", reason="the launcher opens libcuda.so.1 (Linux)"),
]

FAKE = r"""
#include <stdlib.h>
#include <string.h>
static int fail(const char* name) {
    const char* which = getenv("FAKE_CUDA_FAIL");
    return which != NULL && strcmp(which, name) == 0 ? 999 : 0;
}
static int launches = 0, pushes = 0, pops = 0;
int fake_launches(void) { return launches; }
int fake_pushes(void) { return pushes; }
int fake_pops(void) { return pops; }
int cuInit(unsigned int f) { (void)f; return fail("cuInit"); }
int cuDriverGetVersion(int* v) { *v = 13000; return fail("cuDriverGetVersion"); }
int cuDeviceGet(int* d, int o) { *d = o; return fail("cuDeviceGet"); }
int cuDeviceGetAttribute(int* v, int a, int d) { (void)d; *v = a == 75 ? 9 : 0; return fail("cuDeviceGetAttribute"); }
int cuCtxGetCurrent(void** c) { *c = (void*)0; return fail("cuCtxGetCurrent"); }
int cuCtxPushCurrent_v2(void* c) { (void)c; pushes++; return fail("cuCtxPushCurrent"); }
int cuCtxPopCurrent_v2(void** c) { *c = (void*)0x1234; pops++; return fail("cuCtxPopCurrent"); }
int cuDevicePrimaryCtxRetain(void** c, int d) { (void)d; *c = (void*)0x1234; return fail("cuDevicePrimaryCtxRetain"); }
int cuModuleLoadData(void** m, const void* i) { (void)i; *m = (void*)0x5678; return fail("cuModuleLoadData"); }
int cuModuleGetFunction(void** f, void* m, const char* n) {
    (void)m; (void)n; *f = (void*)0x9abc; return fail("cuModuleGetFunction");
}
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void* stream, void** params, void** extra) {
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)stream;
    (void)params; (void)extra;
    launches++;
    return fail("cuLaunchKernel");
}
int cuGetErrorString(int r, const char** s) { (void)r; *s = "fake failure"; return 0; }
"""

CHILD = r"""
import ctypes, sys
from ampscale._native.cuda import _driver
fake = ctypes.CDLL("libcuda.so.1")
step = sys.argv[1]
try:
    _driver.init()
    assert _driver.compute_capability(0) == (9, 0)
    module, context = _driver.load_module(0, b"image")
    function = _driver.get_function(module, context, "kernel")
    _driver.launch(function, context, 1, 1, 0, 7, 8)
    print("OK")
except RuntimeError as exc:
    print("RuntimeError:", exc)
print("launches", fake.fake_launches(), "pushes", fake.fake_pushes(), "pops", fake.fake_pops())
"""


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("libcuda")
    source = directory / "fake.c"
    source.write_text(FAKE)
    assert CC is not None
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(directory / "libcuda.so.1"), str(source)], check=True)
    return directory


def run(fake_driver: pathlib.Path, failing: str = "") -> str:
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_driver), FAKE_CUDA_FAIL=failing)
    done = subprocess.run([sys.executable, "-c", CHILD, failing], env=env, capture_output=True, text=True, check=True)
    return done.stdout


def test_a_launch_through_the_fake_driver(fake_driver: pathlib.Path) -> None:
    out = run(fake_driver)
    assert "OK" in out
    # the module's context is pushed around the load, the lookup and the launch (none was current)
    assert "launches 1 pushes 3 pops 3" in out


@pytest.mark.parametrize(
    ("failing", "named", "launched"),
    [
        ("cuCtxGetCurrent", "cuCtxGetCurrent failed", 0),  # unchecked before: the launch went on
        ("cuCtxPopCurrent", "cuCtxPopCurrent", 0),  # the load's pop fails first
        ("cuDriverGetVersion", "cuDriverGetVersion failed", 0),
        ("cuModuleLoadData", "cuModuleLoadData", 0),
        ("cuLaunchKernel", "cuLaunchKernel failed", 1),
    ],
)
def test_every_failure_is_reported_with_the_call_that_failed(
    fake_driver: pathlib.Path, failing: str, named: str, launched: int
) -> None:
    out = run(fake_driver, failing)
    assert "RuntimeError:" in out, out
    assert named in out, out
    assert "fake failure (CUresult 999)" in out
    assert f"launches {launched}" in out
