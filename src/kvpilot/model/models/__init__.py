"""Model families: one file per family (llama.py is the shared decoder the others build on), chosen through
the torch-free registry (registry.py) by the HF `architectures` entry or the GGUF `general.architecture`."""
