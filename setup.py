"""Install the ``megatron`` package and compile its C++ dataset helpers.

Install torch first (``pip install torch==2.13.0``, CPU or CUDA build as you need);
the ``torch>=2.5`` requirement below is then already satisfied and pip fetches nothing.
"""
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _version() -> str:
    for line in (ROOT / "megatron" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise RuntimeError("megatron/__init__.py defines no __version__")


helpers = Pybind11Extension(
    "megatron.data.helpers_cpp",
    ["megatron/data/helpers.cpp"],
    cxx_std=17,
    extra_compile_args=["-O3"],
)

setup(
    name="megatron-pipedream-2bw",
    version=_version(),
    description="Megatron-style GPT/BERT training with PipeDream-2BW pipeline schedules",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["megatron", "megatron.*"]),
    package_data={"megatron.data": ["helpers.cpp"]},
    ext_modules=[helpers],
    cmdclass={"build_ext": build_ext},
    install_requires=[
        "torch>=2.5",  # nn.RMSNorm (2.4), scaled_dot_product_attention(enable_gqa=) (2.5)
        "numpy",
        "regex",
        "sentencepiece",
        "pybind11",
        "matplotlib",
        "safetensors>=0.4",
    ],
    extras_require={
        # transformers/safetensors: Hugging Face export tests; tokenizers: the fast
        # tokenizer backend is tested against the pure-Python reference.
        "test": ["pytest", "transformers", "safetensors", "tokenizers"],
        "tensorboard": ["tensorboard"],
        # Optional speed-up of GPT-2 BPE / WordPiece (same ids as the built-in code).
        "fast": ["tokenizers"],
    },
    zip_safe=False,
)
