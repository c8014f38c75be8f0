"""Session-wide fixtures: the real embedded model (kvpilot and HF transformers on the same GGUF weights)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

warnings.filterwarnings("ignore", category=DeprecationWarning)


@pytest.fixture(autouse=True, scope="session")
def _no_machine_calibration(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """fit and doctor read `kvpilot fit --calibrate`'s profile from kvpilot's cache dir: the suite plans on nominal
    rates whatever the machine it runs on has measured (tests of calibration point it elsewhere)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVPILOT_CACHE_DIR", str(tmp_path_factory.mktemp("kvpilot-cache")))
        yield


@pytest.fixture(autouse=True)
def _main_thread_omp_pool_released() -> Iterator[None]:
    """After each test, the main thread hands its OpenMP workers back (kvpilot/omp_pool.py): an engine core in a
    thread of a later test (a module's servers) would otherwise run every parallel region beside this idle pool,
    throttled by libgomp to wake-ups instead of spinning (1.6x slower decode measured)."""
    yield
    from kvpilot.omp_pool import release_omp_pool

    release_omp_pool()


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """torch's intra-op threads (OpenMP) set to `num_threads` meanwhile, then restored: threads started meanwhile (an
    in-process server's engine) take the count too. scripts/test.sh runs the suite's engines on one thread each."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from kvpilot.model.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def llm_fp32():
    """kvpilot's LLM on the embedded GGUF in float32 (the dtype in which outputs must match HF exactly)."""
    from kvpilot import LLM

    return LLM(dtype="float32", kv_cache_memory="1GiB", max_model_len=4096)


_GGUF_MEMO: dict[str, Any] = {}  # the memoized gguf functions, shared by the HF fixtures of one session


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While transformers reads the embedded GGUF: its `gguf` package parses the file's header once, not once for
    the config and again for the weights (and for the tokenizer), and builds each tensor-name map once, not once
    per module (~400 times): 15 -> 7 s of CPU for the model, 3 -> 1 s for the tokenizer. Both are pure functions
    of read-only inputs (the weights come out equal, tensor for tensor). Patched only here: kvpilot's own loader
    subclasses gguf.GGUFReader."""
    import gguf

    if not _GGUF_MEMO:
        _GGUF_MEMO.update(GGUFReader=functools.lru_cache(maxsize=None)(gguf.GGUFReader),
                          get_tensor_name_map=functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    with pytest.MonkeyPatch.context() as patch:
        for name, memoized in _GGUF_MEMO.items():
            patch.setattr(gguf, name, memoized)
        yield


@pytest.fixture(scope="session")
def hf_model(gguf_path: Path):
    """HF transformers' own model on the same GGUF (it dequantizes the weights itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    with _gguf_parsed_once():
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


# Files whose costly session fixtures are the same: one worker computes them once for both.
SHARED_SESSION_FIXTURES = {
    # mixed_alone and second_wave_alone: 40 prompts decoded one at a time (~30 s on 2 cores)
    "tests/engine_e2e/test_batching.py": "engine_e2e-alone", "tests/engine_e2e/test_speculative.py": "engine_e2e-alone",
    # fp32_greedy: the float32 model's 48 greedy tokens for 8 prompts in one batch (~11 s)
    **dict.fromkeys(("tests/model/test_hf_reference.py", "tests/model/test_prompt_gemm.py",
                     "tests/model/test_quant_greedy.py"), "model-fp32-greedy"),
}


def suite_group(nodeid: str) -> str:
    """The group a test runs in under scripts/test.sh's two workers: its file (its module fixtures start once),
    except that the Ray tests and the doctor's live probes share one, "live-timing": one local Ray cluster at a
    time (two made the box's load average 12), one live probe at a time (they measure the machine: two at once
    would each see the other as the fault), and neither beside the other (the lanes test beside probes of servers
    on every core measured short TTFT 0.9x better through lanes, against 4-6x beside a one-thread test). Files
    with the same costly session fixtures share one too (SHARED_SESSION_FIXTURES)."""
    path = nodeid.split("::")[0]
    if path in SHARED_SESSION_FIXTURES:
        return SHARED_SESSION_FIXTURES[path]
    if path.startswith(("tests/ray/", "tests/doctor/test_live_")):
        return "live-timing"
    return path


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup` by suite_group. Not xdist's own loadgroup: it names each test's group in the test's
    nodeid, which pytest 9.2 no longer reads from the attribute xdist sets, so every group was silently spread
    over both workers. A scheduler that splits nodeids into groups itself (xdist's documented hook) holds."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return suite_group(nodeid)

    return GroupScheduling(config, log)
