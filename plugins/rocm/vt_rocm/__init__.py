"""vt's ROCm backend over hip-python (``pip install 'vt[rocm]'``).

``caps`` turns device attributes into capabilities (pure, no HIP), ``adapter`` wraps
hip-python's calls with error checking, ``backend`` implements the protocol, ``plugin``
registers it. Nothing imports hip-python until a probe or a backend instance needs it.
"""
