"""Convert DeepSpeed checkpoints between tensor-parallel sizes and to Hugging Face folders.

Same as `python -m swbert.parallel.convert`; see its help for the three commands.
"""

from swbert.parallel.convert import main

if __name__ == "__main__":
    main()
