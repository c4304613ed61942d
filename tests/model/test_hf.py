"""Export to Hugging Face transformers and back: same logits, bit-exact round trip."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

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

    cfg2, state, _, _ = import_folder(tmp_path)
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


# --- folders saved by the installed transformers itself (5.x nests rope_theta under rope_parameters,
# Qwen3-MoE's expert count is num_local_experts; 4.x wrote rope_theta / num_experts at the top) ---

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=61,
            max_position_embeddings=64, initializer_range=0.2)
SAVED = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_embd=32, n_layer=2, n_head=4, vocab_size=61, n_positions=64, initializer_range=0.2)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(TINY, intermediate_size=48, rope_theta=5e5, rms_norm_eps=1e-5)),
    "llama-tied-bias": ("LlamaConfig", "LlamaForCausalLM",
                        dict(TINY, intermediate_size=48, rope_theta=5e5, tie_word_embeddings=True, attention_bias=True,
                             mlp_bias=True, head_dim=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(TINY, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, rope_theta=5e5)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(TINY, intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                       head_dim=16, norm_topk_prob=True, mlp_only_layers=[0], rope_theta=5e5)),
}


def save_hf(case, path, save_kwargs=None, **changes):
    """A tiny random model saved by transformers' own save_pretrained; returns the model."""
    config_cls, model_cls, kwargs = SAVED[case]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**kwargs, **changes})).eval()
    with torch.no_grad():  # norms away from 1 so a swapped or dropped norm shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(0.1 * torch.randn(p.shape))
    model.save_pretrained(path, **(save_kwargs or {}))
    return model


