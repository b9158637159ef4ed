"""Grouped-GEMM experts (agentrl.train.grouped_experts) against the per-expert loop of megatron's
SequentialMLP (MLP.forward without fusion: fc1, silu(gate) * up, x routing prob, fc2), on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from agentrl.train.grouped_experts import GroupedExperts

E, H, INNER = 4, 16, 8


def _config(**kw):
    def init(t):
        torch.nn.init.normal_(t, std=0.2)

    base = {"gated_linear_unit": True, "add_bias_linear": False, "moe_apply_probs_on_input": False, "hidden_size": H,
            "moe_ffn_hidden_size": INNER, "use_cpu_initialization": True, "params_dtype": torch.float32,
            "perform_initialization": True, "init_method": init, "output_layer_init_method": init,
            "activation_func": F.silu, "glu_linear_offset": 0.0}
    return SimpleNamespace(**{**base, **kw})


def _loop(x, counts, probs, w1, w2):
    outs, at = [], 0
    for e, n in enumerate(counts):
        xe, pe = x[at:at + n], probs[at:at + n]
        gate, up = torch.chunk(xe @ w1[e].t(), 2, dim=-1)
        act = (F.silu(gate) * up * pe[:, None]).to(x.dtype)
        outs.append(act @ w2[e].t())
        at += n
    return torch.cat(outs)


def test_grouped_experts_equal_the_per_expert_loop_forward_and_backward():
    torch.manual_seed(0)
    experts = GroupedExperts(E, _config())
    counts = [5, 0, 7, 3]  # an expert without tokens must work too
    x = torch.randn(sum(counts), H, requires_grad=True)
    probs = torch.rand(sum(counts))
    upstream = torch.randn(sum(counts), H)
    out, bias = experts(x, torch.tensor(counts), probs)
    assert bias is None
    (out * upstream).sum().backward()
    w1, w2 = (experts.weight1.detach().clone().requires_grad_(), experts.weight2.detach().clone().requires_grad_())
    x_ref = x.detach().clone().requires_grad_()
    ref = _loop(x_ref, counts, probs, w1, w2)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(experts.weight1.grad, w1.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(experts.weight2.grad, w2.grad, rtol=1e-5, atol=1e-6)
    assert float(experts.weight1.grad[1].abs().max()) == 0.0  # the idle expert gets no gradient


def test_state_dict_has_sequential_mlp_keys_and_loads_back():
    torch.manual_seed(0)
    a, b = GroupedExperts(E, _config()), GroupedExperts(E, _config())
    sd = a.state_dict()
    assert sorted(sd) == sorted(f"local_experts.{e}.linear_fc{i}.weight" for e in range(E) for i in (1, 2))
    assert sd["local_experts.2.linear_fc1.weight"].shape == (2 * INNER, H)
    assert torch.equal(sd["local_experts.2.linear_fc2.weight"], a.weight2[2])
    b.load_state_dict(sd)
    assert torch.equal(a.weight1, b.weight1) and torch.equal(a.weight2, b.weight2)
