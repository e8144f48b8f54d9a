"""Packaging for megatron_pp_ext (a plugin for stock megatron-core)."""

from setuptools import find_packages, setup

setup(
    name="megatron_pp_ext",
    version="0.1.0",
    description="Pipeline-parallel schedules (zero bubble, V-shape, breadth-first, BitPipe, ZeroPP, "
    "DualPipeV) for stock megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # 3.11: the CPU environment the tests run in (megatron-core's cp311 wheel, installed past its metadata);
    # 3.12: megatron-core's declared Python from 0.17 on, Megatron-Bridge's (>=3.12,<3.13) and NGC's PyTorch
    # containers' (the GPU kit runs there). 3.13: neither megatron-core's nor Bridge's wheels are tested on it.
    python_requires=">=3.11,<3.13",
    classifiers=["Programming Language :: Python :: 3.11", "Programming Language :: Python :: 3.12"],
    packages=find_packages(include=["megatron_pp_ext", "megatron_pp_ext.*"]),
    # torch and megatron-core are installed by scripts/setup_env.sh (a CPU torch build and, on 3.11,
    # megatron-core's cp311 wheel, which pip refuses by its Python>=3.12 metadata; on 3.12 pip installs it).
    # psutil: megatron's distributed-checkpoint save workers need it.
    install_requires=["torch>=2.4", "megatron-core>=0.19.2", "numpy", "packaging>=24.2", "psutil"],
    extras_require={
        "plot": ["matplotlib>=3.7"],
        "test": [
            "pytest>=8",
            "hypothesis>=6.100",
            "ruff>=0.6",
            "mypy==2.4.1",
            "matplotlib>=3.7",
            "pytest-timeout>=2.3",
        ],
        "te": ["transformer_engine[pytorch]>=2.10"],
    },
    entry_points={"console_scripts": ["megatron-pp=megatron_pp_ext.cli:main"]},
)