@pytest.mark.parametrize("case", ["mixtral", "qwen3-moe"])
def test_a_moe_folder_transformers_saved_fused_imports_with_same_logits(case, tmp_path):
    """(2026-12-04) transformers 5 saves a MoE's experts fused with ``save_original_format=False``
    (``mlp.experts.gate_up_proj`` [E, 2f, h], ``down_proj``; Mixtral's router under ``mlp.gate``) and loads
    that folder; luban refused it as "tensor ... block_sparse_moe.gate.weight missing"."""
    import safetensors

    hf = save_hf(case, tmp_path / "hf", {"save_original_format": False})
    with safetensors.safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert "model.layers.1.mlp.experts.gate_up_proj" in f.keys()  # the fused layout, as saved
    imported = import_folder(tmp_path / "hf")
    x = torch.randint(0, 61, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(x).logits
    ours = logits_of(imported.cfg, imported.state, x)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()


def logits_of(cfg, state, x):
    model = build_model(cfg).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("case", list(SAVED))
def test_folder_saved_by_transformers_imports_with_same_logits(case, tmp_path):
    hf = save_hf(case, tmp_path / "hf")
    imported = import_folder(tmp_path / "hf")
    assert imported.warnings == []
    x = torch.randint(0, 61, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(x).logits
    ours = logits_of(imported.cfg, imported.state, x)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    if case != "gpt2":
        assert imported.cfg.rope_theta == 5e5

    # export writes back what was imported: transformers loads the same config fields and logits
    export_folder(imported.cfg, imported.state, tmp_path / "out", extra=imported.extra)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "moe_intermediate_size", "num_local_experts", "num_experts_per_tok",
                "rms_norm_eps", "layer_norm_epsilon", "tie_word_embeddings", "max_position_embeddings", "n_positions",
                "activation_function", "hidden_act", "resid_pdrop", "attention_dropout", "router_aux_loss_coef",
                "mlp_only_layers", "norm_topk_prob", "sliding_window", "attention_bias", "mlp_bias",
                "bos_token_id", "eos_token_id"):
        assert getattr(again.config, key, None) == getattr(hf.config, key, None), key
    if case != "gpt2":  # head_dim null means hidden_size / heads; luban writes it out
        assert again.config.head_dim == (hf.config.head_dim or hf.config.hidden_size // hf.config.num_attention_heads)
        assert again.config.rope_parameters["rope_theta"] == hf.config.rope_parameters["rope_theta"]
    with torch.no_grad():
        assert torch.equal(again(x).logits, theirs) or torch.allclose(again(x).logits, theirs, atol=1e-6, rtol=0)


def test_transformers_4_layouts_are_read(tmp_path):
    """The keys transformers 4.40-4.57 wrote: rope_theta at the top, rope_scaling, Qwen3-MoE's num_experts,
    no head_dim (4.40 Llama/Mixtral), torch_dtype."""
    save_hf("qwen3-moe", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    theta = raw.pop("rope_parameters")["rope_theta"]
    raw.update(rope_theta=theta, rope_scaling=None, num_experts=raw.pop("num_local_experts"),
               torch_dtype=raw.pop("dtype"), max_window_layers=2, sliding_window=4096)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    imported = import_folder(tmp_path)
    assert (imported.cfg.rope_theta, imported.cfg.experts, imported.cfg.head_dim) == (5e5, 4, 16)
    assert imported.extra["max_window_layers"] == 2  # inactive (use_sliding_window false): written back as read

    save_hf("llama", tmp_path / "llama")
    raw = json.loads((tmp_path / "llama/config.json").read_text())
    raw.update(rope_theta=raw.pop("rope_parameters")["rope_theta"], rope_scaling=None)
    del raw["head_dim"], raw["mlp_bias"]
    (tmp_path / "llama/config.json").write_text(json.dumps(raw))
    cfg = import_folder(tmp_path / "llama").cfg
    assert (cfg.rope_theta, cfg.head_dim, cfg.bias) == (5e5, 8, False)


def test_gpt2_in_the_hubs_layout_is_read(tmp_path):
    """openai-community/gpt2's file: no ``transformer.`` prefix, the causal-mask buffers saved, bos = eos = 0."""
    from safetensors.torch import load_file, save_file

    save_hf("gpt2", tmp_path, bos_token_id=0, eos_token_id=0)
    ours = import_folder(tmp_path)
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    tensors.update({f"h.{i}.attn.bias": torch.ones(1, 1, 64, 64) for i in range(2)})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hub = import_folder(tmp_path)
    assert hub.cfg == ours.cfg and hub.extra["bos_token_id"] == hub.extra["eos_token_id"] == 0
    assert all(torch.equal(hub.state[k], v) for k, v in ours.state.items())


@pytest.mark.parametrize("case, changes, message", [
    ("llama", {"hidden_act": "gelu"}, "hidden_act = 'gelu': 'silu' or 'swish'"),
    ("gpt2", {"activation_function": "relu"}, "activation_function = 'relu': 'gelu_new' or"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type = 'linear': 'default'"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
     "rope_type = 'llama3'"),
    ("mixtral", {"sliding_window": 8}, "sliding_window = 8: null or >= max_position_embeddings = 64"),
    ("qwen3-moe", {"use_sliding_window": True, "sliding_window": 8}, "sliding_window = 8: null or >="),
    ("qwen3-moe", {"norm_topk_prob": False}, "norm_topk_prob = False: true"),
    ("qwen3-moe", {"mlp_only_layers": [1]}, r"mlp_only_layers = \[1\], decoder_sparse_step = 1"),
    ("llama", {"mlp_bias": True}, "mlp_bias = True: equal to attention_bias = false"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx = True: false"),
])
def test_what_luban_cannot_represent_is_refused_naming_the_key(case, changes, message, tmp_path):
    from luban.errors import LubanError

    save_hf(case, tmp_path, **changes)
    with pytest.raises(LubanError, match=rf"config.json: .*{message}") as err:
        import_folder(tmp_path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case, changes, warning, extra", [
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise = 0.1: transformers jitters the router only in "
     "training", {"router_jitter_noise": 0.1}),
    ("mixtral", {"sliding_window": 64}, "sliding_window = 64 >= max_position_embeddings = 64: the window never applies",
     {"sliding_window": 64}),
    ("qwen3-moe", {"use_sliding_window": True, "sliding_window": 100}, "sliding_window = 100 >=",
     {"sliding_window": 100, "use_sliding_window": True}),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type = 'dynamic': NTK scaling starts "
     "only beyond", {}),
])
def test_what_is_harmless_at_the_lengths_luban_runs_is_accepted_with_a_warning(case, changes, warning, extra, tmp_path):
    hf = save_hf(case, tmp_path / "hf", **changes)
    imported = import_folder(tmp_path / "hf")
    assert len(imported.warnings) == 1 and warning in imported.warnings[0], imported.warnings
    assert extra.items() <= imported.extra.items()
    x = torch.randint(0, 61, (1, 64), generator=torch.Generator().manual_seed(1))  # max_position_embeddings
    with torch.no_grad():
        theirs = hf(x).logits
    assert torch.allclose(logits_of(imported.cfg, imported.state, x), theirs, atol=1e-5, rtol=0)
    export_folder(imported.cfg, imported.state, tmp_path / "out", extra=imported.extra)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    for key in ("router_jitter_noise", "sliding_window", "use_sliding_window"):
        assert getattr(again.config, key, None) == getattr(hf.config, key, None), key
    assert again.config.rope_parameters["rope_type"] == hf.config.rope_parameters["rope_type"]
    with torch.no_grad():
        assert torch.allclose(again(x).logits, theirs, atol=1e-5, rtol=0)


# --- damaged folders: one line naming the file and what is wrong, exit 2, through the real CLI ---

def luban_cli(*args, timeout=300):
    """``luban ARGS`` in a real process of this tree, bounded; its output is read by ``run``."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.run([sys.executable, "-m", "luban", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _garble_header(path):
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32
    path.write_bytes(bytes(data))


def _edit_tensors(change):
    def edit(path):
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(path))
        change(tensors)
        save_file(tensors, str(path))
    return edit


DAMAGE = {
    "config-not-json": ("config.json", lambda p: p.write_text("{'model_type': llama"), "config.json: not readable as JSON"),
    "config-a-list": ("config.json", lambda p: p.write_text("[1, 2, 3]"), "config.json: a JSON object expected, found list"),
    "config-key-missing": ("config.json", lambda p: p.write_text(json.dumps(
        {k: v for k, v in json.loads(p.read_text()).items() if k != "hidden_size"})),
        "config.json: hidden_size missing: a llama config needs it"),
    "config-wrong-type": ("config.json", lambda p: p.write_text(json.dumps(
        {**json.loads(p.read_text()), "num_hidden_layers": "2"})), "config.json: num_hidden_layers = '2': an integer"),
    "safetensors-truncated": ("model.safetensors", _truncate, "model.safetensors: not a readable safetensors file"),
    "safetensors-garbled": ("model.safetensors", _garble_header, "model.safetensors: not a readable safetensors file"),
    "safetensors-empty": ("model.safetensors", lambda p: p.write_bytes(b""), "model.safetensors: not a readable"),
    "tensor-missing": ("model.safetensors", _edit_tensors(lambda t: t.pop("model.norm.weight")),
                       "model.safetensors: tensor model.norm.weight missing"),
    "tensor-wrong-shape": ("model.safetensors", _edit_tensors(lambda t: t.update({"model.norm.weight": torch.ones(31)})),
                           r"model.safetensors: tensor model.norm.weight has shape \[31\]; config.json implies \[32\]"),
    "tensor-unexpected": ("model.safetensors", _edit_tensors(lambda t: t.update({"model.extra.weight": torch.ones(3)})),
                          "model.safetensors: tensor model.extra.weight .* is not part of the llama model"),
    "tensor-integer": ("model.safetensors", _edit_tensors(lambda t: t.update(
        {"model.norm.weight": torch.ones(32, dtype=torch.int64)})), "tensor model.norm.weight has dtype torch.int64"),
    "no-weights": ("model.safetensors", lambda p: p.unlink(), "model.safetensors: no such file"),
}


SUBPROCESS = {"config-not-json", "config-a-list", "safetensors-truncated", "tensor-wrong-shape"}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_folder_is_one_line_naming_the_file(damage, tmp_path, capsys):
    """Four cases in a real ``luban import`` process (each starts torch: slow), the rest through the same
    ``luban.cli.main`` in this process."""
    import re

    from luban.cli import main

    save_hf("llama", tmp_path / "hf")
    name, change, message = DAMAGE[damage]
    change(tmp_path / "hf" / name)
    args = ["import", str(tmp_path / "hf"), str(tmp_path / "run")]
    if damage in SUBPROCESS:
        result = luban_cli(*args)
        code, err = result.returncode, result.stderr
    else:
        capsys.readouterr()
        code, err = main(args), capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert err.startswith(f"luban: error: {tmp_path / 'hf'}/")  # names the file, not only its name
    assert not (tmp_path / "run").exists()


def test_import_refusal_and_warning_through_the_cli(tmp_path):
    save_hf("mixtral", tmp_path / "bad", sliding_window=8)
    result = luban_cli("import", tmp_path / "bad", tmp_path / "run")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"luban: error: {tmp_path / 'bad' / 'config.json'}: sliding_window = 8: ")
    save_hf("mixtral", tmp_path / "ok", router_jitter_noise=0.1)
    result = luban_cli("import", tmp_path / "ok", tmp_path / "run")
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("luban: warning: ") and "router_jitter_noise = 0.1" in result.stderr
    result = luban_cli("export", tmp_path / "run", "--format", "hf", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "out/config.json").read_text())["router_jitter_noise"] == 0.1


# --- exports carry the run's tokenizer; transformers loads them without a warning ---

@pytest.fixture(scope="module")
def bpe_dataset(tmp_path_factory):
    import sysconfig

    from luban.data.build import build_dataset

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("data") / "bpe"
    build_dataset([str(stdlib / "textwrap.py"), str(stdlib / "shlex.py")], out, tokenizer="bpe", vocab_size=300)
    return out


def _run_with_dataset(root, dataset, cfg):
    """A run whose one checkpoint names ``dataset`` as the one it trained on (as the trainer writes)."""
    from luban.train import checkpoint

    meta = {"step": 0, "config": {"model": cfg.to_dict()}, "world_size": 1, "dataset": str(dataset)}
    checkpoint.save(root / "checkpoints", 0, {"model": build_model(cfg, seed=3).state_dict()}, meta, keep=1)
    return root


class TransformersWarnings:
    """Every Python warning and every transformers log record at WARNING or above."""

    def __enter__(self):
        import logging
        import warnings

        self.records, self.handler = [], logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.records.append(record.getMessage())
        self.logger = logging.getLogger("transformers")  # does not propagate to the root logger
        self.logger.addHandler(self.handler)
        self.catch = warnings.catch_warnings(record=True)
        self.caught = self.catch.__enter__()
        warnings.simplefilter("always")
        transformers.logging.get_logger("transformers.luban_test").warning("probe")  # the capture itself works
        return self

    def __exit__(self, *exc):
        self.catch.__exit__(*exc)
        self.logger.removeHandler(self.handler)
        assert self.records[:1] == ["probe"]
        self.messages = self.records[1:] + [str(w.message) for w in self.caught]


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_export_carries_the_tokenizer_and_loads_without_warnings(kind, small_dataset, bpe_dataset, tmp_path,
                                                                 capsys):
    from luban.cli import main
    from luban.data.tokenizer import load_tokenizer

    dataset = small_dataset if kind == "byte" else bpe_dataset
    tok = load_tokenizer(dataset)
    cfg = get_preset("tiny-llama").replace(vocab=max(257, tok.vocab_size))
    run = _run_with_dataset(tmp_path / "run", dataset, cfg)
    assert main(["export", str(run), "--format", "hf", str(tmp_path / "hf")]) == 0
    assert "warning" not in capsys.readouterr().err
    names = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", ".luban"}  # .luban: luban's own folder (luban.owned)
    assert {p.name for p in (tmp_path / "hf").iterdir()} == names
    umask = os.umask(0)
    os.umask(umask)
    assert {oct(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()} == {oct(0o666 & ~umask)}
    config = json.loads((tmp_path / "hf/config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == tok.eos_id

    with TransformersWarnings() as seen:
        hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        text = "def wrap(text):\n    return 'héllo, wörld' \u2603"
        ids = hf_tok(text, return_tensors="pt")
        generated = hf.generate(**ids, max_new_tokens=4, do_sample=False)
    assert seen.messages == []
    assert ids["input_ids"][0].tolist() == tok.encode(text)
    assert hf_tok.decode(tok.encode(text)) == text
    assert (hf_tok.eos_token_id, hf_tok.bos_token_id, hf_tok.pad_token_id) == (tok.eos_id,) * 3
    assert generated.shape == (1, len(tok.encode(text)) + 4)


def test_export_without_a_known_tokenizer_says_so(tmp_path, capsys):
    from luban.cli import main

    save_hf("llama", tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--format", "hf", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert err == f"luban: warning: no tokenizer written: the checkpoint was imported from {tmp_path / 'hf'}; " \
                  "copy its tokenizer files\n"
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # written back as imported


def test_sharded_bf16_folder_is_read(tmp_path):
    hf = save_hf("llama", tmp_path / "fp32").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf", max_shard_size=20000)
    assert (tmp_path / "hf/model.safetensors.index.json").is_file() and not (tmp_path / "hf/model.safetensors").exists()
    imported = import_folder(tmp_path / "hf")
    # bf16 -> fp32 is exact: the weights luban holds (hf.float() would keep RoPE frequencies rounded to bf16)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    x = torch.randint(0, 61, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(logits_of(imported.cfg, imported.state, x), hf(x).logits, atol=1e-5, rtol=0)


# --- hostile and careless folders: each one line naming the file, exit 2, nothing written ---

def _shard(folder):
    """The folder's weights as transformers' sharded layout (5 shards and model.safetensors.index.json)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shard = {n: f"model-0000{1 + i * 2 // len(names)}-of-00002.safetensors" for i, n in enumerate(names)}
    for file in set(shard.values()):
        save_file({n: tensors[n] for n in names if shard[n] == file}, str(folder / file), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shard}))
    return shard


