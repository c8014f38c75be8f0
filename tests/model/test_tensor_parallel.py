"""Tensor parallelism on CPU (gloo, one worker process per extra rank): greedy outputs equal one rank's, on
random-weight Llama and Qwen3 configs whose KV heads split over the ranks and whose single KV head is
replicated; an impossible split fails before anything starts, naming the sizes that work."""

from __future__ import annotations

import json

import pytest
import torch

from kvpilot import LLM, SamplingParams
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.engine.config import EngineConfigError
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.config import ModelConfig, from_hf_config
from kvpilot.model.parallel.shard_plan import check_tp_split, local_config

SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32, "vocab_size": 512,
         "torch_dtype": "float32"}
PROMPTS = [[5, 17, 3, 99, 250, 7], [400, 2, 2, 31], list(range(40, 80))]


def _config(tmp_path, name: str, heads: int, kv_heads: int) -> str:
    config = {**get_hf_config(name), **SMALL, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    config.pop("dtype", None)
    path = tmp_path / f"{name}-{heads}-{kv_heads}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _model_config(tmp_path, name: str, heads: int, kv_heads: int) -> ModelConfig:
    path = _config(tmp_path, name, heads, kv_heads)
    return from_hf_config(json.loads(open(path).read()), path)


def _greedy(path: str, tp: int, prompts: list[list[int]] = PROMPTS, max_tokens: int = 12,
            **engine_args) -> list[list[int]]:
    """Greedy tokens of the prompts; a tensor-parallel engine is shut down after, and rank 0's share of the CPU's
    threads (os.cpu_count() // tp) was the engine's only: the process has its thread count back."""
    threads = torch.get_num_threads()
    llm = LLM(path, load_format="dummy", dtype="float32", tensor_parallel_size=tp, kv_cache_memory="64MiB",
              max_model_len=128, max_num_seqs=4, **engine_args)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    if tp > 1:
        llm.engine.runner.shutdown()
    assert torch.get_num_threads() == threads
    if "speculative_config" in engine_args:  # the drafts were verified, not skipped
        assert sum(o.metrics.num_draft_tokens for o in outputs) > 0
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("name, heads, kv_heads", [("llama-3.1-8b", 4, 2), ("qwen3-0.6b", 4, 1)])
def test_two_ranks_decode_what_one_does(tmp_path, name, heads, kv_heads):
    path = _config(tmp_path, name, heads, kv_heads)
    assert _greedy(path, 2) == _greedy(path, 1)


def test_two_ranks_verify_ngram_drafts_and_decode_what_one_does(tmp_path):
    """n-gram drafts come from the scheduler, in the diff every rank runs: verification stays in lockstep."""
    path = _config(tmp_path, "llama-3.1-8b", 4, 2)
    looping = [[7, 8, 9, 10] * 6, [300, 301, 302] * 5 + [300]]  # prompts that the n-gram lookup can copy from
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    assert _greedy(path, 2, looping, 24, speculative_config=ngram) == _greedy(path, 1, looping, 24)


def test_a_draft_model_with_tensor_parallelism_is_refused_naming_ngram(tmp_path):
    path = _config(tmp_path, "llama-3.1-8b", 4, 2)
    with pytest.raises(EngineConfigError, match=r"'draft_model' with tensor_parallel_size > 1 .*\"ngram\""):
        LLM(path, load_format="dummy", tensor_parallel_size=2,
            speculative_config={"method": "draft_model", "model": path})


def test_a_rank_holds_its_share_of_the_kv_heads(tmp_path):
    config = _model_config(tmp_path, "qwen3-0.6b", 4, 1)
    assert (local_config(config, 2).num_key_value_heads, local_config(config, 2).num_attention_heads) == (1, 2)
    split = _model_config(tmp_path, "llama-3.1-8b", 8, 4)
    assert local_config(split, 4).num_key_value_heads == 1 and local_config(split, 4).intermediate_size == 64


def test_an_impossible_split_fails_at_start_naming_the_sizes_that_work(tmp_path):
    """SmolLM2-135M (the embedded model) has 9 query and 3 KV heads: 2 ranks cannot split it, 3 can."""
    path = tmp_path / "smollm2.json"
    path.write_text(json.dumps({**get_hf_config("smollm2-135m"), **SMALL, "intermediate_size": 192}))
    with pytest.raises(ModelLoadError, match="9 attention heads, 3 KV heads.*sizes that work: 1, 3$"):
        LLM(str(path), load_format="dummy", tensor_parallel_size=2)
    check_tp_split(from_hf_config(json.loads(path.read_text()), str(path)), 3)  # no error


def test_a_script_without_a_main_guard_gets_told(tmp_path):
    """Workers are spawned: they re-import the main module, so an unguarded script would start engines
    recursively. The worker's early exit is reported at once (not after the group's join timeout)."""
    import subprocess
    import sys

    path = _config(tmp_path, "llama-3.1-8b", 4, 2)
    script = tmp_path / "unguarded.py"
    script.write_text(f"from kvpilot import LLM\nLLM({path!r}, load_format='dummy', dtype='float32', "
                      f"tensor_parallel_size=2, kv_cache_memory='64MiB', max_model_len=128)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert 'guard its entry point with `if __name__ == "__main__":`' in done.stderr


def test_ranks_on_gpus_the_machine_lacks_fail_before_anything_starts(tmp_path):
    """One GPU a rank (NCCL): asking for more GPUs than there are names the count, before spawning."""
    import torch

    path = _config(tmp_path, "llama-3.1-8b", 4, 2)
    with pytest.raises(EngineConfigError, match=rf"needs GPUs 0..1, one a rank; this machine has "
                                                rf"{torch.cuda.device_count()}"):
        LLM(path, load_format="dummy", device="cuda", tensor_parallel_size=2)


def test_a_start_that_fails_after_loading_stops_the_ranks(tmp_path):
    """The KV budget is sized after every rank loaded: a budget too small for one block fails the start, and
    the workers and the process group are gone, so the next tensor-parallel engine starts."""
    import torch.distributed

    path = _config(tmp_path, "llama-3.1-8b", 4, 2)
    threads = torch.get_num_threads()
    with pytest.raises(EngineConfigError, match="holds no block"):
        LLM(path, load_format="dummy", dtype="float32", tensor_parallel_size=2, kv_cache_memory="1KiB")
    assert not torch.distributed.is_initialized() and torch.get_num_threads() == threads
    assert _greedy(path, 2) == _greedy(path, 1)
