"""From EngineArgs to a running engine: the arguments (args.py: EngineArgs, torch-free), building the
engine from them (build.py) and its tensor-parallel ranks (tp.py)."""