def _index_edit(change):
    def edit(folder):
        shard = _shard(folder)
        change(folder, shard)
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shard}))
    return edit


def _in_both_shards(folder, shard):
    from safetensors.torch import load_file, save_file

    other = next(f for f in set(shard.values()) if f != shard["model.norm.weight"])
    tensors = load_file(str(folder / other))
    save_file({**tensors, "model.norm.weight": torch.zeros(32)}, str(folder / other))


def _config_edit(**changes):
    def edit(folder):
        raw = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**raw, **changes}))
    return edit


def _in_file(change):
    return lambda folder: _edit_tensors(change)(folder / "model.safetensors")


def _evil_pickle(folder):
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {folder / 'ran'}",))

    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"model.norm.weight": Evil()}))


HOSTILE = {
    # transformers loads these; every logit would be NaN and training from them NaN losses
    "nan-weight": ("llama", _in_file(lambda t: t["model.norm.weight"].__setitem__(0, float("nan"))),
                   r"model.safetensors: tensor model.norm.weight has 1 NaN or infinite value \(of 32\)"),
    "inf-weight-bf16": ("llama", _in_file(lambda t: t.update({"lm_head.weight": torch.full((61, 32), float(
        "inf"), dtype=torch.bfloat16)})), r"tensor lm_head.weight has 1952 NaN or infinite values \(of 1952\)"),
    # shards: a tensor in two of them (which one?), an index that names a shard without the tensor
    "tensor-in-two-shards": ("llama", _index_edit(_in_both_shards),
                             r"model-0000\d-of-00002.safetensors: tensor model.norm.weight is also in model-0000"),
    "index-misplaces": ("llama", _index_edit(lambda folder, shard: shard.update(
        {"model.norm.weight": "model-00002-of-00002.safetensors" if shard["model.norm.weight"].startswith(
            "model-00001") else "model-00001-of-00002.safetensors"})),
        r"model.safetensors.index.json: weight_map places tensor model.norm.weight in model-0000\d-of-00002"
        r".safetensors, which does not hold it \(model-0000\d-of-00002.safetensors does\)"),
    "index-escapes": ("llama", _index_edit(lambda folder, shard: shard.update({"model.norm.weight": "../x"})),
                      "model.safetensors.index.json: weight_map must name the shard files in"),
    # config.json keys whose model luban does not compute (they failed on tensor names, or not at all)
    "quantized": ("llama", _config_edit(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}),
                  "config.json: quantization_config.quant_method = 'bitsandbytes': absent: luban imports unquantized"),
    "cross-attention": ("gpt2", _config_edit(add_cross_attention=True), "config.json: add_cross_attention = True: false"),
    "zero-width": ("llama", _config_edit(intermediate_size=0), "config.json: intermediate_size = 0: an integer >= 1"),
    "zero-kv-heads": ("llama", _config_edit(num_key_value_heads=0), "config.json: num_key_value_heads = 0: an integer >= 1"),
    # 60,000 layers where the file has 2: refused on the first missing name (it built the model first: minutes)
    "layers-typo": ("llama", _config_edit(num_hidden_layers=60000),
                    r"model.safetensors: tensor model.layers.2.input_layernorm.weight missing \(539982 missing\)"),
    "classifier": ("llama", lambda f: save_hf_as(f, "LlamaForSequenceClassification", pad_token_id=0),
                   r"tensor lm_head.weight missing .* \(config.json: architectures = \['LlamaForSequenceClassification'\]; "
                   "luban imports LlamaForCausalLM folders\\)"),
    # PyTorch pickles are read with weights_only: a pickle that would run code is refused, and runs nothing
    "pickle-runs-code": ("llama", _evil_pickle, "pytorch_model.bin: not a PyTorch weights file, or one holding Python "
                                                "objects besides tensors"),
    "pickle-not-a-dict": ("llama", lambda f: (f / "model.safetensors").unlink() or torch.save([1], f / "pytorch_model.bin"),
                          r"pytorch_model.bin: holds a list, not a state dict"),
    "pickle-truncated": ("llama", lambda f: (f / "model.safetensors").unlink() or (f / "pytorch_model.bin").write_bytes(
        b"PK\x03\x04"), "pytorch_model.bin: not a readable PyTorch weights file"),
}


