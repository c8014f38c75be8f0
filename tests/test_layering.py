"""Layering of src/kvpilot, checked on the import graph (tests/import_graph.py, function-local imports
included): no cycle between units, every import goes a direction allowed below, the torch-free units stay
torch-free, and the client tools reach the engine side only through its public interfaces.

Adding an import that crosses units means placing it here first: if it would close a cycle, move the shared
piece down to the lower unit instead of importing late (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import pytest

from tests.import_graph import Import, cycles, module_edges, package_imports, reachable_modules, unit_edges, unit_of

# Plain value types and process helpers, importing at most each other (MAY_IMPORT): any unit may import them.
SHARED_LEAVES = frozenset({"memory_size", "sampling_params", "structured_outputs", "outputs", "omp_pool"})
# unit -> the other units it may import (besides SHARED_LEAVES). The data itself must be acyclic (checked).
MAY_IMPORT: dict[str, frozenset[str]] = {
    **{leaf: frozenset() for leaf in SHARED_LEAVES},
    "sampling_params": frozenset({"structured_outputs"}),  # SamplingParams.structured_outputs (vLLM's shape)
    "cli_options": frozenset(),
    # torch-free core: the scheduler side and the planner (its catalogs, HF-config and GGUF-header parsers)
    "engine": frozenset(),
    "fit": frozenset(),
    # tensors: consumes the scheduler's step contract, reads configs through fit
    "model": frozenset({"engine", "fit"}),
    # wiring and the Python API
    "launch": frozenset({"engine", "fit", "model"}),  # EngineArgs (torch-free), building the engine, TP ranks
    "llm": frozenset({"engine", "launch", "model"}),
    "kvpilot": frozenset({"llm"}),
    "chat_session": frozenset({"llm"}),
    "server": frozenset({"cli_options", "engine", "fit", "kvpilot", "launch", "llm", "model"}),
    # `serve run kvpilot.ray:app`: the short import path of the server's Ray Serve application (server/ray_app)
    "ray": frozenset({"server"}),
    # `kvpilot fit --calibrate`'s measurements: kvpilot's kernels and engine, stored as fit's profile
    "calibrate": frozenset({"fit", "llm", "model"}),
    # client tools: talk to any server over HTTP; bench borrows the model's tokenizer, doctor reads bench results
    "bench": frozenset({"fit", "model"}),
    "doctor": frozenset({"bench", "fit"}),
    # the composition root
    "cli": frozenset({"bench", "calibrate", "chat_session", "cli_options", "doctor", "engine", "fit", "llm",
                      "model", "server"}),
}

# server/core (the engine-core process and the HTTP side's handle on it) and the rest of server/ (the HTTP
# process): the HTTP side goes through the client, the messages and the types that describe an engine...
CORE_DOORS = frozenset({"kvpilot.server.core.engine_client", "kvpilot.server.core.messages",
                        "kvpilot.server.core.engine_spec", "kvpilot.server.core.engine_info"})
# ...and the core uses no more of the HTTP side than these (the client's streams and errors, process helpers).
CORE_HELPERS = frozenset({"kvpilot.server.item_stream", "kvpilot.server.openai.errors", "kvpilot.server.gc_heap",
                          "kvpilot.server.observe.log_writer"})

TORCH_FREE = ("engine", "fit")
CLIENT_TOOLS = ("bench", "fit", "doctor")
# What a client tool may import from the engine-side units: their public faces, never their internals.
PUBLIC_INTERFACES: dict[str, frozenset[str]] = {
    "engine": frozenset({"kvpilot.engine"}),  # the package root re-exports the engine's API
    "model": frozenset({"kvpilot.model.default_model", "kvpilot.model.errors", "kvpilot.model.tokenizer"}),
    "server": frozenset({"kvpilot.server"}),  # create_app, ServerArgs, engine_factory
}


def allowed(importer: str, imported: str) -> bool:
    """May unit `importer` import unit `imported`?"""
    leaf = imported in SHARED_LEAVES and importer not in SHARED_LEAVES
    return leaf or imported in MAY_IMPORT.get(importer, frozenset())


def reaches_internals(imported: str) -> bool:
    """Is `imported` a module of an engine-side unit outside that unit's public interface?"""
    unit = unit_of(imported)
    return unit in PUBLIC_INTERFACES and imported not in PUBLIC_INTERFACES[unit]


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return package_imports()


