"""The greedy decode step's int8 screen of the logits (medusa_runtime/engines/logit_screen.py, ``screen_argmax_in_team``
in lean_cpu.c) against the full projection's own logits: the same argmax bit for bit (NumPy's argmax of the full
float32 logits as the independent reference: first of tied maxima), the error bound it rests on checked in
float64, exact ties and one-ulp near ties, and the calls it leaves to the full projection."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from medusa_runtime import kernels
from medusa_runtime.decoding.decode import encode_prompt
from medusa_runtime.engines.lean import LeanEngine
from medusa_runtime.engines.logit_screen import BLOCK, build_screen
from medusa_runtime.measure.bandwidth import step_weight_bytes, weight_bytes
from medusa_runtime.model import LoadedModel

SCREEN_MAX_ROWS = 5  # lean_cpu.c: calls of more rows take the full projection


def _steps(engine: LeanEngine, prompt: torch.Tensor, tokens: torch.Tensor, rows: int):
    """Decode steps of ``rows`` rows (a chain) at every offset of ``tokens`` after ``prompt``, each from the same
    cache state both ways: (full step, screened step, the screen's estimates) per step."""
    out = []
    with torch.inference_mode():
        cache = engine.new_cache(len(prompt) + len(tokens) + rows)
        engine.forward(prompt, 0, cache, last_only=True)
        start = len(prompt)
        mask = torch.tril(torch.ones(rows, rows, dtype=torch.bool)) if rows > 1 else None
        offsets = torch.arange(rows) if rows > 1 else None
        for at in range(0, len(tokens) - rows + 1, rows):
            ids = tokens[at:at + rows]
            full = engine.decode_step(ids, start, cache, mask, offsets)
            full = (full.logits.clone(), full.hidden.clone(), list(full.pred))
            screened = engine.decode_step(ids, start, cache, mask, offsets, argmax_only=True)
            estimates = cache.native.logits[:rows].clone()
            out.append((full, (screened.logits, screened.hidden.clone(), list(screened.pred)), estimates))
            start += rows  # both steps wrote these rows' keys and values alike
    return out


@pytest.fixture(scope="module")
def answer(default_bf16, mt_bench_first_turns) -> tuple[torch.Tensor, torch.Tensor]:
    """(a chat prompt, the default model's own greedy continuation of 24 tokens by full steps)."""
    engine = LeanEngine(default_bf16, use_kernels=True)
    prompt = torch.tensor(encode_prompt(default_bf16, mt_bench_first_turns[7]["turns"][0], chat=True))
    tokens = []
    with torch.inference_mode():
        cache = engine.new_cache(len(prompt) + 24)
        logits, _ = engine.forward(prompt, 0, cache, last_only=True)
        for i in range(24):
            tokens.append(int(np.argmax(logits[-1].numpy())))
            logits = engine.decode_step(torch.tensor(tokens[-1:]), len(prompt) + i, cache).logits
    return prompt, torch.tensor(tokens)


def _reference_argmax(logits: torch.Tensor) -> list[int]:
    return np.argmax(logits.numpy(), axis=1).tolist()  # NumPy: the first of tied maxima


@pytest.mark.parametrize("rows", [1, 2, 4, SCREEN_MAX_ROWS, SCREEN_MAX_ROWS + 1, 9])
def test_screened_argmax_is_the_full_projections_on_the_default_model(default_bf16, answer, rows, monkeypatch):
    """Steps along a real prompt and the model's own greedy continuation (peaked distributions) and along random
    tokens (flat ones, many candidates): the screened step's argmax equals NumPy's argmax of the full step's
    logits in every row; the hidden states are the same bits; the screened step has no logits. Calls of more
    rows than the screen takes run the full projection and still answer argmax only."""
    monkeypatch.setenv(kernels.AMX_SWITCH, "0")  # the screen runs on the AVX-512 path only
    engine = LeanEngine(default_bf16, max_nodes=16, use_kernels=True)
    assert engine.logit_screen is not None
    prompt, own = answer
    for tokens in (torch.randint(0, default_bf16.vocab_size, (24,), generator=torch.Generator().manual_seed(rows)),
                   own):
        for full, screened, left in _steps(engine, prompt, tokens, rows):
            assert screened[0] is None and torch.equal(screened[1], full[1])
            assert screened[2] == full[2] == _reference_argmax(full[0])
            # the screen ran (its int8 estimates left in the buffer), or the full projection did (its logits)
            assert torch.equal(left, full[0]) == (rows > SCREEN_MAX_ROWS)


def test_the_bound_holds_in_float64_and_the_residual_norms_are_rounded_up(default_bf16, answer, monkeypatch):
    """What the screen rests on, recomputed in float64 from the screen's tensors: every vocabulary row's
    residual norm is at least ||w - s q||_2 and c_v at least s_v |q_v|_1, and every estimate is within
    ||x||_2 e_v + 0.51 t c_v + 2 in 2^-23 |x|_1 max|w_v| (t = max|x| / 16383: the bound before lean_cpu.c's slack)
    of the exact float32 logit. The estimates' error is far below it (the bound is what lets the screen be exact,
    not what it costs), and few rows reach the best lower bound."""
    monkeypatch.setenv(kernels.AMX_SWITCH, "0")
    engine = LeanEngine(default_bf16, max_nodes=16, use_kernels=True)
    screen, weight = engine.logit_screen, engine.lm_head.double()
    vocab, hidden = weight.shape
    q = screen.rows(vocab, hidden).double()
    residual = (weight - screen.scale.double()[:, None] * q).norm(dim=1)
    assert bool((screen.err.double() >= residual).all()) and bool((screen.maxw.double() == weight.abs().amax(1)).all())
    assert bool((screen.csum.double() >= screen.scale.double() * q.abs().sum(1)).all())
    assert int(q.abs().max()) == 127
    prompt, tokens = answer
    worst, candidates = 0.0, []
    for full, screened, estimates in _steps(engine, prompt, tokens, 4):
        x = screened[1].double()  # [rows, hidden]: the same bits as the full step's
        t = x.abs().amax(1, keepdim=True).float().div(16383).double()  # as lean_cpu.c rounds it
        bound = (x.norm(dim=1)[:, None] * screen.err.double()[None, :] + 0.51 * t * screen.csum.double()[None, :]
                 + 2 * hidden * 2.0 ** -23 * x.abs().sum(1)[:, None] * screen.maxw.double()[None, :])
        error = (full[0].double() - estimates.double()).abs()
        assert bool((error <= bound).all())
        worst = max(worst, float((error / bound).max()))
        low = (estimates.double() - bound).amax(dim=1, keepdim=True)
        candidates += ((estimates.double() + bound) >= low).sum(1).tolist()
    assert worst < 0.5, worst
    assert np.median(candidates) < 100, candidates


def _tied_llama(seed: int = 0) -> LoadedModel:
    """A bf16 Llama (head_dim 64) whose lm_head repeats 12 template rows over 960 rows, some copies one bf16 ulp
    larger in one weight: every argmax is tied with many rows or a near tie."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=960, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                      initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False).to(torch.bfloat16)
    with torch.no_grad():
        templates = torch.randn(12, 128).to(torch.bfloat16)
        rows = templates[torch.arange(960) % 12].clone()
        bumped = torch.arange(5, 960, 97)  # a copy here and there one ulp larger in its largest weight
        for r in bumped.tolist():
            k = int(rows[r].float().abs().argmax())
            rows[r, k] = torch.nextafter(rows[r, k].float(), torch.tensor(float("inf")) * rows[r, k].float().sign()
                                         ).to(torch.bfloat16)
        model.lm_head.weight.copy_(rows)
    return LoadedModel(model, None, "tied-llama", torch.bfloat16, torch.device("cpu"))


def test_exact_ties_and_one_ulp_near_ties_keep_the_first_of_the_largest(monkeypatch):
    """Every step's argmax is among copies of one template row: the screen must take the first of the tied rows
    (or the one-ulp-larger copy where one wins), as the full projection's argmax and NumPy's do."""
    monkeypatch.setenv(kernels.AMX_SWITCH, "0")
    loaded = _tied_llama()
    engine = LeanEngine(loaded, max_nodes=8, use_kernels=True)
    gen = torch.Generator().manual_seed(1)
    prompt, tokens = torch.randint(0, 960, (9,), generator=gen), torch.randint(0, 960, (40,), generator=gen)
    ties = 0
    for rows in (1, 3):
        for full, screened, _ in _steps(engine, prompt, tokens, rows):
            assert screened[2] == full[2] == _reference_argmax(full[0])
            ties += sum(int((full[0][r] == full[0][r].max()).sum()) > 1 for r in range(rows))
    assert ties > 10  # the steps did meet exact ties


def test_build_screen_quantises_within_its_scale_and_pads_blocks_with_zeros():
    """The int8 rows against a direct float64 rounding, all-zero rows (scale 0, q 0), the padding of the last
    block, residual norms and |q| sums rounded up to float32 (an odd width pads its last pair with a zero)."""
    torch.manual_seed(0)
    weight = (torch.randn(130, 40) * torch.logspace(-3, 2, 130)[:, None]).to(torch.bfloat16)
    weight[7] = 0
    screen = build_screen(weight)
    q = screen.rows(192, 40)
    assert q.shape[0] == 192 and not q[130:].any() and screen.q.numel() == 192 * 40
    w = weight.double()
    expected = torch.round(w / screen.scale.double().clamp_min(1e-300)[:, None])
    expected[7] = 0
    assert torch.equal(q[:130].double(), expected)
    assert screen.scale[7] == 0 and screen.err[7] == 0 and screen.maxw[7] == 0
    residual = (w - screen.scale.double()[:, None] * q[:130].double()).norm(dim=1)
    assert bool((screen.err.double() >= residual).all())
    assert bool((screen.err.double() <= residual * (1 + 1e-6) + 1e-30).all())
    l1 = screen.scale.double() * q[:130].double().abs().sum(1)
    assert bool((screen.csum.double() >= l1).all()) and bool((screen.csum.double() <= l1 * (1 + 1e-6)).all())
    odd = build_screen(weight[:, :39])
    w39 = w[:, :39]
    expected = torch.round(w39 / odd.scale.double().clamp_min(1e-300)[:, None])
    expected[7] = 0
    assert torch.equal(odd.rows(130, 39).double(), expected)
    assert not odd.q.view(-1, 20, BLOCK, 2)[:, 19, :, 1].any()  # the 40th input of every row: zero


def test_a_greedy_steps_floor_counts_the_screen_instead_of_the_logits_projection(default_bf16, monkeypatch):
    """The bandwidth floor's bytes: the model's weights less the (tied) logits projection's 49,152 x 576 bf16, plus
    the screen's int8 rows (zero padded to blocks of 64) and four float32 values per vocabulary row; an engine
    without the screen (the tile path) counts the weights as they are."""
    monkeypatch.setenv(kernels.AMX_SWITCH, "0")
    engine = LeanEngine(default_bf16, use_kernels=True)
    vocab, hidden = default_bf16.vocab_size, default_bf16.hidden_size
    screened = weight_bytes(default_bf16) - vocab * hidden * 2 + -(-vocab // BLOCK) * BLOCK * hidden + 4 * 4 * vocab
    assert step_weight_bytes(default_bf16, engine) == screened
    engine.logit_screen = None
    assert step_weight_bytes(default_bf16, engine) == weight_bytes(default_bf16)


def test_estimates_far_off_the_argmax_still_find_it_through_the_residual_term(monkeypatch):
    """Two lm_head rows built from the step's own hidden state x: row 3 with every weight 0.45 of a quantisation
    step above its int8 value along sign(x), row 7 0.45 below with one more step on most of x's mass, so that
    row 3's exact logit is the larger by ~1 % while its int8 estimate is ~45 % below row 7's. Only the residual term
    of the bound (||x||_2 e_v, Cauchy-Schwarz) keeps row 3 among the candidates: the screen must still answer 3."""
    monkeypatch.setenv(kernels.AMX_SWITCH, "0")
    loaded = _tied_llama(seed=2)
    gen = torch.Generator().manual_seed(4)
    prompt, token = torch.randint(0, 960, (11,), generator=gen), torch.randint(0, 960, (1,), generator=gen)

    def step(argmax_only: bool):
        engine = LeanEngine(loaded, use_kernels=True)
        with torch.inference_mode():
            cache = engine.new_cache(16)
            engine.forward(prompt, 0, cache, last_only=True)
            return engine.decode_step(token, len(prompt), cache, argmax_only=argmax_only)

    x = step(False).hidden[0].float()
    s = 2.0 ** -7  # the rows' scale: a weight of 127 s sets it
    sign = torch.where(x >= 0, 1.0, -1.0)
    j0 = int(x.abs().argmin())
    order = [k for k in x.abs().argsort(descending=True).tolist() if k != j0]
    mass, heavy = 0.0, []
    for k in order:  # x's largest entries up to 0.88 of |x|_1
        if mass + float(x[k].abs()) > 0.88 * float(x.abs().sum()):
            break
        mass += float(x[k].abs())
        heavy.append(k)
    row3 = 1.45 * s * sign
    row7 = 0.55 * s * sign
    row7[heavy] = 1.55 * s * sign[heavy]
    for row in (row3, row7):
        row[j0] = 127 * s
    with torch.no_grad():
        weight = torch.zeros(960, 128)
        weight[3], weight[7] = row3, row7
        loaded.model.lm_head.weight.copy_(weight.to(torch.bfloat16))
    w = loaded.model.lm_head.weight.float()
    exact = (w[[3, 7]] @ x).tolist()
    q = torch.round(w[[3, 7]] / s)
    estimate = (q @ x * s).tolist()
    assert exact[0] > exact[1] and estimate[0] < 0.75 * estimate[1]  # the trap is set
    full, screened = step(False), step(True)
    assert full.pred == [3] == _reference_argmax(full.logits)
    assert screened.pred == [3]
