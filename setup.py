"""Build the optional C helpers; all metadata lives in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and gearflow
uses its numpy reference paths (``gearflow info`` says which one is active).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gearflow.replay._hotpath",
            ["gearflow/replay/_hotpath.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "gearflow.transport._mac",  # the frame MAC's spans in one call, without the GIL (transport/integrity.py)
            ["gearflow/transport/_mac.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "agents._r2d2_decode",  # R2D2's one-token acting step (agents/r2d2_accel.py)
            ["agents/_r2d2_decode.c"],
            extra_compile_args=["-O3", "-fopenmp-simd"],
            optional=True,
        ),
    ]
)
