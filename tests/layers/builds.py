"""The C kernels' two builds the layer tests compare: this machine's native one and an AVX2 one
(on an AVX-512 machine, built with -mno-avx512f: 8-wide panels)."""
from __future__ import annotations

BUILDS = {"native": (), "avx2": ("-mno-avx512f",)}