def save_hf_as(path, model_cls, **changes):
    config_cls, _, kwargs = SAVED["llama"]
    torch.manual_seed(0)
    getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**kwargs, **changes})).save_pretrained(path)


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_folder_is_one_line_naming_the_file(case, tmp_path, capsys):
    import re

    from luban.cli import main

    family, change, message = HOSTILE[case]
    save_hf(family, tmp_path / "hf")
    change(tmp_path / "hf")
    capsys.readouterr()
    code, err = main(["import", str(tmp_path / "hf"), str(tmp_path / "run")]), capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"luban: error: {tmp_path / 'hf'}/") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "run").exists() and not (tmp_path / "hf/ran").exists()


def _import_refused(folder, run, capsys):
    """``luban import FOLDER RUN`` in this process: its one stderr line (asserted: exit 2, nothing written)."""
    from luban.cli import main

    capsys.readouterr()
    code, err = main(["import", str(folder), str(run)]), capsys.readouterr().err
    assert code == 2 and err.startswith(f"luban: error: {folder}/") and err.count("\n") == 1, err
    assert not run.exists()
    return err


def test_partial_rotary_factor_at_the_top_is_refused_in_one_line(tmp_path, capsys):
    """A hostile sweep, 2026-11-27: ``partial_rotary_factor = 0.5`` at the top of config.json (where 4.x
    wrote it; 5.x moves it under rope_parameters and applies it) raised KeyError, a traceback."""
    save_hf("llama", tmp_path / "hf")
    raw = json.loads((tmp_path / "hf/config.json").read_text())
    raw.update(rope_theta=raw.pop("rope_parameters")["rope_theta"], partial_rotary_factor=0.5)
    (tmp_path / "hf/config.json").write_text(json.dumps(raw))
    err = _import_refused(tmp_path / "hf", tmp_path / "run", capsys)
    assert "config.json: partial_rotary_factor = 0.5: 1.0 (luban rotates every dimension)" in err


