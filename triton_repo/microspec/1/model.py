"""Triton Python-backend entry point; the model lives in trtllm_microspec/serving/triton_model.py."""
import os
import sys

# The stub runs python isolated, so PYTHONPATH is not on sys.path: put it first, before anything imports numpy
# (`microspec serve` puts the package and the stub's numpy<2 there).
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

from trtllm_microspec.serving.triton_model import TritonPythonModel  # noqa: E402, F401
