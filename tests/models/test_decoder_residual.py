"""The decoder loop with each residual add fused into the norm after it (`add_rms_norm`, the
residual stream carried beside the blocks' outputs) is bitwise the loop it replaced,
`h = h + branch(norm(h))` with separate ops, on CPU float32: prefill and decode logits and
the Mamba states, on the embedded model and every tiny HF checkpoint (both families,
Granite's residual and embedding multipliers)."""
import functools
import json

import pytest
import torch
from safetensors.torch import save_file

from hybrid_engine.models.base import HybridForCausalLM
from hybrid_engine.models.embedded import EMBEDDED_CONFIG, EMBEDDED_WEIGHT_SEED
from hybrid_engine.models.granite_moe_hybrid import GraniteBlock
from hybrid_engine.models.loader import load_model
from layers.forward_meta import ForwardMeta
from layers.norms import RMSNorm
from tests.models.conftest import SingleSequence


def _norm(norm: RMSNorm, h: torch.Tensor) -> torch.Tensor:
    return norm.ops.rms_norm(h, norm.weight, norm.eps, norm.weight_in_fp32)


def unfused_forward(model: HybridForCausalLM, input_ids: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
    """The decoder loop before the fusion: each residual add (and Granite's scaling of the
    branch) its own op, each norm a plain `rms_norm`."""
    h = model.embed(input_ids)
    for layer in model.model.layers:
        if isinstance(layer, GraniteBlock):
            h = h + layer.mix(_norm(layer.input_layernorm, h), meta) * layer.residual_multiplier
            h = h + layer.feed_forward(_norm(layer.post_attention_layernorm, h)) * layer.residual_multiplier
        else:
            h = h + layer.mix(_norm(layer.norm, h), meta)
    return _norm(getattr(model.model, model.final_norm_name), h)


def _run(path: str, fused: bool, vocab: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Logits of a 13-token prompt and 5 decode steps, and the Mamba states after them."""
    torch.manual_seed(0)  # the same KV block table for both runs
    seq = SingleSequence(path)
    if not fused:
        seq.model.forward = functools.partial(unfused_forward, seq.model)
    ids = torch.randint(3, vocab, (18,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = [seq.feed(ids[:13])] + [seq.feed([t], decode=True) for t in ids[13:]]
    return torch.cat(logits), seq.states()


def _assert_fused_equals_unfused(path: str, vocab: int) -> None:
    fused_logits, fused_states = _run(path, True, vocab)
    unfused_logits, unfused_states = _run(path, False, vocab)
    assert fused_logits.shape == (18, vocab)
    assert torch.equal(fused_logits, unfused_logits)
    for (conv_a, ssm_a), (conv_b, ssm_b) in zip(fused_states, unfused_states, strict=True):
        assert torch.equal(conv_a, conv_b) and torch.equal(ssm_a, ssm_b)


@pytest.fixture(scope="module")
def embedded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The embedded model's seeded weights saved as a checkpoint directory."""
    path = tmp_path_factory.mktemp("embedded")
    model = load_model(EMBEDDED_CONFIG, None, torch.device("cpu"), torch.float32, seed=EMBEDDED_WEIGHT_SEED)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(EMBEDDED_CONFIG))
    return str(path)


def test_embedded_model_fused_residual_is_bitwise_the_unfused_loop(embedded_checkpoint: str) -> None:
    _assert_fused_equals_unfused(embedded_checkpoint, EMBEDDED_CONFIG["vocab_size"])


def test_hf_checkpoints_fused_residual_is_bitwise_the_unfused_loop(hf_checkpoint) -> None:
    _, path, hf = hf_checkpoint
    _assert_fused_equals_unfused(path, hf.config.vocab_size)