def test_tied_config_with_another_saved_head_is_refused(tmp_path, capsys):
    """A hostile sweep, 2026-11-27: config.json ties the head (tie_word_embeddings = true) but the file holds an
    lm_head.weight that differs from the embedding. transformers 5 loads that head untied; luban dropped it
    and imported the tied model, whose logits differ: a silently wrong model. Refused now; with
    tie_word_embeddings = false the saved head is imported and the logits are transformers'."""
    from safetensors.torch import load_file, save_file

    save_hf("llama", tmp_path / "hf", tie_word_embeddings=True)
    tensors = load_file(str(tmp_path / "hf/model.safetensors"))
    tensors["lm_head.weight"] = torch.randn(61, 32, generator=torch.Generator().manual_seed(4))
    save_file(tensors, str(tmp_path / "hf/model.safetensors"), metadata={"format": "pt"})
    err = _import_refused(tmp_path / "hf", tmp_path / "run", capsys)
    assert "model.safetensors: tensor lm_head.weight differs from model.embed_tokens.weight, which config.json " \
           "ties it to (tie_word_embeddings = true)" in err

    _config_edit(tie_word_embeddings=False)(tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    imported = import_folder(tmp_path / "hf")
    x = torch.randint(0, 61, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.allclose(logits_of(imported.cfg, imported.state, x), hf(x).logits, atol=1e-5, rtol=0)


def test_index_naming_shards_with_other_than_names_is_one_line(tmp_path, capsys):
    """A hostile sweep, 2026-11-27: a weight_map value that is a number or a list (``"model.norm.weight": 3``)
    raised TypeError while the shard names were sorted: a traceback."""
    save_hf("llama", tmp_path / "saved")
    for i, value in enumerate((3, ["model-00001-of-00002.safetensors"])):
        folder = shutil.copytree(tmp_path / "saved", tmp_path / f"hf{i}")
        _index_edit(lambda _, shard: shard.update({"model.norm.weight": value}))(folder)
        err = _import_refused(folder, tmp_path / "run", capsys)
        assert "model.safetensors.index.json: weight_map must name the shard files in" in err


def test_a_shard_that_is_a_named_pipe_is_refused_not_waited_on(tmp_path):
    """A hostile sweep, 2026-11-27: a shard the index names that is a named pipe (or /dev/zero) was opened:
    ``luban import`` waited for a writer forever. A real process, bounded: the shard must be a regular file."""
    save_hf("llama", tmp_path / "hf")
    shard = _shard(tmp_path / "hf")
    pipe = tmp_path / "hf" / shard["model.norm.weight"]
    pipe.unlink()
    os.mkfifo(pipe)
    result = luban_cli("import", tmp_path / "hf", tmp_path / "run", timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr == f"luban: error: {pipe}: not a regular file; the index names it as a shard of the weights\n"
    assert not (tmp_path / "run").exists()


def test_qwen3_moe_sparse_step_zero_is_named(tmp_path, capsys):
    """A hostile sweep, 2026-11-27: ``decoder_sparse_step = 0`` (transformers divides by it: ZeroDivisionError)
    was read as "every layer dense" and refused as ``model.dense_layers = 2``, a key the file does not have."""
    save_hf("qwen3-moe", tmp_path / "hf")
    _config_edit(decoder_sparse_step=0)(tmp_path / "hf")
    err = _import_refused(tmp_path / "hf", tmp_path / "run", capsys)
    assert "config.json: decoder_sparse_step = 0: an integer >= 1" in err


def test_pytorch_bin_folders_are_read(tmp_path):
    """What transformers 4.x saved with safe_serialization=False: pytorch_model.bin (GPT-2's tied head stored
    too, with its causal-mask buffers, as 4.x did), or shards named by pytorch_model.bin.index.json; fp16."""
    hf = save_hf("gpt2", tmp_path / "gpt2")
    (tmp_path / "gpt2/model.safetensors").unlink()
    state = hf.state_dict()
    state.update({f"transformer.h.{i}.attn.bias": torch.ones(1, 1, 64, 64) for i in range(2)})
    torch.save(state, tmp_path / "gpt2/pytorch_model.bin")
    llama = save_hf("llama", tmp_path / "llama").half()
    (tmp_path / "llama/model.safetensors").unlink()
    names = sorted(llama.state_dict())
    shard = {n: f"pytorch_model-0000{1 + (i % 2)}-of-00002.bin" for i, n in enumerate(names)}
    for file in set(shard.values()):
        torch.save({n: t for n, t in llama.state_dict().items() if shard[n] == file}, tmp_path / "llama" / file)
    (tmp_path / "llama/pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shard}))
    x = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(3))
    llama = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32).eval()
    for name, model in (("gpt2", hf), ("llama", llama)):  # fp16 -> fp32 exact; .float() keeps fp16's RoPE
        imported = import_folder(tmp_path / name)
        with torch.no_grad():
            theirs = model(x).logits
        assert torch.allclose(logits_of(imported.cfg, imported.state, x), theirs, atol=1e-5, rtol=0), name


def test_reexport_replaces_only_its_own_files(small_dataset, tmp_path, capsys):
    """Export into luban's own folder again: what the earlier export wrote and this one does not (a tokenizer)
    is removed, not left to pass for the new model's; a file the user put there is kept, and one this export
    would write over is refused untouched."""
    from luban.cli import main

    cfg = get_preset("tiny-llama").replace(vocab=257)
    with_tok = _run_with_dataset(tmp_path / "a", small_dataset, cfg)
    without = _run_with_dataset(tmp_path / "b", tmp_path / "gone", cfg)
    out = tmp_path / "out"
    export = ["export", "--format", "hf"]
    assert main([*export, str(with_tok), str(out)]) == 0
    tokenizer = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    assert tokenizer <= {p.name for p in out.iterdir()}
    assert main([*export, str(without), str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {".luban", "config.json", "model.safetensors"}
    (out / "tokenizer.json").write_text("{}")  # the user copies a tokenizer in: kept by the next export ...
    (out / "README.md").write_text("mine")
    assert main([*export, str(without), str(out)]) == 0
    assert (out / "tokenizer.json").read_text() == "{}" and (out / "README.md").read_text() == "mine"
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main([*export, str(with_tok), str(out)]) == 2  # ... and not overwritten by one that has its own
    err = capsys.readouterr().err
    assert err.startswith(f"luban: error: OUT = '{out}': holds 'tokenizer.json', which luban did not write") \
        and err.count("\n") == 1, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_export_stopped_short_does_not_claim_the_files_it_never_wrote(small_dataset, tmp_path, capsys, monkeypatch):
    """The record listed every name as luban's before the first byte: an export killed before it wrote
    tokenizer.json, then a tokenizer.json the user put there, and the next export replaced it as its own
    (found by a hostile sweep, 2026-11-27). Now each name is listed only as its file is written."""
    import safetensors.torch

    from luban.cli import main

    cfg = get_preset("tiny-llama").replace(vocab=257)
    run = _run_with_dataset(tmp_path / "a", small_dataset, cfg)
    out = tmp_path / "out"
    export = ["export", "--format", "hf", str(run), str(out)]
    assert main(export) == 0
    (out / "tokenizer.json").unlink()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as a kill while the weights are written: nothing after runs

    with monkeypatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", killed)
        with pytest.raises(KeyboardInterrupt):
            main(export)
    (out / "tokenizer.json").write_text('{"mine": true}')  # the user's, put there afterwards
    capsys.readouterr()
    assert main(export) == 2
    assert "holds 'tokenizer.json', which luban did not write" in capsys.readouterr().err
    assert (out / "tokenizer.json").read_text() == '{"mine": true}'


def test_reexport_into_an_export_made_before_the_record(small_dataset, tmp_path, capsys):
    """A folder exported before 2026-11-27 has a marker without the list of files: what that export wrote is
    rebuilt from the files' times (model.safetensors first, config.json last). A tokenizer file the user added
    afterwards is refused, untouched; the export's own files are replaced."""
    import os

    from luban.cli import main

    cfg = get_preset("tiny-llama").replace(vocab=257)
    with_tok = _run_with_dataset(tmp_path / "a", small_dataset, cfg)
    without = _run_with_dataset(tmp_path / "b", tmp_path / "gone", cfg)
    export = ["export", "--format", "hf"]
    for case in ("luban's tokenizer", "user's tokenizer"):
        out = tmp_path / ("ours" if case == "luban's tokenizer" else "theirs")
        assert main([*export, str(with_tok if case == "luban's tokenizer" else without), str(out)]) == 0
        (out / ".luban").write_text('{"luban": "hf-export"}\n')  # as exports wrote it before the record
        if case == "user's tokenizer":
            (out / "tokenizer.json").write_text("{}")
            os.utime(out / "tokenizer.json", ns=(0, (out / "config.json").stat().st_mtime_ns + 10**9))
        capsys.readouterr()
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        code, err = main([*export, str(with_tok), str(out)]), capsys.readouterr().err
        if case == "luban's tokenizer":
            assert code == 0, err
            assert json.loads((out / ".luban").read_text())["files"].keys() == set(os.listdir(out)) - {".luban"}
        else:
            assert code == 2 and err.startswith(f"luban: error: OUT = '{out}': holds 'tokenizer.json'"), err
            assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("made", [False, True])
def test_export_of_a_model_without_a_hugging_face_equivalent_changes_nothing(tmp_path, capsys, made):
    """(2026-12-04) The refusal came after OUT was claimed: a folder made (or the user's empty one)
    marked as an export, which a later ``luban import`` there refused as 'luban's folder for a Hugging
    Face export'."""
    from luban.cli import main
    from luban.train import checkpoint

    cfg = get_preset("tiny-moe").replace(router="sigmoid")
    meta = {"step": 0, "config": {"model": cfg.to_dict()}, "world_size": 1}
    checkpoint.save(tmp_path / "run/checkpoints", 0, {"model": build_model(cfg, seed=3).state_dict()}, meta, keep=1)
    out = tmp_path / "out"
    if made:
        out.mkdir()
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--format", "hf", str(out)]) == 2
    assert "model.router = 'sigmoid'" in capsys.readouterr().err
    assert (list(out.iterdir()) == []) if made else not out.exists()


def test_export_of_a_diverged_checkpoint_is_refused(tmp_path, capsys):
    """NaN weights (the trainer does not stop on a NaN loss) would load in transformers as a model whose
    every logit is NaN, and luban import refuses them: one line, OUT not made."""
    from luban.cli import main
    from luban.train import checkpoint

    cfg = get_preset("tiny-llama")
    state = build_model(cfg, seed=3).state_dict()
    state["layers.1.attn.wq.weight"][0, :3] = float("nan")
    meta = {"step": 0, "config": {"model": cfg.to_dict()}, "world_size": 1}
    checkpoint.save(tmp_path / "run/checkpoints", 0, {"model": state}, meta, keep=1)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--format", "hf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"luban: error: CHECKPOINT = '{tmp_path / 'run'}': its tensor layers.1.attn.wq.weight has 3 NaN "
                   "or infinite values: a diverged run; export an earlier checkpoint (nothing was written)\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case, changes, message", [
    ("gpt2", {"n_head": 5}, "n_head = 5: must divide n_embd = 32"),
    ("llama", {"num_key_value_heads": 3}, "num_key_value_heads = 3: must divide num_attention_heads = 4"),
    ("llama", {"rms_norm_eps": 0}, "rms_norm_eps = 0.0: must be positive"),
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok = 9: at most num_local_experts = 4"),
    ("qwen3-moe", {"num_experts_per_tok": 9}, "num_experts_per_tok = 9: at most {experts} = 4"),
    ("qwen3-moe", {"mlp_only_layers": [0, 1]}, r"mlp_only_layers = \[0, 1\]: must leave a MoE layer among "
                                                "num_hidden_layers = 2"),
    # (2026-12-04) imported, and transformers refuses to load either back
    ("qwen3-moe", {"mlp_only_layers": ["0"]}, r"mlp_only_layers = \['0'\]: a list of layer indices \(integers >= 0\)"),
    ("llama", {"eos_token_id": [1, -5]}, r"eos_token_id = \[1, -5\]: an integer >= 0 or null"),
])
def test_a_config_luban_refuses_is_named_in_config_json_keys(case, changes, message, tmp_path, capsys):
    """A config.json that transformers wrote but luban's ModelConfig refuses names the file's own keys
    (n_head, num_key_value_heads), not luban's (model.heads, model.kv_heads)."""
    import re

    save_hf(case, tmp_path / "hf")
    path = tmp_path / "hf/config.json"
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, **changes}))
    err = _import_refused(tmp_path / "hf", tmp_path / "run", capsys)
    message = message.format(experts="num_experts" if "num_experts" in raw else "num_local_experts")  # 4.x, 5.x
    assert re.search(f"config.json: {message}", err) and "model." not in err, err


