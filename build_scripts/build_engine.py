"""Build an engine directory from a model key, a .gguf file or a HF checkpoint dir; same as `microspec build`.

    python build_scripts/build_engine.py smollm2-135m
    python build_scripts/build_engine.py model.gguf --out engines/mine --max-seq-len 4096
"""
import sys

from trtllm_microspec.cli import main

if __name__ == "__main__":
    main(["build", *sys.argv[1:]])
