"""`library`: each kernel build of builds.BUILDS in turn, for a module's tests."""
from __future__ import annotations

import pytest

from builds import BUILDS
from pagedllm.layers import kernels


@pytest.fixture(scope="module", params=list(BUILDS))
def library(request):
    lib = kernels.load(BUILDS[request.param])
    assert lib is not None
    if request.param == "avx2":
        assert kernels.isa(lib) in ("avx2", "generic") and lib.panel_width() == 8
    return lib