def test_each_field_is_read_from_the_config_key_that_export_writes_it_to():
    """``hf.CONFIG_KEYS`` (which config.json key holds which ModelConfig field) feeds both the writer
    (``hf_config``) and the names in refusals; here the reader agrees: a config.json that export wrote,
    with one key changed, reads back with exactly that field changed."""
    from luban.model.hf import CONFIG_KEYS, hf_config, read_config
    from luban.model.presets import get_preset

    models = {"gpt2": get_preset("tiny"), "llama": get_preset("tiny-llama"),
              "mixtral": get_preset("tiny-moe").replace(arch="llama", norm="rmsnorm", activation="swiglu",
                                                        position="rope", shared_experts=0, dense_layers=0,
                                                        ffn_hidden=64, expert_ffn_hidden=64),  # one intermediate_size
              "qwen3_moe": get_preset("tiny-moe").replace(arch="llama", norm="rmsnorm", activation="swiglu",
                                                          position="rope", shared_experts=0, dense_layers=1,
                                                          qk_norm=True, expert_ffn_hidden=24)}
    for family, keys in CONFIG_KEYS.items():
        model = models[family]
        for field, key in keys.items():
            raw = hf_config(model, family)
            assert raw[key] == getattr(model, field) or family == "mixtral" and key == "intermediate_size", \
                (family, field, key)
            old = raw[key]
            raw[key] = (not old if isinstance(old, bool) else old * 2 if isinstance(old, int)
                        else old / 2 if old else 0.25)
            if key == "rope_theta":
                raw["rope_parameters"]["rope_theta"] = raw[key]
            cfg, _, _ = read_config(raw)
            changed = {f for f in keys if getattr(cfg, f) != getattr(model, f)}  # (head_dim follows gpt2's n_embd)
            want = {f for f, k in keys.items() if k == key}  # mixtral: both widths
            assert changed == want, (family, key, changed)


