"""A copy of a GGUF model keeping only its first N decoder layers: a draft model for speculative decoding that
shares the target's tokenizer and weights format (issue 47: "a truncated copy of the target is fine for the
mechanics"). Used by spec_decode.py's --draft-layers.

    .venv/bin/python benchmarks/truncated_gguf.py OUT.gguf --layers 8        # from the embedded model
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import gguf

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def truncated_copy(source: Path, destination: Path, num_layers: int) -> Path:
    """Writes `source` with blocks 0..num_layers-1 only (its block count field set to match); returns
    destination. ValueError if the model has no more than num_layers layers."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    count_key = f"{arch}.block_count"
    if not 0 < num_layers < int(reader.fields[count_key].contents()):
        raise ValueError(f"--draft-layers must be between 1 and the model's {reader.fields[count_key].contents()} "
                         f"layers minus one, got {num_layers}")
    writer = gguf.GGUFWriter(destination, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer's own
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = num_layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    kept = [t for t in reader.tensors if (m := _BLOCK.match(t.name)) is None or int(m.group(1)) < num_layers]
    for tensor in kept:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return destination


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: the embedded model)")
    args = parser.parse_args()
    from kvpilot.model.default_model import default_model_path

    print(truncated_copy(args.model or Path(default_model_path()), args.output, args.layers))


if __name__ == "__main__":
    main()
