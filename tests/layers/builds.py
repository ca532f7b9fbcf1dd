"""The C kernels' two builds the layer tests compare: this machine's native one and an AVX2 one
(on an AVX-512 machine, built without AVX-512, AVX-VNNI and AMX: 8-wide panels), the flags
PAGEDLLM_KERNEL_ISA takes (kernels.ISA_FLAGS), so a test and an engine started with it share one build."""
from __future__ import annotations

from pagedllm.layers.kernels import ISA_FLAGS

BUILDS = ISA_FLAGS