def _describe(edges: dict[tuple[str, str], list[Import]], pairs) -> str:
    return "\n".join(f"  {a} -> {b}: " + ", ".join(dict.fromkeys(i.where() for i in edges[(a, b)]))
                     for a, b in pairs)


def test_every_unit_has_a_place_in_the_layering(imports: list[Import]) -> None:
    units = {unit_of(imp.importer) for imp in imports}
    assert sorted(units - set(MAY_IMPORT)) == [], "new unit: add it to MAY_IMPORT"


def test_the_allowed_directions_have_no_cycle() -> None:
    assert all(targets <= set(MAY_IMPORT) for targets in MAY_IMPORT.values())
    assert cycles({(a, b) for a in MAY_IMPORT for b in MAY_IMPORT if allowed(a, b)}) == []


def test_no_import_cycle_between_units(imports: list[Import]) -> None:
    edges = unit_edges(imports)
    found = cycles(set(edges))
    pairs = [(a, b) for cycle in found for a, b in edges if a in cycle and b in cycle]
    assert found == [], f"import cycles between units {found}:\n{_describe(edges, sorted(pairs))}"


def test_no_import_cycle_between_modules(imports: list[Import]) -> None:
    """Not even through a function-local import (a late import that closes a cycle hides a layering fault), nor
    through a package's `__init__` that Python runs on the way to one of its modules (model/attention's, which
    imported the backends, made `import kvpilot.model.layers.paged_attention` fail on its own)."""
    assert cycles(module_edges(imports)) == []


def _server_part(module: str) -> str | None:
    """`kvpilot.server.core.messages` -> `core`; a module at server/'s top level -> `http`; else None."""
    parts = module.split(".")
    if parts[:2] != ["kvpilot", "server"] or len(parts) < 3:
        return None
    return parts[2] if len(parts) > 3 else "http"


def test_the_http_side_reaches_the_core_only_through_its_doors(imports: list[Import]) -> None:
    bad = [i.where() for i in imports if _server_part(i.importer) not in (None, "core")
           and _server_part(i.imported) == "core" and i.imported not in CORE_DOORS]
    assert bad == [], f"the HTTP side may use only {sorted(CORE_DOORS)} of server/core"


def test_the_core_uses_only_helpers_of_the_http_side(imports: list[Import]) -> None:
    bad = [i.where() for i in imports if _server_part(i.importer) == "core"
           and _server_part(i.imported) not in (None, "core") and i.imported not in CORE_HELPERS]
    assert bad == [], f"server/core may use only {sorted(CORE_HELPERS)} outside it"


def test_every_import_goes_an_allowed_direction(imports: list[Import]) -> None:
    edges = unit_edges(imports)
    wrong = sorted((a, b) for a, b in edges if not allowed(a, b))
    assert wrong == [], f"imports against the layering:\n{_describe(edges, wrong)}"


@pytest.mark.parametrize("unit", TORCH_FREE)
def test_torch_free_units_reach_no_torch_and_no_model(imports: list[Import], unit: str) -> None:
    """Followed through every kvpilot module they import (parent packages' __init__ aside: kvpilot's own
    loads LLM lazily; tests/fit/test_torch_free.py checks the real import)."""
    roots = {i.importer for i in imports if unit_of(i.importer) == unit}
    reached = reachable_modules(imports, roots)
    bad = [i.where() for i in imports if i.importer in reached
           and (i.imported.split(".")[0] == "torch" or unit_of(i.imported) == "model")]
    assert bad == [], f"{unit} must stay torch-free and never import kvpilot.model"


@pytest.mark.parametrize("client", CLIENT_TOOLS)
def test_client_tools_use_only_public_interfaces(imports: list[Import], client: str) -> None:
    bad = [i.where() for i in imports if unit_of(i.importer) == client and reaches_internals(i.imported)]
    assert bad == [], f"{client} reaches engine/model/server internals"


def test_the_graph_sees_function_local_imports(tmp_path) -> None:
    """The check is only as good as its reader: a late import inside a function is an edge too."""
    pkg = tmp_path / "kvpilot"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("def f():\n    from ..b import y\n    import torch\n")
    (pkg / "b.py").write_text("from kvpilot.a import x\n")
    found = package_imports(tmp_path)
    edges = unit_edges(found)
    assert set(edges) == {("a", "b"), ("b", "a")} and cycles(set(edges)) == [["a", "b"]]
    assert Import("kvpilot.a.x", "torch", 3) in found and Import("kvpilot.b", "kvpilot.a.x", 1) in found
