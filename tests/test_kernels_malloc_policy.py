"""pympar.kernels.malloc_policy: an application (pympar.config.apply_environment) keeps freed memory, so a
repeated step stops page-faulting its activations back in (and PYMPAR_MALLOC=system turns that off)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 20 rounds of allocating and freeing 16 arrays of 2 MiB: the second half's minor faults
SCRIPT = r"""
import resource, numpy as np
import pympar.config
from pympar.kernels import malloc_policy
pympar.config.apply_environment()    # what every application does first: applies the policy
def rnd():
    xs = [np.ones(1 << 19, dtype=np.float32) for _ in range(16)]
    del xs
for _ in range(10): rnd()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10): rnd()
print(malloc_policy.retained(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


def _run(env_extra):
    env = dict(os.environ, **env_extra)
    env.pop("PYMPAR_MALLOC", None) if "PYMPAR_MALLOC" not in env_extra else None
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt: Linux only")
def test_the_application_edge_retains_freed_memory():
    kept, faults = _run({})
    off, faults_off = _run({"PYMPAR_MALLOC": "system"})
    if not kept:
        pytest.skip("this libc refused mallopt (not glibc)")
    assert not off
    # without the policy each 2 MiB block is mmapped and faulted in again: 10 rounds x 16 x 512
    assert faults_off > 10 * 16 * 512 // 2, faults_off
    assert faults < 10 * 16 * 512 // 20, faults
