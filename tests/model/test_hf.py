"""Export to Hugging Face transformers and back: same logits, bit-exact round trip."""

import pytest
import torch

from luban.model import ModelConfig, get_preset
from luban.model.hf import export_folder, import_folder
from luban.model.transformer import build_model

transformers = pytest.importorskip("transformers")

CASES = {
    "gpt2": (get_preset("tiny"), "GPT2LMHeadModel"),
    "llama-gqa-untied": (get_preset("tiny-llama"), "LlamaForCausalLM"),
    "llama-tied-bias": (get_preset("tiny-llama").replace(tie_embeddings=True, bias=True, rope_theta=500000.0),
                        "LlamaForCausalLM"),
    # mixtures of experts: every layer MoE (Mixtral); qk-norm and a dense first layer (Qwen3-MoE)
    "mixtral": (get_preset("tiny-moe").replace(router="softmax", shared_experts=0, dense_layers=0, ffn_hidden=64,
                                               rope_theta=1e6), "MixtralForCausalLM"),
    "qwen3-moe": (get_preset("tiny-moe").replace(router="softmax", shared_experts=0, qk_norm=True, experts_per_token=3,
                                                 norm_eps=1e-6), "Qwen3MoeForCausalLM"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_transformers_with_same_logits(case, tmp_path):
    cfg, cls_name = CASES[case]
    model = build_model(cfg, seed=1).eval()
    with torch.no_grad():  # make biases and norms non-trivial so the mapping is really tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    export_folder(cfg, model.state_dict(), tmp_path)
    hf = getattr(transformers, cls_name).from_pretrained(tmp_path).eval()
    x = torch.randint(0, cfg.vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (ours - theirs).abs().max()

    cfg2, state = import_folder(tmp_path)
    assert cfg2.replace(name=cfg.name) == cfg
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("change, message", [
    ({"router": "sigmoid"}, "model.router = 'sigmoid': a MoE model exports"),
    ({"shared_experts": 1}, "model.shared_experts = 1: a MoE model exports"),
    ({"dense_layers": 1}, "model.dense_layers = 1: Mixtral has no dense layers"),
    ({"bias": True}, "model.bias = True: a MoE model exports"),
])
def test_moe_without_hf_equivalent_is_refused(change, message, tmp_path):
    from luban.errors import LubanError

    cfg = CASES["mixtral"][0].replace(**change)
    with pytest.raises(LubanError, match=message):
        export_folder(cfg, build_model(cfg).state_dict(), tmp_path)


def test_incompatible_model_is_refused(tmp_path):
    from luban.errors import LubanError

    cfg = ModelConfig(arch="gpt2", hidden=64, layers=1, heads=4, position="rope", vocab=64, seq_len=16)
    with pytest.raises(LubanError, match="no Hugging Face equivalent"):
        export_folder(cfg, build_model(cfg).state_dict(), tmp_path)
