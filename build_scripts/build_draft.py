"""Turn an official EAGLE-1/2 checkpoint into a draft directory tied to a target engine; same as
`microspec build-draft`. (Heads trained here with `microspec train-draft` are already draft directories.)

    python build_scripts/build_draft.py --checkpoint EAGLE_DIR --engine ENGINE_DIR --out ENGINE_DIR/eagle
"""
import sys

from trtllm_microspec.cli import main

if __name__ == "__main__":
    main(["build-draft", *sys.argv[1:]])
