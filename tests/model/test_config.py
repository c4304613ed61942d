import pytest

from luban.errors import LubanError
from luban.model import ModelConfig, get_preset, preset_names


def test_presets_build_and_validate():
    names = preset_names()
    for required in ("gpt2-124m", "gpt2-355m", "gpt2-774m", "gpt2-1.5b", "llama-1b", "llama-8b", "llama-70b",
                     "llama-405b", "megatron-1.7b", "megatron-1t", "megatron-22b", "gpt3-175b", "turing-530b"):
        assert required in names
    assert get_preset("llama-8b").kv_heads == 8 and get_preset("llama-8b").ffn_hidden == 14336


def test_from_dict_preset_overrides_rederive():
    cfg = ModelConfig.from_dict({"preset": "gpt2-124m", "hidden": 1024, "heads": 16})
    assert (cfg.head_dim, cfg.ffn_hidden, cfg.kv_heads) == (64, 4096, 16)
    assert cfg.name == "gpt2-124m-custom"
    llama = ModelConfig.from_dict({"arch": "llama", "hidden": 256, "heads": 8, "kv_heads": 2, "layers": 2})
    assert (llama.norm, llama.activation, llama.position, llama.tie_embeddings) == ("rmsnorm", "swiglu", "rope", False)


@pytest.mark.parametrize("raw, message", [
    ({"hidden": 100, "heads": 3}, "model.heads = 3: must divide hidden = 100"),
    ({"hidden": 768, "heads": 12, "kv_heads": 5}, "model.kv_heads = 5: must divide heads = 12"),
    ({"layers": -2}, "model.layers = -2: must be a positive integer"),
    ({"hiden": 5}, "model.hiden = 5: unknown key"),
    ({"norm": "batchnorm"}, "model.norm = 'batchnorm': one of layernorm, rmsnorm"),
    ({"hidden": "big"}, "model.hidden = 'big': must be of type int"),
    ({"preset": "gpt5"}, "model.preset = 'gpt5': one of"),
])
def test_bad_model_config_names_key_value_and_rule(raw, message):
    with pytest.raises(LubanError) as err:
        ModelConfig.from_dict(raw)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("raw, message", [
    ({"preset": ["llama-8b"]}, "model.preset = ['llama-8b']: one of"),
    ({"preset": {"name": "llama-8b"}}, "model.preset = {'name': 'llama-8b'}: one of"),
    ({"hidden": -64}, "model.hidden = -64: must be a positive integer"),
    ({"hidden": 10**30}, "model.hidden = 1000000000000000000000000000000: at most 1048576"),
    # (2026-12-04) a width set alone was "model.heads = 12: must divide hidden = 100": the preset's heads,
    # a key the user did not touch
    ({"preset": "gpt2-124m", "hidden": 100}, "model.hidden = 100: a multiple of model.heads = 12 (the preset gpt2-124m's): "
                                             "set model.heads too, or model.head_dim"),
])
def test_a_bad_preset_or_width_is_named_itself(raw, message):
    """A preset that is a list or a table (``luban plan estimate --model file.toml``) was a TypeError
    traceback; a negative or huge hidden was reported as 'model.heads = 12: must divide hidden = -64',
    blaming the key the user did not touch (a hostile sweep, 2026-11-27)."""
    with pytest.raises(LubanError) as err:
        ModelConfig.from_dict(raw)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
