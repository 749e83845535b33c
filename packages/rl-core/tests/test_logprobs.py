import pytest
import torch

from rl_core.logprobs import entropy_from_logits, log_probs_and_entropy, log_probs_from_logits


def plain(logits, tokens, temperature=1.0):
    log_softmax = torch.log_softmax(logits.double() / temperature, dim=-1)
    log_probs = log_softmax.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


def test_by_hand_uniform_and_peaked():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 100.0]])
    tokens = torch.tensor([1, 3])
    log_probs, entropy = log_probs_and_entropy(logits, tokens)
    torch.testing.assert_close(log_probs, torch.tensor([-torch.log(torch.tensor(4.0)), 0.0]))
    torch.testing.assert_close(entropy, torch.tensor([torch.log(torch.tensor(4.0)), 0.0]))


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_equals_plain_values_and_gradients(chunk_size, temperature):
    torch.manual_seed(chunk_size)
    logits = torch.randn(2, 7, 33, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 33, (2, 7))
    log_probs, entropy = log_probs_and_entropy(
        logits, tokens, temperature=temperature, chunk_size=chunk_size
    )
    ref_log_probs, ref_entropy = plain(logits, tokens, temperature)
    torch.testing.assert_close(log_probs, ref_log_probs)
    torch.testing.assert_close(entropy, ref_entropy)
    w_lp, w_ent = torch.randn(2, 7, dtype=torch.float64), torch.randn(2, 7, dtype=torch.float64)
    (grad,) = torch.autograd.grad((log_probs * w_lp + entropy * w_ent).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref_log_probs * w_lp + ref_entropy * w_ent).sum(), logits)
    torch.testing.assert_close(grad, ref_grad)


def test_gradcheck():
    torch.manual_seed(0)
    logits = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 6, (5,))

    def both(x):
        return log_probs_and_entropy(x, tokens, temperature=0.8, chunk_size=2)

    assert torch.autograd.gradcheck(both, (logits,))


def test_single_outputs_and_bf16_inputs():
    torch.manual_seed(1)
    logits = torch.randn(9, 50).to(torch.bfloat16)
    tokens = torch.randint(0, 50, (9,))
    ref_log_probs, ref_entropy = plain(logits.float(), tokens)
    log_probs = log_probs_from_logits(logits, tokens, chunk_size=4)
    assert log_probs.dtype == torch.float32
    torch.testing.assert_close(log_probs.double(), ref_log_probs, atol=1e-5, rtol=1e-5)
    entropy = entropy_from_logits(logits, chunk_size=4)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-5, rtol=1e-5)
    logits32 = logits.float().requires_grad_()
    log_probs_from_logits(logits32, tokens, chunk_size=2).sum().backward()
    ref = logits.float().requires_grad_()
    plain(ref, tokens)[0].sum().backward()
    torch.testing.assert_close(logits32.grad, ref.grad)


def test_bad_arguments():
    logits = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="tokens must have shape"):
        log_probs_from_logits(logits, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        log_probs_from_logits(logits, torch.zeros(3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_matches_torch_reference_on_gpu(dtype, temperature):
    torch.manual_seed(0)
    logits = (torch.randn(300, 5000, device="cuda") * 3).to(dtype)
    tokens = torch.randint(0, 5000, (300,), device="cuda")
    w_lp, w_ent = torch.randn(300, device="cuda"), torch.randn(300, device="cuda")
    results = {}
    for backend in ("torch", "triton"):
        leaf = logits.detach().clone().requires_grad_()
        log_probs, entropy = log_probs_and_entropy(
            leaf, tokens, temperature=temperature, chunk_size=64, backend=backend
        )
        (log_probs * w_lp + entropy * w_ent).sum().backward()
        results[backend] = (log_probs, entropy, leaf.grad.float())
    for ours, ref in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(
            ours, ref, atol=2e-3 if dtype == torch.bfloat16 else 1e-4, rtol=1e-3
        )


def test_unknown_backend():
    with pytest.raises(ValueError, match="auto, torch, triton"):
        log_probs_and_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), backend="cuda")
    with pytest.raises(ValueError, match="needs CUDA"):
        log_probs_and_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), backend="triton")
