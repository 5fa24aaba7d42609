"""vt's CUDA backend (the vt-cuda distribution): vt.gpu over cuda-python.

``caps`` turns device attributes into capabilities (pure, no CUDA), ``adapter`` is the
vt.gpu runtime adapter over cuda-python's driver API and NVRTC, ``backend`` the
:class:`vt.gpu.GpuBackend` subclass, ``plugin`` registers it. Nothing imports cuda-python
until a probe or a backend instance needs it.
"""
