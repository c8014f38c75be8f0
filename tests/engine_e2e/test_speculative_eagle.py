"""Speculative decoding with EAGLE heads (speculative_config method "eagle" and "eagle3") on a tiny random-weight
Llama target in float32, each head random too and saved the way published checkpoints are laid out (EAGLE-1:
fc, layers.0.*; EAGLE-3: fc over three aux states, midlayer.*, norm, lm_head over a draft vocabulary, d2t):
greedy output is token for token HF transformers' under continuous batching and preemption, seeded sampled
requests give plain decoding's tokens, and a head that does not fit the target is refused naming the field.
Random heads accept next to nothing, so two checks look at the drafts themselves: driven with HF's hidden
states, the proposer's chain equals one computed from scratch in plain torch from the checkpoint's tensors (vLLM's
formulas), across a catch-up; and an EAGLE-1 head built to pass the target's hidden state through drafts the last
known token throughout, which checks the alignment of the features the target's runner hands over."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from kvpilot import LLM, SamplingParams
from kvpilot.engine.config import EngineConfigError
from tests.engine_e2e.conftest import assert_no_leak
from tests.model.hf_match import prompt_ids, save_random_hf_model
from tests.model.test_architectures import _small_config

pytestmark = pytest.mark.slow

CFG = {**_small_config("llama-3.2-1b"), "num_hidden_layers": 4}  # EAGLE-3's default aux layers: 2, 2, 1
VOCAB, HIDDEN = CFG["vocab_size"], CFG["hidden_size"]
PROMPTS = prompt_ids([1, 9, 20, 31, 47], VOCAB)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
DRAFT_VOCAB = 384


def save_eagle_head(kind: str, directory: Path, hidden: int = HIDDEN, vocab: int = VOCAB, seed: int = 0,
                    identity: bool = False) -> str:
    """A random EAGLE head of `kind` for a target of `hidden`/`vocab`, in its checkpoint layout. identity
    (EAGLE-1): fc passes the target's state through and the layer adds nothing, so the head's logits are the
    target's."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim, inter = CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["head_dim"], \
        CFG["intermediate_size"]
    attn_in = hidden if kind == "eagle" else 2 * hidden

    def rand(*shape: int, std: float = 0.08, base: float = 0.0) -> torch.Tensor:
        return base + std * torch.randn(*shape, generator=g)

    layer = "layers.0." if kind == "eagle" else "midlayer."
    state = {
        f"{layer}self_attn.q_proj.weight": rand(heads * head_dim, attn_in),
        f"{layer}self_attn.k_proj.weight": rand(kv_heads * head_dim, attn_in),
        f"{layer}self_attn.v_proj.weight": rand(kv_heads * head_dim, attn_in),
        f"{layer}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{layer}mlp.gate_proj.weight": rand(inter, hidden),
        f"{layer}mlp.up_proj.weight": rand(inter, hidden),
        f"{layer}mlp.down_proj.weight": rand(hidden, inter),
        f"{layer}input_layernorm.weight": rand(hidden, std=0.3, base=1.0),
        f"{layer}post_attention_layernorm.weight": rand(hidden, std=0.3, base=1.0),
    }
    config = {**CFG, "hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": 1}
    if kind == "eagle":
        state["fc.weight"], state["fc.bias"] = rand(hidden, 2 * hidden), rand(hidden)
        if identity:
            state["fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
            state["fc.bias"] = torch.zeros(hidden)
            state[f"{layer}self_attn.o_proj.weight"].zero_()
            state[f"{layer}mlp.down_proj.weight"].zero_()
        config["architectures"] = ["LlamaForCausalLM"]  # as the EAGLE-1 checkpoints on the Hub say
    else:
        targets = torch.randperm(vocab, generator=g)[:DRAFT_VOCAB].sort().values
        state.update({"fc.weight": rand(hidden, 3 * hidden), f"{layer}hidden_norm.weight": rand(hidden, std=0.3,
                                                                                                     base=1.0),
                      "norm.weight": rand(hidden, std=0.3, base=1.0), "lm_head.weight": rand(DRAFT_VOCAB, hidden),
                      "d2t": targets - torch.arange(DRAFT_VOCAB),
                      "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, targets, True)})
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    return str(directory)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    hf = save_random_hf_model(CFG, root / "target")
    return SimpleNamespace(
        want=[hf(p, 24) for p in PROMPTS], hf_model=hf, target=str(root / "target"),
        eagle=save_eagle_head("eagle", root / "eagle"), eagle3=save_eagle_head("eagle3", root / "eagle3"),
        identity=save_eagle_head("eagle", root / "identity", identity=True),
        narrow=save_eagle_head("eagle", root / "narrow", hidden=HIDDEN // 2),
        small_vocab=save_eagle_head("eagle3", root / "small_vocab", vocab=VOCAB // 2 + 200))


@pytest.fixture(scope="module")
def plain(models) -> LLM:
    return LLM(model=models.target, dtype="float32", kv_cache_memory="4MiB", max_model_len=256)


def _spec_llm(plain: LLM, method: str, head: str, kv_cache_memory: str = "4MiB", num_drafts: int = 4,
              max_model_len: int = 256) -> LLM:
    """The target's weights with an EAGLE head; draft rows priced at nothing, so every decode verifies drafts."""
    llm = LLM(loaded=plain.loaded, kv_cache_memory=kv_cache_memory, max_model_len=max_model_len,
              enable_prefix_caching=False,
              speculative_config={"method": method, "model": head, "num_speculative_tokens": num_drafts})
    llm.engine.scheduler.speculator.step_price = lambda num_running: 0.0
    return llm


def _assert_no_leak(llm: LLM) -> None:
    assert_no_leak(llm)
    proposer = llm.engine.scheduler.speculator.proposer
    assert proposer.num_requests == 0 and proposer.num_free_blocks == proposer.runner.num_blocks
    assert proposer.num_featured_requests == 0


def _drafted(outputs) -> tuple[int, int]:
    return sum(o.metrics.num_draft_tokens for o in outputs), sum(o.metrics.num_accepted_tokens for o in outputs)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_output_is_the_targets(models, plain, method):
    llm = _spec_llm(plain, method, getattr(models, method))
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == models.want
    assert _drafted(outputs)[0] > 0
    _assert_no_leak(llm)
    if method == "eagle3":  # the draft vocabulary's argmax, as target ids: the logits' argmax
        head = llm.engine.scheduler.speculator.proposer.head
        hidden = torch.randn(6, HIDDEN)
        assert torch.equal(head.greedy_ids(hidden), head.logits(hidden).argmax(dim=-1))
        assert set(head.greedy_ids(hidden).tolist()) <= set(head.draft_to_target.tolist())
        plain.loaded.model.aux_hidden_layers = ()  # the head set them on the shared target model
        assert plain.loaded.model.aux_hidden is not None


def test_an_identity_head_drafts_the_last_token_throughout(models, plain):
    """fc passes the target's state through and the layer adds nothing, so head position p outputs the target's
    state at p, whose greedy token is the request's token p + 1: from the last known token's position (state
    at n - 2) the first draft is the last known token, and feeding that state forward the chain repeats it.
    Any misalignment of features, positions or the token shift, or a chain fed anything else, breaks that."""
    llm = _spec_llm(plain, "eagle", models.identity, num_drafts=3)
    proposer = llm.engine.scheduler.speculator.proposer
    seen: list[tuple[int, list[int]]] = []
    pending: dict[str, int] = {}
    propose, fill = proposer.propose, proposer.fill

    def recording_propose(request, max_drafts):
        pending[request.request_id] = request.all_token_ids[-1]
        return propose(request, max_drafts)

    def recording_fill(draft_token_ids):
        fill(draft_token_ids)
        seen.extend((pending[rid], list(drafts)) for rid, drafts in draft_token_ids.items())

    proposer.propose, proposer.fill = recording_propose, recording_fill
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == models.want
    assert len(seen) > 20
    assert all(drafts == [last] * len(drafts) for last, drafts in seen)
    _assert_no_leak(llm)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_preemption_under_kv_pressure(models, plain, method):
    # 1 KiB a token for the target's 4 layers, 256 B for the head's one: ~80 tokens each, 228 needed at once
    llm = _spec_llm(plain, method, getattr(models, method), kv_cache_memory="100KiB", num_drafts=3,
                    max_model_len=80)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == models.want
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    _assert_no_leak(llm)
    plain.loaded.model.aux_hidden_layers = ()


def test_seeded_sampled_requests_give_plain_decodings_tokens(models, plain):
    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=20, ignore_eos=True)
              for t, p, s in ((0.8, 0.95, 1), (0.3, 1.0, 2), (1.0, 0.9, 3))]
    want = [plain.generate([PROMPTS[i]], params[i])[0].outputs[0].token_ids for i in range(3)]
    llm = _spec_llm(plain, "eagle3", models.eagle3, num_drafts=3)  # verification is the same for both kinds
    outputs = llm.generate(PROMPTS[:3], params)
    assert [o.outputs[0].token_ids for o in outputs] == want
    _assert_no_leak(llm)
    plain.loaded.model.aux_hidden_layers = ()


def test_a_head_that_does_not_fit_the_target_is_refused(models, plain):
    with pytest.raises(EngineConfigError, match=r"speculative_config\.model: the EAGLE head's hidden size is 32, "
                                                r"the target's 64"):
        _spec_llm(plain, "eagle", models.narrow)
    with pytest.raises(EngineConfigError, match=r"speculative_config\.model: the EAGLE head's vocabulary has 456 "
                                                r"tokens, the target's 512"):
        _spec_llm(plain, "eagle3", models.small_vocab)
    with pytest.raises(EngineConfigError, match=r"speculative_config\.model: the EAGLE head could not be loaded: "
                                                r".*not an EAGLE-1 head"):
        _spec_llm(plain, "eagle", models.eagle3)
    with pytest.raises(EngineConfigError, match=r"speculative_config\.model: the EAGLE head could not be loaded: "
                                                r".*no such directory"):
        _spec_llm(plain, "eagle3", models.eagle3 + "-missing")
    assert plain.loaded.model.aux_hidden_layers == ()


def test_a_head_missing_a_weight_is_refused_naming_the_field(plain, tmp_path):
    from safetensors.torch import load_file

    directory = Path(save_eagle_head("eagle", tmp_path / "eagle"))
    state = load_file(str(directory / "model.safetensors"))
    del state["layers.0.mlp.down_proj.weight"]
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(EngineConfigError, match=r"speculative_config\.model: the EAGLE head could not be loaded: .*"
                                                r"missing weights \['layers\.0\.mlp\.down_proj\.weight'\] \(1 in "
                                                r"all\) for an eagle head"):
        _spec_llm(plain, "eagle", str(directory))


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CFG["rms_norm_eps"]) * weight


def _reference_drafts(kind: str, weights: dict[str, torch.Tensor], hf, tokens: list[int], k: int) -> list[int]:
    """The EAGLE chain computed from scratch with plain torch from the head's checkpoint tensors and HF's
    hidden states of the target (output_hidden_states: entry i is layer i's input, the last the normed output):
    vLLM's formulas, full causal attention recomputed for every draft."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = hf.model
    with torch.no_grad():
        states = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        if kind == "eagle":
            features = states[-1][0]
        else:
            aux = (2, 2, 1)  # vLLM's default for 4 layers: (2, L // 2, L - 3)
            features = torch.cat([states[i][0] for i in aux], dim=-1) @ weights["fc.weight"].T
        layer = "layers.0." if kind == "eagle" else "midlayer."
        w = {name[len(layer):]: t for name, t in weights.items() if name.startswith(layer)}
        heads, kv_heads, head_dim = CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["head_dim"]
        ids, hidden, drafts = list(tokens[1:]), list(features[:len(tokens) - 1]), []
        for _ in range(k):
            n = len(ids)
            embeds = model.model.embed_tokens(torch.tensor(ids))
            h = torch.stack(hidden)
            if kind == "eagle":
                residual = torch.cat([embeds, h], dim=-1) @ weights["fc.weight"].T + weights["fc.bias"]
                x_in = residual
            else:
                residual = h
                x_in = torch.cat([_rms(embeds, w["input_layernorm.weight"]), _rms(h, w["hidden_norm.weight"])], -1)
            q = (x_in @ w["self_attn.q_proj.weight"].T).view(n, heads, head_dim).transpose(0, 1)[None]
            key = (x_in @ w["self_attn.k_proj.weight"].T).view(n, kv_heads, head_dim).transpose(0, 1)[None]
            v = (x_in @ w["self_attn.v_proj.weight"].T).view(n, kv_heads, head_dim).transpose(0, 1)[None]
            cos, sin = model.model.rotary_emb(q, torch.arange(n)[None])
            q, key = apply_rotary_pos_emb(q, key, cos, sin)
            key, v = key.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
            attn = torch.nn.functional.scaled_dot_product_attention(q, key, v, is_causal=True)
            x = residual + attn[0].transpose(0, 1).reshape(n, -1) @ w["self_attn.o_proj.weight"].T
            m = _rms(x, w["post_attention_layernorm.weight"])
            x = x + (torch.nn.functional.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) \
                @ w["mlp.down_proj.weight"].T
            if kind == "eagle":
                token = int(model.lm_head(x[-1]).argmax())
            else:
                draft = int((_rms(x[-1], weights["norm.weight"]) @ weights["lm_head.weight"].T).argmax())
                token = draft + int(weights["d2t"][draft])
            drafts.append(token)
            ids.append(token)
            hidden.append(x[-1])
    return drafts


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_the_chain_is_eagles_from_scratch(models, plain, method):
    """Driven directly with HF's hidden states as the target's: the proposer's drafts equal the reference
    chain's, at the first fill (a whole prompt's catch-up) and after the target 'accepted' one draft and
    emitted another token (a catch-up of the new positions only, the drafts' K/V recomputed)."""
    from safetensors.torch import load_file

    from kvpilot.engine.request import Request
    from kvpilot.engine.scheduler_output import ScheduledChunk

    weights = load_file(str(Path(getattr(models, method)) / "model.safetensors"))
    llm = _spec_llm(plain, method, getattr(models, method))
    proposer = llm.engine.scheduler.speculator.proposer
    hf = models.hf_model

    def observe(request_id: str, tokens: list[int], start: int) -> None:
        with torch.no_grad():
            states = hf.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        rows = slice(start, len(tokens))
        aux = torch.cat([states[i][0] for i in (2, 2, 1)], dim=-1)[rows] if method == "eagle3" else None
        chunk = ScheduledChunk(request_id, start, len(tokens) - start, True)
        proposer.observe([chunk], {}, states[-1][0][rows], aux)

    for i, prompt in enumerate(PROMPTS[1:4]):
        request = Request(f"r{i}", list(prompt), GREEDY, arrival_time=0.0)
        request.append_output_token(models.want[i + 1][0], 0.0)
        observe(request.request_id, request.all_token_ids[:-1], 0)  # the prefill: every prompt position
        drafts = proposer.propose(request, 3)
        proposer.fill({request.request_id: drafts})
        assert drafts == _reference_drafts(method, weights, hf, request.all_token_ids, 3)
        before = request.num_tokens - 1
        for token in (drafts[0], (drafts[1] + 1) % VOCAB):  # one accepted, then the target's own token
            request.append_output_token(token, 0.0)
        observe(request.request_id, request.all_token_ids[:-1], before)  # the verification's rows
        drafts = proposer.propose(request, 2)
        proposer.fill({request.request_id: drafts})
        assert drafts == _reference_drafts(method, weights, hf, request.all_token_ids, 2)
        proposer.forget(request.request_id)
    _assert_no_leak(llm)
    plain.loaded.model.aux_hidden_layers = ()


def test_kept_features_are_bounded(models, plain):
    """Target features a catch-up may still read are bounded: a request decoding without drafts keeps its newest
    max_chunk_tokens rows, and all requests together at most max_feature_rows, taken from prompts before
    drafting requests, oldest positions first."""
    from kvpilot.engine.scheduler_output import ScheduledChunk

    llm = _spec_llm(plain, "eagle", models.eagle)
    proposer = llm.engine.scheduler.speculator.proposer
    window, cap = proposer.max_chunk_tokens, proposer.max_feature_rows
    prompt = torch.randn(window + 10, HIDDEN)
    proposer.observe([ScheduledChunk("idle", 0, window + 10, True)], {}, prompt, None)
    assert proposer.num_feature_rows == window + 10
    decoded = torch.randn(1, HIDDEN)
    proposer.observe([ScheduledChunk("idle", window + 10, 1, True)], {}, decoded, None)  # no drafts: not speculating
    assert proposer.num_feature_rows == window
    kept = proposer._features_at("idle", 0, window + 11)
    assert torch.equal(kept[-window:], torch.cat([prompt[11:], decoded]))
    assert not kept[:11].any()  # the oldest positions went: a later catch-up reads zeros there
    proposer.forget("idle")

    drafting = torch.randn(3, HIDDEN)
    proposer.observe([ScheduledChunk("drafting", 5, 3, True)], {"drafting": [1, 2]}, drafting, None)
    size = cap // 2 + 1
    prompts = [torch.randn(size, HIDDEN) for _ in range(2)]
    for i, rows in enumerate(prompts):
        proposer.observe([ScheduledChunk(f"prompt{i}", 0, size, False)], {}, rows, None)
    assert proposer.num_feature_rows == cap
    assert torch.equal(proposer._features_at("drafting", 5, 3), drafting)  # a speculating request's rows stay
    assert torch.equal(proposer._features_at("prompt1", 0, size), prompts[1])  # the last observed prompt's too
    first, dropped = proposer._features_at("prompt0", 0, size), 3 + 2 * size - cap
    assert torch.equal(first[dropped:], prompts[0][dropped:]) and not first[:dropped].any()
    for rid in ("drafting", "prompt0", "prompt1"):
        proposer.forget(rid)
    _assert_no_leak(llm)
