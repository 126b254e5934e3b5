"""The runtime on a CUDA device (``nox -s gpu``; marker ``gpu``, so the default run, which has no GPU, deselects
them): tree attention against sequential forwards, greedy Medusa against transformers' generate, both engines,
the lean engine's CUDA graphs (its steps and the heads') against the same ops run eagerly, and a short timing
of plain decoding against trees on a model of the default model's shape (random weights: a GPU machine reaches
no package registry, and a step's time does not depend on the weights' values).

Without a CUDA device these tests fail (they are never skipped): the session exists to run them on one."""

from __future__ import annotations

import random
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads.medusa import fresh_heads
from medusa_runtime.model import LoadedModel
from treesearch.tree import load_tree

from .conftest import hf_greedy, tiny_gemma3, tiny_llama
from .graph_checks import check_graphed_heads, check_graphed_steps
from .test_tree import random_tree

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("nox -s gpu needs a CUDA device: torch.cuda.is_available() is False "
                    "(install a CUDA build: MEDUSA_TORCH_SPEC=torch)")
    return torch.device("cuda")


def _to(loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    loaded.model.to(device=device, dtype=dtype)
    return LoadedModel(loaded.model, loaded.tokenizer, loaded.name, dtype, device)


@pytest.mark.parametrize("build,engine", [(tiny_llama, "lean"), (tiny_llama, "hf"), (tiny_gemma3, "hf")])
def test_tree_rows_equal_sequential_forwards_on_cuda(cuda, build, engine):
    loaded = _to(build(), cuda, torch.float32)
    rng = random.Random(5)
    tree = random_tree(rng, 20, 4, 3)
    prompt = [rng.randrange(loaded.vocab_size) for _ in range(13)]
    heads = fresh_heads(tree.depth, 1, loaded.hidden_size, loaded.vocab_size)
    dec = MedusaDecoder(loaded, heads, tree, config=DecodeConfig(topk=tree.max_rank + 1, engine=engine))
    tokens = torch.tensor([rng.randrange(loaded.vocab_size) for _ in range(tree.num_nodes)], device=cuda)
    cache = dec.new_cache(len(prompt) + tree.num_nodes)
    with torch.no_grad():
        dec.prefill(torch.tensor(prompt, device=cuda), cache)
        got, _ = dec.verify(tokens, len(prompt), cache)
        paths = [()] + list(tree.paths)
        for i, path in enumerate(paths):
            nodes = sorted((j for j in range(len(paths)) if path[: len(paths[j])] == paths[j]), key=lambda j: len(paths[j]))
            ids = torch.tensor([prompt + tokens[nodes].tolist()], device=cuda)
            want = loaded.model(ids).logits[0, -1].float()
            torch.testing.assert_close(got[i], want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("build,engine", [(tiny_llama, "lean"), (tiny_llama, "lean-static"), (tiny_llama, "lean-torch"),
                                          (tiny_llama, "hf"), (tiny_gemma3, "hf")])
@pytest.mark.parametrize("tree", ["chain:3", "mc_sim_7b_63"])
def test_greedy_medusa_is_generate_on_cuda(cuda, build, engine, tree):
    loaded = _to(build(), cuda, torch.float32)
    rng = random.Random(9)
    prompt = [rng.randrange(loaded.vocab_size) for _ in range(10)]
    heads = fresh_heads(5, 1, loaded.hidden_size, loaded.vocab_size)
    res = MedusaDecoder(loaded, heads, load_tree(tree), config=DecodeConfig(max_new_tokens=40, engine=engine)).generate(prompt)
    assert res.token_ids == hf_greedy(loaded, prompt, 40)


def test_graphed_steps_equal_eager_static_steps_on_cuda(cuda):
    check_graphed_steps(_to(tiny_llama(), cuda, torch.float32), atol=2e-4, rtol=1e-4)


def test_graphs_can_be_switched_off_on_cuda(cuda, monkeypatch):
    from medusa_runtime.engines import make_engine

    loaded = _to(tiny_llama(), cuda, torch.float32)
    assert make_engine(loaded, "lean").graphs
    monkeypatch.setenv("MEDUSA_CUDA_GRAPHS", "0")
    engine = make_engine(loaded, "lean")
    assert engine.static and not engine.graphs


@pytest.mark.parametrize("condition", ["none", "root", "path"])
def test_graphed_heads_equal_their_eager_ops_on_cuda(cuda, condition):
    check_graphed_heads(_to(tiny_llama(), cuda, torch.float32), condition)


def test_default_model_plain_step_within_two_ms_on_cuda(cuda, capsys):
    """Issue 53's bar: a plain decode step of the default model's shape (30 layers, 576 wide, 49,152 tokens) in
    float16 at most 2 ms with the lean engine's CUDA graphs; eager PyTorch (lean-torch) printed beside it."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    loaded = _to(LoadedModel(LlamaForCausalLM(cfg).eval().requires_grad_(False), None, "smollm2-shape",
                             torch.float32, torch.device("cpu")), cuda, torch.float16)
    loaded.model.generation_config.eos_token_id = None
    prompt = torch.randint(0, cfg.vocab_size, (200,)).tolist()
    ms, outputs = {}, {}
    for engine in ("lean", "lean-torch", "lean", "lean-torch"):  # interleaved, the later pair counts
        dec = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=256, engine=engine))
        res = dec.generate(prompt)
        ms[engine], outputs[engine] = res.stats.step_ms, res.token_ids
    with capsys.disabled():
        print(f"\n{torch.cuda.get_device_name(cuda)}, float16, plain step ms: CUDA graphs {ms['lean']:.3f}, "
              f"eager {ms['lean-torch']:.3f}")
    assert ms["lean"] <= 2.0
    assert ms["lean"] < ms["lean-torch"]


def test_decode_steps_on_cuda_timed(cuda, capsys):
    """Plain decoding against chains and mc_sim_7b_63 on the default model's shape (30 layers, 576 wide, 49,152
    tokens) in float16 and float32: ms per step (printed) and, in float32, outputs equal to plain decoding's."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    rows = []
    for dtype in (torch.float32, torch.float16):
        loaded = _to(LoadedModel(LlamaForCausalLM(cfg).eval().requires_grad_(False), None, "smollm2-shape",
                                 torch.float32, torch.device("cpu")), cuda, dtype)
        loaded.model.generation_config.eos_token_id = None
        heads = fresh_heads(5, 1, loaded.hidden_size, loaded.vocab_size)
        prompt = torch.randint(0, cfg.vocab_size, (200,)).tolist()
        outputs = {}
        for name, tree in (("plain", None), ("chain:2", "chain:2"), ("chain:4", "chain:4"), ("mc_sim_7b_63", "mc_sim_7b_63")):
            dec = MedusaDecoder(loaded, None if tree is None else heads, tree, config=DecodeConfig(max_new_tokens=128))
            dec.generate(prompt)  # warm-up
            t0 = time.perf_counter()
            res = dec.generate(prompt)
            torch.cuda.synchronize(cuda)
            outputs[name] = res.token_ids
            st = res.stats
            rows.append(f"| {str(dtype).removeprefix('torch.')} | {name} | {1e3 * st.time_verify / st.steps:.2f} | "
                        f"{1e3 * st.time_heads / st.steps:.2f} | {1e3 * (time.perf_counter() - t0) / st.steps:.2f} | "
                        f"{st.tau:.2f} | {res.token_ids == outputs['plain']} |")
        if dtype == torch.float32:
            assert all(out == outputs["plain"] for out in outputs.values())
    with capsys.disabled():
        print(f"\n{torch.cuda.get_device_name(cuda)}, batch 1, prompt 200, 128 new tokens (random weights)")
        print("| dtype | configuration | verify ms/step | heads ms/step | total ms/step | tau | output = plain |")
        print("|---|---|---:|---:|---:|---:|---|")
        print("\n".join(rows))