def test_a_variants_weights_are_named_in_the_refusal(tmp_path):
    """(2026-12-04) ``save_pretrained(variant="fp16")`` writes model.fp16.safetensors alone: refused as
    "model.safetensors: no such file", not naming what the folder holds."""
    from luban.errors import LubanError

    save_hf("llama", tmp_path / "hf", {"variant": "fp16"})
    with pytest.raises(LubanError, match=r"it holds model\.fp16\.safetensors, a variant's weights"):
        import_folder(tmp_path / "hf")


@pytest.mark.parametrize("change, line", [
    ({"bias": False}, "model.bias = false: GPT-2 (its Hugging Face class) has biases: bias = true"),
    ({"kv_heads": 2}, "model.kv_heads = 2: GPT-2 (its Hugging Face class) has no grouped-query attention"),
    ({"head_dim": 8}, "model.head_dim = 8: GPT-2 (its Hugging Face class) needs head_dim x heads = hidden"),
])
def test_a_gpt2_export_refusal_names_the_key_that_keeps_it_from_gpt2(change, line):
    """(2026-12-04) It listed norm, activation and position, each as GPT-2 needs them, and not the key that
    was not: 'GPT-2 needs layernorm+gelu+learned+bias'."""
    from luban.errors import LubanError
    from luban.model.hf import exportable

    with pytest.raises(LubanError) as err:
        exportable(ModelConfig.from_dict({"preset": "tiny", **change}))
    assert str(err.value).startswith(line), err.value


def test_a_llama_of_hidden_act_swish_imports_as_silu(tmp_path):
    """(2026-12-04) refused, though transformers' ACT2FN maps "swish" to the same SiLU; exported back as given."""
    hf = save_hf("llama", tmp_path / "hf", hidden_act="swish")
    imported = import_folder(tmp_path / "hf")
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(x).logits
    assert torch.allclose(logits_of(imported.cfg, imported.state, x), theirs, atol=1e-5, rtol=0)
    export_folder(imported.cfg, imported.state, tmp_path / "out", extra=imported.extra)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["hidden_act"] == "swish"


def test_float64_weights_are_read_as_float32_with_a_warning(tmp_path):
    hf = save_hf("llama", tmp_path / "hf")
    hf.double().save_pretrained(tmp_path / "f64")
    imported = import_folder(tmp_path / "f64")
    assert [w for w in imported.warnings if w.startswith("float64 weights read as float32")], imported.warnings
    assert all(t.dtype == torch.float32 for t in imported.state.values())
