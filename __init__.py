"""qpn: NVFP4 and FP8 weight-only linear layers for GPUs without FP4/FP8 hardware.

Parts (see docs/ARCHITECTURE.md): `qpn.ref` (pure-numpy bit-exact reference), `qpn.checkpoints`
(checkpoint I/O and the packed format), `qpn.cupy_kernels` (sm_75 CUDA kernels through CuPy),
`qpn.torch_bridge` (torch custom ops, modules, vLLM), `qpn.apps` (the `qpn` command, the demo).
"""

__version__ = "0.1.0"
